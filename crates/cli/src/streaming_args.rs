//! SSD expert streaming flags (`--ssd-streaming`, cache size, preload, profiles).

use std::sync::Arc;

use model::Model;

#[derive(clap::Args, Clone, Debug, Default)]
pub struct StreamingArgs {
    /// Keep routed experts on disk and stream them into a bounded cache.
    #[arg(long)]
    pub ssd_streaming: bool,
}

impl StreamingArgs {
    /// The expert source these flags ask for (`None`: resident experts).
    pub fn expert_source(&self, _model: &Arc<Model>) -> anyhow::Result<Option<cluster::stage::SharedExperts>> {
        anyhow::ensure!(!self.ssd_streaming, "--ssd-streaming is not built yet");
        Ok(None)
    }
}
