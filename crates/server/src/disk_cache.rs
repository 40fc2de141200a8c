//! The disk KV cache: sessions evicted from a slot (or alive at shutdown) are saved as engine
//! snapshots, so a later request — also after a restart — whose prompt shares a prefix with a
//! saved sequence restores that KV instead of evaluating it (the session is then cut back to the
//! shared prefix). The directory is bounded in bytes; the least recently used sessions go first.
//!
//! Layout: `DIR/<first 16 hex digits of the model fingerprint>/<hash>-<n_tokens>.kv` (the
//! snapshot) and `.tokens` beside it (magic, the sequence as little-endian u32, checksum;
//! written last). The index — every saved sequence, kept in memory, a few bytes per token — is
//! rebuilt from the `.tokens` files with the `.kv` modification times as the LRU order; there is
//! no index file to corrupt. Writes go through a background thread (a long session's KV is
//! large; the scheduler must not wait for the disk). Both files carry a checksum of their whole
//! content, checked when read (a `.kv` when it is restored: a mismatch drops the entry and the
//! prompt is evaluated instead), and are written atomically with mode 0600
//! ([`engine::file::write_atomic`]); the directories are created with mode 0700.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::SystemTime;

use engine::Snapshot;
use engine::file::{self, CHECKSUM_LEN, Checksum};

/// FNV-1a over the tokens' little-endian bytes: the file name of a saved sequence.
#[derive(Clone, Copy)]
pub struct PrefixHash(u64);

impl Default for PrefixHash {
    fn default() -> Self {
        PrefixHash(0xcbf2_9ce4_8422_2325)
    }
}

impl PrefixHash {
    pub fn push(&mut self, token: u32) {
        for b in token.to_le_bytes() {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    pub fn of(tokens: &[u32]) -> u64 {
        let mut h = PrefixHash::default();
        tokens.iter().for_each(|&t| h.push(t));
        h.0
    }
}

#[derive(Clone, Debug)]
struct Entry {
    hash: u64,
    /// The saved sequence (also in a `.tokens` sidecar, so the index is rebuilt without
    /// reading the KV).
    tokens: Arc<[u32]>,
    bytes: u64,
    used: SystemTime,
}

#[derive(Default)]
struct Index {
    entries: Vec<Entry>,
}

impl Index {
    fn total_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }
}

pub struct DiskCache {
    dir: PathBuf,
    max_bytes: u64,
    index: Arc<Mutex<Index>>,
    writer: Option<(SyncSender<Snapshot>, JoinHandle<()>)>,
}

fn stem(hash: u64, n_tokens: usize) -> String {
    format!("{hash:016x}-{n_tokens}")
}

fn kv_path(dir: &Path, e: &Entry) -> PathBuf {
    dir.join(format!("{}.kv", stem(e.hash, e.tokens.len())))
}

fn tokens_path(dir: &Path, e: &Entry) -> PathBuf {
    dir.join(format!("{}.tokens", stem(e.hash, e.tokens.len())))
}

fn remove(dir: &Path, e: &Entry) {
    for p in [kv_path(dir, e), tokens_path(dir, e)] {
        if let Err(err) = std::fs::remove_file(&p)
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!("disk KV cache: removing {}: {err}", p.display());
        }
    }
}

/// Deletes least recently used sessions until the total fits `max_bytes`.
fn enforce_bound(dir: &Path, index: &mut Index, max_bytes: u64) {
    index.entries.sort_by_key(|e| e.used);
    while index.total_bytes() > max_bytes && !index.entries.is_empty() {
        let e = index.entries.remove(0);
        tracing::info!(
            "disk KV cache: evicting {} ({} tokens, {} bytes)",
            kv_path(dir, &e).display(),
            e.tokens.len(),
            e.bytes
        );
        remove(dir, &e);
    }
}

/// Magic of a `.tokens` file (version 1: magic, tokens, checksum).
const TOKENS_MAGIC: &[u8; 8] = b"MSTOKS01";

/// Reads a `.tokens` file, checking its magic and checksum.
fn read_tokens(path: &Path) -> std::io::Result<Vec<u32>> {
    let b = std::fs::read(path)?;
    let bad = |why: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {why}", path.display()),
        )
    };
    // The magic must lie before the checksum: a file too short for both is refused before
    // any slicing (else the token range below could start after its end).
    let body = match b.len().checked_sub(CHECKSUM_LEN) {
        Some(body) if body >= TOKENS_MAGIC.len() => body,
        _ => return Err(bad("too short")),
    };
    if !b.starts_with(TOKENS_MAGIC) {
        return Err(bad("not a tokens file of this version (bad magic)"));
    }
    if b[body..] != Checksum::of(&b[..body]) {
        return Err(bad("checksum mismatch: the file is corrupt or cut short"));
    }
    let tokens = &b[TOKENS_MAGIC.len()..body];
    if tokens.len() % 4 != 0 {
        return Err(bad("not a whole number of tokens"));
    }
    Ok(tokens
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn write_tokens(path: &Path, tokens: &[u32]) -> std::io::Result<()> {
    let mut bytes = TOKENS_MAGIC.to_vec();
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    let sum = Checksum::of(&bytes);
    bytes.extend_from_slice(&sum);
    file::write_atomic(path, |w| w.write_all(&bytes))
}

/// Creates `dir` and its missing parents, private to this user.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir)
}

