//! Reading experts from the model's files: `pread` into aligned slots past the page cache
//! (`crate::direct_io`: O_DIRECT on Linux, F_NOCACHE on macOS), so streamed experts neither count
//! against a memory limit twice nor evict the resident weights, falling back to buffered reads
//! where the filesystem refuses O_DIRECT (tmpfs, some network filesystems), said once. Every
//! read checks that it got every byte it needed and that the file is still the one that was
//! loaded (size, mtime, inode).

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::direct_io;
use crate::error::StreamError;
use crate::layout::{ALIGN, ExpertPlan, Segment};
use crate::policy::Key;

/// One read as a fault-injection hook sees it.
#[derive(Clone, Debug)]
pub struct ReadEvent {
    pub layer: usize,
    pub expert: usize,
    pub path: PathBuf,
    /// File range of the weights this read is for.
    pub offset: u64,
    pub len: u64,
}

/// What a hook makes a read do instead of succeeding.
#[derive(Clone, Debug)]
pub enum InjectedFault {
    /// The read fails with this error kind.
    Error(io::ErrorKind),
    /// The read returns only this many bytes (as at end of file).
    Short(u64),
    /// A direct read is refused (EINVAL), as some filesystems do with O_DIRECT.
    RefuseDirect,
}

/// Test hook called before every read (fault injection); `None` lets the read happen.
pub type ReadHook = Arc<dyn Fn(&ReadEvent) -> Option<InjectedFault> + Send + Sync>;

/// What identifies the file that was loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Identity {
    len: u64,
    mtime: (i64, i64),
    ino: u64,
    dev: u64,
}

impl Identity {
    fn of(m: &std::fs::Metadata) -> Identity {
        Identity {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ino: m.ino(),
            dev: m.dev(),
        }
    }

    fn differences(&self, now: &Identity) -> Option<String> {
        if self.ino != now.ino || self.dev != now.dev {
            Some("it was replaced".into())
        } else if self.len != now.len {
            Some(format!("size {} bytes, was {}", now.len, self.len))
        } else if self.mtime != now.mtime {
            Some("it was modified (mtime changed)".into())
        } else {
            None
        }
    }
}

struct SplitFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    /// Set when this file's direct reads were refused at run time.
    direct_refused: AtomicBool,
    identity: Identity,
}

/// The open files of a model's splits.
pub struct ModelFiles {
    files: Vec<SplitFile>,
    hook: Option<ReadHook>,
    fallback_said: AtomicBool,
}

