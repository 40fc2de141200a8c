//! GLM-5.3 Flash (`glm5-next`) against transformers 5.24 on the tiny random fixture
//! (`tools/fixtures/models/glm5_next.py`): KDA layers 0 and 3, latent layers 1 (k-pool indexer)
//! and 2 (reusing layer 1's selection), a dense layer then routed experts, hyper-connections,
//! the clamped SwiGLU, 473 prompt positions, 32 greedy tokens.

mod common;

use std::path::PathBuf;

use common::{argmax, ids, json, logits_chunked, npy_f32, row_diffs};

use model::{
    Compute, KvCache, KvType, LogitsWanted, Model, NoHooks, ResidentExperts, SeqInput, StageInput,
    StageOutput,
};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/glm5-next")
}

fn load() -> (PathBuf, Model, Vec<u32>) {
    let dir = fixture();
    let model = Model::load(dir.join("model-f32.gguf")).unwrap();
    let prompt = ids(&json(&dir.join("prompt_tokens.json"))["tokens"]);
    (dir, model, prompt)
}

#[test]
fn glm5_next_matches_transformers_at_every_position() {
    let (dir, model, prompt) = load();
    let cx = Compute::new(2);
    let (shape, want) = npy_f32(&dir.join("logits.npy"));
    let v = model.hp.n_vocab;
    assert_eq!(shape, vec![prompt.len(), v]);
    for chunk in [prompt.len(), 64, 7, 1] {
        let got = logits_chunked(&model, &cx, &prompt, chunk);
        let diffs = row_diffs(&got, &want, v);
        let worst = diffs.iter().copied().fold(0f32, f32::max);
        let first_bad = diffs.iter().position(|&d| d > 1e-4);
        eprintln!(
            "glm5-next: chunks of {chunk}: max |ours − transformers| = {worst:.2e} over {} positions (first > 1e-4: {first_bad:?})",
            prompt.len()
        );
        assert!(
            worst <= 1e-4,
            "chunks of {chunk}: logits differ by {worst} (first at {first_bad:?})"
        );
    }
    // f16 latent rows (the indexer keys stay f32): 1.7e-5 here, as llama.cpp with f16 KV (1.8e-5).
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(KvType::F16, 0..=last, 1024));
    let f16_logits = feed(&model, &cx, &mut kv, &prompt);
    let d16 = row_diffs(&f16_logits, &want, v)
        .into_iter()
        .fold(0f32, f32::max);
    eprintln!("glm5-next: f16 KV: max |ours − transformers| = {d16:.2e}");
    assert!(d16 <= 1e-4, "f16 KV: {d16}");
    let (_, lcpp) = npy_f32(&dir.join("llama_cpp_logits_f32.npy"));
    let got = logits_chunked(&model, &cx, &prompt, prompt.len());
    let dl = row_diffs(&got, &lcpp, v).into_iter().fold(0f32, f32::max);
    eprintln!("glm5-next: max |ours − llama.cpp| = {dl:.2e}");
    assert!(dl <= 1e-4, "llama.cpp: {dl}");
}

#[test]
fn glm5_next_greedy_decode_matches_transformers() {
    let (dir, model, prompt) = load();
    let cx = Compute::new(2);
    let v = model.hp.n_vocab;
    let g = json(&dir.join("greedy.json"));
    let want_tokens = ids(&g["generated_tokens"]);
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(KvType::F32, 0..=last, 1024));
    let src = ResidentExperts::new(&model);
    let mut input = prompt.clone();
    let mut tokens = Vec::new();
    let mut step_logits = Vec::new();
    for _ in 0..want_tokens.len() {
        let mut seqs = [SeqInput {
            kv: &mut kv,
            n_tokens: input.len(),
            logits: LogitsWanted::Last,
        }];
        let StageOutput::Logits(l) = model
            .forward(
                &cx,
                &src,
                0..=last,
                true,
                StageInput::Tokens(&input),
                &mut seqs,
                &mut NoHooks,
            )
            .unwrap()
        else {
            unreachable!()
        };
        let t = argmax(l.row(0)) as u32;
        step_logits.extend_from_slice(l.row(0));
        tokens.push(t);
        input = vec![t];
    }
    let matching = tokens
        .iter()
        .zip(&want_tokens)
        .filter(|(a, b)| a == b)
        .count();
    eprintln!(
        "glm5-next: greedy {matching}/{} tokens match",
        want_tokens.len()
    );
    assert_eq!(tokens, want_tokens, "greedy tokens");
    let (_, want_steps) = npy_f32(&dir.join("greedy_logits.npy"));
    let d = row_diffs(&step_logits, &want_steps, v)
        .into_iter()
        .fold(0f32, f32::max);
    eprintln!("glm5-next: decode-step logits max diff {d:.2e}");
    assert!(d <= 1e-4, "decode-step logits differ by {d}");
}

