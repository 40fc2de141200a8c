//! `moeshard bench`: llama-bench-style prompt processing (`-p`) and generation (`-n`) speed
//! with mean ± stddev over repetitions, and a ds4-bench-style context sweep that reports how
//! prefill and decode speed change as the KV cache fills. Runs through the engine, so it
//! measures whatever executor the flags select (local, pipeline, tensor-parallel, streaming).
//!
//! With `--prompt-file` or speculative decoding the generation test is a real greedy generation
//! after the prompt (through the same loop as `moeshard run`), so drafts have a text to come
//! from and the output reports how many of them the model kept.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use engine::generate::{GenerateOptions, generate};
use engine::tokenizer::Tokenizer;
use engine::{DEFAULT_PREFILL_CHUNK, Engine, EvalRequest, Sampler, SamplerConfig, Speculation};
use model::LogitsWanted;

use crate::cluster_args::ClusterArgs;
use crate::common::{self, ModelArgs};
use crate::speculative_args::SpeculativeArgs;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Prompt tokens per prompt-processing test (0 skips it).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Tokens per generation test (0 skips it).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 3)]
    pub repetitions: usize,
    /// Prompt tokens per forward pass (llama-bench's batch size). Default 512; a pipeline gets
    /// the whole prompt and cuts it itself (`--dist-prefill-chunk`) so chunks overlap.
    #[arg(short = 'b', long)]
    pub batch: Option<usize>,
    /// Sessions decoding together (one batched forward per step, as `serve --parallel` runs
    /// them); the generation test then reports aggregate tokens per second over all of them.
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Context sweep: first context depth (enables the sweep with --ctx-max).
    #[arg(long)]
    pub ctx_start: Option<usize>,
    #[arg(long)]
    pub ctx_max: Option<usize>,
    #[arg(long, default_value_t = 1024)]
    pub step: usize,
    /// Generated tokens measured at each sweep depth.
    #[arg(long, default_value_t = 32)]
    pub sweep_gen: usize,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// After each test, where its time went: wall-clock seconds per phase of the forward passes
    /// run in this process (all of them for a single node; the first stage or rank 0 of a
    /// cluster), summed over the repetitions; in a sweep, of each depth's decode.
    #[arg(long)]
    pub profile: bool,
    /// A text prompt instead of random tokens: the prompt-processing test evaluates it (instead
    /// of `-p` random tokens; `-p 0` still skips it) and the generation test generates greedily
    /// after it, e.g.
    /// `tools/bench/code_edit_prompt.txt` (repetitive code, what prompt lookup drafts from).
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    // With speculative decoding the generation test generates greedily after the prompt
    // (`--prompt-file`, or `-p` random tokens) and reports drafted and accepted tokens.
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
}

/// Deterministic token ids spread over the vocabulary (like llama-bench's random prompt).
fn tokens(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % n_vocab as u64) as u32
        })
        .collect()
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64
    } else {
        0.0
    };
    (m, var.sqrt())
}

fn eval(engine: &mut Engine, session: u64, toks: &[u32], want: LogitsWanted) -> anyhow::Result<()> {
    engine.executor_mut().eval(&[EvalRequest {
        session,
        tokens: toks,
        logits: want,
    }])?;
    Ok(())
}

/// Seconds to evaluate `n` random prompt tokens on a fresh session in batches of `batch`.
fn prompt_test(engine: &mut Engine, n: usize, batch: usize, seed: u64) -> anyhow::Result<f64> {
    let toks = tokens(n, engine.info().n_vocab, seed);
    prompt_tokens_test(engine, &toks, batch)
}

