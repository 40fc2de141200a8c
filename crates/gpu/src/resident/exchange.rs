//! The host's side of a step that computes routed experts on the host (host_experts.rs): per
//! layer, the device writes its normed rows and routing into page-locked memory it maps, the
//! CPU computes its experts' weighted sums there, and the device reads them (handoff.rs).

use model::{Compute, Model};

/// A step's page-locked exchange buffer: `rows` normed rows of `d` floats, then `rows · max_k`
/// slot experts (u32) and as many weights come back; `rows` sums of `d` floats go in.
pub(super) struct Exchange<'a> {
    buf: &'a mut [f32],
    rows: usize,
    d: usize,
    slots_max: usize,
}

impl<'a> Exchange<'a> {
    /// The floats the buffer of a step of `rows` rows takes.
    pub(super) fn floats(rows: usize, d: usize, max_k: usize) -> usize {
        2 * rows * d + 2 * rows * max_k
    }

    /// Over `buf`, which holds [`Exchange::floats`] of these in a step that computes host
    /// experts (and may be empty in others, which never call the methods below).
    pub(super) fn new(buf: &'a mut [f32], rows: usize, d: usize, max_k: usize) -> Exchange<'a> {
        Exchange {
            buf,
            rows,
            d,
            slots_max: rows * max_k,
        }
    }

    /// Once the layer's routing is back: the host experts the device takes in a one-row step,
    /// the first `read` of the row's slots that `on_host` marks (slot order).
    pub(super) fn device_share(&self, slots: usize, on_host: &[bool], read: usize) -> Vec<u32> {
        if self.rows != 1 || read == 0 {
            return Vec::new();
        }
        let ids = &self.buf[self.d..self.d + slots];
        bytemuck::cast_slice::<f32, u32>(ids)
            .iter()
            .copied()
            .filter(|&e| on_host.get(e as usize) == Some(&true))
            .take(read)
            .collect()
    }

    /// Once the layer's routing is back: how many of its `slots` are experts `on_host` marks.
    pub(super) fn host_slots(&self, slots: usize, on_host: &[bool]) -> usize {
        let ids = &self.buf[self.rows * self.d..][..slots];
        bytemuck::cast_slice::<f32, u32>(ids)
            .iter()
            .filter(|&&e| on_host.get(e as usize) == Some(&true))
            .count()
    }

    /// Once the layer's routing is back: the host's share of layer `il` (`k` slots a row,
    /// `slots` in the step) into the sums, the experts `on_host` marks but those of
    /// `device_share` (which the device computes).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn compute_host_share(
        &mut self,
        cx: &Compute,
        model: &Model,
        il: usize,
        k: usize,
        slots: usize,
        on_host: &[bool],
        device_share: &[u32],
    ) -> model::Result<()> {
        let (n, d) = (self.rows, self.d);
        let (routed, sums) = self.buf.split_at_mut(n * d + 2 * self.slots_max);
        let (rows, routing) = routed.split_at(n * d);
        let (ids, wts) = routing.split_at(self.slots_max);
        let ids: &[u32] = bytemuck::cast_slice(&ids[..slots]);
        let mut cpu_mask = std::borrow::Cow::Borrowed(on_host);
        for &e in device_share {
            cpu_mask.to_mut()[e as usize] = false;
        }
        model::blocks::moe::host_expert_sums(
            cx,
            model,
            il,
            rows,
            k,
            ids,
            &wts[..slots],
            &cpu_mask,
            &mut sums[..n * d],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exchange of one row (d = 4, max_k = 4) whose routing came back as `ids`.
    fn routed(buf: &mut Vec<f32>, ids: &[u32]) {
        buf.resize(Exchange::floats(1, 4, 4), 0.0);
        for (slot, &e) in ids.iter().enumerate() {
            buf[4 + slot] = f32::from_bits(e);
        }
    }

    #[test]
    fn the_device_takes_the_first_host_slots_in_slot_order() {
        let mut buf = Vec::new();
        routed(&mut buf, &[5, 1, 6, 2]);
        let on_host = [false, true, true, false, false, false, true, false];
        let x = Exchange::new(&mut buf, 1, 4, 4);
        assert_eq!(x.device_share(4, &on_host, 2), vec![1, 6]);
        assert_eq!(x.device_share(4, &on_host, 8), vec![1, 6, 2]);
        assert!(x.device_share(4, &on_host, 0).is_empty());
        // An expert id past the mask is no host expert (host_expert_sums reports it).
        routed(&mut buf, &[9, 2, 1, 0]);
        let x = Exchange::new(&mut buf, 1, 4, 4);
        assert_eq!(x.device_share(4, &on_host, 1), vec![2]);
    }

    #[test]
    fn steps_of_several_rows_leave_every_host_expert_to_the_cpu() {
        let mut buf = vec![0.0; Exchange::floats(2, 4, 4)];
        let on_host = [true; 8];
        let x = Exchange::new(&mut buf, 2, 4, 4);
        assert!(x.device_share(8, &on_host, 3).is_empty());
    }
}