/// Threads only split work: prompt logits and one-token steps give the same bits at 1 and 3
/// threads (the KDA recurrence runs per head, the indexer and attention per row).
#[test]
fn glm5_next_thread_count_does_not_change_a_bit() {
    let (_, model, prompt) = load();
    let prompt = &prompt[..160];
    let runs: Vec<(Vec<f32>, Vec<f32>)> = [1, 3]
        .iter()
        .map(|&t| {
            let cx = Compute::new(t);
            (
                logits_chunked(&model, &cx, prompt, prompt.len()),
                logits_chunked(&model, &cx, prompt, 1),
            )
        })
        .collect();
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(
        same(&runs[0].0, &runs[1].0),
        "prompt logits differ between 1 and 3 threads"
    );
    assert!(
        same(&runs[0].1, &runs[1].1),
        "token-by-token logits differ between 1 and 3 threads"
    );
}

/// Feeds `tokens` to `kv` (its next positions), returning the logits of every one.
fn feed(model: &Model, cx: &Compute, kv: &mut KvCache, tokens: &[u32]) -> Vec<f32> {
    common::forward_logits(model, cx, kv, tokens)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The recurrent layers rewind to any of the latest `KEPT_REWINDS` positions (replaying the
/// kept step inputs: a re-evaluated last token, a rejected speculative draft) and to where
/// longer chunks started; re-running from there gives the original bits. A rewind further back is
/// refused and changes nothing.
#[test]
fn glm5_next_rewinds_to_its_checkpoints_and_refuses_others() {
    let (_, model, prompt) = load();
    let cx = Compute::new(2);
    let v = model.hp.n_vocab;
    let kept = model::kv::KEPT_REWINDS;
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(KvType::F32, 0..=last, 1024));
    feed(&model, &cx, &mut kv, &prompt[..200]);
    // A speculative step: eight drafts and the token before them at once.
    let drafts = &prompt[200..209];
    let first = feed(&model, &cx, &mut kv, drafts);
    for back in 1..=drafts.len() {
        let n = 209 - back;
        assert!(kv.can_rewind(n), "rewind by {back}");
        kv.truncate(n).unwrap();
        let again = feed(&model, &cx, &mut kv, &drafts[9 - back..]);
        assert_eq!(
            bits(&again),
            bits(&first[(9 - back) * v..]),
            "rewind by {back} and re-run"
        );
    }
    let oldest = 209 - kept;
    assert!(kv.can_rewind(oldest) && !kv.can_rewind(oldest - 1) && !kv.can_rewind(150));
    assert!(kv.truncate(150).is_err());
    assert_eq!(kv.len(), 209, "a refused rewind changes nothing");
    // A long chunk: its start stays a rewind point, and its latest positions.
    let long = &prompt[209..309];
    let first = feed(&model, &cx, &mut kv, long);
    assert!(kv.can_rewind(209) && !kv.can_rewind(250) && kv.can_rewind(309 - kept));
    kv.truncate(300).unwrap();
    assert_eq!(
        bits(&feed(&model, &cx, &mut kv, &long[91..])),
        bits(&first[91 * v..])
    );
    kv.truncate(209).unwrap();
    assert_eq!(bits(&feed(&model, &cx, &mut kv, long)), bits(&first));
    // Decoding one token at a time keeps the latest positions replayable.
    for pos in 309..314 {
        feed(&model, &cx, &mut kv, &prompt[pos..pos + 1]);
    }
    assert!((314 - kept..=314).all(|n| kv.can_rewind(n)) && !kv.can_rewind(313 - kept));
    kv.truncate(0).unwrap();
    let fresh = feed(&model, &cx, &mut kv, &prompt[..8]);
    let mut other = KvCache::new(model.kv_layout(KvType::F32, 0..=last, 1024));
    assert_eq!(
        bits(&fresh),
        bits(&feed(&model, &cx, &mut other, &prompt[..8]))
    );
}

/// A prompt prefilled in chunks keeps the recurrent memory where its chunks started (a bounded
/// number, spread over the history): a prefix shared with another prompt ends at the latest of
/// them at most, and continuing from there gives the bits of the first run.
#[test]
fn glm5_next_shared_prefixes_rewind_to_chunk_checkpoints() {
    let (_, model, prompt) = load();
    let cx = Compute::new(2);
    let v = model.hp.n_vocab;
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(KvType::F32, 0..=last, 1024));
    let chunk = 40;
    let mut first = Vec::new();
    for part in prompt.chunks(chunk) {
        first.extend(feed(&model, &cx, &mut kv, part));
    }
    let n = prompt.len();
    let starts: Vec<usize> = (chunk..n).step_by(chunk).collect();
    // Every chunk start but the latest falls outside the replayable positions; more than
    // `KEPT_CHECKPOINTS` of them, so some were let go.
    assert!(starts.len() > model::kv::KEPT_CHECKPOINTS + 1);
    let points: Vec<usize> = (1..n)
        .filter(|&p| kv.can_rewind(p) && p < n - model::kv::KEPT_REWINDS)
        .collect();
    assert_eq!(points.len(), model::kv::KEPT_CHECKPOINTS, "{points:?}");
    assert!(points.iter().all(|p| starts.contains(p)), "{points:?}");
    assert_eq!(kv.rewind_point(n - 1), n - 1);
    assert_eq!(kv.rewind_point(points[0] - 1), 0);
    for (shared, i) in [(points[5] + 7, 5), (points[2], 2), (points[0] + 1, 0)] {
        let at = kv.rewind_point(shared);
        assert_eq!(at, points[i], "rewind point of {shared}");
        kv.truncate(at).unwrap();
        let again = feed(&model, &cx, &mut kv, &prompt[at..at + 30]);
        assert_eq!(
            bits(&again),
            bits(&first[at * v..(at + 30) * v]),
            "from {at}"
        );
        // The later checkpoints are gone, the earlier ones kept, and the chunk just fed
        // started at a checkpoint again.
        let reachable: Vec<usize> = (1..kv.len() - model::kv::KEPT_REWINDS)
            .filter(|&p| kv.can_rewind(p))
            .collect();
        assert_eq!(reachable, points[..=i], "after the rewind to {at}");
    }
}

