//! The premise of continuous batching: evaluating sessions together in one `Executor::eval`
//! gives every session exactly the logits it gets alone — bit for bit, for decode tokens batched
//! with each other and with another session's prefill chunk — so a server stream does not depend
//! on who else is being served. Checked on every fixture architecture, with a thread pool.

use std::path::PathBuf;
use std::sync::Arc;

use engine::{EvalRequest, Executor, LocalExecutor};
use model::{Compute, KvType, LogitsWanted, Model};

fn fixture(arch: &str, file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures")
        .join(arch)
        .join(file)
}

fn executor(path: &PathBuf, threads: usize) -> LocalExecutor {
    let model = Arc::new(Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    LocalExecutor::new(model, Compute::new(threads), KvType::F16, 256)
}

fn greedy(logits: &[f32]) -> u32 {
    engine::sampler::argmax(logits)
}

/// Each session alone: a prompt, then `steps` greedy tokens; returns every logits row seen.
fn solo(path: &PathBuf, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut ex = executor(path, 2);
    let r = ex
        .eval(&[EvalRequest {
            session: 1,
            tokens: prompt,
            logits: LogitsWanted::Last,
        }])
        .unwrap();
    let mut rows = vec![r[0].last().unwrap().to_vec()];
    for _ in 0..steps {
        let t = [greedy(rows.last().unwrap())];
        let r = ex
            .eval(&[EvalRequest {
                session: 1,
                tokens: &t,
                logits: LogitsWanted::Last,
            }])
            .unwrap();
        rows.push(r[0].last().unwrap().to_vec());
    }
    rows
}

#[test]
fn batched_eval_is_bit_identical_to_solo_eval() {
    let prompts: [&[u32]; 4] = [
        &[1, 5, 9, 13, 2, 7],
        &[3, 3, 3],
        &[11, 40, 2, 8, 19, 23, 4, 4, 1],
        &[7],
    ];
    let steps = 12;
    for arch in [
        "qwen3moe", "qwen2moe", "mixtral", "olmoe", "llama", "gpt-oss",
    ] {
        for file in ["model-q8_0.gguf", "model-q4_k.gguf", "model-f32.gguf"] {
            let path = fixture(arch, file);
            let expect: Vec<Vec<Vec<f32>>> =
                prompts.iter().map(|p| solo(&path, p, steps)).collect();
            // Together: session 0 prefills at once and decodes; the others start one step later
            // each, prefilling in chunks of 2 next to the decoders, as the scheduler does.
            let mut ex = executor(&path, 2);
            let mut pos = vec![0usize; prompts.len()];
            let mut rows: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
            let mut step = 0;
            while rows.iter().any(|r| r.len() < steps + 1) {
                let mut toks: Vec<Vec<u32>> = Vec::new();
                let mut who = Vec::new();
                for (s, p) in prompts.iter().enumerate() {
                    if step < s || rows[s].len() == steps + 1 {
                        continue;
                    }
                    if pos[s] < p.len() {
                        let n = if s == 0 {
                            p.len()
                        } else {
                            2.min(p.len() - pos[s])
                        };
                        toks.push(p[pos[s]..pos[s] + n].to_vec());
                        pos[s] += n;
                    } else {
                        toks.push(vec![greedy(rows[s].last().unwrap())]);
                    }
                    who.push(s);
                }
                let batch: Vec<EvalRequest> = who
                    .iter()
                    .zip(&toks)
                    .map(|(&s, t)| EvalRequest {
                        session: s as u64 + 1,
                        tokens: t,
                        logits: if pos[s] == prompts[s].len() {
                            LogitsWanted::Last
                        } else {
                            LogitsWanted::None
                        },
                    })
                    .collect();
                let out = ex.eval(&batch).unwrap();
                for (&s, r) in who.iter().zip(&out) {
                    if pos[s] == prompts[s].len() {
                        rows[s].push(r.last().unwrap().to_vec());
                    }
                }
                step += 1;
            }
            for (s, (got, want)) in rows.iter().zip(&expect).enumerate() {
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{arch}/{file}: session {s} row {i} differs when batched"
                    );
                }
            }
        }
    }
}
