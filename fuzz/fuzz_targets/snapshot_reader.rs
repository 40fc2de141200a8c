//! `engine::Snapshot::read_from` on arbitrary bytes (what `Snapshot::load` runs over a file),
//! and what `moeshard run --load-snapshot` does with a snapshot it read: restore it into an
//! engine (of the tiny qwen3moe fixture) (the layout check comes first) and continue the conversation.
//!
//! The first byte picks the form: even, the rest of the input is the file (a mutated file's
//! checksum fails, so this mostly exercises the parser); odd, a snapshot built by `arbitrary`
//! (the engine model's or another's, sized right or not) is written by the real writer and must
//! read back as itself before it is restored.
#![no_main]

use arbitrary::Unstructured;
use engine::Snapshot;
use libfuzzer_sys::fuzz_target;
use moeshard_fuzz::snapshots;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let snap = if mode & 1 == 0 {
        match Snapshot::read_from(&mut &rest[..], rest.len() as u64) {
            Ok(snap) => snap,
            Err(_) => return,
        }
    } else {
        let Ok(built) = snapshots::arbitrary_snapshot(&mut Unstructured::new(rest)) else {
            return;
        };
        let bytes = snapshots::bytes(&built);
        let back = Snapshot::read_from(&mut &bytes[..], bytes.len() as u64)
            .unwrap_or_else(|e| panic!("a snapshot the writer made does not read back: {e}"));
        assert!(
            snapshots::bytes(&back) == bytes,
            "the snapshot changed on the way"
        );
        back
    };
    moeshard_fuzz::restore_and_continue(&snap);
});
