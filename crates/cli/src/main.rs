//! The `moeshard` command line.

mod allocator;
mod bench;
mod chat;
mod cluster_args;
mod common;
mod gpu_args;
mod inspect;
mod keygen;
mod logging;
mod logits;
mod npy;
mod perplexity;
mod plan;
mod quantize;
mod run;
mod sampling;
mod serve;
mod shard;
mod speculative_args;
mod streaming_args;
mod synth;
mod topology;
mod upcycle;
mod worker;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "moeshard",
    version,
    about = "Mixture-of-Experts inference across machines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines as text or as JSON objects (what is logged: RUST_LOG, default `info`).
    #[arg(long, global = true, value_enum, default_value_t = logging::LogFormat::Text)]
    log_format: logging::LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Complete a prompt, streaming the output.
    Run(run::RunArgs),
    /// Interactive multi-turn chat.
    Chat(chat::ChatArgs),
    /// OpenAI-compatible HTTP server.
    Serve(serve::ServeArgs),
    /// Prompt-processing and generation speed (llama-bench style), or a context sweep.
    Bench(bench::BenchArgs),
    /// Perplexity over a text file (llama-perplexity's method).
    Perplexity(perplexity::PerplexityArgs),
    /// Write the logits of every position as a NumPy array.
    Logits(logits::LogitsArgs),
    /// Serve a layer range of a pipeline, or a rank of a tensor-parallel group.
    #[command(long_about = worker::ABOUT)]
    Worker(worker::WorkerArgs),
    /// Write a new cluster key (32 random bytes, mode 0600).
    Keygen(keygen::KeygenArgs),
    /// Print a GGUF file's architecture, hyperparameters, tokenizer and tensor table.
    Inspect(inspect::InspectArgs),
    /// Write a random-weight GGUF with a real model's shapes and quant mix.
    Synth(synth::SynthArgs),
    /// Rewrite a GGUF with its matrices in another block format.
    Quantize(quantize::QuantizeArgs),
    /// Write the part of a model one pipeline stage or tensor-parallel rank runs (--plan: the
    /// bytes per machine).
    Shard(shard::ShardArgs),
    /// Place a tensor-parallel group's experts by a routing profile (balanced work, hottest
    /// experts replicated within a budget) and write the file --expert-placement reads.
    Plan(plan::PlanArgs),
    /// Turn a dense llama GGUF into an equivalent Mixtral-style MoE GGUF (a test of the MoE path).
    Upcycle(upcycle::UpcycleArgs),
}

fn main() -> std::process::ExitCode {
    allocator::keep_freed_buffers();
    let cli = Cli::parse();
    logging::init(cli.log_format);
    let result = match cli.command {
        Command::Run(a) => run::run(&a),
        Command::Chat(a) => chat::run(&a),
        Command::Serve(a) => serve::run(&a),
        Command::Perplexity(a) => perplexity::run(&a),
        Command::Bench(a) => bench::run(&a),
        Command::Logits(a) => logits::run(&a),
        Command::Worker(a) => worker::run(&a),
        Command::Keygen(a) => keygen::run(&a),
        Command::Shard(a) => shard::run(&a),
        Command::Plan(a) => plan::run(&a),
        Command::Inspect(a) => inspect::run(&a),
        Command::Upcycle(a) => upcycle::run(&a),
        Command::Quantize(a) => quantize::run(&a),
        Command::Synth(a) => synth::run(&a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
