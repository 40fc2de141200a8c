//! Server metrics: counters, gauges and latency histograms the scheduler and handlers update,
//! the executor's own statistics as the scheduler last published them, and `GET /metrics` in
//! the Prometheus text format (encoded by `prometheus-client`: names, escaping, histogram
//! buckets). Counters and histograms live in a registry made once; values only known at
//! scrape time (queue, connections, ratios, executor statistics) are encoded from a registry
//! made for each scrape.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter as PromCounter;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge as PromGauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The `Content-Type` of `GET /metrics`.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// An `f64` gauge.
#[derive(Clone, Debug, Default)]
pub struct Gauge(PromGauge<f64, AtomicU64>);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.set(v);
    }
    pub fn get(&self) -> f64 {
        self.0.get()
    }
}

/// A monotonic `u64` counter (exported with a `_total` suffix).
#[derive(Clone, Debug, Default)]
pub struct Counter(PromCounter);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.inc_by(n);
    }
    pub fn inc(&self) {
        self.0.inc();
    }
    pub fn get(&self) -> u64 {
        self.0.get()
    }
}

/// A monotonic `f64` counter (exported with a `_total` suffix).
#[derive(Clone, Debug, Default)]
pub struct FloatCounter(PromCounter<f64, AtomicU64>);

impl FloatCounter {
    pub fn add(&self, v: f64) {
        self.0.inc_by(v);
    }
    pub fn get(&self) -> f64 {
        self.0.get()
    }
}

/// A latency histogram in seconds, which also keeps its count and sum for `/v1/status` (the
/// crate's histogram only encodes them).
#[derive(Clone, Debug)]
pub struct Latency {
    histogram: Histogram,
    count: PromCounter,
    sum: PromCounter<f64, AtomicU64>,
}

impl Latency {
    /// Doubling buckets from `first` seconds.
    fn new(first: f64) -> Latency {
        Latency {
            histogram: Histogram::new(exponential_buckets(first, 2.0, 16)),
            count: PromCounter::default(),
            sum: PromCounter::default(),
        }
    }

    pub fn observe(&self, seconds: f64) {
        self.histogram.observe(seconds);
        self.count.inc();
        self.sum.inc_by(seconds);
    }

    pub fn count(&self) -> u64 {
        self.count.get()
    }

    /// Mean seconds (0 before the first observation).
    pub fn mean(&self) -> f64 {
        let n = self.count.get();
        if n > 0 {
            self.sum.get() / n as f64
        } else {
            0.0
        }
    }
}

/// Request latencies, in seconds.
#[derive(Clone, Debug)]
pub struct Latencies {
    /// Admission (before the body is read) to the first sampled token.
    pub time_to_first_token: Latency,
    /// Between consecutive sampled tokens of one request.
    pub inter_token: Latency,
    /// Submission to the scheduler until a slot takes the request.
    pub queue_wait: Latency,
    /// One batched forward step (`Executor::eval`).
    pub step: Latency,
}

impl Default for Latencies {
    fn default() -> Self {
        // 16 doubling buckets each: a 14 MiB demo model decodes in well under a millisecond per
        // token, a streamed 600 GiB model takes seconds; each range covers both ends.
        Latencies {
            time_to_first_token: Latency::new(0.005),
            inter_token: Latency::new(0.000_25),
            queue_wait: Latency::new(0.001),
            step: Latency::new(0.000_25),
        }
    }
}

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
    /// Speculative decoding: tokens drafted and verified, and how many of them were kept.
    pub drafted_tokens: Counter,
    pub accepted_tokens: Counter,
    pub steps: Counter,
    /// Seconds spent in batched forward steps.
    pub step_seconds: FloatCounter,
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
    pub latency: Latencies,
    /// `Executor::stats()` as of the last publication.
    pub executor: Mutex<Vec<(String, f64)>>,
    /// `Executor::cluster_view()` as of the last publication.
    pub cluster: Mutex<engine::ClusterView>,
    registry: Registry,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
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