/// Reads into `buf` from `offset` until it is full or the file ends; returns the bytes read.
/// With O_DIRECT every request must stay aligned, so a read that stops short of alignment is
/// not continued.
fn pread_full(f: &File, buf: &mut [u8], offset: u64, direct: bool) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => {
                done += n;
                if direct && !(done as u64).is_multiple_of(ALIGN) {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

impl ModelFiles {
    /// Opens `paths` (the splits, in order), expecting the lengths that were mapped. With
    /// `direct`, each is also opened for direct reads ([`direct_io::open`]) and probed with one aligned
    /// read.
    pub fn open(
        paths: &[(PathBuf, u64)],
        direct: bool,
        hook: Option<ReadHook>,
    ) -> Result<ModelFiles, StreamError> {
        let mut files = Vec::with_capacity(paths.len());
        let mut refused = Vec::new();
        for (path, mapped_len) in paths {
            let open_err = |e| StreamError::Open {
                path: path.clone(),
                source: e,
            };
            let buffered = File::open(path).map_err(open_err)?;
            let identity = Identity::of(&buffered.metadata().map_err(open_err)?);
            if identity.len != *mapped_len {
                return Err(StreamError::Changed {
                    path: path.clone(),
                    detail: format!("size {} bytes, was {mapped_len}", identity.len),
                });
            }
            let direct = if direct {
                match open_direct(path) {
                    Ok(f) => Some(f),
                    Err(e) => {
                        refused.push(format!("{}: {e}", path.display()));
                        None
                    }
                }
            } else {
                None
            };
            files.push(SplitFile {
                path: path.clone(),
                buffered,
                direct,
                direct_refused: AtomicBool::new(false),
                identity,
            });
        }
        let me = ModelFiles {
            files,
            hook,
            fallback_said: AtomicBool::new(false),
        };
        if !refused.is_empty() {
            me.say_fallback(&refused.join("; "));
        }
        Ok(me)
    }

    /// Whether every file is read past the page cache (O_DIRECT, F_NOCACHE).
    pub fn direct(&self) -> bool {
        self.files
            .iter()
            .all(|f| f.direct.is_some() && !f.direct_refused.load(Ordering::Relaxed))
    }

    fn say_fallback(&self, why: &str) {
        if !self.fallback_said.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "{} was refused ({why}); streaming experts with buffered reads \
                 (the page cache will hold streamed bytes until they are dropped after each read)",
                direct_io::MECHANISM
            );
        }
    }

    pub fn path(&self, split: usize) -> &Path {
        &self.files[split].path
    }

    /// Reads expert `key` per `plan` into `slot` (at least `plan.slot_bytes` long, `ALIGN`-
    /// aligned); returns the bytes transferred from disk.
    pub fn read_expert(
        &self,
        key: Key,
        plan: &ExpertPlan,
        slot: &mut [u8],
    ) -> Result<u64, StreamError> {
        let mut total = 0;
        for seg in &plan.segments {
            total += self.read_segment(key, seg, slot)?;
        }
        Ok(total)
    }

    fn read_segment(&self, key: Key, seg: &Segment, slot: &mut [u8]) -> Result<u64, StreamError> {
        let f = &self.files[seg.split];
        let fault = self.hook.as_ref().and_then(|h| {
            h(&ReadEvent {
                layer: key.layer as usize,
                expert: key.expert as usize,
                path: f.path.clone(),
                offset: seg.data_start,
                len: seg.data_end - seg.data_start,
            })
        });
        let read_err = |source: io::Error| StreamError::Read {
            layer: key.layer as usize,
            expert: key.expert as usize,
            path: f.path.clone(),
            offset: seg.data_start,
            len: seg.data_end - seg.data_start,
            source,
        };
        if let Some(InjectedFault::Error(kind)) = fault {
            return Err(read_err(io::Error::new(kind, "injected read error")));
        }
        let lead = (seg.data_start - seg.start) as usize;
        let want = (seg.data_end - seg.data_start) as usize;
        let mut result = None;
        if let Some(d) = f
            .direct
            .as_ref()
            .filter(|_| !f.direct_refused.load(Ordering::Relaxed))
        {
            let buf = &mut slot[seg.slot_off..seg.slot_off + seg.len as usize];
            let read = if matches!(fault, Some(InjectedFault::RefuseDirect)) {
                Err(io::Error::from_raw_os_error(libc::EINVAL))
            } else {
                direct_io::advise_read(d, seg.start, seg.len);
                pread_full(d, buf, seg.start, true)
            };
            match read {
                Ok(n) => result = Some((n.saturating_sub(lead).min(want), seg.len)),
                Err(e) if direct_io::is_refusal(&e) => {
                    f.direct_refused.store(true, Ordering::Relaxed);
                    self.say_fallback(&format!("{}: {e}", f.path.display()));
                }
                Err(e) => return Err(read_err(e)),
            }
        }
        let (mut got, transferred) = match result {
            Some(r) => r,
            None => {
                let buf = &mut slot[seg.slot_off + lead..seg.slot_off + lead + want];
                let n = pread_full(&f.buffered, buf, seg.data_start, false).map_err(read_err)?;
                // Streamed bytes are not worth keeping in the page cache (they are in the slot).
                direct_io::drop_cached(&f.buffered, seg.data_start, want as u64);
                (n, want as u64)
            }
        };
        if let Some(InjectedFault::Short(n)) = fault {
            got = got.min(n as usize);
        }
        // After the read, so a change made before or while reading is seen.
        let now = f.buffered.metadata().map_err(read_err)?;
        if let Some(detail) = f.identity.differences(&Identity::of(&now)) {
            return Err(StreamError::Changed {
                path: f.path.clone(),
                detail,
            });
        }
        if got < want {
            return Err(StreamError::Short {
                layer: key.layer as usize,
                expert: key.expert as usize,
                path: f.path.clone(),
                offset: seg.data_start,
                want: want as u64,
                got: got as u64,
            });
        }
        Ok(transferred)
    }
}

fn open_direct(path: &Path) -> io::Result<File> {
    let f = direct_io::open(path)?;
    // Some filesystems accept the flag at open and refuse the reads: probe one block.
    let len = f.metadata()?.len();
    if len >= ALIGN {
        let mut probe = Box::new(AlignedBlock([0; ALIGN as usize]));
        f.read_at(&mut probe.0, 0)?;
    }
    Ok(f)
}

/// One `ALIGN`-aligned block for the direct-read probe.
#[repr(C, align(4096))]
struct AlignedBlock([u8; ALIGN as usize]);
