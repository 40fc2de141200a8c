//! The coordinator's executor: runs the first stage itself, drives the route, keeps every
//! session's token transcript, and replays it onto a rebuilt route after a failure so that a
//! request in progress finishes with the same tokens.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::executor::{EvalRequest, EvalResult, Executor, ModelInfo, SessionId};
use engine::snapshot::{Snapshot, SnapshotLayout};
use engine::{EngineError, Result, RunError, Runner};
use model::{StageInput, StageOutput};

use super::protocol::*;
use super::registry::{StageAdmission, chain};
use super::route::{Attempt, Route, RouteParams};
use crate::activation::ActFormat;
use crate::error::{ClusterError, bind};
use crate::registry::Registry;
use crate::transcripts::{Transcripts, WorkItem};
use crate::wire::{Kind, LinkConfig, f32_values, pack};

#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// Where workers register (`host:port`).
    pub listen: String,
    pub link: LinkConfig,
    /// How long to wait for a complete route before failing a request.
    pub route_wait: Duration,
    /// Prompt tokens per pipelined chunk.
    pub chunk: usize,
    /// Chunks in flight at once (1: no overlap).
    pub window: usize,
    pub act: ActFormat,
    /// After each prefill, replay the session and require bit-identical logits.
    pub replay_check: bool,
    /// Print per-hop timing of every chunk and token.
    pub debug: bool,
}

/// What comes back for an item that asked for logits: the header and the raw f32 rows.
type ItemResult = (ResultHeader, Vec<u8>);

pub struct PipelineExecutor {
    pub(super) local: Runner,
    pub(super) registry: Arc<Registry<StageAdmission>>,
    pub(super) route: Option<Route>,
    pub(super) cfg: PipelineConfig,
    pub(super) info: ModelInfo,
    pub(super) layout: SnapshotLayout,
    pub(super) sessions: Transcripts,
    next_request: u64,
    bound: std::net::SocketAddr,
    /// The last work item's timing per stage (this one first) and its round trip, for
    /// `cluster_view`.
    last_item: Option<(Vec<engine::cluster_view::HopTiming>, u64)>,
}

pub(super) fn exec_err(msg: impl Into<String>) -> EngineError {
    EngineError::Executor(msg.into())
}

impl PipelineExecutor {
    /// Starts listening for workers. `local` runs layers `0..=k` with the embeddings.
    pub fn new(local: Runner, cfg: PipelineConfig) -> Result<PipelineExecutor> {
        let model = Arc::clone(local.model());
        let n_ctx = local.n_ctx();
        let info = engine::local::model_info_kv(&model, n_ctx, local.kv_type());
        let layout = SnapshotLayout::of(&model, local.kv_type(), n_ctx);
        let admission = StageAdmission {
            fingerprint: info.fingerprint.clone(),
            n_layer: model.n_layer(),
            local_last: local.range().last,
            n_ctx,
        };
        let (listener, bound) = bind("--listen", &cfg.listen)?;
        let registry = Registry::start(admission, listener, cfg.link.clone())?;
        tracing::info!(
            "pipeline coordinator: layers {} here, workers register at {bound}",
            local.label()
        );
        Ok(PipelineExecutor {
            local,
            registry,
            route: None,
            cfg,
            info,
            layout,
            sessions: Transcripts::default(),
            next_request: 1,
            bound,
            last_item: None,
        })
    }

    /// The address workers should dial.
    pub fn listen_addr(&self) -> std::net::SocketAddr {
        self.bound
    }

    pub(super) fn all_local(&self) -> bool {
        self.local.range().head
    }

    fn route_ok(&self) -> bool {
        self.route.as_ref().is_some_and(|r| r.is_ok(&self.registry))
    }

    fn drop_route(&mut self, why: &str) {
        if let Some(r) = self.route.take() {
            tracing::warn!("dropping the route ({why})");
            r.data.shutdown();
        }
        self.sessions.mark_all_stale();
    }

