//! The upcycled-MoE check: SmolLM2 turned into a 4-expert Mixtral-style model (router all
//! zeros, every expert weighted 1/4, down projections scaled by 4) must compute the dense
//! model's function — a test of the whole MoE path on real weights.

mod common;

use common::*;

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > v[b] { i } else { b })
}

const TOKENS: &str =
    "504,3575,282,4521,314,30,1062,3575,282,4468,314,7042,30,378,2671,282,260,1458";

#[test]
fn upcycled_smollm2_matches_the_dense_model() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n).to_string_lossy().into_owned();
    let m = smollm2();
    // F16 weights keep activations in f32, so only the summation order differs.
    run_ok(&[
        "quantize",
        m.to_str().unwrap(),
        &d("dense-f16.gguf"),
        "--type",
        "f16",
    ]);
    run_ok(&[
        "upcycle",
        &d("dense-f16.gguf"),
        &d("moe-f16.gguf"),
        "--experts",
        "4",
    ]);
    let logits = |model: &str, out: &str| {
        run_ok(&[
            "logits",
            "-m",
            model,
            "--tokens",
            TOKENS,
            "--out",
            out,
            "--kv-type",
            "f32",
            "--no-warm",
        ]);
        read_npy_f32(std::path::Path::new(out)).1
    };
    let dense = logits(&d("dense-f16.gguf"), &d("dense.npy"));
    let moe = logits(&d("moe-f16.gguf"), &d("moe.npy"));
    assert_eq!(dense.len(), moe.len());
    let max_diff = dense
        .iter()
        .zip(&moe)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("F16 SmolLM2 dense vs upcycled MoE: max |Δlogit| = {max_diff:e}");
    assert!(
        max_diff < 2e-3,
        "upcycled MoE differs from the dense model by {max_diff}"
    );
    for (a, b) in dense.chunks(49152).zip(moe.chunks(49152)) {
        assert_eq!(argmax(a), argmax(b));
    }
    // The original Q4_1 file, upcycled: its int8 activations make rounding flips possible, so
    // compare the greedy text.
    run_ok(&[
        "upcycle",
        m.to_str().unwrap(),
        &d("moe-q41.gguf"),
        "--experts",
        "4",
    ]);
    let run = |model: &str| {
        run_ok(&[
            "run",
            "-m",
            model,
            "-p",
            "The capital of Germany is",
            "-n",
            "16",
            "--temp",
            "0",
            "--no-warm",
        ])
    };
    let want = run(m.to_str().unwrap());
    assert!(
        want.contains(" Berlin"),
        "SmolLM2 should know the capital of Germany: {want:?}"
    );
    assert_eq!(run(&d("moe-q41.gguf")), want);
}
