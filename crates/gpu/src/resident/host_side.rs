//! The host's side of a step that computes routed experts on the host: which layers it
//! serves, and serving one through the handoff (handoff.rs) once the device's routing is out.

use std::time::Duration;

use cudarc::driver::sys::CUstream;
use model::{Compute, Model};

use super::handoff::{Handoff, HandoffLayout, HostLayer};
use super::{DevFfn, ResidentModel};

/// The most experts a token may pick for the device to take some of its host experts
/// (`moe_route`'s one-row fast path keeps a slot a lane).
const READ_MAX_K: usize = 32;

impl ResidentModel {
    /// The exchange of a step of `n` rows whose host computes experts, in `pinned` (grown as
    /// needed): per layer, its n normed rows, then its slots' experts and weights (n·max_k
    /// each) come out, and the host's n sums go in after them, each half announced by a flag
    /// (handoff.rs). Sized by this step's rows, not the arena's (a decode step after a long
    /// prompt).
    pub(super) fn step_handoff(
        &self,
        pinned: &mut Option<cudarc::driver::PinnedHostSlice<f32>>,
        n: usize,
        n_layers: usize,
    ) -> model::Result<Handoff> {
        let layout = HandoffLayout::new(n, self.d, self.max_k, n_layers);
        let pin = crate::cuda::ensure_pinned_with_flags(
            &self.dev.ctx,
            pinned,
            layout.floats(),
            cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP,
        )
        .map_err(|e| self.error("allocating page-locked memory", e))?;
        // SAFETY: pin holds the layout's floats, allocated device-mapped above; only this
        // step (under the state lock) uses it, and it ends by synchronizing the stream.
        unsafe { Handoff::new(pin, layout) }.map_err(|e| self.error("mapping the exchange", e))
    }

    /// After a step's launches and the host's side of the layers served after them (`rest`):
    /// everything drained (also on an error, so that nothing still reads or writes the
    /// exchange or the streaming buffer), and the device's give-up reported.
    pub(super) fn finish_launches(
        &self,
        handoff: Option<&Handoff>,
        rest: model::Result<()>,
        host_compute: bool,
    ) -> model::Result<()> {
        if let (Err(_), Some(hand)) = (&rest, handoff) {
            hand.release_all();
            let _ = self.stream.synchronize();
            if let Some(h) = &self.host_experts {
                let _ = h.synchronize();
            }
        }
        rest?;
        self.stream
            .synchronize()
            .map_err(|e| self.error("waiting for the GPU", e))?;
        if let Some(h) = self.host_experts.as_ref().filter(|_| host_compute) {
            // The device's share's copies are done before its kernels read them; their
            // stream's signals may still be finishing.
            h.synchronize()
                .map_err(|e| self.error("waiting for the expert copies", e))?;
        }
        if handoff.is_some_and(Handoff::failed) {
            return Err(self.error(
                "a step whose host computes experts",
                "the GPU gave up waiting for the host's expert sums",
            ));
        }
        Ok(())
    }

    /// The layers whose host experts a step of `n` rows computes, in order (none when the
    /// device holds every routed expert); in a one-row step the device takes `per_row` of
    /// the row's host experts.
    pub(super) fn host_layers(&self, n: usize, per_row: usize) -> Vec<HostLayer<'_>> {
        let Some(h) = &self.host_experts else {
            return Vec::new();
        };
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(il, l)| {
                let DevFfn::Moe { k, .. } = &l.ffn else {
                    return None;
                };
                let mask = h.on_host(il)?;
                // A one-row step's device takes the first of the row's host experts
                // (moe_route's fast path: k ≤ 32).
                let reading = if n == 1 && *k <= READ_MAX_K {
                    per_row.min(*k)
                } else {
                    0
                };
                Some(HostLayer {
                    il,
                    k: *k,
                    slots: n * k,
                    mask,
                    reading,
                })
            })
            .collect()
    }

    /// Layer `hl` of a handed-over step, on the host: once its routing is out, the device's
    /// share of its host experts (if any) copied in, the rest computed here, the sums handed
    /// in. Returns the time the host's experts took.
    pub(super) fn serve_host_layer(
        &self,
        hand: &Handoff,
        hl: &HostLayer,
        cx: &Compute,
        model: &Model,
        cu: CUstream,
    ) -> model::Result<Duration> {
        let Some(h) = &self.host_experts else {
            return Ok(Duration::ZERO);
        };
        hand.wait_routed(hl.il, cu)
            .map_err(|e| self.error("waiting for a layer's routing", e))?;
        let mut xchg = hand.exchange();
        let share = xchg.device_share(hl.slots, hl.mask, hl.reading);
        if hl.reading > 0 {
            if share.is_empty() {
                hand.set_copied(hl.il);
            } else {
                h.copy_experts_in_then_signal(
                    hl.il,
                    &share,
                    &self.f.handoff_signal,
                    hand.copied_address(hl.il),
                )
                .map_err(|e| self.error(&format!("copying layer {}'s experts in", hl.il), e))?;
            }
        }
        let t_host = std::time::Instant::now();
        xchg.compute_host_share(cx, model, hl.il, hl.k, hl.slots, hl.mask, &share)?;
        hand.set_summed(hl.il);
        let took = t_host.elapsed();
        if hl.slots == hl.k && hl.reading == 0 && hl.k <= READ_MAX_K {
            // A decode row's host experts, all on the CPU: what `--gpu-host-read auto` weighs.
            h.record_cpu_layer(xchg.host_slots(hl.slots, hl.mask), took);
        }
        self.dev
            .read_over_link
            .fetch_add(share.len() as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(took)
    }
}
