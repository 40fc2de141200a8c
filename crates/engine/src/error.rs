//! Engine errors: model, tokenizer, template, and executor failures with their context.

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("context full: {needed} positions needed, the context holds {n_ctx}")]
    ContextFull { needed: usize, n_ctx: usize },
    /// A rewind to a prefix whose positions the sliding-window layers no longer hold (they keep
    /// the latest positions only): not an error of the session, which callers evaluate afresh.
    #[error("cannot rewind session {session} to {n} positions: {why}")]
    CannotRewind { session: u64, n: usize, why: String },
    #[error(transparent)]
    Grammar(#[from] crate::grammar::GrammarError),
    #[error("snapshot: {0}")]
    Snapshot(String),
    #[error("{0}")]
    Executor(String),
    /// A failure of a distributed executor (a peer, a link, the group), with its source chain.
    #[error(transparent)]
    Cluster(Box<dyn std::error::Error + Send + Sync>),
    #[error("I/O on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