impl Metrics {
    pub fn new() -> Metrics {
        let mut m = Metrics {
            requests: Counter::default(),
            requests_ok: Counter::default(),
            requests_failed: Counter::default(),
            requests_cancelled: Counter::default(),
            requests_rejected: Counter::default(),
            prompt_tokens: Counter::default(),
            prompt_tokens_cached: Counter::default(),
            prompt_tokens_evaluated: Counter::default(),
            generated_tokens: Counter::default(),
            drafted_tokens: Counter::default(),
            accepted_tokens: Counter::default(),
            steps: Counter::default(),
            step_seconds: FloatCounter::default(),
            disk_saves: Counter::default(),
            disk_restores: Counter::default(),
            disk_restored_tokens: Counter::default(),
            queued: AtomicU64::new(0),
            outstanding: AtomicU64::new(0),
            processing: Gauge::default(),
            slots: Gauge::default(),
            batch_size: Gauge::default(),
            batch_size_max: Gauge::default(),
            decode_tps: Gauge::default(),
            prompt_tps: Gauge::default(),
            kv_tokens: Gauge::default(),
            kv_capacity_tokens: Gauge::default(),
            disk_bytes: Gauge::default(),
            disk_entries: Gauge::default(),
            connections: AtomicU64::new(0),
            connections_refused: Counter::default(),
            latency: Latencies::default(),
            executor: Mutex::new(Vec::new()),
            cluster: Mutex::new(engine::ClusterView::default()),
            registry: Registry::with_prefix("moeshard"),
        };
        // Help texts without a final full stop: the encoder adds it.
        let counters = [
            ("requests", "Completion requests received", &m.requests),
            (
                "requests_succeeded",
                "Requests that finished normally",
                &m.requests_ok,
            ),
            (
                "requests_failed",
                "Requests that ended with an error",
                &m.requests_failed,
            ),
            (
                "requests_cancelled",
                "Requests cancelled by a client disconnect or shutdown",
                &m.requests_cancelled,
            ),
            (
                "requests_rejected",
                "Requests refused with 503 (queue full or shutting down)",
                &m.requests_rejected,
            ),
            (
                "prompt_tokens",
                "Prompt tokens of admitted requests",
                &m.prompt_tokens,
            ),
            (
                "prompt_tokens_cached",
                "Prompt tokens reused from the prefix or disk KV cache",
                &m.prompt_tokens_cached,
            ),
            (
                "prompt_tokens_evaluated",
                "Prompt tokens actually evaluated",
                &m.prompt_tokens_evaluated,
            ),
            ("generated_tokens", "Tokens sampled", &m.generated_tokens),
            (
                "speculative_drafted_tokens",
                "Tokens drafted by speculative decoding and verified",
                &m.drafted_tokens,
            ),
            (
                "speculative_accepted_tokens",
                "Drafted tokens the model kept",
                &m.accepted_tokens,
            ),
            ("steps", "Batched forward steps", &m.steps),
            (
                "disk_cache_saves",
                "Sessions written to the disk KV cache",
                &m.disk_saves,
            ),
            (
                "disk_cache_restores",
                "Sessions restored from the disk KV cache",
                &m.disk_restores,
            ),
            (
                "disk_cache_restored_tokens",
                "Positions restored from disk instead of evaluated",
                &m.disk_restored_tokens,
            ),
            (
                "http_connections_refused",
                "Connections refused with 503 at --max-connections",
                &m.connections_refused,
            ),
        ]
        .map(|(name, help, c)| (name, help, c.0.clone()));
        let gauges = [
            (
                "decode_tokens_per_second",
                "Aggregate decode speed over the last seconds",
                &m.decode_tps,
            ),
            (
                "prompt_tokens_per_second",
                "Prefill speed over the last seconds",
                &m.prompt_tps,
            ),
            (
                "requests_processing",
                "Requests in a slot (prefilling or decoding)",
                &m.processing,
            ),
            ("slots", "Session slots (--parallel)", &m.slots),
            (
                "batch_size",
                "Sessions in the last forward step",
                &m.batch_size,
            ),
            (
                "batch_size_max",
                "Most sessions in one forward step so far",
                &m.batch_size_max,
            ),
            (
                "kv_cache_tokens",
                "Positions held in the slots' KV caches",
                &m.kv_tokens,
            ),
            (
                "disk_cache_bytes",
                "Bytes in the disk KV cache",
                &m.disk_bytes,
            ),
            (
                "disk_cache_entries",
                "Sessions in the disk KV cache",
                &m.disk_entries,
            ),
        ]
        .map(|(name, help, g)| (name, help, g.0.clone()));
        let histograms = [
            (
                "time_to_first_token_seconds",
                "Seconds from a request's admission to its first sampled token",
                &m.latency.time_to_first_token,
            ),
            (
                "inter_token_latency_seconds",
                "Seconds between consecutive sampled tokens of a request",
                &m.latency.inter_token,
            ),
            (
                "queue_wait_seconds",
                "Seconds a request waited for a slot",
                &m.latency.queue_wait,
            ),
            (
                "step_duration_seconds",
                "Seconds per batched forward step",
                &m.latency.step,
            ),
        ]
        .map(|(name, help, h)| (name, help, h.histogram.clone()));
        let r = &mut m.registry;
        for (name, help, c) in counters {
            r.register(name, help, c);
        }
        for (name, help, g) in gauges {
            r.register(name, help, g);
        }
        r.register(
            "step_seconds",
            "Seconds spent in batched forward steps",
            m.step_seconds.0.clone(),
        );
        for (name, help, h) in histograms {
            r.register(name, help, h);
        }
        m
    }