/// A session exported mid-conversation (at the current position and at a replayed position
/// behind it) and imported into a fresh cache continues bit for bit as the original.
#[test]
fn glm5_next_restored_session_continues_bit_identically() {
    let (_, model, prompt) = load();
    let cx = Compute::new(2);
    let last = model.n_layer() - 1;
    let layout = || model.kv_layout(KvType::F32, 0..=last, 1024);
    let mut kv = KvCache::new(layout());
    for part in prompt[..301].chunks(64) {
        feed(&model, &cx, &mut kv, part);
    }
    for n in [301, 299] {
        let mut restored = KvCache::new(layout());
        restored.begin_import(n).unwrap();
        for il in 0..=last {
            let (k, v) = kv.export(il, n).unwrap();
            if il == 0 || il == 3 {
                assert!(k.is_empty(), "a KDA layer exports no rows");
            }
            restored.import(il, n, &k, &v).unwrap();
        }
        let mut original = KvCache::new(layout());
        for part in prompt[..n].chunks(64) {
            feed(&model, &cx, &mut original, part);
        }
        let a = feed(&model, &cx, &mut original, &prompt[n..n + 40]);
        let b = feed(&model, &cx, &mut restored, &prompt[n..n + 40]);
        assert_eq!(bits(&a), bits(&b), "restored at {n}: the next 40 positions");
        for pos in n + 40..n + 44 {
            let a = feed(&model, &cx, &mut original, &prompt[pos..pos + 1]);
            let b = feed(&model, &cx, &mut restored, &prompt[pos..pos + 1]);
            assert_eq!(bits(&a), bits(&b), "restored at {n}: decode at {pos}");
        }
    }
    // No memory of a position the cache cannot reconstruct is exported.
    assert!(kv.export(0, 250).is_err());
    assert!(kv.export(0, 301 - model::kv::KEPT_REWINDS).is_ok());
}

