//! What the model crate's reference tests share: reading the fixtures' `.npy`/JSON files,
//! running a prompt through a whole model, comparing logits.
#![allow(dead_code)]

use std::path::Path;

use model::{
    Compute, KvCache, KvType, LogitsWanted, Model, NoHooks, ResidentExperts, SeqInput, StageInput,
    StageOutput,
};

pub fn npy_f32(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..6], b"\x93NUMPY", "{}", path.display());
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
    };
    let header = std::str::from_utf8(&bytes[start..start + hlen]).unwrap();
    assert!(
        header.contains("'<f4'") && header.contains("'fortran_order': False"),
        "{header}"
    );
    let shape = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap()
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let data = bytes[start + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (shape, data)
}

pub fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Logits of every position, the prompt in chunks of `chunk` tokens.
pub fn logits_chunked(model: &Model, cx: &Compute, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(KvType::F32, 0..=last, 1024));
    let mut out = Vec::new();
    for part in tokens.chunks(chunk) {
        out.extend(forward_logits(model, cx, &mut kv, part));
    }
    out
}

/// One step of the whole model (resident experts, no hooks) over a batch: `tokens` are the
/// sequences' new tokens in batch order.
pub fn forward_batch(
    model: &Model,
    cx: &Compute,
    tokens: &[u32],
    seqs: &mut [SeqInput],
) -> model::Logits {
    let last = model.n_layer() - 1;
    let src = ResidentExperts::new(model);
    let input = StageInput::Tokens(tokens);
    match model.forward(cx, &src, 0..=last, true, input, seqs, &mut NoHooks) {
        Ok(StageOutput::Logits(l)) => l,
        Ok(StageOutput::Hidden(_)) => unreachable!("the whole model ends in the head"),
        Err(e) => panic!("forward: {e}"),
    }
}

/// One step of the whole model over `part` after what `kv` holds: every position's logits.
pub fn forward_logits(model: &Model, cx: &Compute, kv: &mut KvCache, part: &[u32]) -> Vec<f32> {
    let mut seqs = [SeqInput {
        kv,
        n_tokens: part.len(),
        logits: LogitsWanted::All,
    }];
    forward_batch(model, cx, part, &mut seqs).data
}

pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > v[b] { i } else { b })
}

/// Max |a − b| per row of `v`.
pub fn row_diffs(a: &[f32], b: &[f32], v: usize) -> Vec<f32> {
    a.chunks_exact(v)
        .zip(b.chunks_exact(v))
        .map(|(x, y)| {
            x.iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max)
        })
        .collect()
}

/// `n` greedy tokens after `prompt`, one forward per token (the decode path of the cache).
pub fn greedy(model: &Model, cx: &Compute, prompt: &[u32], n: usize) -> Vec<u32> {
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(KvType::F32, 0..=last, 1024));
    let mut input = prompt.to_vec();
    let mut tokens = Vec::new();
    for _ in 0..n {
        let mut seqs = [SeqInput {
            kv: &mut kv,
            n_tokens: input.len(),
            logits: LogitsWanted::Last,
        }];
        let l = forward_batch(model, cx, &input, &mut seqs);
        let t = argmax(l.row(0)) as u32;
        tokens.push(t);
        input = vec![t];
    }
    tokens
}
