//! How many of a decode row's host experts the device computes itself (`--gpu-host-read`).
//!
//! In a one-row whole step the CPU computes the row's routed experts that stay on the host
//! while the device waits for their sums; the device can take the first N of them instead,
//! their weights copied over the link once the routing is known, so that the link and the
//! CPU's memory work at the same time. The best N balances the two: the copies of N experts
//! against the CPU's time for the others. Measured on an H100 host (PCIe 5, 16 cores,
//! qwen3-30b-a3b Q4_K): 3 of 8 was best and 4 already slower than 2 (docs/perf.md), which is
//! what this balance predicts there; a slower link or a faster CPU wants fewer.
//!
//! `auto` (the default) times the link once when the model is built, then the CPU's experts
//! over the first one-row steps (each computing all of the row's host experts), and fixes N
//! from the two for the rest of the run (a fixed N keeps the step's CUDA graph).

use std::time::Duration;

/// `--gpu-host-read`: a fixed count, or chosen from measurements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostRead {
    /// The device takes up to this many of a row's host experts (0: the CPU computes them all).
    Fixed(usize),
    /// Chosen by [`HostReadPlan`] from the link's and the CPU's measured speeds.
    #[default]
    Auto,
}

impl std::str::FromStr for HostRead {
    type Err = String;

    fn from_str(s: &str) -> Result<HostRead, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(HostRead::Auto);
        }
        s.parse::<usize>()
            .map(HostRead::Fixed)
            .map_err(|_| format!("{s:?}: give a count of experts (0, 1, 2, ...) or \"auto\""))
    }
}

impl std::fmt::Display for HostRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostRead::Fixed(n) => write!(f, "{n}"),
            HostRead::Auto => f.write_str("auto"),
        }
    }
}

/// Layers the CPU serves, all of a row's host experts each, that `auto` weighs: four decode
/// steps of a 48-layer model.
const SAMPLES_TO_CHOOSE: usize = 192;

/// Layers served first, not weighed: the thread pool's and the caches' first-use costs.
const WARM_UP_SAMPLES: usize = 64;

/// What handing experts to the device costs beyond their copies: the copy stream's signal and
/// the device's wait on it, and its expert launches (a few microseconds each on an H100).
const DEVICE_SHARE_OVERHEAD: Duration = Duration::from_micros(10);

/// The count a model's one-row steps use, fixed or being measured.
#[derive(Clone, Debug)]
pub struct HostReadPlan {
    mode: HostRead,
    /// The time to copy one host expert over the link (measured when the model was built;
    /// without it `auto` leaves every host expert to the CPU).
    copy_per_expert: Option<Duration>,
    /// Layers served by the CPU alone while measuring: (host experts, time).
    samples: Vec<(usize, Duration)>,
    /// Samples seen, the first [`WARM_UP_SAMPLES`] of them dropped.
    seen: usize,
    chosen: Option<usize>,
}

impl HostReadPlan {
    pub fn new(mode: HostRead, copy_per_expert: Option<Duration>) -> HostReadPlan {
        HostReadPlan {
            mode,
            copy_per_expert,
            samples: Vec::new(),
            seen: 0,
            chosen: match mode {
                HostRead::Fixed(n) => Some(n),
                HostRead::Auto => None,
            },
        }
    }

    /// The count for the next one-row step (0 while `auto` is measuring).
    pub fn per_row(&self) -> usize {
        self.chosen.unwrap_or(0)
    }

    /// The count chosen, once there is one.
    pub fn chosen(&self) -> Option<usize> {
        self.chosen
    }

    pub fn mode(&self) -> HostRead {
        self.mode
    }

    /// The CPU computed `experts` host experts of a one-row step's layer alone in `took`.
    /// Returns the count `auto` chose, when this sample completed its measurement.
    pub fn record(&mut self, experts: usize, took: Duration) -> Option<usize> {
        if self.chosen.is_some() || experts == 0 {
            return None;
        }
        self.seen += 1;
        if self.seen <= WARM_UP_SAMPLES {
            return None;
        }
        self.samples.push((experts, took));
        if self.samples.len() < SAMPLES_TO_CHOOSE {
            return None;
        }
        let n = self
            .copy_per_expert
            .map_or(0, |copy| choose(&self.samples, copy));
        self.chosen = Some(n);
        Some(n)
    }

    /// The CPU's measured time per expert (what `auto` chose from), once measured.
    pub fn cpu_per_expert(&self) -> Option<Duration> {
        per_expert(&self.samples)
    }

    pub fn copy_per_expert(&self) -> Option<Duration> {
        self.copy_per_expert
    }
}

/// The CPU's time per host expert over `samples` (total time over total experts: a layer's
/// fixed costs are spread over its experts, which makes handing some over look a little
/// better than it is).
fn per_expert(samples: &[(usize, Duration)]) -> Option<Duration> {
    let experts: usize = samples.iter().map(|s| s.0).sum();
    let time: Duration = samples.iter().map(|s| s.1).sum();
    (experts > 0).then(|| time / experts as u32)
}

