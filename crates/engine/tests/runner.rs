//! The runner on the committed demo model: a model split into two runners (as two pipeline
//! stages) gives the whole runner's logits bit for bit, a work item that does not extend the
//! runner's history is refused without touching it, and a session exported and imported into
//! another runner continues exactly as the original.

use std::path::PathBuf;
use std::sync::Arc;

use engine::prefix_hash;
use engine::{LayerRange, RunError, Runner, SeqWork};
use model::{Compute, KvType, Model, StageInput, StageOutput};

fn demo() -> Arc<Model> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/shakespeare-moe.gguf");
    Arc::new(Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

fn runner(model: &Arc<Model>, range: LayerRange) -> Runner {
    Runner::new(Arc::clone(model), Compute::new(1), range, KvType::F32, 64)
}

fn item(session: u64, history: &[u32], new: &[u32]) -> SeqWork {
    SeqWork {
        session,
        pos0: history.len() as u32,
        n_tokens: new.len() as u32,
        reset: false,
        hash_before: prefix_hash::of(history),
        logits: 2,
    }
}

fn logits(out: StageOutput) -> Vec<f32> {
    match out {
        StageOutput::Logits(l) => l.data,
        StageOutput::Hidden(_) => panic!("expected logits"),
    }
}

#[test]
fn split_runners_match_the_whole_and_refuse_a_wrong_history() {
    let model = demo();
    let n = model.n_layer();
    assert!(n >= 2, "the demo model has {n} layers");
    let mut whole = runner(&model, LayerRange::whole(n));
    let mut front = runner(
        &model,
        LayerRange::parse(&format!("0:{}", n / 2 - 1), n).unwrap(),
    );
    let mut back = runner(
        &model,
        LayerRange::parse(&format!("{}:output", n / 2), n).unwrap(),
    );
    let (a, b) = ([1u32, 50, 7, 300], [42u32, 9]);
    let mut history = Vec::new();
    for new in [&a[..], &b[..]] {
        let w = [item(1, &history, new)];
        let want = logits(whole.run(&w, new, StageInput::Tokens(new)).unwrap());
        let StageOutput::Hidden(h) = front.run(&w, new, StageInput::Tokens(new)).unwrap() else {
            panic!("the front range ends before the head");
        };
        let got = logits(back.run(&w, new, StageInput::Hidden(&h)).unwrap());
        assert_eq!(
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        history.extend_from_slice(new);
    }
    // An item claiming a different history is refused and changes nothing.
    let wrong = [item(1, &[9, 9, 9, 9, 9, 9], &[5])];
    assert!(matches!(
        whole.run(&wrong, &[5], StageInput::Tokens(&[5])),
        Err(RunError::HashMismatch { session: 1, .. })
    ));
    assert_eq!(whole.session_len(1), history.len());
    // A rewind to an earlier position with the right hash is accepted.
    let rewind = [item(1, &a[..2], &[77])];
    whole
        .run(&rewind, &[77], StageInput::Tokens(&[77]))
        .unwrap();
    assert_eq!(whole.session_len(1), 3);
}

#[test]
fn an_exported_session_continues_identically_elsewhere() {
    let model = demo();
    let n = model.n_layer();
    let mut first = runner(&model, LayerRange::whole(n));
    let prompt = [3u32, 14, 15, 92, 65];
    first
        .run(
            &[item(7, &[], &prompt)],
            &prompt,
            StageInput::Tokens(&prompt),
        )
        .unwrap();
    let layers = first.export(7, prompt.len()).unwrap();
    assert_eq!(layers.len(), n);
    let mut second = runner(&model, LayerRange::whole(n));
    second.import(7, &prompt, &layers).unwrap();
    let next = [35u32];
    let w = [item(7, &prompt, &next)];
    let a = logits(first.run(&w, &next, StageInput::Tokens(&next)).unwrap());
    let b = logits(second.run(&w, &next, StageInput::Tokens(&next)).unwrap());
    assert_eq!(a, b);
    // A layer of the wrong size is refused and leaves no half-restored session.
    let mut short = layers.clone();
    short[n - 1].0.pop();
    assert!(second.import(8, &prompt, &short).is_err());
    assert_eq!(second.session_len(8), 0);
    assert!(!second.contains(8));
}