/// Seconds for `parallel` fresh sessions to generate `n` tokens each, one token per session
/// per step, all sessions of a step in one batched evaluation.
fn gen_test(engine: &mut Engine, n: usize, parallel: usize, seed: u64) -> anyhow::Result<f64> {
    let n_vocab = engine.info().n_vocab;
    let sessions: Vec<_> = (0..parallel.max(1)).map(|_| engine.new_session()).collect();
    let toks: Vec<Vec<u32>> = (0..sessions.len())
        .map(|i| tokens(n, n_vocab, seed + 7919 * i as u64))
        .collect();
    let t0 = Instant::now();
    for step in 0..n {
        let batch: Vec<EvalRequest> = sessions
            .iter()
            .zip(&toks)
            .map(|(s, t)| EvalRequest {
                session: s.id,
                tokens: std::slice::from_ref(&t[step]),
                logits: LogitsWanted::Last,
            })
            .collect();
        engine.executor_mut().eval(&batch)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    for s in sessions {
        engine.close(s);
    }
    Ok(secs)
}

/// Drafted and accepted tokens of a test's repetitions (speculative decoding).
#[derive(Clone, Copy, Debug, Default)]
struct Drafts {
    drafted: usize,
    accepted: usize,
}

impl Drafts {
    fn rate(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// The generation test on a prompt: a fresh session, the prompt evaluated (not timed), then `n`
/// greedy tokens through the generation loop `moeshard run` uses, speculative when `speculation`
/// is given. Returns the tokens timed (the first one comes from the prompt's logits, so not
/// counted), their seconds and the drafts.
fn prompt_gen_test(
    engine: &mut Engine,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    n: usize,
    speculation: Option<&Speculation>,
) -> anyhow::Result<(usize, f64, Drafts)> {
    let mut session = engine.new_session();
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    let opts = GenerateOptions {
        max_tokens: n,
        stop: Vec::new(),
        ignore_eos: true,
        speculative: speculation.cloned(),
    };
    let stats = generate(
        engine,
        &mut session,
        tokenizer,
        &mut sampler,
        prompt,
        &opts,
        &mut |_| true,
    );
    engine.close(session);
    let stats = stats?;
    Ok((
        stats.generated_tokens.saturating_sub(1),
        stats.generation_secs,
        Drafts {
            drafted: stats.drafted_tokens,
            accepted: stats.accepted_tokens,
        },
    ))
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let mut margs = args.model.clone();
    if let (Some(_), Some(max)) = (args.ctx_start, args.ctx_max)
        && margs.ctx == 0
    {
        margs.ctx = max + args.sweep_gen + 1;
    }
    let prompt_text = match &args.prompt_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the prompt {}", path.display()))?,
        ),
        None => None,
    };
    let sweeping = args.ctx_start.is_some() && args.ctx_max.is_some();
    let (model, mut engine) = common::open(&margs, &args.cluster)?;
    let info = engine.info().clone();
    let tokenizer =
        Tokenizer::from_metadata(model.files().metadata()).context("building the tokenizer")?;
    let speculation = args
        .speculative
        .speculation(&margs, info.n_ctx, &tokenizer)?;
    // Generation after a prompt (not random tokens fed one by one) with a prompt file or drafts.
    let prompt: Option<Vec<u32>> = match (&prompt_text, &speculation) {
        (Some(text), _) => Some(tokenizer.encode(text, true, true)),
        (None, Some(_)) => Some(tokens(args.n_prompt.max(1), info.n_vocab, 5)),
        (None, None) => None,
    };
    if let Some(p) = &prompt {
        anyhow::ensure!(!p.is_empty(), "the prompt tokenizes to nothing");
        anyhow::ensure!(
            !sweeping,
            "--prompt-file and speculative decoding do not apply to the context sweep"
        );
        anyhow::ensure!(
            args.parallel <= 1,
            "--prompt-file and speculative decoding measure one generation: drop --parallel"
        );
        anyhow::ensure!(
            p.len() + args.n_gen <= info.n_ctx,
            "the prompt ({} tokens) and -n {} exceed the context ({}): raise --ctx",
            p.len(),
            args.n_gen,
            info.n_ctx
        );
    }
    let threads = if margs.threads == 0 {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    } else {
        margs.threads
    };
    let describe = engine.executor().describe();
    let kernels_name = match margs.gpu.gpu {
        Some(n) => format!("{}+cuda{n}", kernels::Isa::detect().name()),
        None => kernels::Isa::detect().name().to_string(),
    };
    eprintln!(
        "model: {} ({}, {:.2} GiB), {describe}",
        info.name,
        info.arch,
        info.weight_bytes as f64 / (1u64 << 30) as f64
    );
    let batch = args
        .batch
        .unwrap_or(if engine.executor().chunks_long_evals() {
            usize::MAX
        } else {
            DEFAULT_PREFILL_CHUNK
        });
    if let (Some(start), Some(max)) = (args.ctx_start, args.ctx_max) {
        return sweep(&mut engine, args, batch, start, max);
    }
    // Warm-up, as llama-bench's: the whole prompt once (the first step of a shape allocates its
    // buffers; a 32-token warm-up left that to the first timed 512-token step, 30-50 ms of it
    // on the GPU path), then a few tokens. With a prompt, the generation itself (a draft model
    // then holds the prompt in its cache, as the target's prefill is not part of the timed
    // generation either).
    prompt_test(&mut engine, args.n_prompt.max(1), batch, 99)?;
    match &prompt {
        Some(p) => {
            prompt_gen_test(&mut engine, &tokenizer, p, 4, speculation.as_ref())?;
        }
        None => {
            gen_test(&mut engine, 4, args.parallel, 98)?;
        }
    }
    // `-p 0` still skips the prompt-processing test when the prompt comes from a file.
    let n_prompt = match &prompt {
        Some(p) if args.n_prompt > 0 => p.len(),
        _ => args.n_prompt,
    };
    let mut results = Vec::new();
    for (name, n, is_prompt) in [
        (format!("pp{n_prompt}"), n_prompt, true),
        (
            if args.parallel > 1 {
                format!("tg{}×{}", args.n_gen, args.parallel)
            } else {
                format!("tg{}", args.n_gen)
            },
            args.n_gen,
            false,
        ),
    ] {
        if n == 0 {
            continue;
        }
        let mut tps = Vec::new();
        let mut test_secs = 0.0;
        let mut drafts: Option<Drafts> = None;
        model::profile::reset();
        model::profile::set_enabled(args.profile);
        for r in 0..args.repetitions.max(1) {
            let (n_tokens, secs) = match (&prompt, is_prompt) {
                (Some(p), true) => (n, prompt_tokens_test(&mut engine, p, batch)?),
                (None, true) => (n, prompt_test(&mut engine, n, batch, r as u64)?),
                (Some(p), false) => {
                    let (timed, secs, d) =
                        prompt_gen_test(&mut engine, &tokenizer, p, n, speculation.as_ref())?;
                    if speculation.is_some() {
                        let total = drafts.get_or_insert_with(Drafts::default);
                        total.drafted += d.drafted;
                        total.accepted += d.accepted;
                    }
                    (timed, secs)
                }
                (None, false) => (
                    n * args.parallel.max(1),
                    gen_test(&mut engine, n, args.parallel, 1000 + r as u64)?,
                ),
            };
            tps.push(n_tokens as f64 / secs.max(1e-9));
            test_secs += secs;
        }
        model::profile::set_enabled(false);
        if args.profile {
            print_profile(&name, test_secs);
        }
        let (m, sd) = mean_sd(&tps);
        results.push((name, m, sd, tps, drafts));
    }
    let stats = engine.executor().stats();
    if args.json {
        let json = serde_json::json!({
            "model": info.name,
            "arch": info.arch,
            "file": margs.source().display_path(),
            "weight_bytes": info.weight_bytes,
            "threads": threads,
            "kernels": kernels_name,
            "executor": describe,
            "prompt_file": args.prompt_file.as_ref().map(|p| p.display().to_string()),
            "speculative": speculative_name(speculation.as_ref()),
            "tests": results.iter().map(|(name, m, sd, all, drafts)| {
                let mut t = serde_json::json!({"test": name, "tps_mean": m, "tps_stddev": sd, "tps": all});
                if let Some(d) = drafts {
                    t["drafted_tokens"] = serde_json::json!(d.drafted);
                    t["accepted_tokens"] = serde_json::json!(d.accepted);
                    t["acceptance_rate"] = serde_json::json!(d.rate());
                }
                t
            }).collect::<Vec<_>>(),
            "stats": stats.iter().map(|(k, v)| (k.clone(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!("| model | size | threads | kernels | test | t/s |");
        println!("| --- | ---: | ---: | --- | ---: | ---: |");
        for (name, m, sd, _, _) in &results {
            println!(
                "| {} | {:.2} GiB | {threads} | {} | {name} | {m:.2} ± {sd:.2} |",
                model.spec.name,
                info.weight_bytes as f64 / (1u64 << 30) as f64,
                kernels_name
            );
        }
        for (name, _, _, all, drafts) in &results {
            if let Some(d) = drafts {
                println!(
                    "{name} speculative ({}): drafted {}, accepted {}, acceptance rate {:.1} % over {} repetitions",
                    speculative_name(speculation.as_ref()).unwrap_or("off"),
                    d.drafted,
                    d.accepted,
                    100.0 * d.rate(),
                    all.len()
                );
            }
        }
        for (k, v) in stats {
            println!("{k}: {v}");
        }
    }
    Ok(())
}

/// `prompt-lookup` or `draft-model`, as the flag spells it.
fn speculative_name(speculation: Option<&Speculation>) -> Option<&'static str> {
    match speculation? {
        Speculation::PromptLookup(_) => Some("prompt-lookup"),
        Speculation::DraftModel(_) => Some("draft-model"),
    }
}

/// Seconds to evaluate `toks` on a fresh session in batches of `batch`.
fn prompt_tokens_test(engine: &mut Engine, toks: &[u32], batch: usize) -> anyhow::Result<f64> {
    let s = engine.new_session();
    let t0 = Instant::now();
    let chunks: Vec<&[u32]> = toks.chunks(batch.max(1)).collect();
    for (i, c) in chunks.iter().enumerate() {
        let want = if i + 1 == chunks.len() {
            LogitsWanted::Last
        } else {
            LogitsWanted::None
        };
        eval(engine, s.id, c, want)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    engine.close(s);
    Ok(secs)
}

/// The phase totals of one test (all repetitions) against its measured time, on stderr so the
/// table (or JSON) on stdout stays what it was. The pool columns say why a phase is slow at many
/// threads: "in jobs" is the share of its time the pool's threads worked together (the rest the
/// caller worked alone), "busy" the share of the jobs' thread time spent working (the rest
/// waiting for the slowest thread or for work), "threads" how many took part in a job on
/// average, "join" how long a worker took to enter a job, "tail" how long a job's threads
/// idled between the first running out of work and the last finishing (about one task when the
/// work is balanced; much more when a thread was slow or descheduled holding a task).
fn print_profile(test: &str, test_secs: f64) {
    let totals = model::profile::totals();
    let covered: f64 = totals.iter().map(|t| t.seconds).sum();
    eprintln!("profile of {test}: {test_secs:.3} s measured");
    eprintln!(
        "| phase | s | % | calls | pool jobs | in jobs % | busy % | threads | join µs | tail µs |"
    );
    eprintln!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut all = kernels::pool_stats::PoolTotals::ZERO;
    for t in &totals {
        all = all.plus(&t.pool);
        eprintln!(
            "| {} | {:.3} | {:.1} | {} | {} |",
            t.phase.name(),
            t.seconds,
            100.0 * t.seconds / test_secs.max(1e-12),
            t.calls,
            pool_columns(&t.pool, t.seconds)
        );
    }
    eprintln!(
        "| (all phases) | {covered:.3} | {:.1} | | {} |",
        100.0 * covered / test_secs.max(1e-12),
        pool_columns(&all, covered)
    );
    let rest = test_secs - covered;
    eprintln!(
        "| (outside the phases) | {rest:.3} | {:.1} | | | | | | | |",
        100.0 * rest / test_secs.max(1e-12)
    );
}

/// The pool columns of [`print_profile`] for jobs that ran within `secs` of phase time.
fn pool_columns(pool: &kernels::pool_stats::PoolTotals, secs: f64) -> String {
    if pool.jobs == 0 {
        return "0 | 0.0 | | | |".to_string();
    }
    let per_job = |v: u64| v as f64 / pool.jobs as f64;
    let workers = pool.participants.saturating_sub(pool.jobs);
    let join_us = if workers == 0 {
        String::new()
    } else {
        format!("{:.2}", pool.join_nanos as f64 * 1e-3 / workers as f64)
    };
    format!(
        "{} | {:.1} | {:.1} | {:.1} | {join_us} | {:.2}",
        pool.jobs,
        100.0 * pool.job_nanos as f64 * 1e-9 / secs.max(1e-12),
        100.0 * pool.busy_nanos as f64 / pool.capacity_nanos.max(1) as f64,
        per_job(pool.participants),
        per_job(pool.tail_nanos) * 1e-3,
    )
}

/// ds4-bench style: grow one session's context step by step; at each depth measure the prefill
/// of the step and the decode of `sweep_gen` tokens (then rewind them).
fn sweep(
    engine: &mut Engine,
    args: &BenchArgs,
    batch: usize,
    start: usize,
    max: usize,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.step > 0 && start <= max,
        "--ctx-start must not exceed --ctx-max, and --step must be positive"
    );
    let n_vocab = engine.info().n_vocab;
    let s = engine.new_session();
    let all = tokens(max + args.sweep_gen, n_vocab, 7);
    let mut have = 0usize;
    let mut rows = Vec::new();
    println!("ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kv_bytes");
    let mut ctx = start;
    loop {
        let target = ctx.max(1);
        let t0 = Instant::now();
        let new = &all[have..target];
        for c in new.chunks(batch.max(1)) {
            eval(engine, s.id, c, LogitsWanted::Last)?;
        }
        let prefill_secs = t0.elapsed().as_secs_f64();
        let prefill_tokens = new.len();
        have = target;
        model::profile::reset();
        model::profile::set_enabled(args.profile);
        let t1 = Instant::now();
        for t in &all[have..have + args.sweep_gen] {
            eval(engine, s.id, std::slice::from_ref(t), LogitsWanted::Last)?;
        }
        let gen_secs = t1.elapsed().as_secs_f64();
        model::profile::set_enabled(false);
        if args.profile {
            print_profile(&format!("tg{} at depth {have}", args.sweep_gen), gen_secs);
        }
        let per_pos = engine.info().n_layer;
        let kv_bytes = kv_bytes_estimate(engine, have, per_pos);
        let at = have;
        match engine.executor_mut().truncate(s.id, have) {
            Ok(()) => {}
            // The sliding-window layers dropped what position `have` attends to: the next
            // depth prefills from the start (its prefill rate is then over the whole context).
            Err(engine::EngineError::CannotRewind { .. }) => {
                engine.executor_mut().destroy(s.id);
                have = 0;
            }
            Err(e) => return Err(e.into()),
        }
        let row = (
            at,
            prefill_tokens,
            prefill_tokens as f64 / prefill_secs.max(1e-9),
            args.sweep_gen,
            args.sweep_gen as f64 / gen_secs.max(1e-9),
            kv_bytes,
        );
        println!(
            "{},{},{:.2},{},{:.2},{}",
            row.0, row.1, row.2, row.3, row.4, row.5
        );
        rows.push(row);
        if ctx >= max {
            break;
        }
        ctx = (ctx + args.step).min(max);
    }
    engine.close(s);
    Ok(())
}

/// KV bytes of `n` positions (all layers, whatever the split), from the model's shape; the
/// sliding-window layers hold at most their bound.
fn kv_bytes_estimate(engine: &Engine, n: usize, _n_layer: usize) -> usize {
    engine.info().kv_bytes_at(n)
}
