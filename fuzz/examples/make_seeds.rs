//! Writes the seed inputs of every target into `DIR/<target>/` (real files and bodies: GGUFs
//! written by the project's writer, some with the metadata of the committed llama.cpp fixtures,
//! snapshots and disk-cache files the engine and the cache write for the tiny qwen3moe fixture, the request
//! bodies of the server tests). `scripts/fuzz.sh --seeds` runs it and minimizes the result into
//! fuzz/corpus; run it again when a format changes.
//!
//!     cargo +nightly run --release --manifest-path fuzz/Cargo.toml --example make_seeds -- DIR

use std::path::{Path, PathBuf};

use gguf::{Array, GgmlType, GgufFile, GgufVersion, GgufWriter, Metadata, StringArray, Value};
use serde_json::json;

fn main() {
    let out = PathBuf::from(std::env::args().nth(1).expect("usage: make_seeds DIR"));
    gguf_seeds(&out.join("gguf_reader"));
    snapshot_seeds(&out.join("snapshot_reader"));
    disk_seeds(&out.join("disk_kv_reader"));
    request_seeds(&out.join("request_bodies"));
    frame_seeds(&out.join("frame_decoder"));
    handshake_seeds(&out.join("handshake"));
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
    eprintln!("{}/{name}: {} bytes", dir.display(), bytes.len());
}

fn gguf_bytes(w: &GgufWriter) -> Vec<u8> {
    let mut out = Vec::new();
    w.write_to(&mut out).unwrap();
    GgufFile::from_bytes("seed", out.clone()).expect("a seed the reader accepts");
    out
}

/// Raw bytes of `n` elements of `dtype` (whole blocks).
fn tensor_data(dtype: GgmlType, shape: &[u64]) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    let bytes = dtype.row_bytes(n).unwrap() as usize;
    (0..bytes).map(|i| (i * 37 % 251) as u8).collect()
}

