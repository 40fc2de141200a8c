//! `moeshard serve`: the OpenAI-compatible HTTP server.

use crate::common::ModelArgs;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
}

pub fn run(_args: &ServeArgs) -> anyhow::Result<()> {
    anyhow::bail!("serve is not built yet")
}
