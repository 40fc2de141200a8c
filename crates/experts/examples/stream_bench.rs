//! Prompt and generation speed with streamed experts, measured like `llama-bench`: random token
//! ids (so routing is as varied as real text, not one token repeated), a prompt of `--pp`
//! tokens in chunks of `--chunk`, then `--tg` single-token steps; expert-cache statistics per
//! phase.
//!
//! `cargo run --release -p experts --example stream_bench -- MODEL [--pp 32] [--tg 16]
//!  [--chunk 512] [--threads 2] [--cache SIZE|COUNT] [--cold] [--no-lookahead] [--resident]`

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use experts::{CacheSize, StreamedExperts, StreamingOptions};
use model::{
    Compute, ExpertSource, KvCache, KvType, LogitsWanted, Model, NoHooks, ResidentExperts,
    SeqInput, StageInput, WeightSelection,
};

struct Args {
    model: String,
    pp: usize,
    tg: usize,
    chunk: usize,
    threads: usize,
    cache: CacheSize,
    cold: bool,
    lookahead: bool,
    resident: bool,
}

fn parse() -> Args {
    let mut a = Args {
        model: String::new(),
        pp: 32,
        tg: 16,
        chunk: 512,
        threads: 2,
        cache: CacheSize::Auto,
        cold: false,
        lookahead: true,
        resident: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().expect("flag value");
        match x.as_str() {
            "--pp" => a.pp = val().parse().expect("--pp N"),
            "--tg" => a.tg = val().parse().expect("--tg N"),
            "--chunk" => a.chunk = val().parse().expect("--chunk N"),
            "--threads" => a.threads = val().parse().expect("--threads N"),
            "--cache" => a.cache = experts::parse_size(&val()).expect("--cache SIZE|COUNT"),
            "--cold" => a.cold = true,
            "--no-lookahead" => a.lookahead = false,
            "--resident" => a.resident = true,
            _ => a.model = x,
        }
    }
    assert!(!a.model.is_empty(), "usage: stream_bench MODEL [flags]");
    a
}

fn stats(s: &dyn Fn() -> Vec<(String, f64)>) -> HashMap<String, f64> {
    s().into_iter().collect()
}

fn main() {
    let a = parse();
    let t0 = Instant::now();
    let model = Arc::new(Model::load(&a.model).expect("loading the model"));
    let last = model.n_layer() - 1;
    let ranges = model.weight_ranges(&WeightSelection {
        layers: 0..=last,
        embeddings: true,
        head: true,
        experts: a.resident,
    });
    model.warm(&ranges, |_| {});
    let n_ctx = (a.pp + a.tg + 1).next_multiple_of(256);
    let mut kv = KvCache::new(model.kv_layout(KvType::F16, 0..=last, n_ctx));
    let streamed = (!a.resident).then(|| {
        StreamedExperts::new(
            Arc::clone(&model),
            StreamingOptions {
                cache: a.cache,
                cold: a.cold,
                lookahead: a.lookahead,
                reserve_bytes: (kv.bytes_per_position() * 4096) as u64,
                ..StreamingOptions::default()
            },
        )
        .expect("streaming source")
    });
    let resident = ResidentExperts::new(&model);
    let source: &dyn ExpertSource = match &streamed {
        Some(s) => s,
        None => &resident,
    };
    let get = || streamed.as_ref().map(|s| s.stats()).unwrap_or_default();
    eprintln!("ready in {:.2?}", t0.elapsed());
    let cx = Compute::new(a.threads);
    let n_vocab = model.hp.n_vocab as u64;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut token = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n_vocab) as u32
    };
    let mut step = |n: usize, kv: &mut KvCache| {
        let tokens: Vec<u32> = (0..n).map(|_| token()).collect();
        let mut seqs = [SeqInput {
            kv,
            n_tokens: n,
            logits: LogitsWanted::Last,
        }];
        model
            .forward(
                &cx,
                source,
                0..=last,
                true,
                StageInput::Tokens(&tokens),
                &mut seqs,
                &mut NoHooks,
            )
            .expect("forward");
    };
    let report = |name: &str, n: usize, secs: f64, before: &HashMap<String, f64>| {
        let after = stats(&get);
        let d =
            |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
        let streamed = d("expert_hits") + d("expert_inflight_hits") + d("expert_misses");
        println!(
            "{name}: {n} tokens in {secs:.2} s = {:.2} t/s | hit rate {:.3} (in-flight {:.3}) | \
             read {:.1} MiB/token at {:.2} GB/s busy | waited {:.1} ms/token | prefetch {} read, {} used",
            n as f64 / secs,
            if streamed > 0.0 {
                d("expert_hits") / streamed
            } else {
                1.0
            },
            if streamed > 0.0 {
                d("expert_inflight_hits") / streamed
            } else {
                0.0
            },
            d("expert_read_mib") / n as f64,
            if d("expert_read_busy_s") > 0.0 {
                d("expert_read_mib") * (1u64 << 20) as f64 / d("expert_read_busy_s") / 1e9
            } else {
                0.0
            },
            d("expert_wait_s") * 1e3 / n as f64,
            d("expert_prefetch_reads"),
            d("expert_prefetch_used"),
        );
    };
    let before = stats(&get);
    let t = Instant::now();
    let mut left = a.pp;
    while left > 0 {
        let n = left.min(a.chunk);
        step(n, &mut kv);
        left -= n;
    }
    if a.pp > 0 {
        report(
            &format!("pp{}", a.pp),
            a.pp,
            t.elapsed().as_secs_f64(),
            &before,
        );
    }
    let before = stats(&get);
    let t = Instant::now();
    for _ in 0..a.tg {
        step(1, &mut kv);
    }
    if a.tg > 0 {
        report(
            &format!("tg{}", a.tg),
            a.tg,
            t.elapsed().as_secs_f64(),
            &before,
        );
    }
}