/// The count that minimizes the mean layer time over `samples` (a row's host experts, as
/// seen), a layer taking the longer of the device's share (copies, then its launches) and the
/// CPU's rest. Ties go to the smaller count (less link traffic).
pub fn choose(samples: &[(usize, Duration)], copy_per_expert: Duration) -> usize {
    let Some(cpu) = per_expert(samples) else {
        return 0;
    };
    let most = samples.iter().map(|s| s.0).max().unwrap_or(0);
    let layer_time = |n: usize, experts: usize| {
        let device = n.min(experts);
        let device_time = if device == 0 {
            Duration::ZERO
        } else {
            copy_per_expert
                .saturating_mul(device as u32)
                .saturating_add(DEVICE_SHARE_OVERHEAD)
        };
        device_time.max(cpu.saturating_mul((experts - device) as u32))
    };
    let total = |n: usize| {
        samples.iter().fold(Duration::ZERO, |t, &(e, _)| {
            t.saturating_add(layer_time(n, e))
        })
    };
    (0..=most).min_by_key(|&n| (total(n), n)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn parses_counts_and_auto() {
        assert_eq!("auto".parse::<HostRead>(), Ok(HostRead::Auto));
        assert_eq!("AUTO".parse::<HostRead>(), Ok(HostRead::Auto));
        assert_eq!("3".parse::<HostRead>(), Ok(HostRead::Fixed(3)));
        let e = "three".parse::<HostRead>().unwrap_err();
        assert!(e.contains("three") && e.contains("auto"), "{e}");
        assert_eq!(HostRead::Fixed(2).to_string(), "2");
        assert_eq!(HostRead::Auto.to_string(), "auto");
    }

    /// The H100 host's numbers: 8 host experts a layer at 41 µs each on 16 cores, about
    /// 3 MB an expert over a link of about 50 GB/s (61 µs). Measured best: 3.
    #[test]
    fn balances_the_link_against_the_cpu() {
        let samples = vec![(8, us(328)); 200];
        assert_eq!(choose(&samples, us(61)), 3);
        // A link half as fast: fewer.
        assert_eq!(choose(&samples, us(122)), 2);
        // A link slower than the CPU's whole share: none.
        assert_eq!(choose(&samples, us(400)), 0);
        // A link much faster than the CPU: most of them.
        assert_eq!(choose(&samples, us(5)), 7);
        // No overflow on a link that never finishes.
        assert_eq!(choose(&samples, Duration::MAX), 0);
    }

    #[test]
    fn weighs_layers_by_how_many_host_experts_they_had() {
        // Half the layers with 2 host experts, half with 8 (41 µs each): the count is the
        // step's, so 3 also hands both of the 2s over (132 µs against the CPU's 82), and still
        // wins on the 8s.
        let mut samples = vec![(2, us(82)); 100];
        samples.extend(vec![(8, us(328)); 100]);
        assert_eq!(choose(&samples, us(61)), 3);
        assert_eq!(choose(&[], us(61)), 0);
    }

    #[test]
    fn auto_measures_then_keeps_its_choice() {
        let mut plan = HostReadPlan::new(HostRead::Auto, Some(us(61)));
        assert_eq!(plan.per_row(), 0);
        // The warm-up's slow layers are not weighed.
        for _ in 0..WARM_UP_SAMPLES {
            assert_eq!(plan.record(8, us(5_000)), None);
        }
        for _ in 0..SAMPLES_TO_CHOOSE - 1 {
            assert_eq!(plan.record(8, us(328)), None);
            assert_eq!(plan.chosen(), None);
        }
        // Layers with no host expert in the row tell nothing.
        assert_eq!(plan.record(0, us(5)), None);
        assert_eq!(plan.record(8, us(328)), Some(3));
        assert_eq!(plan.per_row(), 3);
        assert_eq!(plan.cpu_per_expert(), Some(us(41)));
        // Later steps change nothing.
        assert_eq!(plan.record(8, us(10_000)), None);
        assert_eq!(plan.per_row(), 3);

        let mut fixed = HostReadPlan::new(HostRead::Fixed(2), Some(us(61)));
        assert_eq!(fixed.per_row(), 2);
        assert_eq!(fixed.record(8, us(328)), None);
        assert_eq!(fixed.per_row(), 2);

        // No timing of the link (nothing to copy): the CPU keeps them all.
        let mut untimed = HostReadPlan::new(HostRead::Auto, None);
        for _ in 0..WARM_UP_SAMPLES + SAMPLES_TO_CHOOSE {
            untimed.record(8, us(328));
        }
        assert_eq!(untimed.per_row(), 0);
        assert_eq!(untimed.chosen(), Some(0));
    }
}
