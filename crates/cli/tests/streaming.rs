//! `--ssd-streaming` through the real binary: logits bit-identical to the resident run for every
//! MoE fixture and for SmolLM2 upcycled to a 4-expert MoE, at cache sizes from one slot to
//! everything (one slot per layer included); profiles, preload and statistics; flag errors.

mod common;

use common::*;

const TOKENS: &str = "1,17,42,99,5,250,31,8,77,120,3,64,200,11,90,2";

fn logits(dir: &std::path::Path, model: &str, extra: &[&str], name: &str) -> Vec<f32> {
    let out = dir
        .join(format!("{name}.npy"))
        .to_string_lossy()
        .into_owned();
    let mut args = vec![
        "logits",
        "-m",
        model,
        "--tokens",
        TOKENS,
        "--out",
        &out,
        "--kv-type",
        "f32",
        "-t",
        "2",
    ];
    args.extend_from_slice(extra);
    run_ok(&args);
    read_npy_f32(std::path::Path::new(&out)).1
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn streamed_logits_equal_resident_logits_for_every_moe_fixture() {
    let dir = tempfile::tempdir().unwrap();
    // (fixture, MoE layers, files): every layer of these tiny models routes, but the first of
    // deepseek2 and glm4moe (a leading dense layer); deepseek2-lite has no quantized files
    // (llama-quantize cannot load it); gpt-oss also in MXFP4.
    let all = &["f32", "q8_0", "q4_k"][..];
    for (arch, layers, quants) in [
        ("mixtral", "4", all),
        ("olmoe", "3", all),
        ("qwen2moe", "4", all),
        ("qwen3moe", "4", all),
        ("deepseek2", "3", all),
        ("deepseek2-lite", "3", &["f32"][..]),
        ("glm4moe", "3", all),
        ("gpt-oss", "4", &["f32", "q8_0", "q4_k", "mxfp4"][..]),
    ] {
        for &quant in quants {
            let m = fixture(arch, &format!("model-{quant}.gguf"));
            let m = m.to_str().unwrap();
            let want = logits(dir.path(), m, &[], "resident");
            for cache in [
                &["--expert-cache", "1", "--expert-cache-cold"][..],
                &["--expert-cache", layers][..],
                &[
                    "--expert-cache",
                    layers,
                    "--expert-cache-cold",
                    "--resident-layers",
                    "1",
                ][..],
                &["--expert-cache", "64MiB"][..],
            ] {
                let mut args = vec!["--ssd-streaming"];
                args.extend_from_slice(cache);
                let got = logits(dir.path(), m, &args, "streamed");
                assert!(
                    same_bits(&got, &want),
                    "{arch} {quant} {args:?}: logits differ from the resident run"
                );
            }
        }
    }
}

#[test]
fn upcycled_smollm2_streams_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    let moe = dir.path().join("moe.gguf").to_string_lossy().into_owned();
    run_ok(&[
        "upcycle",
        smollm2().to_str().unwrap(),
        &moe,
        "--experts",
        "4",
    ]);
    let want = logits(dir.path(), &moe, &["--no-warm"], "resident");
    // SmolLM2-135M has 30 layers: 30 slots is one per layer.
    for cache in [
        &["--expert-cache", "1", "--expert-cache-cold"][..],
        &["--expert-cache", "30", "--expert-cache-cold"][..],
        &[
            "--expert-cache",
            "30",
            "--resident-layers",
            "4",
            "--expert-readers",
            "1",
        ][..],
        &["--expert-cache", "1GiB"][..],
    ] {
        let mut args = vec!["--ssd-streaming"];
        args.extend_from_slice(cache);
        let got = logits(dir.path(), &moe, &args, "streamed");
        assert!(
            same_bits(&got, &want),
            "upcycled SmolLM2 {args:?}: logits differ from the resident run"
        );
    }
}

#[test]
fn a_saved_profile_preloads_and_generation_matches() {
    let dir = tempfile::tempdir().unwrap();
    let m = fixture("qwen3moe", "model-q8_0.gguf");
    let m = m.to_str().unwrap();
    let prof = dir
        .path()
        .join("profile.txt")
        .to_string_lossy()
        .into_owned();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "-m",
            m,
            "-p",
            "The ferryman",
            "-n",
            "12",
            "--temp",
            "0",
            "--ignore-eos",
        ];
        args.extend_from_slice(extra);
        let out = std::process::Command::new(bin())
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (want, _) = run(&[]);
    let (text, _) = run(&[
        "--ssd-streaming",
        "--expert-cache",
        "3",
        "--expert-cache-cold",
        "--save-expert-profile",
        &prof,
    ]);
    assert_eq!(text, want);
    let saved = std::fs::read_to_string(&prof).unwrap();
    assert!(saved.starts_with("moeshard-expert-profile 1\n"), "{saved}");
    let (text, err) = run(&[
        "--ssd-streaming",
        "--expert-cache",
        "6",
        "--expert-profile",
        &prof,
        "--preload-experts",
        "5",
        "--expert-stats",
    ]);
    assert_eq!(text, want);
    assert!(err.contains("5 preloaded"), "{err}");
    for stat in [
        "expert_hit_rate",
        "expert_read_mib_per_step",
        "expert_read_gbps",
        "expert_wait_s",
    ] {
        assert!(err.contains(stat), "no {stat} in:\n{err}");
    }
}

#[test]
fn bad_streaming_flags_are_refused_with_a_reason() {
    let olmoe = fixture("olmoe", "model-q4_k.gguf");
    let dense = fixture("llama", "model-q4_k.gguf");
    // `logits` of two tokens on `model` with `flags`: fails, saying `needle`.
    let fails = |model: &std::path::Path, flags: &[&str], needle: &str| {
        let m = model.to_str().unwrap();
        let mut args = vec!["logits", "-m", m, "--tokens", "1,2", "--out", "/dev/null"];
        args.extend_from_slice(flags);
        let out = std::process::Command::new(bin())
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(needle),
            "{args:?}: {err}"
        );
    };
    let streaming = ["--ssd-streaming", "--expert-cache"];
    fails(
        &olmoe,
        &[&streaming[..], &["0"]].concat(),
        "at least one slot",
    );
    fails(
        &olmoe,
        &[&streaming[..], &["5 parsecs"]].concat(),
        "bad size",
    );
    fails(&olmoe, &["--expert-cache", "4"], "--ssd-streaming");
    // A routing profile places experts for streaming or a GPU; read before the GPU opens,
    // so a bad one is named even where no GPU is.
    let profile = ["--expert-profile", "/nonexistent/routing.profile"];
    fails(&olmoe, &profile, "--ssd-streaming or --gpu");
    fails(
        &olmoe,
        &[&profile[..], &["--gpu"]].concat(),
        "--expert-profile /nonexistent/routing.profile",
    );
    fails(&dense, &["--ssd-streaming"], "no routed experts");
}