fn writer_loop(dir: PathBuf, max_bytes: u64, index: Arc<Mutex<Index>>, rx: Receiver<Snapshot>) {
    for snap in rx {
        let entry = Entry {
            hash: PrefixHash::of(&snap.tokens),
            tokens: snap.tokens.clone().into(),
            bytes: 0,
            used: SystemTime::now(),
        };
        let path = kv_path(&dir, &entry);
        let t0 = std::time::Instant::now();
        // Tokens last: a session is only indexed (after a restart too) once its KV is complete.
        if let Err(e) = snap.save(&path).map_err(|e| e.to_string()).and_then(|()| {
            write_tokens(&tokens_path(&dir, &entry), &entry.tokens).map_err(|e| e.to_string())
        }) {
            tracing::warn!("disk KV cache: saving {}: {e}", path.display());
            remove(&dir, &entry);
            continue;
        }
        let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        tracing::info!(
            "disk KV cache: saved {} tokens ({:.1} MiB) to {} in {:.2?}",
            entry.tokens.len(),
            bytes as f64 / (1u64 << 20) as f64,
            path.display(),
            t0.elapsed()
        );
        let mut idx = index.lock().expect("disk index lock");
        // A saved prefix of the new sequence is superseded by it.
        let (gone, kept): (Vec<Entry>, Vec<Entry>) = idx
            .entries
            .drain(..)
            .partition(|e| entry.tokens.starts_with(&e.tokens));
        idx.entries = kept;
        for e in &gone {
            remove(&dir, e);
        }
        idx.entries.push(Entry { bytes, ..entry });
        enforce_bound(&dir, &mut idx, max_bytes);
    }
}