fn gguf_seeds(dir: &Path) {
    let mut w = GgufWriter::new();
    write(dir, "empty-v3.gguf", &gguf_bytes(&w));
    w.set_version(GgufVersion::V2);
    write(dir, "empty-v2.gguf", &gguf_bytes(&w));

    // Every value type, arrays of each, nested and string arrays.
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("u8", Value::U8(7)).unwrap();
    w.add_metadata("i8", Value::I8(-7)).unwrap();
    w.add_metadata("u16", Value::U16(700)).unwrap();
    w.add_metadata("i16", Value::I16(-700)).unwrap();
    w.add_metadata("llama.block_count", Value::U32(2)).unwrap();
    w.add_metadata("i32", Value::I32(-70000)).unwrap();
    w.add_metadata("f32", Value::F32(0.5)).unwrap();
    w.add_metadata("u64", Value::U64(1 << 40)).unwrap();
    w.add_metadata("i64", Value::I64(-(1 << 40))).unwrap();
    w.add_metadata("f64", Value::F64(-2.25)).unwrap();
    w.add_metadata("bool", Value::Bool(true)).unwrap();
    w.add_metadata("string", "héllo").unwrap();
    w.add_metadata("a.u8", Value::Array(Array::U8(vec![1, 2, 3])))
        .unwrap();
    w.add_metadata("a.i32", Value::Array(Array::I32(vec![-1, 2])))
        .unwrap();
    w.add_metadata("a.u32", Value::Array(Array::U32(vec![1, 2])))
        .unwrap();
    w.add_metadata("a.f32", Value::Array(Array::F32(vec![1.5, -0.0])))
        .unwrap();
    w.add_metadata("a.u64", Value::Array(Array::U64(vec![u64::MAX])))
        .unwrap();
    w.add_metadata("a.f64", Value::Array(Array::F64(vec![1e300])))
        .unwrap();
    w.add_metadata("a.bool", Value::Array(Array::Bool(vec![true, false])))
        .unwrap();
    let mut strings = StringArray::new();
    for s in ["<s>", "</s>", "a", "▁the", ""] {
        strings.push(s);
    }
    w.add_metadata("a.str", Value::Array(Array::String(strings)))
        .unwrap();
    let nested = Array::Array(vec![
        Array::U8(vec![1]),
        Array::Array(vec![Array::I16(vec![-2])]),
    ]);
    w.add_metadata("a.nested", Value::Array(nested)).unwrap();
    write(dir, "all-types-v3.gguf", &gguf_bytes(&w));
    w.set_version(GgufVersion::V2);
    write(dir, "all-types-v2.gguf", &gguf_bytes(&w));

    // Tensors of several types, a larger alignment, an empty tensor.
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.set_alignment(64).unwrap();
    for (name, dtype, shape) in [
        ("f32", GgmlType::F32, &[4u64, 2][..]),
        ("f16", GgmlType::F16, &[8]),
        ("bf16", GgmlType::Bf16, &[2, 2, 2]),
        ("q8_0", GgmlType::Q8_0, &[32, 2]),
        ("q4_0", GgmlType::Q4_0, &[32, 1, 2]),
        ("q4_k", GgmlType::Q4K, &[256]),
        ("q6_k", GgmlType::Q6K, &[256, 1, 1, 1]),
        ("empty", GgmlType::F32, &[0, 3]),
    ] {
        w.add_tensor(name, dtype, shape, tensor_data(dtype, shape))
            .unwrap();
    }
    write(dir, "tensors.gguf", &gguf_bytes(&w));

    // A one-file "split" set.
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "qwen3moe").unwrap();
    w.add_metadata("split.no", Value::U16(0)).unwrap();
    w.add_metadata("split.count", Value::U16(1)).unwrap();
    w.add_metadata("split.tensors.count", Value::I32(1))
        .unwrap();
    w.add_tensor("t", GgmlType::F32, &[2], tensor_data(GgmlType::F32, &[2]))
        .unwrap();
    write(dir, "split.gguf", &gguf_bytes(&w));

    // Real models' metadata (llama.cpp's converter: the committed fixtures and the demo model),
    // arrays cut to a few entries, with a few of their tensors at a tiny size.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut real = vec![root.join("models/shakespeare-moe.gguf")];
    for arch in ["llama", "mixtral", "olmoe", "qwen2moe", "qwen3moe"] {
        real.push(root.join(format!(
            "crates/model/tests/fixtures/{arch}/model-q4_k.gguf"
        )));
    }
    for path in real {
        let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut meta = Metadata::new();
        for (key, value) in file.metadata().iter() {
            meta.push(key, shrink(value)).unwrap();
        }
        let mut w = GgufWriter::with_metadata(meta).unwrap();
        for info in file.tensors().iter().take(4) {
            let dtype = info.dtype;
            let shape = [dtype.block_size() as u64, 1];
            w.add_tensor(info.name.clone(), dtype, &shape, tensor_data(dtype, &shape))
                .unwrap();
        }
        let name = path
            .parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy();
        let name = if name == "models" {
            "shakespeare".into()
        } else {
            name
        };
        write(dir, &format!("real-{name}.gguf"), &gguf_bytes(&w));
    }
}

/// `value` with arrays cut to their first 8 entries.
fn shrink(value: &Value) -> Value {
    const N: usize = 8;
    let Value::Array(a) = value else {
        return value.clone();
    };
    let cut = match a {
        Array::U8(v) => Array::U8(v.iter().take(N).copied().collect()),
        Array::I8(v) => Array::I8(v.iter().take(N).copied().collect()),
        Array::U16(v) => Array::U16(v.iter().take(N).copied().collect()),
        Array::I16(v) => Array::I16(v.iter().take(N).copied().collect()),
        Array::U32(v) => Array::U32(v.iter().take(N).copied().collect()),
        Array::I32(v) => Array::I32(v.iter().take(N).copied().collect()),
        Array::F32(v) => Array::F32(v.iter().take(N).copied().collect()),
        Array::U64(v) => Array::U64(v.iter().take(N).copied().collect()),
        Array::I64(v) => Array::I64(v.iter().take(N).copied().collect()),
        Array::F64(v) => Array::F64(v.iter().take(N).copied().collect()),
        Array::Bool(v) => Array::Bool(v.iter().take(N).copied().collect()),
        Array::String(v) => {
            let mut s = StringArray::new();
            v.iter().take(N).for_each(|x| s.push(x));
            Array::String(s)
        }
        Array::Array(v) => Array::Array(v.iter().take(N).cloned().collect()),
    };
    Value::Array(cut)
}

