//! The gguf crate's test suite, one binary: round trips, the corrupt-file suite, split models
//! and property tests. Tests against real downloaded models live in `real_files.rs`.

mod common;
mod corrupt;
mod props;
mod round_trip;
mod splits;
