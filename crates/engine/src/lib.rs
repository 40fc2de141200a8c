//! The engine: sessions (tokens, positions, KV), sampling, tokenizer and chat template, and the
//! executor seam behind which a session runs locally, as a pipeline or as a tensor-parallel group.

pub mod chat_output;
pub mod chat_template;
pub mod cluster_view;
pub mod error;
pub mod executor;
pub mod file;
pub mod generate;
pub mod grammar;
pub mod layer_range;
pub mod local;
pub mod logprobs;
pub mod prefix_hash;
pub mod runner;
pub mod sampler;
pub mod session;
pub mod snapshot;
pub mod speculative;
pub mod text;
pub mod tokenizer;

pub use cluster_view::ClusterView;
pub use error::{EngineError, Result};
pub use executor::{EvalRequest, EvalResult, Executor, ModelInfo, SessionId};
pub use grammar::{GrammarCompiler, GrammarError, GrammarSpec, TokenConstraint};
pub use layer_range::{LayerRange, RangeSpec};
pub use local::{ExpertMode, LocalExecutor};
pub use runner::{RunError, Runner, SeqWork, SharedExperts};
pub use sampler::{Sampler, SamplerConfig};
pub use session::{DEFAULT_PREFILL_CHUNK, Engine, Session};
pub use snapshot::{Snapshot, SnapshotLayout};
pub use speculative::{DraftModel, PromptLookup, Speculation};