    /// Waits (up to `route_wait`) for workers forming a complete chain, and wires them up.
    pub(super) fn ensure_route(&mut self) -> Result<()> {
        if self.all_local() || self.route_ok() {
            return Ok(());
        }
        if self.route.is_some() {
            self.drop_route("a stage joined or left");
        }
        let deadline = Instant::now() + self.cfg.route_wait;
        loop {
            let generation = self.registry.generation();
            let missing = match chain(&self.registry) {
                Ok((workers, generation)) => {
                    let epoch = self.request_id();
                    let params = RouteParams {
                        epoch,
                        act: self.cfg.act,
                        link: &self.cfg.link,
                        fingerprint: &self.info.fingerprint,
                        n_ctx: self.info.n_ctx,
                    };
                    match Route::wire(workers, generation, params) {
                        Ok(route) => {
                            tracing::info!("route: {}{}", self.local.label(), route.describe());
                            self.route = Some(route);
                            self.sessions.mark_all_stale();
                            return Ok(());
                        }
                        Err(e) => {
                            tracing::warn!("could not wire the route: {e}");
                            if Instant::now() >= deadline {
                                return Err(ClusterError::Formation(format!(
                                    "no working route within {:?}: {e}",
                                    self.cfg.route_wait
                                ))
                                .into());
                            }
                            std::thread::sleep(Duration::from_millis(200));
                            continue;
                        }
                    }
                }
                Err(missing) => missing,
            };
            if Instant::now() >= deadline {
                return Err(ClusterError::Formation(format!(
                    "no complete route after {:?}: no stage serves layer {missing}{}",
                    self.cfg.route_wait,
                    if missing >= self.info.n_layer {
                        " (the output head)"
                    } else {
                        ""
                    }
                ))
                .into());
            }
            self.registry.wait_change(
                generation,
                deadline.min(Instant::now() + Duration::from_millis(500)),
            );
        }
    }

    pub(super) fn request_id(&mut self) -> u64 {
        self.next_request += 1;
        self.next_request
    }

    fn route(&self) -> std::result::Result<&Route, Attempt> {
        self.route
            .as_ref()
            .ok_or_else(|| Attempt::RouteLost("no route".into()))
    }

    fn wait_result(&self, rid: u64) -> std::result::Result<ItemResult, Attempt> {
        self.route()?
            .wait_result(rid, &self.registry, self.info.n_vocab)
    }

    /// Runs work items through the local stage and the route, `window` in flight; returns the
    /// logits of the items that asked for them, in order.
    fn run_items(
        &mut self,
        items: Vec<WorkItem>,
    ) -> std::result::Result<Vec<Option<ItemResult>>, Attempt> {
        let n_embd = self.info.n_embd;
        let mut out = Vec::with_capacity(items.len());
        let mut in_flight: VecDeque<(usize, u64, Instant, u64)> = VecDeque::new();
        for (i, (seqs, tokens)) in items.into_iter().enumerate() {
            out.push(None);
            let t0 = Instant::now();
            let produced = self
                .local
                .run(&seqs, &tokens, StageInput::Tokens(&tokens))
                .map_err(|e| match e {
                    RunError::HashMismatch { session, .. } => Attempt::Desync(session),
                    e @ RunError::Model { .. } => Attempt::Fatal(e.into()),
                })?;
            let local_us = t0.elapsed().as_micros() as u64;
            match produced {
                StageOutput::Logits(l) => out[i] = Some(ResultHeader::of(&l)),
                StageOutput::Hidden(h) => {
                    let exact = self.local.model().hp.carried_width();
                    let act = self.cfg.act;
                    let mut enc =
                        Vec::with_capacity(act.encoded_len_exact_tail(tokens.len(), n_embd, exact));
                    act.encode_exact_tail(&h, n_embd, exact, &mut enc);
                    let header = WorkHeader {
                        seqs,
                        tokens,
                        act: self.cfg.act,
                        n_embd: n_embd as u32,
                    };
                    let rid = self.request_id();
                    self.route()?.send(&pack(Kind::Work, rid, &header, &enc))?;
                    in_flight.push_back((i, rid, Instant::now(), local_us));
                    while in_flight.len() >= self.cfg.window.max(1) {
                        let (j, rid, sent, lus) = in_flight.pop_front().expect("non-empty");
                        let r = self.wait_result(rid)?;
                        self.report(j, lus, sent, &r.0);
                        out[j] = Some(r);
                    }
                }
            }
        }
        while let Some((j, rid, sent, lus)) = in_flight.pop_front() {
            let r = self.wait_result(rid)?;
            self.report(j, lus, sent, &r.0);
            out[j] = Some(r);
        }
        Ok(out)
    }

