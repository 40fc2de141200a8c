//! The cache's memory: one zeroed allocation of `n_slots` equal, `ALIGN`-aligned slots. Pages
//! are committed when first written (a cache that never fills never costs its full size).
//!
//! Who may touch a slot is decided by the cache state under its lock, not here: a slot is
//! written only by the one reader its entry's read was given to while the entry is `Reading`,
//! and read only while the entry is `Ready` and pinned (a pinned entry is never evicted, so
//! never re-read into). The lock's release/acquire orders the reader's writes before any use.

use std::ptr::NonNull;

use crate::layout::ALIGN;

pub struct Slab {
    ptr: NonNull<u8>,
    size: usize,
    slot_bytes: usize,
    n_slots: usize,
}

// SAFETY: a `Slab` owns its anonymous mapping (unmapped only in `Drop`), plain memory with no tie
// to the thread that mapped it.
unsafe impl Send for Slab {}
// SAFETY: through `&Slab` the slots are reachable only by the `unsafe` `slot`/`slot_mut`, whose
// contracts leave it to the callers that no slot is written while another reference to it
// lives; the cache grants that under its lock (module doc), so sharing a slab between threads
// adds no data race.
unsafe impl Sync for Slab {}

impl Slab {
    /// `n_slots` slots of `slot_bytes` (a multiple of `ALIGN`, at least one slot).
    pub fn new(n_slots: usize, slot_bytes: usize) -> Option<Slab> {
        assert!(
            slot_bytes > 0 && (slot_bytes as u64).is_multiple_of(ALIGN),
            "slot size {slot_bytes} is not a positive multiple of {ALIGN}"
        );
        assert!(n_slots > 0, "a slab needs at least one slot");
        let size = n_slots.checked_mul(slot_bytes)?;
        // An anonymous private map: page-aligned (so `ALIGN`-aligned), zero-filled (no slice
        // ever covers uninitialized bytes) and committed only where written. (The global
        // allocator would memset an over-aligned zeroed block, committing all of it.)
        // SAFETY: a fresh mapping with no address hint; the result is checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let ptr = NonNull::new(p.cast::<u8>())?;
        Some(Slab {
            ptr,
            size,
            slot_bytes,
            n_slots,
        })
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slot `i`, read-only.
    ///
    /// # Safety
    /// No one writes slot `i` while the returned slice lives (its entry is `Ready` and pinned).
    pub unsafe fn slot(&self, i: usize) -> &[u8] {
        assert!(i < self.n_slots);
        // SAFETY: in bounds of the (zero-initialized) allocation; exclusion is the caller's
        // contract.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().add(i * self.slot_bytes), self.slot_bytes)
        }
    }

    /// Slot `i`, writable.
    ///
    /// # Safety
    /// The caller is the only one touching slot `i` while the returned slice lives (it was given
    /// the read of the slot's `Reading` entry).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&self, i: usize) -> &mut [u8] {
        assert!(i < self.n_slots);
        // SAFETY: in bounds of the (zero-initialized) allocation; exclusive by the caller's
        // contract.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr().add(i * self.slot_bytes),
                self.slot_bytes,
            )
        }
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this size and not unmapped since; the slices of `slot` and
        // `slot_mut` borrow the slab, so none outlives it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.size) };
    }
}
