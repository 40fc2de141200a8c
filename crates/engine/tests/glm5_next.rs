//! GLM-5.3 Flash through the local executor: a snapshot taken mid-conversation (KDA layers carry
//! their recurrent state, the indexer layer its keys) survives the file format and a restore into
//! another executor, which then continues bit for bit; the re-evaluation of a last token rewinds
//! the recurrent layers exactly, and a rewind further back than they keep is refused.

use std::path::PathBuf;
use std::sync::Arc;

use engine::{EngineError, EvalRequest, Executor, LocalExecutor, Snapshot};
use model::{Compute, KvType, LogitsWanted, Model};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/glm5-next")
}

fn prompt() -> Vec<u32> {
    let path = fixture().join("prompt_tokens.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn executor(model: &Arc<Model>) -> LocalExecutor {
    LocalExecutor::new(Arc::clone(model), Compute::new(2), KvType::F32, 512)
}

fn eval(x: &mut LocalExecutor, tokens: &[u32]) -> Vec<u32> {
    let out = x
        .eval(&[EvalRequest {
            session: 1,
            tokens,
            logits: LogitsWanted::All,
        }])
        .unwrap();
    out[0].logits.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn glm5_next_snapshot_restores_and_rewinds_exactly() {
    let path = fixture().join("model-f32.gguf");
    let model = Arc::new(Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    let prompt = prompt();
    let mut a = executor(&model);
    // Per position: the two latent layers' f32 rows of 32, the indexer layer's f32 key and
    // pooling scores of 64 and a quarter of a pooled key; the KDA layers none.
    assert_eq!(
        a.info().kv_bytes_per_position,
        2 * 32 * 4 + (2 * 64 + 16) * 4
    );
    eval(&mut a, &prompt[..300]);
    eval(&mut a, &prompt[300..301]);
    let mut snap = a.snapshot(1).unwrap();
    snap.tokens = prompt[..301].to_vec();
    let mut bytes = Vec::new();
    snap.write_to(&mut bytes).unwrap();
    let read = Snapshot::read_from(&mut &bytes[..], bytes.len() as u64).unwrap();
    let mut b = executor(&model);
    b.restore(1, &read).unwrap();
    assert_eq!(b.session_len(1), 301);
    assert_eq!(
        eval(&mut a, &prompt[301..340]),
        eval(&mut b, &prompt[301..340])
    );
    for pos in 340..344 {
        let t = &prompt[pos..pos + 1];
        assert_eq!(eval(&mut a, t), eval(&mut b, t), "decode at {pos}");
    }
    // The engine's re-evaluation of the last token.
    let last = eval(&mut a, &prompt[344..345]);
    a.truncate(1, 344).unwrap();
    assert_eq!(eval(&mut a, &prompt[344..345]), last);
    match a.truncate(1, 300) {
        Err(EngineError::CannotRewind { n: 300, .. }) => {}
        other => panic!("a rewind past what the recurrent layers keep: {other:?}"),
    }
    assert_eq!(a.session_len(1), 345);
}

/// A new prompt that shares the beginning of a cached conversation (a system prompt, an
/// earlier turn) reuses the recurrent memory at the latest chunk start inside the shared part
/// instead of evaluating from the start, and ends with a fresh session's bits.
#[test]
fn glm5_next_shared_prefix_resumes_from_a_chunk_checkpoint() {
    let path = fixture().join("model-f32.gguf");
    let model = Arc::new(Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    let prompt = prompt();
    let engine = |model: &Arc<Model>| {
        let mut e = engine::Engine::new(Box::new(executor(model)));
        e.prefill_chunk = 64;
        e
    };
    let mut e = engine(&model);
    let mut s = e.new_session();
    assert_eq!(e.sync(&mut s, &prompt).unwrap(), prompt.len());
    // Shares 300 tokens; the chunk starts were 64, 128, ..., 448.
    let mut other = prompt[..300].to_vec();
    other.extend(prompt[..40].iter().rev());
    assert_eq!(e.executor().rewind_point(s.id, 300), 256);
    assert_eq!(e.sync(&mut s, &other).unwrap(), other.len() - 256);
    let mut fresh = engine(&model);
    let mut f = fresh.new_session();
    fresh.sync(&mut f, &other).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&s.last_logits), bits(&f.last_logits));
}
