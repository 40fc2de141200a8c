//! moeshard's own files (snapshots, the server's disk KV cache): a checksum of the whole content
//! checked on load, and atomic writes — a temporary file in the same directory, created with
//! mode 0600, written, fsynced and renamed into place (then the directory fsynced), so a crash
//! or an error mid-write never leaves a partial file under the final name.
//!
//! The checksum is XXH3-128 (`xxhash-rust`). It is there to catch torn writes, truncation and
//! bit rot, not tampering — whoever can rewrite a 0600 file can recompute any unkeyed hash,
//! SHA-256 included — and it sits on the disk KV cache's restore path, before the first token.
//! Measured with `examples/snapshot_io.rs` on the 2-core development VM (SHA-NI present), a
//! 105 MB snapshot: XXH3-128 16–21 ms (5–6 GB/s), SHA-256 (`sha2`) 101–108 ms (~1 GB/s); a
//! load from the page cache takes 143–171 ms with XXH3, so SHA-256 would have added ~60 %.
//! A save (fsync included) took 309–514 ms.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use xxhash_rust::xxh3::Xxh3;

/// Bytes of a stored checksum.
pub const CHECKSUM_LEN: usize = 16;

/// The running checksum of a file's content.
#[derive(Clone, Default)]
pub struct Checksum(Xxh3);

impl Checksum {
    pub fn new() -> Checksum {
        Checksum(Xxh3::new())
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The checksum as stored (little-endian XXH3-128).
    pub fn digest(&self) -> [u8; CHECKSUM_LEN] {
        self.0.digest128().to_le_bytes()
    }

    /// The checksum of `bytes`.
    pub fn of(bytes: &[u8]) -> [u8; CHECKSUM_LEN] {
        let mut c = Checksum::new();
        c.update(bytes);
        c.digest()
    }
}

/// A stored checksum that is not the checksum of the content.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mismatch {
    pub stored: [u8; CHECKSUM_LEN],
    pub computed: [u8; CHECKSUM_LEN],
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex = |d: &[u8]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        write!(
            f,
            "checksum mismatch: the file is corrupt or cut short (stored {}, computed {})",
            hex(&self.stored),
            hex(&self.computed)
        )
    }
}

/// A writer that checksums what passes through it.
pub struct ChecksumWriter<W> {
    inner: W,
    sum: Checksum,
}

impl<W: Write> ChecksumWriter<W> {
    pub fn new(inner: W) -> Self {
        ChecksumWriter {
            inner,
            sum: Checksum::new(),
        }
    }

    /// Appends the checksum of everything written so far; returns the inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        let d = self.sum.digest();
        self.inner.write_all(&d)?;
        Ok(self.inner)
    }
}

impl<W: Write> Write for ChecksumWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.sum.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A reader over the checksummed part of a stream of known length (everything but the
/// trailing checksum): it never reads into the checksum, so a parser confused by a corrupt
/// length field still leaves the stored checksum to compare with.
pub struct ChecksumReader<R> {
    inner: R,
    sum: Checksum,
    /// Checksummed bytes not read yet.
    left: u64,
}

impl<R: Read> ChecksumReader<R> {
    /// `total`: the stream's length in bytes, checksum included.
    pub fn new(inner: R, total: u64) -> io::Result<Self> {
        let Some(left) = total.checked_sub(CHECKSUM_LEN as u64) else {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{total} bytes cannot hold a {CHECKSUM_LEN}-byte checksum"),
            ));
        };
        Ok(ChecksumReader {
            inner,
            sum: Checksum::new(),
            left,
        })
    }

    /// Checksummed bytes not read yet: an upper bound for any length field.
    pub fn left(&self) -> u64 {
        self.left
    }

    /// Reads the rest of the checksummed part and the stored checksum, and compares.
    pub fn verify(mut self) -> io::Result<Result<(), Mismatch>> {
        io::copy(&mut self, &mut io::sink())?;
        if self.left > 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let mut stored = [0u8; CHECKSUM_LEN];
        self.inner.read_exact(&mut stored)?;
        let computed = self.sum.digest();
        Ok(if stored == computed {
            Ok(())
        } else {
            Err(Mismatch { stored, computed })
        })
    }
}

impl<R: Read> Read for ChecksumReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        if want == 0 {
            return Ok(0);
        }
        let n = self.inner.read(&mut buf[..want])?;
        self.sum.update(&buf[..n]);
        self.left -= n as u64;
        Ok(n)
    }
}

/// A temporary file that is removed unless it was renamed into place (errors, panics).
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The temporary name of a write to `path`: hidden, in the same directory, unique to this
/// process and write, ending in `.tmp` (the disk KV cache removes such leftovers of a crash).
pub fn temp_path(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy());
    path.with_file_name(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Creates `path` with what `write` produces, atomically: written to a temporary file in the
/// same directory (mode 0600), fsynced, renamed over `path`, the directory fsynced. On any
/// error (or a panic in `write`) the temporary file is removed and `path` is untouched.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
) -> io::Result<()> {
    let tmp = temp_path(path);
    let mut opts = OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let file = opts.open(&tmp)?;
    let mut guard = TempFile(Some(tmp.clone()));
    let mut w = BufWriter::with_capacity(1 << 20, file);
    write(&mut w)?;
    let file = w.into_inner().map_err(io::IntoInnerError::into_error)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)?;
    // Renamed: nothing left to remove (disarmed, not forgotten, which leaked the path).
    guard.0 = None;
    // The rename is durable once the directory is.
    if let Some(dir) = path.parent() {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_round_trip_and_corruption() {
        let mut w = ChecksumWriter::new(Vec::new());
        w.write_all(b"hello, world").unwrap();
        let buf = w.finish().unwrap();
        assert_eq!(buf.len(), 12 + CHECKSUM_LEN);
        let mut r = ChecksumReader::new(buf.as_slice(), buf.len() as u64).unwrap();
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(
            got, b"hello, world",
            "the checksum is not part of the content"
        );
        assert!(r.verify().unwrap().is_ok());
        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x10;
            let r = ChecksumReader::new(bad.as_slice(), bad.len() as u64).unwrap();
            assert!(r.verify().unwrap().is_err(), "byte {i}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn atomic_write_is_private_and_leaves_nothing_on_failure() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.bin");
        write_atomic(&path, |w| w.write_all(b"one")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{mode:o}");
        let files = || {
            let mut v: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        // A write that fails half way: the old content stays, no temporary file is left.
        let err = write_atomic(&path, |w| {
            w.write_all(&[7u8; 3 << 20])?;
            Err(io::Error::other("interrupted"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "interrupted");
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        assert_eq!(files(), ["f.bin"]);
        // A panic mid-write: the same.
        let p2 = dir.path().join("g.bin");
        let r = std::panic::catch_unwind(|| {
            write_atomic(&p2, |w| {
                w.write_all(b"partial")?;
                w.flush()?;
                panic!("killed mid-write")
            })
        });
        assert!(r.is_err());
        assert_eq!(files(), ["f.bin"]);
    }
}
