//! `MOESHARD_GPU_TIMING=1`: where a whole step's time goes, summed per step shape and printed
//! on stderr.

use std::sync::Mutex;

/// Host preparation, the device's work (launches to synchronize), the host's routed experts
/// within it (a step that computes them) and the copy into the host caches, summed per number
/// of rows in a step (a prompt's chunks, a warm-up's short prompt and decode rows apart, so no
/// average mixes them) and printed every 64 single-row steps and when the model is dropped.
#[derive(Default)]
pub(super) struct StepTiming {
    sums: Mutex<std::collections::BTreeMap<usize, StepSums>>,
}

/// Steps of one row count: how many, their summed parts and the fastest step's (a first step
/// also pays for its allocations, which an average hides), and the same sums since the last
/// report (a bench sweep reports at each depth: the totals alone mix the depths).
#[derive(Default)]
struct StepSums {
    count: u64,
    total: [std::time::Duration; 4],
    fastest: Option<[std::time::Duration; 4]>,
    recent_count: u64,
    recent: [std::time::Duration; 4],
}

impl StepTiming {
    pub(super) fn record(&self, rows: usize, parts: [std::time::Duration; 4]) {
        let Ok(mut sums) = self.sums.lock() else {
            return;
        };
        let s = sums.entry(rows).or_default();
        s.count += 1;
        s.recent_count += 1;
        for ((t, r), p) in s.total.iter_mut().zip(s.recent.iter_mut()).zip(parts) {
            *t += p;
            *r += p;
        }
        let sum = |p: &[std::time::Duration; 4]| p.iter().sum::<std::time::Duration>();
        if s.fastest.is_none_or(|f| sum(&parts) < sum(&f)) {
            s.fastest = Some(parts);
        }
        if rows == 1 && s.count.is_multiple_of(64) {
            Self::print(&mut sums);
        }
    }

    /// Reports every shape's steps on stderr and starts their recent sums again.
    fn print(sums: &mut std::collections::BTreeMap<usize, StepSums>) {
        for (&rows, s) in sums.iter_mut() {
            eprintln!("{}", Self::report(rows, s));
            s.recent_count = 0;
            s.recent = Default::default();
        }
    }

    fn report(rows: usize, s: &StepSums) -> String {
        let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
        let n = s.count as f64;
        let what = if rows == 1 { "row" } else { "rows" };
        let f = s.fastest.unwrap_or_default();
        let mut line = format!(
            "gpu timing: {} steps of {rows} {what}: host {:.0} µs, device {:.0} µs, host experts {:.0} µs, caches {:.0} µs a step (fastest: {:.0} + {:.0} + {:.0} + {:.0} µs)",
            s.count,
            us(s.total[0]) / n,
            us(s.total[1]) / n,
            us(s.total[2]) / n,
            us(s.total[3]) / n,
            us(f[0]),
            us(f[1]),
            us(f[2]),
            us(f[3])
        );
        if s.recent_count > 0 && s.recent_count < s.count {
            let r = s.recent_count as f64;
            line += &format!(
                "; the last {}: host {:.0} µs, device {:.0} µs a step",
                s.recent_count,
                us(s.recent[0]) / r,
                us(s.recent[1]) / r
            );
        }
        line
    }
}

impl Drop for StepTiming {
    fn drop(&mut self) {
        if let Ok(mut sums) = self.sums.lock() {
            Self::print(&mut sums);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::StepTiming;
    use std::time::Duration;

    fn step(host_us: u64, device_us: u64) -> [Duration; 4] {
        let us = Duration::from_micros;
        [us(host_us), us(device_us), us(0), us(10)]
    }

    /// The line a report would print now for steps of `rows` rows.
    fn report_now(timing: &StepTiming, rows: usize) -> String {
        StepTiming::report(rows, &timing.sums.lock().unwrap()[&rows])
    }

    #[test]
    fn a_report_gives_the_steps_since_the_last_one_apart() {
        let timing = StepTiming::default();
        for _ in 0..64 {
            timing.record(1, step(10, 100));
        }
        // The 64th step reported (on stderr) and started the recent sums again.
        let line = report_now(&timing, 1);
        assert!(
            line.contains("64 steps of 1 row: host 10 µs, device 100 µs"),
            "{line}"
        );
        assert!(!line.contains("the last"), "{line}");
        for _ in 0..63 {
            timing.record(1, step(30, 300));
        }
        let line = report_now(&timing, 1);
        assert!(
            line.contains("127 steps of 1 row: host 20 µs, device 199 µs"),
            "{line}"
        );
        assert!(
            line.contains("the last 63: host 30 µs, device 300 µs"),
            "{line}"
        );
        // Shapes keep their own sums.
        timing.record(512, step(1000, 90000));
        let line = report_now(&timing, 512);
        assert!(
            line.contains("1 steps of 512 rows: host 1000 µs, device 90000 µs"),
            "{line}"
        );
    }
}