    fn report(&mut self, item: usize, local_us: u64, sent: Instant, h: &ResultHeader) {
        let round = sent.elapsed().as_micros() as u64;
        let here = engine::cluster_view::HopTiming {
            stage: self.local.label(),
            compute_us: local_us,
            ..Default::default()
        };
        let hops = std::iter::once(here)
            .chain(h.timings.iter().map(|t| engine::cluster_view::HopTiming {
                stage: t.stage.clone(),
                wait_us: t.wait_us,
                compute_us: t.compute_us,
                send_us: t.send_us,
                bytes_in: t.bytes_in,
                bytes_out: t.bytes_out,
            }))
            .collect();
        self.last_item = Some((hops, round));
        if !self.cfg.debug {
            return;
        }
        let mut line = format!("item {item}: {} compute {local_us} µs", self.local.label());
        let mut accounted = 0;
        for t in &h.timings {
            line.push_str(&format!(
                " | {} wait {} compute {} send {} µs, in {} B out {} B",
                t.stage, t.wait_us, t.compute_us, t.send_us, t.bytes_in, t.bytes_out
            ));
            accounted += t.wait_us + t.compute_us + t.send_us;
        }
        line.push_str(&format!(
            " | network+queue {} µs",
            round.saturating_sub(accounted)
        ));
        eprintln!("[pipeline] {line}");
    }

    /// Replays a session's transcript onto a fresh state in every stage (local included).
    pub(super) fn replay(&mut self, session: SessionId) -> std::result::Result<Vec<u8>, Attempt> {
        if self.sessions.len(session) == 0 {
            self.local.destroy(session);
            self.sessions.mark_synced(session);
            return Ok(Vec::new());
        }
        tracing::info!(
            "replaying session {session} ({} tokens)",
            self.sessions.len(session)
        );
        let out = self.run_items(self.sessions.replay_items(session, self.cfg.chunk))?;
        self.sessions.mark_synced(session);
        Ok(out
            .into_iter()
            .last()
            .flatten()
            .map(|(_, raw)| raw)
            .unwrap_or_default())
    }

    fn attempt(&mut self, batch: &[EvalRequest]) -> std::result::Result<Vec<EvalResult>, Attempt> {
        self.ensure_route().map_err(Attempt::Fatal)?;
        for r in batch {
            if !self.all_local() && !self.sessions.is_synced(r.session) {
                self.replay(r.session)?;
            }
        }
        let items = self.sessions.eval_items(batch, self.cfg.chunk);
        let outs = self.run_items(items)?;
        // A single request may come in several chunks, a batch as one item: either way the
        // rows arrive in request order.
        let rows: Vec<f32> = outs
            .into_iter()
            .flatten()
            .flat_map(|(_, raw)| f32_values(&raw))
            .collect();
        Ok(EvalResult::split(batch, &rows, self.info.n_vocab))
    }
}

impl Executor for PipelineExecutor {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn eval(&mut self, batch: &[EvalRequest]) -> Result<Vec<EvalResult>> {
        self.sessions.check_fits(batch, self.info.n_ctx)?;
        let deadline = Instant::now() + self.cfg.route_wait;
        let mut desyncs = 0;
        loop {
            match self.attempt(batch) {
                Ok(results) => {
                    self.sessions.commit(batch);
                    if self.cfg.replay_check && batch.len() == 1 && batch[0].tokens.len() > 1 {
                        self.check_replay(batch[0].session, &results[0])?;
                    }
                    return Ok(results);
                }
                Err(Attempt::Fatal(e)) => {
                    self.rollback(batch);
                    return Err(e);
                }
                Err(Attempt::Desync(session)) => {
                    self.rollback(batch);
                    self.sessions.mark_stale(session);
                    desyncs += 1;
                    if desyncs > 3 {
                        return Err(exec_err(format!(
                            "session {session} keeps diverging between stages"
                        )));
                    }
                }
                Err(Attempt::RouteLost(why)) => {
                    self.rollback(batch);
                    self.drop_route(&why);
                    if Instant::now() >= deadline {
                        return Err(exec_err(format!(
                            "route lost ({why}) and not restored within {:?}",
                            self.cfg.route_wait
                        )));
                    }
                    tracing::warn!(
                        "route lost ({why}); waiting for a complete route, then replaying"
                    );
                }
            }
        }
    }