/// A raw-file input of the `snapshot_reader` target: mode byte 0, then the file.
fn snapshot_bytes(s: &engine::Snapshot) -> Vec<u8> {
    let mut out = vec![0u8];
    s.write_to(&mut out).unwrap();
    out
}

fn snapshot_seeds(dir: &Path) {
    // Real snapshots of the engine's model (what `--save-snapshot` writes).
    for tokens in [&[1u32][..], &[1, 17, 42], &moeshard_fuzz::disk::TOKENS] {
        let snap = moeshard_fuzz::real_snapshot(tokens);
        write(
            dir,
            &format!("real-{}-tokens.snap", tokens.len()),
            &snapshot_bytes(&snap),
        );
        let mut no_logits = snap.clone();
        no_logits.last_logits.clear();
        let name = format!("real-{}-tokens-no-logits.snap", tokens.len());
        write(dir, &name, &snapshot_bytes(&no_logits));
    }
    // No positions (what a restore of nothing would take).
    let mut empty = moeshard_fuzz::real_snapshot(&[1]);
    empty.tokens.clear();
    empty.last_logits.clear();
    for (k, v) in &mut empty.layers {
        k.clear();
        v.clear();
    }
    write(dir, "real-empty.snap", &snapshot_bytes(&empty));
    // A small one of another model (the layout check refuses it).
    let other = engine::Snapshot {
        fingerprint: "abc".into(),
        tokens: vec![1, 2, 3],
        kv_type: model::KvType::F32,
        n_kv_head: 1,
        head_dim_k: 2,
        head_dim_v: 2,
        layers: vec![(vec![1; 24], vec![2; 24])],
        last_logits: vec![0.5, -1.0],
    };
    write(dir, "small-other-model.snap", &snapshot_bytes(&other));
    structured_seeds(dir);
}

/// Inputs of the structure-aware form (odd first byte) of the snapshot and disk targets: the
/// `arbitrary`-built snapshot takes whatever bytes follow.
fn structured_seeds(dir: &Path) {
    for (i, mode) in [1u8, 3, 5].into_iter().enumerate() {
        let bytes: Vec<u8> = std::iter::once(mode)
            .chain((0..96u32).map(|j| (j.wrapping_mul(2_654_435_761 + i as u32) >> 11) as u8))
            .collect();
        write(dir, &format!("structured-{i}.bin"), &bytes);
    }
    // The engine's model, 3 tokens, F16, its shape, exact layers, no logits.
    write(
        dir,
        "structured-exact.bin",
        &[1, 1, 1, 3, 0, 1, 0, 0, 2, 0, 3, 0, 1, 0, 0, 0],
    );
}

fn disk_seeds(dir: &Path) {
    let t = moeshard_fuzz::disk::template();
    // Mode byte 0: the files' contents follow.
    let frame = |files: &[(String, Vec<u8>)], keep: bool| {
        let mut out = vec![0u8];
        for (i, (_, contents)) in files.iter().enumerate() {
            if i + 1 < files.len() {
                if keep {
                    out.extend_from_slice(&u32::MAX.to_le_bytes());
                    continue;
                }
                out.extend_from_slice(&(contents.len() as u32).to_le_bytes());
            }
            out.extend_from_slice(contents);
        }
        out
    };
    write(dir, "original.bin", &frame(&t.files, false));
    write(dir, "original-kept.bin", &frame(&t.files, true));
    // Another session's files under this session's names.
    let other = moeshard_fuzz::disk::files_of(&[5, 6]);
    write(dir, "other-session.bin", &frame(&other.files, false));
    let mut empty_last = t.files.clone();
    empty_last.last_mut().unwrap().1.clear();
    write(dir, "empty-last.bin", &frame(&empty_last, false));
    structured_seeds(dir);
}