impl DiskCache {
    /// Opens (creating) the cache of the model with `fingerprint` under `root`.
    pub fn open(root: &Path, fingerprint: &str, max_bytes: u64) -> std::io::Result<DiskCache> {
        let sub: String = fingerprint
            .chars()
            .filter(char::is_ascii_hexdigit)
            .take(16)
            .collect();
        let dir = root.join(if sub.is_empty() {
            "model".to_string()
        } else {
            sub
        });
        create_private_dir(&dir)?;
        let mut index = Index::default();
        let mut orphans = Vec::new();
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            match path.extension().and_then(|e| e.to_str()) {
                Some("kv") => {
                    let meta = std::fs::metadata(&path)?;
                    let tokens_file = path.with_extension("tokens");
                    match read_tokens(&tokens_file) {
                        Ok(tokens)
                            if path.file_stem().and_then(|s| s.to_str())
                                == Some(stem(PrefixHash::of(&tokens), tokens.len()).as_str()) =>
                        {
                            index.entries.push(Entry {
                                hash: PrefixHash::of(&tokens),
                                tokens: tokens.into(),
                                bytes: meta.len(),
                                used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                            })
                        }
                        other => {
                            if let Err(e) = other
                                && e.kind() != std::io::ErrorKind::NotFound
                            {
                                tracing::warn!("disk KV cache: {e}");
                            }
                            orphans.push(tokens_file);
                            orphans.push(path);
                        }
                    }
                }
                // A write cut short by a crash.
                Some("tmp") => orphans.push(path),
                // Tokens whose KV is gone.
                Some("tokens") if !path.with_extension("kv").exists() => orphans.push(path),
                _ => {}
            }
        }
        for p in orphans {
            match std::fs::remove_file(&p) {
                Ok(()) => tracing::info!(
                    "disk KV cache: removed incomplete or unreadable {}",
                    p.display()
                ),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!("disk KV cache: removing {}: {e}", p.display()),
            }
        }
        enforce_bound(&dir, &mut index, max_bytes);
        tracing::info!(
            "disk KV cache: {} ({} sessions, {:.1} MiB of at most {:.1} MiB)",
            dir.display(),
            index.entries.len(),
            index.total_bytes() as f64 / (1u64 << 20) as f64,
            max_bytes as f64 / (1u64 << 20) as f64
        );
        let index = Arc::new(Mutex::new(index));
        // Two snapshots in flight at most: beyond that the scheduler waits for the disk rather
        // than holding an unbounded amount of KV in memory.
        let (tx, rx) = sync_channel(2);
        let (d, i) = (dir.clone(), Arc::clone(&index));
        let handle = std::thread::Builder::new()
            .name("kv-disk-writer".into())
            .spawn(move || writer_loop(d, max_bytes, i, rx))?;
        Ok(DiskCache {
            dir,
            max_bytes,
            index,
            writer: Some((tx, handle)),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// (entries, bytes) for metrics.
    pub fn usage(&self) -> (usize, u64) {
        let idx = self.index.lock().expect("disk index lock");
        (idx.entries.len(), idx.total_bytes())
    }

    /// Whether `tokens` (or a longer sequence starting with them) is saved.
    pub fn covers(&self, tokens: &[u32]) -> bool {
        let idx = self.index.lock().expect("disk index lock");
        idx.entries.iter().any(|e| e.tokens.starts_with(tokens))
    }

    /// Queues a session for writing (skipped when a saved sequence already covers it).
    pub fn save(&self, snap: Snapshot) -> bool {
        if snap.tokens.is_empty() || self.covers(&snap.tokens) {
            return false;
        }
        match &self.writer {
            Some((tx, _)) => tx.send(snap).is_ok(),
            None => false,
        }
    }

    /// The saved session sharing the longest prefix with `prompt`, if that prefix is longer
    /// than `min_len` (what memory already offers); returns it with the shared length.
    pub fn lookup(&self, prompt: &[u32], min_len: usize) -> Option<(Snapshot, usize)> {
        let best = {
            let idx = self.index.lock().expect("disk index lock");
            idx.entries
                .iter()
                .map(|e| (crate::prefix_cache::common_prefix(&e.tokens, prompt), e))
                .filter(|(n, _)| *n > min_len)
                .max_by_key(|(n, e)| (*n, e.used))
                .map(|(n, e)| (n, e.clone()))
        };
        let (n, entry) = best?;
        let path = kv_path(&self.dir, &entry);
        match Snapshot::load(&path) {
            Ok(snap) if snap.tokens[..] == entry.tokens[..] => {
                let now = SystemTime::now();
                // The file's time is the LRU order after a restart.
                if let Ok(f) = std::fs::File::options().write(true).open(&path) {
                    let _ = f.set_modified(now);
                }
                let mut idx = self.index.lock().expect("disk index lock");
                if let Some(e) = idx.entries.iter_mut().find(|e| e.tokens == entry.tokens) {
                    e.used = now;
                }
                Some((snap, n))
            }
            other => {
                let why = other.err().map_or_else(
                    || "other tokens than indexed".to_string(),
                    |e| e.to_string(),
                );
                tracing::warn!("disk KV cache: dropping an unreadable entry: {why}");
                remove(&self.dir, &entry);
                let mut idx = self.index.lock().expect("disk index lock");
                idx.entries.retain(|e| e.tokens != entry.tokens);
                None
            }
        }
    }

    /// Waits for queued writes to reach the disk.
    pub fn flush(&mut self) {
        if let Some((tx, handle)) = self.writer.take() {
            drop(tx);
            let _ = handle.join();
        }
        let mut idx = self.index.lock().expect("disk index lock");
        enforce_bound(&self.dir, &mut idx, self.max_bytes);
    }
}

impl Drop for DiskCache {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Parses a size such as `512M`, `20G`, `1.5GiB` or `1000000` (bytes).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 512M, 20G)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    Ok((value * mult as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(tokens: &[u32], payload: usize) -> Snapshot {
        Snapshot {
            fingerprint: "abc".into(),
            tokens: tokens.to_vec(),
            kv_type: model::KvType::F16,
            n_kv_head: 1,
            head_dim_k: 2,
            head_dim_v: 2,
            layers: vec![(vec![1; payload], vec![2; payload])],
            last_logits: vec![0.5; 4],
        }
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("12X").is_err());
    }

    #[test]
    fn saves_restores_longest_prefix_and_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = DiskCache::open(dir.path(), "fp00", 1 << 20).unwrap();
        assert!(c.save(snap(&[1, 2, 3], 10)));
        assert!(c.save(snap(&[1, 2, 7, 8, 9], 10)));
        assert!(c.save(snap(&[9, 9], 10)));
        c.flush();
        assert!(!c.save(snap(&[1, 2, 3], 10)), "already saved");
        assert!(!c.save(snap(&[9], 10)), "covered by [9, 9]");
        let c = DiskCache::open(dir.path(), "fp00", 1 << 20).unwrap();
        assert_eq!(c.usage().0, 3);
        let (got, n) = c.lookup(&[1, 2, 7, 8, 5, 6], 0).unwrap();
        assert_eq!(
            (got.tokens, n),
            (vec![1, 2, 7, 8, 9], 4),
            "longest common prefix, not whole"
        );
        assert_eq!(c.lookup(&[1, 2, 3, 4], 0).unwrap().1, 3);
        assert!(
            c.lookup(&[1, 2, 3, 4], 3).is_none(),
            "not longer than what the slot has"
        );
        assert!(c.lookup(&[2, 3], 0).is_none());
    }

    #[test]
    fn a_longer_save_supersedes_its_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = DiskCache::open(dir.path(), "fp", 1 << 20).unwrap();
        c.save(snap(&[1, 2], 10));
        c.flush();
        let mut c = DiskCache::open(dir.path(), "fp", 1 << 20).unwrap();
        c.save(snap(&[1, 2, 3], 10));
        c.flush();
        assert_eq!(c.usage().0, 1);
        assert_eq!(
            std::fs::read_dir(c.dir()).unwrap().count(),
            2,
            "one .kv and one .tokens"
        );
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_corrupt_entry_is_refused_and_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = DiskCache::open(dir.path(), "fp", 1 << 20).unwrap();
        c.save(snap(&[1, 2, 3], 1000));
        c.flush();
        let c = DiskCache::open(dir.path(), "fp", 1 << 20).unwrap();
        let kv = c
            .dir()
            .join(format!("{}.kv", stem(PrefixHash::of(&[1, 2, 3]), 3)));
        let mut bytes = std::fs::read(&kv).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x20;
        std::fs::write(&kv, &bytes).unwrap();
        let err = Snapshot::load(&kv).unwrap_err().to_string();
        assert!(err.contains("checksum mismatch"), "{err}");
        assert!(c.lookup(&[1, 2, 3, 4], 0).is_none(), "not restored");
        assert_eq!(c.usage().0, 0, "dropped from the index");
        assert!(files(c.dir()).is_empty(), "{:?}", files(c.dir()));
    }

