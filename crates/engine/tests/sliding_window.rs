//! Sessions over gpt-oss' bounded sliding-window cache (the fixture's window is 8): a prompt
//! that shares a prefix the sliding layers no longer hold is a cache miss (the executor refuses
//! the rewind, `Engine::sync` evaluates the prompt afresh) with the logits of a fresh session;
//! a short rewind reuses the cache; a snapshot holds what the next token of a sliding layer
//! attends to (`window - 1` positions), goes through a file and continues exactly as the
//! original session.

use std::path::PathBuf;
use std::sync::Arc;

use engine::local::LocalExecutor;
use engine::{Engine, EngineError, Snapshot};
use model::{Compute, KvType, Model};

const N_CTX: usize = 256;

fn gpt_oss() -> Arc<Model> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/gpt-oss/model-f32.gguf");
    Arc::new(Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

fn engine(model: &Arc<Model>) -> Engine {
    let exec = LocalExecutor::new(Arc::clone(model), Compute::new(2), KvType::F32, N_CTX);
    let mut e = Engine::new(Box::new(exec));
    // Chunks larger than the window, so that prefill drops positions too.
    e.prefill_chunk = 20;
    e
}

fn tokens(model: &Model, n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % model.hp.n_vocab as u64) as u32
        })
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The logits after `prompt` on a fresh session of a fresh engine.
fn fresh_logits(model: &Arc<Model>, prompt: &[u32]) -> Vec<f32> {
    let mut e = engine(model);
    let mut s = e.new_session();
    e.sync(&mut s, prompt).unwrap();
    s.last_logits
}

#[test]
fn rewinds_past_the_window_are_cache_misses_with_fresh_results() {
    let model = gpt_oss();
    let w = model.hp.sliding_window.unwrap();
    let mut e = engine(&model);
    let mut s = e.new_session();
    let history = tokens(&model, 12 * w, 1);
    assert_eq!(e.sync(&mut s, &history).unwrap(), history.len());

    // Sharing only the first 10 tokens: the executor refuses the rewind...
    let err = e.executor_mut().truncate(s.id, 10).unwrap_err();
    assert!(matches!(err, EngineError::CannotRewind { .. }), "{err}");
    assert_eq!(
        e.executor().session_len(s.id),
        history.len(),
        "nothing changed"
    );
    // ... and sync evaluates the whole prompt, as a fresh session would.
    let mut other = history[..10].to_vec();
    other.extend(tokens(&model, 3 * w, 2));
    assert_eq!(e.sync(&mut s, &other).unwrap(), other.len());
    assert!(same_bits(&s.last_logits, &fresh_logits(&model, &other)));

    // A prompt that rewinds a few tokens reuses the rest.
    let mut edited = other[..other.len() - 3].to_vec();
    edited.extend(tokens(&model, 5, 3));
    assert_eq!(e.sync(&mut s, &edited).unwrap(), 5);
    assert!(same_bits(&s.last_logits, &fresh_logits(&model, &edited)));
}

#[test]
fn a_snapshot_keeps_the_window_and_continues_like_the_original() {
    let model = gpt_oss();
    let w = model.hp.sliding_window.unwrap();
    let mut e = engine(&model);
    let mut s = e.new_session();
    let history = tokens(&model, 9 * w + 5, 4);
    e.sync(&mut s, &history).unwrap();
    let snap = e.snapshot(&s).unwrap();
    let row = snap.bytes_per_position_per_layer();
    for (il, (k, v)) in snap.layers.iter().enumerate() {
        let positions = if model.hp.window(il).is_some() {
            w - 1
        } else {
            history.len()
        };
        assert_eq!(k.len() + v.len(), positions * row, "layer {il}");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.snap");
    snap.save(&path).unwrap();
    let back = Snapshot::load(&path).unwrap();
    assert_eq!(back, snap);

    let mut e2 = engine(&model);
    let mut r = e2.restore(&back).unwrap();
    assert!(same_bits(&r.last_logits, &s.last_logits));
    // The restored logits are kept, so extending the prompt evaluates only the new tokens.
    let mut more = history.clone();
    more.extend(tokens(&model, 4 * w, 5));
    assert_eq!(e2.sync(&mut r, &more).unwrap(), 4 * w);
    e.sync(&mut s, &more).unwrap();
    assert!(same_bits(&r.last_logits, &s.last_logits));
    assert_eq!(e2.sync(&mut r, &more).unwrap(), 0);
}

#[test]
fn a_full_cache_reuses_any_prefix_and_refuses_a_windowed_snapshot() {
    let model = gpt_oss();
    let w = model.hp.sliding_window.unwrap();
    let runner = engine::Runner::new(
        Arc::clone(&model),
        Compute::new(2),
        engine::LayerRange::whole(model.n_layer()),
        KvType::F32,
        N_CTX,
    )
    .with_full_sliding(true);
    let mut e = Engine::new(Box::new(LocalExecutor::from_runner(runner)));
    e.prefill_chunk = 20;
    let info = e.info().clone();
    assert_eq!(
        info.kv_bytes_at(200),
        200 * info.kv_bytes_per_position,
        "every layer keeps every position"
    );
    let mut s = e.new_session();
    let history = tokens(&model, 12 * w, 1);
    e.sync(&mut s, &history).unwrap();
    let mut other = history[..10].to_vec();
    other.extend(tokens(&model, 3 * w, 2));
    assert_eq!(
        e.sync(&mut s, &other).unwrap(),
        3 * w,
        "the 10 tokens are reused"
    );
    assert!(same_bits(&s.last_logits, &fresh_logits(&model, &other)));

    // The bounded engine's sliding layers cost at most their bound.
    let bounded = engine(&model);
    let b = bounded.info();
    let full_layers = b.kv_bytes_per_position - b.kv_sliding_bytes_per_position;
    assert!(b.kv_sliding_bytes_per_position > 0 && full_layers > 0);
    assert_eq!(
        b.kv_bytes_at(200),
        200 * full_layers
            + b.kv_sliding_bytes_per_position * model::kv::sliding_positions_held(w, 1)
    );

    // A bounded session's snapshot holds the window only: a full cache cannot take it.
    let mut be = engine(&model);
    let mut bs = be.new_session();
    be.sync(&mut bs, &history).unwrap();
    let snap = be.snapshot(&bs).unwrap();
    let err = e.restore(&snap).unwrap_err().to_string();
    assert!(err.contains("bounded sliding-window cache"), "{err}");
}