    /// `GET /metrics`: the Prometheus text format.
    pub fn render(&self) -> String {
        let mut scrape = Registry::with_prefix("moeshard");
        let mut gauge = |name: &str, help: &str, v: f64| {
            scrape.register(name, help, ConstGauge::new(v));
        };
        gauge(
            "requests_queued",
            "Requests waiting for a slot",
            self.queued.load(Ordering::Relaxed) as f64,
        );
        gauge(
            "http_connections",
            "Open HTTP connections",
            self.connections.load(Ordering::Relaxed) as f64,
        );
        let cap = self.kv_capacity_tokens.get();
        gauge(
            "kv_cache_usage_ratio",
            "KV positions held / (slots x context)",
            if cap > 0.0 {
                self.kv_tokens.get() / cap
            } else {
                0.0
            },
        );
        let stats = self.executor.lock().map(|s| s.clone()).unwrap_or_default();
        for (name, value) in &stats {
            gauge(
                &format!("executor_{}", sanitize(name)),
                &format!("Executor statistic `{name}`"),
                *value,
            );
        }
        if let Some(rate) = hit_rate(&stats) {
            gauge(
                "expert_cache_hit_rate",
                "Expert-cache hits / (hits + misses) (SSD streaming)",
                rate,
            );
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_text::encode(&mut out, &self.registry);
        let _ = prometheus_text::encode(&mut out, &scrape);
        out
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
        m.step_seconds.add(0.5);
        m.latency.time_to_first_token.observe(0.012);
        m.latency.time_to_first_token.observe(100.0);
        let text = m.render();
        assert!(
            text.contains("# TYPE moeshard_requests_total counter\nmoeshard_requests_total 3\n"),
            "{text}"
        );
        assert!(text.contains("moeshard_step_seconds_total 0.5\n"), "{text}");
        assert!(
            text.contains("moeshard_kv_cache_usage_ratio 0.25\n"),
            "{text}"
        );
        assert!(
            text.contains("moeshard_executor_expert_cache_hits 3.0\n"),
            "{text}"
        );
        assert!(
            text.contains("moeshard_expert_cache_hit_rate 0.75\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE moeshard_time_to_first_token_seconds histogram\n"));
        // 0.012 s falls in the third bucket (0.005, 0.01, 0.02, …); 100 s only in +Inf.
        assert!(text.contains("moeshard_time_to_first_token_seconds_bucket{le=\"0.01\"} 0\n"));
        assert!(text.contains("moeshard_time_to_first_token_seconds_bucket{le=\"0.02\"} 1\n"));
        assert!(text.contains("moeshard_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(text.contains("moeshard_time_to_first_token_seconds_count 2\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let mut parts = line.split(' ');
            let series = parts.next().unwrap();
            let name = series.split('{').next().unwrap();
            assert!(
                name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{line}"
            );
            parts.next().unwrap().parse::<f64>().unwrap();
        }
    }
}
