//! Server metrics: counters and gauges the scheduler and handlers update with atomics, the
//! executor's own statistics as the scheduler last published them, and their rendering in the
//! Prometheus text format for `GET /metrics`.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// An `f64` gauge stored as bits.
#[derive(Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

#[derive(Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
pub struct Metrics {
    pub requests: Counter,
    pub requests_ok: Counter,
    pub requests_failed: Counter,
    pub requests_cancelled: Counter,
    pub requests_rejected: Counter,
    /// Prompt tokens of finished-prefill requests, and how many of them came from a cache.
    pub prompt_tokens: Counter,
    pub prompt_tokens_cached: Counter,
    pub prompt_tokens_evaluated: Counter,
    pub generated_tokens: Counter,
    pub steps: Counter,
    /// Seconds spent in batched forward steps.
    pub step_seconds: Gauge,
    pub disk_saves: Counter,
    pub disk_restores: Counter,
    pub disk_restored_tokens: Counter,
    /// Requests waiting for a slot.
    pub queued: AtomicU64,
    /// Requests admitted or waiting (admission control).
    pub outstanding: AtomicU64,
    pub processing: Gauge,
    pub slots: Gauge,
    pub batch_size: Gauge,
    pub batch_size_max: Gauge,
    pub decode_tps: Gauge,
    pub prompt_tps: Gauge,
    pub kv_tokens: Gauge,
    pub kv_capacity_tokens: Gauge,
    pub disk_bytes: Gauge,
    pub disk_entries: Gauge,
    /// Open HTTP connections.
    pub connections: AtomicU64,
    /// Connections refused at `--max-connections`.
    pub connections_refused: Counter,
    /// `Executor::stats()` as of the last publication.
    pub executor: Mutex<Vec<(String, f64)>>,
}

/// A Prometheus metric name from an executor statistic's name.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect()
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, value: f64) {
    let _ = writeln!(out, "# HELP moeshard_{name} {help}");
    let _ = writeln!(out, "# TYPE moeshard_{name} {kind}");
    let _ = writeln!(out, "moeshard_{name} {value}");
}

