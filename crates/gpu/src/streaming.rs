//! Routed experts the device does not hold, run there for a prompt by copying their weights in:
//! how one call's copies are split into passes through a bounded device buffer, and which host
//! pages to lock so the copies are DMA at the link's speed. Plain arithmetic, no CUDA.

use std::ops::Range;

/// Offsets of matrices in the streaming buffer: a multiple of every row kernel's alignment.
pub(crate) const STREAM_ALIGN: usize = 256;

/// One call's plan: `passes` are consecutive ranges of jobs (in order, together covering all of
/// them) whose copied-in matrices fit the buffer; `offsets[j][k]` is where job `j`'s matrix `k`
/// goes in the buffer during its pass (0 where the device holds it).
#[derive(Debug, PartialEq, Eq)]
#[cfg_attr(not(any(target_os = "linux", target_os = "windows")), allow(dead_code))]
pub(crate) struct PassPlan {
    pub(crate) passes: Vec<Range<usize>>,
    pub(crate) offsets: Vec<[usize; 3]>,
}

/// Plans passes for jobs whose matrices need `copies[j][k]` bytes copied in (`None`: held).
/// A new pass starts where the next job's copies would overflow `capacity`; a job whose copies
/// alone overflow it is an error (its index and bytes).
#[cfg_attr(not(any(target_os = "linux", target_os = "windows")), allow(dead_code))]
pub(crate) fn plan_passes(
    copies: &[[Option<usize>; 3]],
    capacity: usize,
) -> Result<PassPlan, (usize, usize)> {
    let mut passes: Vec<Range<usize>> = Vec::new();
    passes.push(0..0);
    let mut offsets = Vec::with_capacity(copies.len());
    let mut used = 0usize;
    for (j, mats) in copies.iter().enumerate() {
        let need: usize = mats
            .iter()
            .flatten()
            .map(|&len| len.next_multiple_of(STREAM_ALIGN))
            .sum();
        if need > capacity {
            return Err((j, need));
        }
        let pass = passes.last_mut().expect("one pass at least");
        if need > 0 && used + need > capacity && pass.start < pass.end {
            passes.push(j..j);
            used = 0;
        }
        let mut at = [0usize; 3];
        for (k, len) in mats.iter().enumerate() {
            if let Some(len) = len {
                at[k] = used;
                used += len.next_multiple_of(STREAM_ALIGN);
            }
        }
        offsets.push(at);
        passes.last_mut().expect("one pass at least").end = j + 1;
    }
    Ok(PassPlan { passes, offsets })
}

/// The host's page size (4 KiB where it cannot be read).
pub(crate) fn host_page_size() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf reads a constant of the system and has no preconditions.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if n > 0 {
            return n as usize;
        }
    }
    4096
}

/// `ranges` (start, length) rounded out to whole pages, sorted, with ranges that share a page
/// merged (a page may hold the end of one tensor and the start of the next, and a page can be
/// locked once only); ranges that merely touch stay apart.
pub(crate) fn page_spans(ranges: &[(usize, usize)], page: usize) -> Vec<Range<usize>> {
    let mut spans: Vec<Range<usize>> = ranges
        .iter()
        .filter(|&&(_, len)| len > 0)
        .map(|&(start, len)| start / page * page..(start + len).next_multiple_of(page))
        .collect();
    spans.sort_unstable_by_key(|s| s.start);
    let mut merged: Vec<Range<usize>> = Vec::with_capacity(spans.len());
    for s in spans {
        match merged.last_mut() {
            Some(last) if s.start < last.end => last.end = last.end.max(s.end),
            _ => merged.push(s),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_jobs_need_no_copies_and_one_pass() {
        let plan = plan_passes(&[[None; 3], [None; 3]], 0).unwrap();
        assert_eq!((plan.passes.len(), plan.passes[0].clone()), (1, 0..2));
        assert_eq!(plan.offsets, vec![[0; 3], [0; 3]]);
    }

    #[test]
    fn copies_split_into_passes_that_fit_and_keep_job_order() {
        // Three experts of 300 + 300 + 500 bytes (aligned: 512 + 512 + 512), a held one, and
        // one half held; a buffer of 2048 takes one whole expert and a half at most.
        let e = [Some(300), Some(300), Some(500)];
        let copies = [e, [None; 3], e, [None, None, Some(256)], e];
        let plan = plan_passes(&copies, 2048).unwrap();
        assert_eq!(plan.passes, vec![0..2, 2..4, 4..5]);
        assert_eq!(
            plan.offsets,
            vec![
                [0, 512, 1024],
                [0; 3],
                [0, 512, 1024],
                [0, 0, 1536],
                [0, 512, 1024]
            ]
        );
        // Every pass's copies inside the buffer.
        for (j, (mats, at)) in copies.iter().zip(&plan.offsets).enumerate() {
            for (len, &o) in mats.iter().zip(at) {
                if let Some(len) = len {
                    assert!(o + len <= 2048, "job {j}");
                }
            }
        }
    }

    #[test]
    fn an_expert_larger_than_the_buffer_is_an_error() {
        let copies = [[None; 3], [Some(1000), Some(1000), Some(1000)]];
        assert_eq!(plan_passes(&copies, 2048), Err((1, 3072)));
    }

    #[test]
    fn page_spans_round_out_and_merge_only_shared_pages() {
        let spans = page_spans(
            &[(5000, 100), (100, 4000), (4100, 10), (8192, 1), (0, 0)],
            4096,
        );
        // 100..4100 and 4100..4110 share page 4096..8192; 5000..5100 too; 8192..8193 only
        // touches it.
        assert_eq!(spans, vec![0..8192, 8192..12288]);
    }
}
