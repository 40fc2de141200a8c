//! Pipeline parallelism: each process owns an inclusive layer range; hidden states travel
//! stage to stage, results come back hop by hop; prefills are chunked with a window of chunks
//! in flight so stages overlap; a broken route is rebuilt and sessions replayed.

pub mod coordinator;
pub mod protocol;
pub mod registry;
mod route;
mod snapshot;
mod stage_loop;
pub mod worker;

pub use coordinator::{PipelineConfig, PipelineExecutor};
pub use worker::{WorkerConfig, run_worker};
