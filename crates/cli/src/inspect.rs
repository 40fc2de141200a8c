//! `moeshard inspect`: what a user needs to know about a GGUF file before splitting it.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct InspectArgs {
    /// The GGUF file (first split of a multi-file model).
    pub file: PathBuf,
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    anyhow::bail!("inspect is not built yet: {}", args.file.display())
}
