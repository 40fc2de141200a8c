//! The `moeshard` command line.

mod inspect;

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
}

#[derive(Subcommand)]
enum Command {
    /// Print a GGUF file's architecture, hyperparameters, tokenizer and tensor table.
    Inspect(inspect::InspectArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MOESHARD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Inspect(args) => inspect::run(&args),
    }
}
