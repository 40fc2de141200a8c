//! A step whose host computes routed experts hands each layer back and forth with the device
//! through page-locked memory both of them address (resident.cu `handoff_out`, `handoff_in`,
//! `handoff_signal`). The device's side is enqueued, or replayed from a graph, ahead of the
//! host's: a kernel writes the layer's normed rows and routing into the exchange and sets a
//! flag, the host waits on that flag, computes its experts, writes their sums and sets another
//! flag, which a kernel waiting in the stream turns into the layer's weighted sum. No copy,
//! event or launch of the host's sits between the two sides (together they cost a one-row step
//! 14 µs of device time a layer on an H100, and these steps could not be graphs: docs/perf.md).
//!
//! Flags are 0 until set; the host clears them before each step. Each layer has its own three
//! (routing out, sums in, the device's share of the host experts copied in), so a flag is set
//! once per step and never raced.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::exchange::Exchange;

/// A layer's flags: its routing is out, the host's sums are in, the device's share of its host
/// experts is in the streaming buffer.
const FLAGS_PER_LAYER: usize = 3;
const ROUTED: usize = 0;
const SUMMED: usize = 1;
const COPIED: usize = 2;
/// How long the host waits for a layer's routing before it calls the step failed (the kernels
/// give up on the host after 30 s: resident.cu `HANDOFF_TIMEOUT_NS`).
const HOST_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the exchange's parts lie, in floats from its start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HandoffLayout {
    rows: usize,
    d: usize,
    max_k: usize,
    data: usize,
    n_layers: usize,
}

impl HandoffLayout {
    pub(super) fn new(rows: usize, d: usize, max_k: usize, n_layers: usize) -> HandoffLayout {
        HandoffLayout {
            rows,
            d,
            max_k,
            data: Exchange::floats(rows, d, max_k),
            n_layers,
        }
    }

    /// The floats the exchange takes: its data, every layer's flags and the device's failure
    /// word.
    pub(super) fn floats(&self) -> usize {
        self.data + FLAGS_PER_LAYER * self.n_layers + 1
    }

    fn flag(&self, il: usize, which: usize) -> usize {
        self.data + FLAGS_PER_LAYER * il + which
    }

    fn failed(&self) -> usize {
        self.data + FLAGS_PER_LAYER * self.n_layers
    }

    /// Where the host's sums start (after the rows, slot experts and weights that come out).
    fn sums(&self) -> usize {
        self.rows * self.d + 2 * self.rows * self.max_k
    }
}

/// One step's exchange: its host address, and the device address of the same memory.
pub(super) struct Handoff {
    host: *mut f32,
    dev: u64,
    layout: HandoffLayout,
}

