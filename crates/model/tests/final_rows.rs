//! The final layer runs its FFN (and everything after its attention) only on the batch rows that
//! need logits. Asking for fewer rows must not change a bit: neither the logits of the rows asked
//! for, nor the caches the step leaves behind (the next step's logits agree bit for bit).

use std::path::PathBuf;

mod common;

use model::{Compute, KvCache, KvType, Logits, LogitsWanted, Model, SeqInput};

fn fixture(family: &str, file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(family)
        .join(file)
}

/// One step of the whole model over two sequences, `parts[i]` appended to `kvs[i]`.
fn step(
    model: &Model,
    cx: &Compute,
    kvs: &mut [KvCache; 2],
    parts: [&[u32]; 2],
    wanted: [LogitsWanted; 2],
) -> Logits {
    let tokens: Vec<u32> = parts.concat();
    let [kv0, kv1] = kvs;
    let mut seqs = [
        SeqInput {
            kv: kv0,
            n_tokens: parts[0].len(),
            logits: wanted[0],
        },
        SeqInput {
            kv: kv1,
            n_tokens: parts[1].len(),
            logits: wanted[1],
        },
    ];
    common::forward_batch(model, cx, &tokens, &mut seqs)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn rows_without_logits_change_no_bit() {
    use LogitsWanted::{All, Last, None};
    let cx = Compute::new(2);
    for (family, file) in [
        ("qwen3moe", "model-f32.gguf"),
        ("qwen3moe", "model-q4_k.gguf"),
        ("olmoe", "model-iq2_xxs.gguf"),
        ("llama", "model-q8_0.gguf"),
        ("deepseek2", "model-q4_k.gguf"),
        ("glm4moe", "model-f32.gguf"),
        ("gpt-oss", "model-mxfp4.gguf"),
        ("glm-dsa", "model-f32.gguf"),
        ("glm5-next", "model-f32.gguf"),
        ("deepseek4", "model-f32.gguf"),
    ] {
        let what = format!("{family}/{file}");
        let model = Model::load(fixture(family, file)).unwrap();
        let prompt = common::ids(&common::json(&fixture(family, "prompt_tokens.json"))["tokens"]);
        let split = prompt.len() / 3;
        let parts = [&prompt[..split], &prompt[split..]];
        let new_caches = || {
            let layout = || model.kv_layout(KvType::F32, 0..=model.n_layer() - 1, 512);
            [KvCache::new(layout()), KvCache::new(layout())]
        };
        let mut full = new_caches();
        let every = step(&model, &cx, &mut full, parts, [All, All]);
        let next = [&prompt[..1], &prompt[1..2]];
        let after_full = step(&model, &cx, &mut full, next, [Last, Last]);
        for wanted in [[Last, None], [None, Last], [Last, Last], [None, None]] {
            let mut kvs = new_caches();
            let some = step(&model, &cx, &mut kvs, parts, wanted);
            assert_eq!(some.rows.len(), some.data.len() / some.n_vocab, "{what}");
            for (i, &row) in some.rows.iter().enumerate() {
                assert_eq!(
                    bits(some.row(i)),
                    bits(every.row(row)),
                    "{what}: row {row} asked with {wanted:?}"
                );
            }
            let after = step(&model, &cx, &mut kvs, next, [Last, Last]);
            assert_eq!(
                bits(&after.data),
                bits(&after_full.data),
                "{what}: the step after one that asked {wanted:?}"
            );
        }
    }
}
