//! Reads that bypass the page cache, behind one set of functions for both platforms we run on.
//! Streamed experts live in the cache's own slots; keeping a second copy in the page cache
//! would count them twice against a memory limit and evict the resident weights.
//!
//! - **Linux**: `O_DIRECT`. Offsets, lengths and buffers must be aligned (`crate::layout::ALIGN`)
//!   and some filesystems (tmpfs, some network filesystems) refuse it with `EINVAL`, at open
//!   or at the first read; the buffered fallback then drops what it read with
//!   `posix_fadvise(DONTNEED)`.
//! - **macOS**: `fcntl(F_NOCACHE)` on an ordinary descriptor (no alignment rules, never refused
//!   by a filesystem) and `fcntl(F_RDADVISE)` before a read, which starts the whole range's
//!   transfer at once instead of letting the read proceed in pieces. macOS has no call that
//!   drops a file range from its cache, so the buffered fallback keeps what it read.

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
compile_error!("uncached expert reads are implemented for Linux (O_DIRECT) and macOS (F_NOCACHE)");

use std::fs::File;
use std::io;
use std::path::Path;

/// The name of the mechanism, for logs and statistics.
pub const MECHANISM: &str = if cfg!(target_os = "macos") {
    "F_NOCACHE"
} else {
    "O_DIRECT"
};

/// Opens `path` read-only for reads that bypass the page cache.
pub fn open(path: &Path) -> io::Result<File> {
    platform::open(path)
}

/// Whether `e`, from a direct open or read, means this file cannot be read past the cache (the
/// caller falls back to buffered reads) rather than a real I/O failure.
pub fn is_refusal(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Tells the system that `len` bytes at `offset` of `file` (opened by [`open`]) will be read next.
pub fn advise_read(file: &File, offset: u64, len: u64) {
    platform::advise_read(file, offset, len);
}

/// Drops `len` bytes at `offset` of buffered `file` from the page cache, where the platform
/// can (they were copied into a slot and will not be read through the cache again).
pub fn drop_cached(file: &File, offset: u64, len: u64) {
    platform::drop_cached(file, offset, len);
}

#[cfg(target_os = "linux")]
mod platform {
    use std::fs::{File, OpenOptions};
    use std::io;
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    use std::path::Path;

    pub fn open(path: &Path) -> io::Result<File> {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
    }

    /// `O_DIRECT` reads do no read-ahead, and a read of the whole span is one request already.
    pub fn advise_read(_file: &File, _offset: u64, _len: u64) {}

    pub fn drop_cached(file: &File, offset: u64, len: u64) {
        let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len))
        else {
            return;
        };
        // SAFETY: an advice syscall that takes no pointers, on the descriptor of `file`, which
        // the borrow keeps open for the call; its result only affects caching.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), offset, len, libc::POSIX_FADV_DONTNEED);
        }
    }
}

#[cfg(target_os = "macos")]
mod platform {
    use std::fs::File;
    use std::io;
    use std::os::unix::io::AsRawFd;
    use std::path::Path;

    pub fn open(path: &Path) -> io::Result<File> {
        let f = File::open(path)?;
        // SAFETY: `fcntl` with an integer argument on the descriptor of `f`, which is open.
        if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) } == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(f)
    }

    pub fn advise_read(file: &File, offset: u64, len: u64) {
        // `ra_count` is an int: ranges past 2 GiB are advised only in part (experts are smaller).
        let (Ok(ra_offset), Ok(ra_count)) = (
            libc::off_t::try_from(offset),
            libc::c_int::try_from(len.min(i32::MAX as u64)),
        ) else {
            return;
        };
        let mut advice = libc::radvisory {
            ra_offset,
            ra_count,
        };
        // SAFETY: `F_RDADVISE` reads one `radvisory` through the pointer, which points at a live
        // local for the duration of the call; the descriptor is open (borrowed). Failure only
        // loses the hint.
        unsafe {
            libc::fcntl(file.as_raw_fd(), libc::F_RDADVISE, &mut advice);
        }
    }

    /// macOS has no `posix_fadvise` and no other call that evicts a file range from the
    /// unified buffer cache; the pages age out as usual.
    pub fn drop_cached(_file: &File, _offset: u64, _len: u64) {}
}