impl Handoff {
    /// Over the page-locked, device-mapped `host` of `layout.floats()` floats.
    ///
    /// # Safety
    /// `host` holds `layout.floats()` floats, mapped into the device's address space, and
    /// nothing else reads or writes it while this handoff is in use but the step's kernels.
    pub(super) unsafe fn new(
        host: *mut f32,
        layout: HandoffLayout,
    ) -> Result<Handoff, cudarc::driver::DriverError> {
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: host was allocated page-locked with the device-map flag (the caller's).
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) }.result()?;
        Ok(Handoff { host, dev, layout })
    }

    /// The exchange's host address (a step's graph names it).
    pub(super) fn host_address(&self) -> usize {
        self.host as usize
    }

    fn word(&self, at: usize) -> &AtomicU32 {
        // SAFETY: at < layout.floats() (the flags' indices), an f32 slot is an aligned u32,
        // and the device writes it only through 32-bit stores.
        unsafe { &*self.host.add(at).cast::<AtomicU32>() }
    }

    fn dev_at(&self, at: usize) -> u64 {
        self.dev + 4 * at as u64
    }

    /// The device addresses `handoff_out` writes (the exchange's start) and layer `il`'s
    /// routing flag.
    pub(super) fn out_addresses(&self, il: usize) -> (u64, u64) {
        (self.dev, self.dev_at(self.layout.flag(il, ROUTED)))
    }

    /// The device address of the host's sums and of layer `il`'s flag for them.
    pub(super) fn sums_addresses(&self, il: usize) -> (u64, u64) {
        (
            self.dev_at(self.layout.sums()),
            self.dev_at(self.layout.flag(il, SUMMED)),
        )
    }

    /// The device address of layer `il`'s flag for its copied share.
    pub(super) fn copied_address(&self, il: usize) -> u64 {
        self.dev_at(self.layout.flag(il, COPIED))
    }

    /// The device address of the word a kernel sets when it gave up waiting.
    pub(super) fn failed_address(&self) -> u64 {
        self.dev_at(self.layout.failed())
    }

    /// Clears every flag: before the step's launches, while no kernel of it runs.
    pub(super) fn reset(&self) {
        for at in self.layout.data..self.layout.floats() {
            self.word(at).store(0, Ordering::Relaxed);
        }
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Waits until layer `il`'s routing is out; `Err` when the stream failed meanwhile (a
    /// kernel fault never sets the flag) or after [`HOST_TIMEOUT`].
    pub(super) fn wait_routed(&self, il: usize, stream: sys::CUstream) -> Result<(), String> {
        let flag = self.word(self.layout.flag(il, ROUTED));
        let start = Instant::now();
        let mut spins = 0u32;
        while flag.load(Ordering::Acquire) == 0 {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                // SAFETY: a live stream of this context.
                match unsafe { sys::cuStreamQuery(stream) } {
                    sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_NOT_READY => {}
                    e => return Err(format!("the GPU failed before layer {il}'s routing: {e:?}")),
                }
                if start.elapsed() > HOST_TIMEOUT {
                    return Err(format!(
                        "layer {il}'s routing did not come back from the GPU in {HOST_TIMEOUT:?}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The exchange's data, once a layer's routing is out (`wait_routed`) and until its sums
    /// are in (`set_summed`).
    pub(super) fn exchange(&self) -> Exchange<'_> {
        // SAFETY: the data part holds layout.data floats; between a layer's routing flag and
        // its sums flag the device neither reads nor writes it (handoff_out of the next layer
        // comes after the kernel that waits for the sums flag).
        let buf = unsafe { std::slice::from_raw_parts_mut(self.host, self.layout.data) };
        Exchange::new(buf, self.layout.rows, self.layout.d, self.layout.max_k)
    }

    /// The host's sums of layer `il` are in the exchange.
    pub(super) fn set_summed(&self, il: usize) {
        self.word(self.layout.flag(il, SUMMED))
            .store(1, Ordering::Release);
    }

    /// Layer `il`'s share of host experts needs no copy (the host sets what a kernel on the copy
    /// stream sets otherwise).
    pub(super) fn set_copied(&self, il: usize) {
        self.word(self.layout.flag(il, COPIED))
            .store(1, Ordering::Release);
    }

    /// Lets every waiting kernel of the step go on (a step the host gives up on: its stream
    /// must drain before the step's buffers are used again).
    pub(super) fn release_all(&self) {
        for il in 0..self.layout.n_layers {
            self.set_copied(il);
            self.set_summed(il);
        }
    }

    /// Whether a kernel gave up waiting for the host.
    pub(super) fn failed(&self) -> bool {
        self.word(self.layout.failed()).load(Ordering::Acquire) != 0
    }
}

/// A layer whose host computes experts in this step.
pub(super) struct HostLayer<'m> {
    pub(super) il: usize,
    pub(super) k: usize,
    pub(super) slots: usize,
    /// Which of the layer's experts are the host's.
    pub(super) mask: &'m [bool],
    /// How many of a one-row step's host slots the device takes (their weights copied in).
    pub(super) reading: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_follow_the_data_and_each_layer_has_its_own() {
        let l = HandoffLayout::new(2, 8, 4, 3);
        assert_eq!(l.data, Exchange::floats(2, 8, 4));
        assert_eq!(l.sums(), 2 * 8 + 2 * 2 * 4);
        assert_eq!(l.sums() + 2 * 8, l.data);
        let flags: Vec<usize> = (0..3)
            .flat_map(|il| [ROUTED, SUMMED, COPIED].map(|w| l.flag(il, w)))
            .collect();
        assert_eq!(flags, (l.data..l.data + 9).collect::<Vec<_>>());
        assert_eq!(l.failed(), l.data + 9);
        assert_eq!(l.floats(), l.data + 10);
    }
}
