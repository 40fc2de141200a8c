//! Tensor/expert parallelism across N ranks: every rank runs the same tokens; routed experts
//! are sharded, attention is split by heads where it divides (else replicated), dense FFNs and
//! shared experts by columns, the output head by vocabulary; partial sums are all-reduced in a
//! fixed rank order so every rank holds identical hidden states.

pub mod coordinator;
pub mod mesh;
pub mod protocol;
pub mod worker;

pub use coordinator::{TpConfig, TpExecutor, placement};
pub use worker::{TpWorkerConfig, run_tp_worker};
