//! Allocator settings for the forward pass's per-layer buffers.
//!
//! A prefill chunk allocates its large buffers afresh in every layer (the experts' outputs of
//! every token slot, the f64 sums, the gathered rows: tens of MB at 512 tokens). glibc serves
//! an allocation above its mmap threshold (dynamic, at most 32 MiB) with a fresh mapping and
//! unmaps it on free, so such a buffer page-faults on every first touch, in every layer; freed
//! heap memory above the trim threshold is returned to the OS and faults again too. Measured on
//! olmoe-7b-a1b at 2 threads, pp512: 75.1 t/s as glibc leaves it, 87.1 with both thresholds at
//! 1 GiB (the experts' weighted sum alone went from 0.57 s to 0.08 s); pp256's buffers stay
//! under 32 MiB and were unaffected. Keeping the memory costs at most the largest chunk's
//! scratch, next to gigabytes of weights — what llama.cpp's preallocated compute buffers hold.

/// Serves allocations below 1 GiB from the heap and keeps up to 1 GiB of freed heap memory, so
/// the next layer's buffers reuse pages that are already mapped. Call before other threads
/// start. A no-op where the allocator is not glibc's.
pub fn keep_freed_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const GIB: libc::c_int = 1 << 30;
        // SAFETY: mallopt only sets two allocator parameters (it takes the allocator's lock);
        // nothing else runs yet (the first line of main).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, GIB);
            libc::mallopt(libc::M_TRIM_THRESHOLD, GIB);
        }
    }
}