    fn truncate(&mut self, session: SessionId, n: usize) -> Result<()> {
        // Every stage drops the same sliding-window positions (they see the same work), so
        // this stage's cache answers for all. A session to be replayed keeps nothing anyway.
        if self.sessions.is_synced(session) && !self.local.can_rewind(session, n) {
            return Err(EngineError::CannotRewind {
                session,
                n,
                why: "the sliding-window or recurrent layers no longer reach that position".into(),
            });
        }
        self.sessions.truncate(session, n);
        // Stages rewind when the next work item names an earlier position.
        Ok(())
    }

    fn rewind_point(&self, session: SessionId, n: usize) -> usize {
        if self.sessions.is_synced(session) {
            self.local.rewind_point(session, n)
        } else {
            n
        }
    }

    fn session_len(&self, session: SessionId) -> usize {
        self.sessions.len(session)
    }

    fn destroy(&mut self, session: SessionId) {
        self.sessions.remove(session);
        self.local.destroy(session);
        let rid = self.request_id();
        if let Some(route) = &self.route {
            let _ = route.data.send(&pack(
                Kind::SessionOp,
                rid,
                &SessionOp::Destroy { session },
                &[],
            ));
        }
    }

    fn snapshot(&mut self, session: SessionId) -> Result<Snapshot> {
        self.snapshot_session(session)
    }

    fn restore(&mut self, session: SessionId, s: &Snapshot) -> Result<()> {
        self.restore_session(session, s)
    }

    fn stats(&self) -> Vec<(String, f64)> {
        self.local.stats()
    }

    fn cluster_view(&self) -> engine::ClusterView {
        use engine::cluster_view::{ClusterKind, NodeView};
        let (mut members, _) = self.registry.members();
        members.sort_by_key(|m| m.claim.first);
        let here = NodeView {
            role: "coordinator".into(),
            layers: self.local.label(),
            rank: None,
            address: Some(self.bound.to_string()),
        };
        let stages = members.iter().map(|m| NodeView {
            role: "stage".into(),
            layers: m.claim.to_string(),
            rank: None,
            address: Some(m.listen.clone()),
        });
        let (hops, round_trip_us) = match &self.last_item {
            Some((hops, round)) => (hops.clone(), Some(*round)),
            None => (Vec::new(), None),
        };
        engine::ClusterView {
            kind: ClusterKind::Pipeline,
            complete: self.all_local() || self.route_ok(),
            nodes: std::iter::once(here).chain(stages).collect(),
            hops,
            round_trip_us,
            tp_step: None,
        }
    }

    fn chunks_long_evals(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        let mut s = format!("pipeline: {} (coordinator)", self.local.label());
        if let Some(r) = &self.route {
            s.push_str(&r.describe());
        }
        s.push_str(&format!(
            "; chunk {} window {} activations {}-bit",
            self.cfg.chunk,
            self.cfg.window,
            self.cfg.act.bits()
        ));
        s
    }
}

impl PipelineExecutor {
    /// Puts the local stage back to the transcripts after a failed attempt.
    fn rollback(&mut self, batch: &[EvalRequest]) {
        for r in batch {
            let n = self.sessions.len(r.session);
            if self.local.session_len(r.session) != n {
                // The local stage rewinds on the next work item (pos0 = n); mark remote state stale.
                self.sessions.mark_stale(r.session);
            }
        }
    }

    fn check_replay(&mut self, session: SessionId, got: &EvalResult) -> Result<()> {
        let want = got.last().map(|l| l.to_vec()).unwrap_or_default();
        let raw = self
            .replay(session)
            .map_err(|_| exec_err("--dist-replay-check: the replay failed"))?;
        let replayed = f32_values(&raw);
        let same = replayed.len() == want.len()
            && replayed
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        if !same {
            return Err(exec_err(format!(
                "--dist-replay-check: session {session} replayed to different logits"
            )));
        }
        tracing::info!("replay check: session {session} replayed bit-identically");
        Ok(())
    }
}