fn request_seeds(dir: &Path) {
    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant who answers briefly."},
        {"role": "user", "content": "What is the tallest mountain on Earth?"},
    ]);
    let mut turn2 = messages.as_array().unwrap().clone();
    turn2.push(json!({"role": "assistant", "content": "Mount Everest."}));
    turn2.push(json!({"role": "user", "content": "And the second tallest?"}));
    let chat = [
        json!({"messages": messages, "max_tokens": 16, "temperature": 0}),
        json!({"messages": turn2, "max_tokens": 12, "temperature": 0, "cache_prompt": false}),
        json!({"model": "moeshard", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
               {"role": "assistant", "content": null}], "max_tokens": 5, "stop": "\n", "stream": true,
               "stream_options": {"include_usage": true}, "temperature": 0, "seed": -3, "unknown_field": 1}),
        json!({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "ROMEO:"}],
               "max_completion_tokens": 4, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.1,
               "presence_penalty": 0.5, "frequency_penalty": -0.5, "n": 1, "logprobs": false, "tools": [],
               "stop": ["\n\n", "END"], "ignore_eos": true}),
    ];
    let completion = [
        json!({"prompt": "The three primary colors are", "max_tokens": 8, "temperature": 0, "stream": true,
               "ignore_eos": true, "cache_prompt": true}),
        json!({"prompt": "hello", "max_tokens": 16000, "temperature": 0, "ignore_eos": true, "stream": true}),
        json!({"prompt": ["a"], "echo": true, "suffix": "", "best_of": 1, "logprobs": 0}),
        json!({"prompt": [1, 2, 3], "echo": true, "seed": 7, "temperature": 1.5}),
        json!({"prompt": [[1, 2]], "max_tokens": 1}),
    ];
    for (i, body) in chat.iter().enumerate() {
        let mut bytes = vec![0u8];
        bytes.extend(serde_json::to_vec(body).unwrap());
        write(dir, &format!("chat-{i}.json"), &bytes);
    }
    for (i, body) in completion.iter().enumerate() {
        let mut bytes = vec![1u8];
        bytes.extend(serde_json::to_vec(body).unwrap());
        write(dir, &format!("completion-{i}.json"), &bytes);
    }
    // Structure-aware inputs: the arbitrary-built bodies take whatever bytes follow.
    for mode in [2u8, 3] {
        let bytes: Vec<u8> = std::iter::once(mode)
            .chain((0..256u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8))
            .collect();
        write(dir, &format!("structured-{mode}.bin"), &bytes);
    }
}

/// Real frames as the pipeline and the tensor-parallel group send them, as one plaintext
/// stream (mode byte 0), and the structured form (odd mode byte) for the sealed reader.
fn frame_seeds(dir: &Path) {
    use cluster::activation::ActFormat;
    use cluster::pipeline::protocol::{ResultHeader, WorkHeader};
    use cluster::tp::protocol::TpReply;
    use cluster::wire::{self, Frame, Hello, Kind, Role, encode, pack};
    let hidden: Vec<f32> = (0..2 * 64).map(|i| i as f32 / 7.0).collect();
    let mut act = Vec::new();
    ActFormat::Bf16.encode(&hidden, 64, &mut act);
    let work = WorkHeader {
        seqs: Vec::new(),
        tokens: vec![1, 2],
        act: ActFormat::Bf16,
        n_embd: 64,
    };
    let frames = [
        Frame::new(Kind::Hello, 0, encode(&Hello::new(Role::Hop, "", 0, None))),
        pack(Kind::Work, 7, &work, &act),
        pack(Kind::WorkResult, 7, &ResultHeader::default(), &wire::f32_bytes(&[0.5; 16])),
        pack(Kind::TpDone, 3, &TpReply::Ready { epoch: 2 }, &[]),
        Frame::new(Kind::Ping, 0, Vec::new()),
        Frame::new(Kind::Error, 9, encode(&"stage 2:3 failed".to_string())),
    ];
    let mut stream = vec![0u8];
    for f in &frames {
        f.write_to(&mut stream).unwrap();
    }
    write(dir, "plain-stream.bin", &stream);
    structured_seeds(dir);
}

/// Handshake inputs: the structured form for each client variant (the fuzzer's `arbitrary`
/// decoding turns these bytes into keyed, keyless and raw clients) and a real keyless hello.
fn handshake_seeds(dir: &Path) {
    use cluster::wire::{AuthMode, Hello, Role, hello_frame};
    let hello = Hello::new(Role::Rank { rank: Some(1), expert_weight: 1.0 }, "f4fe54a2", 512, None);
    let (frame, _) = hello_frame(&AuthMode::Insecure, &hello).unwrap();
    let mut raw = vec![0u8, 1, 0];
    frame.write_to(&mut raw).unwrap();
    write(dir, "keyless-hello.bin", &raw);
    structured_seeds(dir);
}
