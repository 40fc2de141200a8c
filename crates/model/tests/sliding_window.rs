//! gpt-oss' sliding-window layers keep only their latest positions: decoding far past the
//! window (8 on the fixture) gives the same logits, bit for bit, as a cache that keeps every
//! position, while the sliding layers' memory stays bounded; rewinds within the kept slack
//! work, rewinds past it are refused without changing the cache; snapshots keep what the next
//! token of a sliding layer attends to (`window - 1` positions) and restore into a bounded
//! cache (and a full cache refuses them); a split
//! into stages across sliding and full layers matches the whole.

use std::path::PathBuf;

mod common;

use model::{
    Compute, KvCache, KvType, LogitsWanted, Model, NoHooks, ResidentExperts, SeqInput, StageInput,
    StageOutput,
};

const N_CTX: usize = 512;

fn gpt_oss() -> Model {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt-oss/model-f32.gguf");
    Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn window(model: &Model) -> usize {
    model
        .hp
        .sliding_window
        .expect("gpt-oss has a sliding window")
}

fn bounded(model: &Model, kv_type: KvType) -> KvCache {
    KvCache::new(model.kv_layout(kv_type, 0..=model.n_layer() - 1, N_CTX))
}

fn full(model: &Model, kv_type: KvType) -> KvCache {
    KvCache::new(
        model
            .kv_layout(kv_type, 0..=model.n_layer() - 1, N_CTX)
            .full_sliding(),
    )
}

/// Deterministic tokens spread over the vocabulary.
fn tokens(model: &Model, n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % model.hp.n_vocab as u64) as u32
        })
        .collect()
}

/// Logits of every token of `input`, appended to `kv`.
fn forward_all(model: &Model, cx: &Compute, kv: &mut KvCache, input: &[u32]) -> Vec<f32> {
    common::forward_logits(model, cx, kv, input)
}

/// Feeds `toks` in chunks of the given sizes (cycled), then one token at a time, into both
/// caches; every position's logits must be the same bits.
fn feed_both(
    model: &Model,
    cx: &Compute,
    a: &mut KvCache,
    b: &mut KvCache,
    toks: &[u32],
    chunks: &[usize],
) {
    let mut at = 0;
    let mut sizes = chunks.iter().copied().chain(std::iter::repeat(1));
    while at < toks.len() {
        let n = sizes.next().unwrap_or(1).min(toks.len() - at);
        let la = forward_all(model, cx, a, &toks[at..at + n]);
        let lb = forward_all(model, cx, b, &toks[at..at + n]);
        assert!(
            la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()) && la.len() == lb.len(),
            "logits of positions {at}..{} differ between the bounded and the full cache",
            at + n
        );
        at += n;
    }
}

fn sliding_layers(model: &Model) -> Vec<usize> {
    (0..model.n_layer())
        .filter(|&il| model.hp.window(il).is_some())
        .collect()
}

#[test]
fn decode_far_past_the_window_matches_the_full_cache_in_bounded_memory() {
    let model = gpt_oss();
    let cx = Compute::new(2);
    let w = window(&model);
    assert!(!sliding_layers(&model).is_empty() && sliding_layers(&model).len() < model.n_layer());
    for kv_type in [KvType::F32, KvType::F16] {
        let (mut b, mut f) = (bounded(&model, kv_type), full(&model, kv_type));
        let toks = tokens(&model, 40 * w, 1);
        let chunks = [5, 1, 3 * w + 1, 2, w, 7];
        feed_both(&model, &cx, &mut b, &mut f, &toks, &chunks);
        let n = toks.len();
        for il in 0..model.n_layer() {
            let held = b.keys(il).unwrap().len() / (b.bytes_per_position() / model.n_layer() / 2);
            if model.hp.window(il).is_some() {
                // At most 3 windows plus the largest chunk, whatever the length.
                assert!(
                    held <= 3 * w + 3 * w + 1,
                    "layer {il} holds {held} positions"
                );
                assert_eq!(b.held_from(il).unwrap() + held, n);
            } else {
                assert_eq!(held, n, "full layer {il}");
            }
        }
        let (used_b, used_f) = (b.bytes_used(), f.bytes_used());
        eprintln!(
            "gpt-oss fixture, {} KV at {n} positions (window {w}): bounded {used_b} bytes in use, {} allocated; full {used_f} in use, {} allocated",
            kv_type.name(),
            b.bytes_allocated(),
            f.bytes_allocated()
        );
        assert_eq!(used_f, n * f.bytes_per_position());
        assert!(used_b < used_f / 2 + used_f / 4, "{used_b} of {used_f}");
    }
}

