//! `GET /v1/status`: one JSON document for the built-in page's cluster view (and anyone else
//! polling): the model, where it runs (nodes, their layers and addresses, the last step's time
//! per hop), the scheduler's gauges, latency summaries and the executor's own statistics
//! (expert-cache hit rate and bytes read when streaming). Everything comes from what the
//! scheduler last published (at most a second old); nothing is measured here.

use std::sync::atomic::Ordering;

use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::handlers::Shared;
use crate::metrics::{Latency, Metrics};

fn summary(l: &Latency) -> Value {
    json!({"count": l.count(), "mean_seconds": l.mean()})
}

/// The status document of `m` for a model `info` served as `model_id`.
pub fn document(m: &Metrics, model_id: &str, info: &engine::ModelInfo) -> Value {
    let cap = m.kv_capacity_tokens.get();
    let executor: Map<String, Value> = m
        .executor
        .lock()
        .map(|s| s.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, json!(v)))
        .collect();
    let cluster = m.cluster.lock().map(|c| c.clone()).unwrap_or_default();
    json!({
        "model": {
            "id": model_id,
            "name": info.name,
            "arch": info.arch,
            "n_layer": info.n_layer,
            "n_expert": info.n_expert,
            "n_expert_used": info.n_expert_used,
            "n_ctx": info.n_ctx,
            "weight_bytes": info.weight_bytes,
        },
        "cluster": cluster,
        "server": {
            "slots": m.slots.get(),
            "requests_processing": m.processing.get(),
            "requests_queued": m.queued.load(Ordering::Relaxed),
            "decode_tokens_per_second": m.decode_tps.get(),
            "prompt_tokens_per_second": m.prompt_tps.get(),
            "batch_size": m.batch_size.get(),
            "kv_cache_tokens": m.kv_tokens.get(),
            "kv_cache_usage_ratio": if cap > 0.0 { m.kv_tokens.get() / cap } else { 0.0 },
            "requests_total": m.requests.get(),
            "generated_tokens_total": m.generated_tokens.get(),
            "speculative_drafted_tokens_total": m.drafted_tokens.get(),
            "speculative_accepted_tokens_total": m.accepted_tokens.get(),
            "prompt_tokens_total": m.prompt_tokens.get(),
            "prompt_tokens_cached_total": m.prompt_tokens_cached.get(),
            "steps_total": m.steps.get(),
            "http_connections": m.connections.load(Ordering::Relaxed),
        },
        "latency": {
            "time_to_first_token": summary(&m.latency.time_to_first_token),
            "inter_token": summary(&m.latency.inter_token),
            "queue_wait": summary(&m.latency.queue_wait),
            "step": summary(&m.latency.step),
        },
        "executor": executor,
    })
}

pub async fn status(axum::extract::State(st): Shared) -> Response {
    axum::Json(document(&st.metrics, &st.requests.model_id, &st.model_info)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::cluster_view::{ClusterKind, HopTiming, NodeView};

    fn info() -> engine::ModelInfo {
        engine::ModelInfo {
            name: "demo".into(),
            arch: "qwen3moe".into(),
            n_vocab: 10,
            n_layer: 6,
            n_embd: 8,
            n_expert: 8,
            n_expert_used: 2,
            n_ctx: 64,
            fingerprint: "ab".into(),
            weight_bytes: 1000,
            kv_bytes_per_position: 4,
            kv_sliding_bytes_per_position: 0,
            kv_sliding_positions: 0,
        }
    }

    #[test]
    fn the_document_carries_what_the_scheduler_published() {
        let m = Metrics::default();
        m.slots.set(4.0);
        m.queued.store(3, Ordering::Relaxed);
        m.decode_tps.set(120.5);
        m.kv_tokens.set(32.0);
        m.kv_capacity_tokens.set(256.0);
        m.latency.time_to_first_token.observe(0.25);
        m.drafted_tokens.add(10);
        m.accepted_tokens.add(7);
        m.latency.time_to_first_token.observe(0.75);
        *m.executor.lock().unwrap() = vec![("expert_hit_rate".into(), 0.5)];
        *m.cluster.lock().unwrap() = engine::ClusterView {
            kind: ClusterKind::Pipeline,
            complete: true,
            nodes: vec![NodeView {
                role: "stage".into(),
                layers: "3:output".into(),
                rank: None,
                address: Some("10.0.0.2:7001".into()),
            }],
            hops: vec![HopTiming {
                stage: "3:output".into(),
                compute_us: 250,
                ..Default::default()
            }],
            round_trip_us: Some(900),
            tp_step: None,
        };
        let d = document(&m, "shakespeare-moe", &info());
        assert_eq!(d["model"]["id"], "shakespeare-moe");
        assert_eq!(d["model"]["n_layer"], 6);
        assert_eq!(d["server"]["requests_queued"], 3);
        assert_eq!(d["server"]["decode_tokens_per_second"], 120.5);
        assert_eq!(d["server"]["kv_cache_usage_ratio"], 0.125);
        assert_eq!(d["server"]["speculative_drafted_tokens_total"], 10);
        assert_eq!(d["server"]["speculative_accepted_tokens_total"], 7);
        assert_eq!(d["latency"]["time_to_first_token"]["count"], 2);
        assert_eq!(d["latency"]["time_to_first_token"]["mean_seconds"], 0.5);
        assert_eq!(d["latency"]["step"]["mean_seconds"], 0.0);
        assert_eq!(d["executor"]["expert_hit_rate"], 0.5);
        assert_eq!(d["cluster"]["kind"], "pipeline");
        assert_eq!(d["cluster"]["nodes"][0]["address"], "10.0.0.2:7001");
        assert_eq!(d["cluster"]["hops"][0]["compute_us"], 250);
        assert_eq!(d["cluster"]["round_trip_us"], 900);
    }
}
