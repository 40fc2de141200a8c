//! Helpers shared by the kernel examples: flags, plausible random weights, timing.

use std::time::{Duration, Instant};

use gguf::GgmlType;

/// The value after `name` on the command line.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// `--budget-ms` (time spent per measurement), else `default_ms`.
pub fn budget_arg(default_ms: u64) -> Duration {
    Duration::from_millis(
        arg("--budget-ms")
            .map(|s| s.parse().expect("milliseconds"))
            .unwrap_or(default_ms),
    )
}

/// `--threads 1,2,...` (default 1,2).
pub fn threads_arg() -> Vec<usize> {
    arg("--threads")
        .unwrap_or_else(|| "1,2".into())
        .split(',')
        .map(|s| s.parse().expect("thread count"))
        .collect()
}

/// Fills `n` bytes of plausible blocks of `t` (random quants, small f16 scales).
pub fn random_weights(t: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = t.row_bytes(cols as u64).expect("whole blocks") as usize;
    let mut data = vec![0u8; rows * rb];
    let mut s = 0x1234_5678_9abc_def0u64;
    for b in data.iter_mut() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        *b = s as u8;
    }
    // Make every f16 scale field small and finite (random bits could be NaN or inf); MXFP4's
    // exponent must not be huge either.
    let ts = t.type_size();
    let safe = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    for block in data.chunks_exact_mut(ts) {
        for &o in kernels::blocks::f16_scale_fields(t) {
            block[o..o + 2].copy_from_slice(&safe);
        }
        match t {
            GgmlType::Mxfp4 => block[0] = 120,
            GgmlType::Q8K => block[..4].copy_from_slice(&0.01f32.to_le_bytes()),
            _ => {}
        }
    }
    data
}

/// Median seconds of `f` over enough runs to fill ~`budget` (the minimum with `--stat min`,
/// steadier on a loaded machine).
pub fn time(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let t0 = Instant::now();
    f();
    let once = t0.elapsed().as_secs_f64().max(1e-7);
    let reps = ((budget.as_secs_f64() / once) as usize).clamp(3, 2000);
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    if arg("--stat").as_deref() == Some("min") {
        v[0]
    } else {
        v[v.len() / 2]
    }
}