    #[test]
    fn crash_leftovers_and_corrupt_sidecars_are_removed_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = DiskCache::open(dir.path(), "fp", 1 << 20).unwrap();
        c.save(snap(&[1, 2], 10));
        c.save(snap(&[5, 6], 10));
        c.flush();
        let d = c.dir().to_path_buf();
        drop(c);
        let good = stem(PrefixHash::of(&[1, 2]), 2);
        let bad = stem(PrefixHash::of(&[5, 6]), 2);
        // A write interrupted by a crash leaves only its temporary file.
        std::fs::write(d.join(format!(".{bad}.kv.77.0.tmp")), b"partial").unwrap();
        let tokens = d.join(format!("{bad}.tokens"));
        let mut t = std::fs::read(&tokens).unwrap();
        t[9] ^= 1;
        std::fs::write(&tokens, t).unwrap();
        std::fs::write(d.join("0000000000000000-1.tokens"), b"no kv").unwrap();
        let c = DiskCache::open(dir.path(), "fp", 1 << 20).unwrap();
        assert_eq!(c.usage().0, 1);
        assert_eq!(
            files(&d),
            [format!("{good}.kv"), format!("{good}.tokens")],
            "only the intact entry is left"
        );
        assert!(c.lookup(&[1, 2], 0).is_some());
    }

    #[cfg(unix)]
    #[test]
    fn files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cache");
        let mut c = DiskCache::open(&root, "fp", 1 << 20).unwrap();
        c.save(snap(&[1, 2], 10));
        c.flush();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(c.dir()), 0o700);
        assert_eq!(mode(&root), 0o700);
        let names = files(c.dir());
        assert_eq!(names.len(), 2);
        for n in names {
            assert_eq!(mode(&c.dir().join(&n)), 0o600, "{n}");
        }
    }

    #[test]
    fn size_bound_evicts_least_recently_used() {
        let dir = tempfile::tempdir().unwrap();
        let one = {
            let mut c = DiskCache::open(dir.path(), "fp", u64::MAX).unwrap();
            c.save(snap(&[1], 1000));
            c.flush();
            c.usage().1
        };
        let mut c = DiskCache::open(dir.path(), "fp", one * 2 + one / 2).unwrap();
        c.save(snap(&[2], 1000));
        c.flush();
        // Touch [1] so [2] is the least recently used when [3] arrives.
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(c.lookup(&[1], 0).is_some());
        drop(c);
        let mut c = DiskCache::open(dir.path(), "fp", one * 2 + one / 2).unwrap();
        c.save(snap(&[3], 1000));
        c.flush();
        assert_eq!(c.usage().0, 2);
        assert!(c.lookup(&[2], 0).is_none(), "evicted");
        assert!(c.lookup(&[1], 0).is_some() && c.lookup(&[3], 0).is_some());
    }
}
