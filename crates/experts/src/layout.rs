//! Where one expert's bytes are on disk and where they land in a cache slot. An expert is its
//! gate, up and down matrices, three ranges of three stacked tensors (two for a fused gate_up);
//! each range is read as the enclosing `ALIGN`-aligned span (O_DIRECT needs aligned offsets,
//! lengths and buffers; GGUF only aligns tensors to 32 bytes) into an aligned place in the slot,
//! and the matrix is sliced out of it.

use gguf::GgmlType;
use model::Model;
use model::weights::{Ffn, Matrix};

/// O_DIRECT alignment of file offsets, lengths and buffers: 4096 covers 512-byte and
/// 4K-native devices alike (the logical block size is never larger on the disks we target).
pub const ALIGN: u64 = 4096;

/// One aligned read: `len` bytes of split `split` from `start`, landing at `slot_off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub split: usize,
    /// Aligned file offset of the read.
    pub start: u64,
    /// Aligned length of the read.
    pub len: u64,
    /// The bytes that matter: `data_start..data_end` (unaligned, inside `start..start+len`).
    pub data_start: u64,
    pub data_end: u64,
    /// Aligned offset of `start` in the slot.
    pub slot_off: usize,
}

/// One matrix of an expert, as placed in its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub slot_off: usize,
    pub len: usize,
}

/// How to read expert `expert` of `layer` and find its matrices afterwards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertPlan {
    pub segments: Vec<Segment>,
    /// Gate, up, down.
    pub matrices: [Placed; 3],
    /// Bytes of the slot this plan uses.
    pub slot_bytes: usize,
    /// Bytes of weights (what a buffered read would transfer).
    pub data_bytes: u64,
}

fn align_down(x: u64) -> u64 {
    x / ALIGN * ALIGN
}

fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// How many routed experts `layer` has (`None` for a dense layer).
pub(crate) fn n_expert_of(model: &Model, layer: usize) -> Option<usize> {
    match &model.layer(layer)?.ffn {
        Ffn::Moe { experts, .. } => Some(experts.gate.n_expert),
        Ffn::Dense { .. } => None,
    }
}

/// The read plan of one expert, or `None` when `layer` has no routed expert `expert` in the
/// file (a shard file holds only some layers, or only some experts).
pub fn plan(model: &Model, layer: usize, expert: usize) -> Option<ExpertPlan> {
    let Ffn::Moe { experts, .. } = &model.layer(layer)?.ffn else {
        return None;
    };
    if !experts.gate.holds(expert) {
        return None;
    }
    let (gate, up) = experts.gate_up(expert);
    let down = experts.down.expert(expert);
    Some(plan_matrices(&[gate, up, down]))
}

/// Groups the matrices into aligned reads (merging those whose aligned spans touch, as the two
/// halves of a fused gate_up do) and places the reads one after another in the slot.
fn plan_matrices(mats: &[Matrix; 3]) -> ExpertPlan {
    let mut order = [0usize, 1, 2];
    order.sort_by_key(|&i| (mats[i].data.split, mats[i].data.offset));
    let mut segments: Vec<Segment> = Vec::with_capacity(3);
    let mut seg_of = [0usize; 3];
    for &i in &order {
        let d = mats[i].data;
        let (start, end) = (align_down(d.offset), align_up(d.offset + d.len));
        match segments.last_mut() {
            Some(s) if s.split == d.split && start <= s.start + s.len => {
                s.len = s.len.max(end - s.start);
                s.data_start = s.data_start.min(d.offset);
                s.data_end = s.data_end.max(d.offset + d.len);
            }
            _ => segments.push(Segment {
                split: d.split,
                start,
                len: end - start,
                data_start: d.offset,
                data_end: d.offset + d.len,
                slot_off: 0,
            }),
        }
        seg_of[i] = segments.len() - 1;
    }
    let mut off = 0usize;
    for s in &mut segments {
        s.slot_off = off;
        off += s.len as usize;
    }
    let place = |i: usize| {
        let m = &mats[i];
        let s = &segments[seg_of[i]];
        Placed {
            dtype: m.dtype,
            rows: m.rows,
            cols: m.cols,
            slot_off: s.slot_off + (m.data.offset - s.start) as usize,
            len: m.data.len as usize,
        }
    };
    let matrices = [place(0), place(1), place(2)];
    let data_bytes = segments.iter().map(|s| s.data_end - s.data_start).sum();
    ExpertPlan {
        segments,
        matrices,
        slot_bytes: off,
        data_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::weights::TensorRef;

    fn m(offset: u64, len: u64) -> Matrix {
        Matrix {
            dtype: GgmlType::F32,
            rows: 1,
            cols: (len / 4) as usize,
            data: TensorRef {
                split: 0,
                offset,
                len,
            },
        }
    }

    #[test]
    fn unaligned_ranges_get_enclosing_aligned_reads() {
        let p = plan_matrices(&[m(32, 8000), m(100_032, 8000), m(50_016, 96)]);
        assert_eq!(p.segments.len(), 3);
        for s in &p.segments {
            assert_eq!(s.start % ALIGN, 0);
            assert_eq!(s.len % ALIGN, 0);
            assert_eq!(s.slot_off as u64 % ALIGN, 0);
            assert!(s.start <= s.data_start && s.data_end <= s.start + s.len);
        }
        // Gate at 32: first segment, 32 bytes into it.
        assert_eq!(p.matrices[0].slot_off, 32);
        // Down (50_016) is read second in file order.
        assert_eq!(p.matrices[2].slot_off, 8192 + (50_016 - 49_152));
        assert_eq!(p.data_bytes, 16_096);
    }

    #[test]
    fn adjacent_matrices_share_one_read() {
        let p = plan_matrices(&[m(4000, 4000), m(8000, 4000), m(1 << 20, 4096)]);
        assert_eq!(p.segments.len(), 2);
        assert_eq!(p.segments[0].start, 0);
        assert_eq!(p.segments[0].len, 12_288);
        assert_eq!(p.matrices[1].slot_off, 8000);
        assert_eq!(p.matrices[2].slot_off, 12_288);
        assert_eq!(p.slot_bytes, 16_384);
    }
}
