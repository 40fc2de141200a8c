//! `ExpertSource` implementations beyond the resident one: SSD streaming of routed experts
//! through a bounded cache ([`StreamedExperts`]), optionally limited to the experts one node
//! of a cluster owns. The model crate defines the seam; this crate knows files, memory and
//! threads, not networking.

mod budget;
mod cache;
pub mod direct_io;
pub mod error;
pub mod io;
pub mod layout;
pub mod policy;
pub mod profile;
mod slab;
mod source;

pub use budget::{CacheSize, available_memory, parse_size};
pub use cache::OwnedFn;
pub use error::StreamError;
pub use io::{InjectedFault, ReadEvent, ReadHook};
pub use profile::Profile;
pub use source::{StreamedExperts, StreamingOptions};