#[test]
fn rewinds_within_the_slack_work_and_past_it_are_refused() {
    let model = gpt_oss();
    let cx = Compute::new(2);
    let w = window(&model);
    let (mut b, mut f) = (bounded(&model, KvType::F32), full(&model, KvType::F32));
    let toks = tokens(&model, 12 * w, 2);
    feed_both(&model, &cx, &mut b, &mut f, &toks, &[3 * w]);
    let n = toks.len();
    assert!(
        b.held_from(0).unwrap() > 0,
        "the sliding layers dropped positions"
    );
    // Too far back: refused, and the cache is untouched.
    for m in [1, w, n / 2] {
        assert!(!b.can_rewind(m), "rewind to {m} of {n}");
        let err = b.truncate(m).unwrap_err().to_string();
        assert!(err.contains("cannot rewind"), "{err}");
        assert_eq!(b.len(), n);
    }
    // Any rewind by up to a window is kept; continuing from there matches the full cache.
    for back in [1, w / 2, w] {
        assert!(b.can_rewind(n - back), "rewind by {back}");
    }
    b.truncate(n - w).unwrap();
    f.truncate(n - w).unwrap();
    let more = tokens(&model, 4 * w, 3);
    feed_both(&model, &cx, &mut b, &mut f, &more, &[2, w + 3]);
    // Back to nothing always works (a new sequence).
    b.truncate(0).unwrap();
    f.truncate(0).unwrap();
    feed_both(&model, &cx, &mut b, &mut f, &toks[..3 * w], &[w]);
}

#[test]
fn snapshots_keep_the_window_and_restore_into_a_bounded_cache() {
    let model = gpt_oss();
    let cx = Compute::new(2);
    let w = window(&model);
    let last = model.n_layer() - 1;
    let (mut b, mut f) = (bounded(&model, KvType::F16), full(&model, KvType::F16));
    let toks = tokens(&model, 9 * w + 3, 4);
    feed_both(&model, &cx, &mut b, &mut f, &toks, &[w + 1]);
    let n = toks.len();
    let export = |kv: &KvCache| -> Vec<(Vec<u8>, Vec<u8>)> {
        (0..=last)
            .map(|il| {
                let (k, v) = kv.export(il, n).unwrap();
                (k.to_vec(), v.to_vec())
            })
            .collect()
    };
    let (snap_b, snap_f) = (export(&b), export(&f));
    let row = b.bytes_per_position() / model.n_layer();
    for il in 0..=last {
        let kept = snap_b[il].0.len() + snap_b[il].1.len();
        let want = if model.hp.window(il).is_some() {
            w - 1
        } else {
            n
        };
        assert_eq!(kept, want * row, "layer {il}");
        assert_eq!(
            snap_f[il].0.len() + snap_f[il].1.len(),
            n * row,
            "layer {il}"
        );
    }
    let restore = |into: &mut KvCache, snap: &[(Vec<u8>, Vec<u8>)]| -> model::Result<()> {
        into.begin_import(n)?;
        for (il, (k, v)) in snap.iter().enumerate() {
            into.import(il, n, k, v)?;
        }
        Ok(())
    };
    // A bounded snapshot and a full one restore into bounded caches that continue the same
    // way; a restored session cannot rewind (it holds what the next token attends to only).
    let mut from_b = bounded(&model, KvType::F16);
    restore(&mut from_b, &snap_b).unwrap();
    let mut from_f = bounded(&model, KvType::F16);
    restore(&mut from_f, &snap_f).unwrap();
    assert!(!from_b.can_rewind(n - 1) && from_b.can_rewind(0));
    let more = tokens(&model, 3 * w, 5);
    feed_both(&model, &cx, &mut b, &mut from_b, &more, &[2]);
    feed_both(&model, &cx, &mut f, &mut from_f, &more, &[2]);
    // After the furthest rewind the cache accepts it still exports a snapshot.
    let len = b.len();
    let m = (1..len).find(|&m| b.can_rewind(m)).unwrap();
    b.truncate(m).unwrap();
    for il in 0..=last {
        b.export(il, m).unwrap();
    }
    // A full cache cannot be made from the window of a sliding layer.
    let mut into_full = full(&model, KvType::F16);
    let err = restore(&mut into_full, &snap_b).unwrap_err().to_string();
    assert!(err.contains("bounded sliding-window cache"), "{err}");
}

