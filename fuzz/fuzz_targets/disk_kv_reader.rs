//! The server's disk KV cache reading what it finds on disk: `DiskCache::open` (which rebuilds
//! the index from the directory) and `DiskCache::lookup` (which reads a saved session back), then
//! the restore the scheduler does with what `lookup` returned.
//!
//! The first byte picks the form. Even: at start-up the real cache saves one real session of the
//! tiny model; the files it wrote (their names and formats are the cache's business, not this
//! target's) are the template. For each input the same files are laid out again with contents
//! taken from the input, smallest file first: for every file but the last a u32 length
//! (little-endian; `u32::MAX` keeps the file's original contents) and that many bytes, and the
//! rest of the input for the last one. Odd: a snapshot built by `arbitrary` is saved through the
//! cache (so its files are whole and their checksums right), the cache is opened again and must
//! find it, and what it returns is restored and continued.
#![no_main]

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use moeshard_fuzz::disk::{TOKENS, template};
use moeshard_fuzz::snapshots;
use server::disk_cache::DiskCache;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, data)) = data.split_first() else {
        return;
    };
    if mode & 1 == 1 {
        return saved_and_found(data);
    }
    let t = template();
    let root = moeshard_fuzz::scratch_dir();
    let dir = root.join(&t.subdir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut rest = data;
    for (i, (name, original)) in t.files.iter().enumerate() {
        let contents = if i + 1 == t.files.len() {
            rest
        } else if let Some((len, tail)) = rest.split_first_chunk::<4>() {
            let len = u32::from_le_bytes(*len);
            rest = tail;
            if len == u32::MAX {
                original.as_slice()
            } else {
                let (head, tail) = rest.split_at((len as usize).min(rest.len()));
                rest = tail;
                head
            }
        } else {
            original.as_slice()
        };
        std::fs::write(dir.join(name), contents).unwrap();
    }

    let Ok(cache) = DiskCache::open(root, &t.fingerprint, 1 << 30) else {
        return;
    };
    let (entries, _) = cache.usage();
    assert!(entries <= 1, "one session's files make at most one entry");
    let _ = cache.covers(&TOKENS[..3]);
    if let Some((snap, shared)) = cache.lookup(&TOKENS, 0) {
        assert!(shared > 0 && shared <= TOKENS.len());
        assert_eq!(snap.tokens[..shared], TOKENS[..shared]);
        // The scheduler restores what the cache returned.
        moeshard_fuzz::restore_and_continue(&snap);
    }
    drop(cache);
});

fn saved_and_found(data: &[u8]) {
    let Ok(snap) = snapshots::arbitrary_snapshot(&mut Unstructured::new(data)) else {
        return;
    };
    let root = moeshard_fuzz::scratch_dir();
    let fingerprint = &moeshard_fuzz::tiny().fingerprint;
    let mut cache = DiskCache::open(root, fingerprint, 1 << 30).expect("opening an empty cache");
    let saved = cache.save(snap.clone());
    assert_eq!(
        saved,
        !snap.tokens.is_empty(),
        "a session is saved unless it is empty"
    );
    cache.flush();
    drop(cache);
    let cache = DiskCache::open(root, fingerprint, 1 << 30).expect("opening the cache again");
    assert_eq!(cache.usage().0, usize::from(saved));
    if !saved {
        return;
    }
    let (back, shared) = cache
        .lookup(&snap.tokens, 0)
        .expect("a saved session is found after a restart");
    assert_eq!(shared, snap.tokens.len());
    assert!(
        snapshots::bytes(&back) == snapshots::bytes(&snap),
        "the session changed on disk"
    );
    // The scheduler restores what the cache returned (continuing it: snapshot_reader's work).
    moeshard_fuzz::with_engine(|engine, _| {
        if let Ok(session) = engine.restore(&back) {
            engine.close(session);
        }
    });
}