/// Stages of a pipeline, each its own cache and the previous stage's hidden state (the four
/// streams) as input, the indexer selection handed on where a stage starts between the
/// full-indexer layer and its shared layer: every split gives the single pass's bits. Without
/// the selection, a stage starting at the shared layer is refused by name.
#[test]
fn glm5_next_pipeline_stages_match_the_single_pass() {
    let (_, model, prompt) = load();
    let cx = Compute::new(2);
    let prompt = &prompt[..120];
    let whole = logits_chunked(&model, &cx, prompt, 50);
    let src = ResidentExperts::new(&model);
    let last = model.n_layer() - 1;
    for stages in [
        &[0..=0, 1..=3][..],
        &[0..=1, 2..=3],
        &[0..=2, 3..=3],
        &[0..=0, 1..=1, 2..=2, 3..=3],
    ] {
        let mut kvs: Vec<KvCache> = stages
            .iter()
            .map(|r| KvCache::new(model.kv_layout(KvType::F32, r.clone(), 1024)))
            .collect();
        let mut got = Vec::new();
        for part in prompt.chunks(50) {
            let mut hidden = Vec::new();
            for (i, (range, kv)) in stages.iter().zip(kvs.iter_mut()).enumerate() {
                let head = *range.end() == last;
                let input = match i {
                    0 => StageInput::Tokens(part),
                    _ => StageInput::Hidden(&hidden),
                };
                let out = model
                    .forward(
                        &cx,
                        &src,
                        range.clone(),
                        head,
                        input,
                        &mut [SeqInput {
                            kv,
                            n_tokens: part.len(),
                            logits: if head {
                                LogitsWanted::All
                            } else {
                                LogitsWanted::None
                            },
                        }],
                        &mut NoHooks,
                    )
                    .unwrap();
                match out {
                    StageOutput::Hidden(h) => {
                        assert_eq!(h.len(), part.len() * model.hp.hidden_width());
                        hidden = h;
                    }
                    StageOutput::Logits(l) => got.extend(l.data),
                }
            }
        }
        assert_eq!(bits(&got), bits(&whole), "stages {stages:?}");
    }
    let mut kv = KvCache::new(model.kv_layout(KvType::F32, 2..=last, 1024));
    // Streams, then an empty carried selection (every slot unused).
    let (stream, carried) = (model.hp.stream_width(), model.hp.carried_width());
    let hidden: Vec<f32> = (0..4)
        .flat_map(|_| {
            std::iter::repeat_n(0.5f32, stream)
                .chain(std::iter::repeat_n(f32::from_bits(u32::MAX), carried))
        })
        .collect();
    let refused = model.forward(
        &cx,
        &src,
        2..=last,
        true,
        StageInput::Hidden(&hidden),
        &mut [SeqInput {
            kv: &mut kv,
            n_tokens: 4,
            logits: LogitsWanted::All,
        }],
        &mut NoHooks,
    );
    let err = refused
        .expect_err("a stage starting at a shared layer without the selection")
        .to_string();
    assert!(
        err.contains("layer 2 reuses the indexer selection of layer 1"),
        "{err}"
    );
    assert_eq!(kv.len(), 0, "the refused pass leaves nothing in the cache");
}