/// Stages 0..=0 (sliding), 1..=2 (full, sliding) and 3 (full, and the head), each with its
/// own bounded cache, match the whole model on a full cache, and agree on every rewind (the
/// last stage holds no sliding layer and still answers as the others do).
#[test]
fn a_split_across_sliding_and_full_layers_matches_the_whole() {
    let model = gpt_oss();
    let cx = Compute::new(2);
    let w = window(&model);
    let last = model.n_layer() - 1;
    let src = ResidentExperts::new(&model);
    let ranges = [0..=0, 1..=2, 3..=last];
    let mut stages: Vec<KvCache> = ranges
        .iter()
        .map(|r| KvCache::new(model.kv_layout(KvType::F32, r.clone(), N_CTX)))
        .collect();
    let mut whole = full(&model, KvType::F32);
    let toks = tokens(&model, 10 * w, 6);
    let mut at = 0;
    for n in [w + 2, 1, 2 * w, 1, 1, 3]
        .into_iter()
        .chain(std::iter::repeat(1))
    {
        if at >= toks.len() {
            break;
        }
        let chunk = &toks[at..(at + n).min(toks.len())];
        let mut hidden: Option<Vec<f32>> = None;
        let mut logits = Vec::new();
        for (range, kv) in ranges.iter().zip(stages.iter_mut()) {
            let head = *range.end() == last;
            let mut seq = [SeqInput {
                kv,
                n_tokens: chunk.len(),
                logits: if head {
                    LogitsWanted::All
                } else {
                    LogitsWanted::None
                },
            }];
            let input = match &hidden {
                None => StageInput::Tokens(chunk),
                Some(h) => StageInput::Hidden(h),
            };
            match model
                .forward(
                    &cx,
                    &src,
                    range.clone(),
                    head,
                    input,
                    &mut seq,
                    &mut NoHooks,
                )
                .unwrap()
            {
                StageOutput::Hidden(h) => hidden = Some(h),
                StageOutput::Logits(l) => logits = l.data,
            }
        }
        let one = forward_all(&model, &cx, &mut whole, chunk);
        assert!(
            logits.len() == one.len()
                && logits
                    .iter()
                    .zip(&one)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
            "positions {at}..: the split differs from the whole"
        );
        at += chunk.len();
        for m in [0, 1, at / 2, at.saturating_sub(w), at - 1] {
            let answers: Vec<bool> = stages.iter().map(|kv| kv.can_rewind(m)).collect();
            assert!(
                answers.windows(2).all(|p| p[0] == p[1]),
                "rewind to {m} of {at}: {answers:?}"
            );
        }
    }
    assert!(stages[0].held_from(0).unwrap() > 0);
    assert_eq!(stages[1].held_from(1).unwrap(), 0, "layer 1 is full");
    assert!(
        !stages[2].can_rewind(1),
        "the full-only stage tracks the window too"
    );
}