impl Metrics {
    pub fn render(&self) -> String {
        let mut o = String::new();
        let c = |v: &Counter| v.get() as f64;
        metric(
            &mut o,
            "requests_total",
            "counter",
            "Completion requests received.",
            c(&self.requests),
        );
        metric(
            &mut o,
            "requests_succeeded_total",
            "counter",
            "Requests that finished normally.",
            c(&self.requests_ok),
        );
        metric(
            &mut o,
            "requests_failed_total",
            "counter",
            "Requests that ended with an error.",
            c(&self.requests_failed),
        );
        metric(
            &mut o,
            "requests_cancelled_total",
            "counter",
            "Requests cancelled by a client disconnect or shutdown.",
            c(&self.requests_cancelled),
        );
        metric(
            &mut o,
            "requests_rejected_total",
            "counter",
            "Requests refused with 503 (queue full or shutting down).",
            c(&self.requests_rejected),
        );
        metric(
            &mut o,
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            c(&self.prompt_tokens),
        );
        metric(
            &mut o,
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens reused from the prefix or disk KV cache.",
            c(&self.prompt_tokens_cached),
        );
        metric(
            &mut o,
            "prompt_tokens_evaluated_total",
            "counter",
            "Prompt tokens actually evaluated.",
            c(&self.prompt_tokens_evaluated),
        );
        metric(
            &mut o,
            "generated_tokens_total",
            "counter",
            "Tokens sampled.",
            c(&self.generated_tokens),
        );
        metric(
            &mut o,
            "steps_total",
            "counter",
            "Batched forward steps.",
            c(&self.steps),
        );
        metric(
            &mut o,
            "step_seconds_total",
            "counter",
            "Seconds spent in batched forward steps.",
            self.step_seconds.get(),
        );
        metric(
            &mut o,
            "decode_tokens_per_second",
            "gauge",
            "Aggregate decode speed over the last seconds.",
            self.decode_tps.get(),
        );
        metric(
            &mut o,
            "prompt_tokens_per_second",
            "gauge",
            "Prefill speed over the last seconds.",
            self.prompt_tps.get(),
        );
        metric(
            &mut o,
            "requests_queued",
            "gauge",
            "Requests waiting for a slot.",
            self.queued.load(Ordering::Relaxed) as f64,
        );
        metric(
            &mut o,
            "requests_processing",
            "gauge",
            "Requests in a slot (prefilling or decoding).",
            self.processing.get(),
        );
        metric(
            &mut o,
            "slots",
            "gauge",
            "Session slots (--parallel).",
            self.slots.get(),
        );
        metric(
            &mut o,
            "batch_size",
            "gauge",
            "Sessions in the last forward step.",
            self.batch_size.get(),
        );
        metric(
            &mut o,
            "batch_size_max",
            "gauge",
            "Most sessions in one forward step so far.",
            self.batch_size_max.get(),
        );
        metric(
            &mut o,
            "kv_cache_tokens",
            "gauge",
            "Positions held in the slots' KV caches.",
            self.kv_tokens.get(),
        );
        let cap = self.kv_capacity_tokens.get();
        metric(
            &mut o,
            "kv_cache_usage_ratio",
            "gauge",
            "KV positions held / (slots x context).",
            if cap > 0.0 {
                self.kv_tokens.get() / cap
            } else {
                0.0
            },
        );
        metric(
            &mut o,
            "disk_cache_saves_total",
            "counter",
            "Sessions written to the disk KV cache.",
            c(&self.disk_saves),
        );
        metric(
            &mut o,
            "disk_cache_restores_total",
            "counter",
            "Sessions restored from the disk KV cache.",
            c(&self.disk_restores),
        );
        metric(
            &mut o,
            "disk_cache_restored_tokens_total",
            "counter",
            "Positions restored from disk instead of evaluated.",
            c(&self.disk_restored_tokens),
        );
        metric(
            &mut o,
            "disk_cache_bytes",
            "gauge",
            "Bytes in the disk KV cache.",
            self.disk_bytes.get(),
        );
        metric(
            &mut o,
            "disk_cache_entries",
            "gauge",
            "Sessions in the disk KV cache.",
            self.disk_entries.get(),
        );
        metric(
            &mut o,
            "http_connections",
            "gauge",
            "Open HTTP connections.",
            self.connections.load(Ordering::Relaxed) as f64,
        );
        metric(
            &mut o,
            "http_connections_refused_total",
            "counter",
            "Connections refused with 503 at --max-connections.",
            c(&self.connections_refused),
        );
        let stats = self.executor.lock().map(|s| s.clone()).unwrap_or_default();
        for (name, value) in &stats {
            let n = sanitize(name);
            metric(
                &mut o,
                &format!("executor_{n}"),
                "gauge",
                &format!("Executor statistic `{name}`."),
                *value,
            );
        }
        if let Some(rate) = hit_rate(&stats) {
            metric(
                &mut o,
                "expert_cache_hit_rate",
                "gauge",
                "Expert-cache hits / (hits + misses) (SSD streaming).",
                rate,
            );
        }
        o
    }
}

/// Hit rate from an executor's `…hits` and `…misses` statistics, when it reports both.
fn hit_rate(stats: &[(String, f64)]) -> Option<f64> {
    stats.iter().find_map(|(name, hits)| {
        let prefix = name.strip_suffix("hits")?;
        let misses = stats
            .iter()
            .find(|(n, _)| n.strip_suffix("misses") == Some(prefix))?
            .1;
        (hits + misses > 0.0).then(|| hits / (hits + misses))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text_with_executor_stats() {
        let m = Metrics::default();
        m.requests.add(3);
        m.kv_tokens.set(50.0);
        m.kv_capacity_tokens.set(200.0);
        *m.executor.lock().unwrap() = vec![
            ("expert cache hits".into(), 3.0),
            ("expert cache misses".into(), 1.0),
        ];
        let text = m.render();
        assert!(
            text.contains("# TYPE moeshard_requests_total counter\nmoeshard_requests_total 3\n")
        );
        assert!(text.contains("moeshard_kv_cache_usage_ratio 0.25\n"));
        assert!(text.contains("moeshard_executor_expert_cache_hits 3\n"));
        assert!(text.contains("moeshard_expert_cache_hit_rate 0.75\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let mut parts = line.split(' ');
            let name = parts.next().unwrap();
            assert!(
                name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{line}"
            );
            parts.next().unwrap().parse::<f64>().unwrap();
        }
    }
}