/// Partial sums of one tensor-parallel group, added in rank order on every rank.
struct Group {
    slots: std::sync::Mutex<Vec<Vec<f64>>>,
    barrier: std::sync::Barrier,
}

struct RankHooks<'g> {
    rank: usize,
    group: &'g Group,
}

impl model::Hooks for RankHooks<'_> {
    fn all_reduce(
        &mut self,
        _layer: usize,
        _point: model::ReducePoint,
        data: &mut [f64],
    ) -> model::Result<()> {
        self.group.slots.lock().unwrap()[self.rank] = data.to_vec();
        self.group.barrier.wait();
        {
            let slots = self.group.slots.lock().unwrap();
            for (i, v) in data.iter_mut().enumerate() {
                *v = slots.iter().map(|s| s[i]).sum();
            }
        }
        self.group.barrier.wait();
        Ok(())
    }
}

/// Two ranks, each half the latent and KDA heads (and its heads' recurrent state), half the
/// routed experts and half the vocabulary, the indexer whole on both: the prompt's logits, in
/// one chunk and token by token, are the single node's bits. The ranks' snapshots, their KDA
/// states merged by heads, restore into one node, which continues as the single node does; the
/// merged states split back into the ranks' shares.
#[test]
fn glm5_next_two_rank_tensor_parallel_matches_the_single_node() {
    let (dir, single, prompt) = load();
    let prompt = &prompt[..100];
    let cx = Compute::new(1);
    let files = std::sync::Arc::new(gguf::GgufModel::open(dir.join("model-f32.gguf")).unwrap());
    let ranks: Vec<std::sync::Arc<Model>> = (0..2)
        .map(|r| std::sync::Arc::new(Model::from_gguf_rank(files.clone(), r, 2).unwrap()))
        .collect();
    assert!(ranks[0].shard().attention_split, "heads are split");
    assert_eq!(ranks[1].shard().heads, 2..4);
    let v = single.hp.n_vocab;
    let n_expert = single.hp.moe.as_ref().unwrap().n_expert;
    for chunk in [prompt.len(), 1] {
        let want = logits_chunked(&single, &cx, prompt, chunk);
        let group = Group {
            slots: std::sync::Mutex::new(vec![Vec::new(); 2]),
            barrier: std::sync::Barrier::new(2),
        };
        type RankOut = (usize, Vec<f32>, Vec<(Vec<u8>, Vec<u8>)>);
        let parts: Vec<RankOut> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .enumerate()
                .map(|(r, m)| {
                    let group = &group;
                    s.spawn(move || {
                        let cx = Compute::new(1);
                        let owned = (0..n_expert).map(|e| e * 2 / n_expert == r).collect();
                        let src = model::OwnedResidentExperts::new(m.clone(), owned);
                        let last = m.n_layer() - 1;
                        let mut kv = KvCache::new(m.kv_layout(KvType::F32, 0..=last, 1024));
                        let mut hooks = RankHooks { rank: r, group };
                        let mut out = Vec::new();
                        let mut width = 0;
                        for part in prompt.chunks(chunk) {
                            let StageOutput::Logits(l) = m
                                .forward(
                                    &cx,
                                    &src,
                                    0..=last,
                                    true,
                                    StageInput::Tokens(part),
                                    &mut [SeqInput {
                                        kv: &mut kv,
                                        n_tokens: part.len(),
                                        logits: LogitsWanted::All,
                                    }],
                                    &mut hooks,
                                )
                                .unwrap()
                            else {
                                unreachable!()
                            };
                            width = l.n_vocab;
                            out.extend(l.data);
                        }
                        let exports = (0..=last)
                            .map(|il| {
                                let (k, v) = kv.export(il, prompt.len()).unwrap();
                                (k.to_vec(), v.to_vec())
                            })
                            .collect();
                        (width, out, exports)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut got = Vec::with_capacity(want.len());
        for row in 0..prompt.len() {
            for (w, data, _) in &parts {
                got.extend_from_slice(&data[row * w..(row + 1) * w]);
            }
        }
        assert_eq!(got.len(), prompt.len() * v);
        let differing = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        eprintln!("glm5-next: 2 ranks, chunks of {chunk}: {differing} logits differ from one node");
        assert_eq!(differing, 0, "2 ranks, chunks of {chunk}");
        if chunk == 1 {
            continue;
        }
        let p = single.hp.glm5next.as_ref().unwrap();
        let (hd, taps) = (p.kda_head_dim, p.conv_kernel - 1);
        let last = single.n_layer() - 1;
        let n = prompt.len();
        let mut restored = KvCache::new(single.kv_layout(KvType::F32, 0..=last, 1024));
        restored.begin_import(n).unwrap();
        for il in 0..=last {
            let (k, v) = &parts[0].2[il];
            if p.kind(il) == model::hparams::Glm5LayerKind::Kda {
                let shares: Vec<&[u8]> = parts.iter().map(|r| &r.2[il].1[..]).collect();
                let merged = model::kv::merge_recurrent_shares(&shares, hd, taps).unwrap();
                for (r, part) in parts.iter().enumerate() {
                    let heads = ranks[r].shard().heads.clone();
                    let back = model::kv::split_recurrent_share(&merged, heads, hd, taps).unwrap();
                    assert_eq!(back, part.2[il].1, "layer {il}: rank {r}'s share");
                }
                restored.import(il, n, k, &merged).unwrap();
            } else {
                assert_eq!((k, v), (&parts[1].2[il].0, &parts[1].2[il].1));
                restored.import(il, n, k, v).unwrap();
            }
        }
        let mut original = KvCache::new(single.kv_layout(KvType::F32, 0..=last, 1024));
        feed(&single, &cx, &mut original, prompt);
        let next = &load().2[n..n + 20];
        let a = feed(&single, &cx, &mut original, next);
        let b = feed(&single, &cx, &mut restored, next);
        assert_eq!(
            bits(&a),
            bits(&b),
            "a group's snapshot restored on one node"
        );
    }
}

/// Two sequences in one batch (different lengths and histories) get the bits each gets alone:
/// the KDA state, the indexer keys and the selections stay per sequence.
#[test]
fn glm5_next_batched_sequences_match_their_own_runs() {
    let (_, model, prompt) = load();
    let cx = Compute::new(2);
    let last = model.n_layer() - 1;
    let layout = || model.kv_layout(KvType::F32, 0..=last, 1024);
    let (a_hist, a_new) = (&prompt[..90], &prompt[90..97]);
    let (b_hist, b_new) = (&prompt[200..231], &prompt[231..232]);
    let mut alone = Vec::new();
    for (hist, new) in [(a_hist, a_new), (b_hist, b_new)] {
        let mut kv = KvCache::new(layout());
        feed(&model, &cx, &mut kv, hist);
        alone.extend(feed(&model, &cx, &mut kv, new));
    }
    let (mut ka, mut kb) = (KvCache::new(layout()), KvCache::new(layout()));
    feed(&model, &cx, &mut ka, a_hist);
    feed(&model, &cx, &mut kb, b_hist);
    let batch: Vec<u32> = a_new.iter().chain(b_new).copied().collect();
    let src = ResidentExperts::new(&model);
    let StageOutput::Logits(l) = model
        .forward(
            &cx,
            &src,
            0..=last,
            true,
            StageInput::Tokens(&batch),
            &mut [
                SeqInput {
                    kv: &mut ka,
                    n_tokens: a_new.len(),
                    logits: LogitsWanted::All,
                },
                SeqInput {
                    kv: &mut kb,
                    n_tokens: b_new.len(),
                    logits: LogitsWanted::All,
                },
            ],
            &mut NoHooks,
        )
        .unwrap()
    else {
        unreachable!()
    };
    assert_eq!(bits(&l.data), bits(&alone));
}
