//! The coordinator's executor: runs the first stage itself, drives the route, keeps every
//! session's token transcript, and replays it onto a rebuilt route after a failure so that a
//! request in progress finishes with the same tokens.

use std::collections::VecDeque;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use engine::executor::{EvalRequest, EvalResult, Executor, ModelInfo, SessionId};
use engine::snapshot::Snapshot;
use engine::{EngineError, Result};
use model::{StageInput, StageOutput};

use super::protocol::*;
use super::registry::{Expect, Registry, Worker, wait_reply};
use crate::activation::ActFormat;
use crate::stage::{StageError, StageRuntime};
use crate::transcripts::{Transcripts, WorkItem};
use crate::wire::messages::build_id;
use crate::wire::{self, AuthMode, Connection, Frame, Hello, Kind, Role};

#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// Where workers register (`host:port`).
    pub listen: String,
    pub auth: AuthMode,
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

struct Route {
    workers: Vec<Arc<Worker>>,
    data: Connection,
    results: Receiver<Frame>,
    broken: Arc<AtomicBool>,
    generation: u64,
}

/// Why an evaluation attempt failed.
enum Attempt {
    /// The route broke: rebuild, replay, retry.
    RouteLost(String),
    /// A stage's history of a session differs: replay it, retry.
    Desync(u64),
    Fatal(EngineError),
}

impl From<EngineError> for Attempt {
    fn from(e: EngineError) -> Self {
        Attempt::Fatal(e)
    }
}

pub struct PipelineExecutor {
    local: StageRuntime,
    registry: Arc<Registry>,
    route: Option<Route>,
    cfg: PipelineConfig,
    info: ModelInfo,
    sessions: Transcripts,
    next_request: u64,
    bound: std::net::SocketAddr,
}

fn exec_err(msg: impl Into<String>) -> EngineError {
    EngineError::Executor(msg.into())
}

impl PipelineExecutor {
    /// Starts listening for workers. `local` runs layers `0..=k` with the embeddings.
    pub fn new(local: StageRuntime, cfg: PipelineConfig) -> Result<PipelineExecutor> {
        let model = Arc::clone(local.model());
        let n_ctx = local.n_ctx();
        let info = engine::local::model_info_kv(&model, n_ctx, local.kv_type());
        let expect = Expect {
            fingerprint: info.fingerprint.clone(),
            n_layer: model.n_layer(),
            local_last: *local.layers.end(),
            n_ctx,
        };
        let registry = Registry::new(expect);
        let listener = TcpListener::bind(&cfg.listen)
            .map_err(|e| exec_err(format!("binding --listen {}: {e}", cfg.listen)))?;
        let bound = listener.local_addr().map_err(|e| exec_err(e.to_string()))?;
        {
            let (reg, auth) = (Arc::clone(&registry), cfg.auth.clone());
            std::thread::Builder::new()
                .name("coord-listen".into())
                .spawn(move || reg.serve(listener, auth))
                .map_err(|e| exec_err(e.to_string()))?;
        }
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
            sessions: Transcripts::default(),
            next_request: 1,
            bound,
        })
    }

    /// The address workers should dial.
    pub fn listen_addr(&self) -> std::net::SocketAddr {
        self.bound
    }

    fn all_local(&self) -> bool {
        self.local.head
    }

    fn route_ok(&self) -> bool {
        self.route.as_ref().is_some_and(|r| {
            !r.broken.load(Ordering::Acquire) && r.generation == self.registry.generation()
        })
    }

    fn drop_route(&mut self, why: &str) {
        if let Some(r) = self.route.take() {
            tracing::warn!("dropping the route ({why})");
            r.data.shutdown();
        }
        self.sessions.mark_all_stale();
    }

    /// Waits (up to `route_wait`) for workers forming a complete chain, and wires them up.
    fn ensure_route(&mut self) -> Result<()> {
        if self.all_local() || self.route_ok() {
            return Ok(());
        }
        if self.route.is_some() {
            self.drop_route("a stage joined or left");
        }
        let deadline = Instant::now() + self.cfg.route_wait;
        loop {
            let generation = self.registry.generation();
            match self.registry.chain() {
                Ok(chain) => match self.wire_route(chain, generation) {
                    Ok(route) => {
                        tracing::info!(
                            "route: {} → {}",
                            self.local.label(),
                            route
                                .workers
                                .iter()
                                .map(|w| format!("{} ({})", w.label(), w.listen))
                                .collect::<Vec<_>>()
                                .join(" → ")
                        );
                        self.route = Some(route);
                        self.sessions.mark_all_stale();
                        return Ok(());
                    }
                    Err(e) => {
                        tracing::warn!("could not wire the route: {e}");
                        if Instant::now() >= deadline {
                            return Err(exec_err(format!(
                                "no working route within {:?}: {e}",
                                self.cfg.route_wait
                            )));
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                },
                Err(missing) => {
                    if Instant::now() >= deadline {
                        return Err(exec_err(format!(
                            "no complete route after {:?}: no stage serves layer {missing}{}",
                            self.cfg.route_wait,
                            if missing >= self.info.n_layer {
                                " (the output head)".to_string()
                            } else {
                                String::new()
                            }
                        )));
                    }
                    self.registry.wait_change(
                        generation,
                        deadline.min(Instant::now() + Duration::from_millis(500)),
                    );
                }
            }
        }
    }

    fn wire_route(
        &mut self,
        chain: Vec<Arc<Worker>>,
        generation: u64,
    ) -> std::result::Result<Route, String> {
        let epoch = self.next_request;
        self.next_request += 1;
        // Back to front, so each stage's next hop is listening when it connects.
        for (i, w) in chain.iter().enumerate().rev() {
            let next = chain.get(i + 1).map(|n| n.listen.clone());
            let msg = Control::Route {
                epoch,
                next,
                act: self.cfg.act,
            };
            w.control
                .send_msg(Kind::Route, epoch, &msg)
                .map_err(|e| format!("stage {}: {e}", w.label()))?;
            let _ = w.control.send_msg(Kind::Route, 0, &Control::ResetSessions);
            match wait_reply(w, epoch, Duration::from_secs(15))? {
                ControlReply::RouteReady { .. } => {}
                ControlReply::RouteFailed { detail, .. } => {
                    return Err(format!("stage {}: {detail}", w.label()));
                }
            }
        }
        let first = &chain[0];
        let stream = wire::dial(&first.listen).map_err(|e| e.to_string())?;
        let hello = Hello {
            protocol: wire::PROTOCOL_VERSION,
            build: build_id(),
            role: Role::Hop,
            fingerprint: self.info.fingerprint.clone(),
            n_ctx: self.info.n_ctx as u32,
            listen: None,
            nonce: [0; 32],
            keyless: false,
        };
        let (data, mut reader, _) = wire::connect(stream, &self.cfg.auth, hello)
            .map_err(|e| format!("data link to {}: {e}", first.listen))?;
        let broken = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let b2 = Arc::clone(&broken);
        std::thread::Builder::new()
            .name("coord-results".into())
            .spawn(move || {
                loop {
                    match reader.recv() {
                        Ok(f) => {
                            if tx.send(f).is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            tracing::warn!("data link to the first stage: {e}");
                            b2.store(true, Ordering::Release);
                            let fail = StageFailure::LinkLost {
                                stage: "coordinator".into(),
                                detail: e.to_string(),
                            };
                            let mut f = pack(Kind::WorkResult, 0, &fail, &[]);
                            f.flags = FLAG_FAILURE;
                            let _ = tx.send(f);
                            return;
                        }
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        Ok(Route {
            workers: chain,
            data,
            results: rx,
            broken,
            generation,
        })
    }

    fn request_id(&mut self) -> u64 {
        self.next_request += 1;
        self.next_request
    }

    /// Waits for the result of `rid`; stage failures and a lost link become `Attempt`s.
    fn wait_result(&self, rid: u64) -> std::result::Result<(ResultHeader, Vec<u8>), Attempt> {
        let route = self
            .route
            .as_ref()
            .ok_or_else(|| Attempt::RouteLost("no route".into()))?;
        loop {
            let f = match route.results.recv_timeout(Duration::from_millis(250)) {
                Ok(f) => f,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if route.generation != self.registry.generation()
                        && self.registry.chain().is_err()
                    {
                        return Err(Attempt::RouteLost("a stage left".into()));
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Attempt::RouteLost("data link closed".into()));
                }
            };
            if f.kind == Kind::WorkResult && f.flags & FLAG_FAILURE != 0 {
                let fail: StageFailure = unpack("stage failure", &f.payload)
                    .map(|(x, _)| x)
                    .map_err(|e| Attempt::RouteLost(e.to_string()))?;
                return Err(match fail {
                    StageFailure::Desync { session, stage } => {
                        tracing::warn!(
                            "stage {stage} lost track of session {session}; replaying it"
                        );
                        Attempt::Desync(session)
                    }
                    StageFailure::LinkLost { stage, detail } => {
                        Attempt::RouteLost(format!("{stage}: {detail}"))
                    }
                    StageFailure::Failed { stage, detail } => {
                        Attempt::Fatal(exec_err(format!("stage {stage}: {detail}")))
                    }
                });
            }
            if f.request_id != rid || f.kind != Kind::WorkResult {
                continue;
            }
            let (h, raw): (ResultHeader, &[u8]) = unpack("result", &f.payload)
                .map_err(|e| Attempt::Fatal(exec_err(e.to_string())))?;
            return Ok((h, raw.to_vec()));
        }
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
                    StageError::HashMismatch { session, .. } => Attempt::Desync(session),
                    StageError::Model { .. } => Attempt::Fatal(exec_err(e.to_string())),
                })?;
            let local_us = t0.elapsed().as_micros() as u64;
            match produced {
                StageOutput::Logits(l) => {
                    let raw: Vec<u8> = l.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                    let h = ResultHeader {
                        n_rows: l.rows.len() as u32,
                        n_vocab: l.n_vocab as u32,
                        rows: l.rows.iter().map(|&r| r as u32).collect(),
                        timings: Vec::new(),
                    };
                    out[i] = Some((h, raw));
                }
                StageOutput::Hidden(h) => {
                    let mut enc =
                        Vec::with_capacity(self.cfg.act.encoded_len(tokens.len(), n_embd));
                    self.cfg.act.encode(&h, n_embd, &mut enc);
                    let header = WorkHeader {
                        seqs,
                        tokens,
                        act: self.cfg.act,
                        n_embd: n_embd as u32,
                    };
                    let rid = self.request_id();
                    let frame = pack(Kind::Work, rid, &header, &enc);
                    let route = self
                        .route
                        .as_ref()
                        .ok_or_else(|| Attempt::RouteLost("no route".into()))?;
                    route.data.send(&frame).map_err(|e| {
                        Attempt::RouteLost(format!("sending to the first stage: {e}"))
                    })?;
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

    fn report(&self, item: usize, local_us: u64, sent: Instant, h: &ResultHeader) {
        if !self.cfg.debug {
            return;
        }
        let round = sent.elapsed().as_micros() as u64;
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
    fn replay(&mut self, session: SessionId) -> std::result::Result<Vec<u8>, Attempt> {
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
        let chunked = batch.len() == 1;
        let outs = self.run_items(items)?;
        // Map logits rows back to requests.
        let mut results: Vec<EvalResult> = batch.iter().map(|_| EvalResult::default()).collect();
        let n_vocab = self.info.n_vocab;
        for out in outs.into_iter().flatten() {
            let (h, raw) = out;
            let rows: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if chunked {
                let r = &mut results[0];
                r.n_vocab = n_vocab;
                r.n_rows += h.n_rows as usize;
                r.logits.extend_from_slice(&rows);
            } else {
                let mut starts = Vec::with_capacity(batch.len());
                let mut acc = 0;
                for r in batch {
                    starts.push(acc);
                    acc += r.tokens.len();
                }
                for (i, &row) in h.rows.iter().enumerate() {
                    let q = starts.partition_point(|&s| s <= row as usize) - 1;
                    let res = &mut results[q];
                    res.n_vocab = n_vocab;
                    res.n_rows += 1;
                    res.logits
                        .extend_from_slice(&rows[i * n_vocab..(i + 1) * n_vocab]);
                }
            }
        }
        Ok(results)
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
        self.sessions.truncate(session, n);
        // Stages rewind when the next work item names an earlier position.
        Ok(())
    }

    fn session_len(&self, session: SessionId) -> usize {
        self.sessions.len(session)
    }

    fn destroy(&mut self, session: SessionId) {
        self.sessions.remove(session);
        self.local.destroy(session);
        if let Some(route) = &self.route {
            let rid = self.next_request + 1;
            self.next_request += 1;
            let _ = route.data.send(&pack(
                Kind::SessionOp,
                rid,
                &SessionOp::Destroy { session },
                &[],
            ));
        }
    }

    fn snapshot(&mut self, session: SessionId) -> Result<Snapshot> {
        if !self.sessions.contains(session) {
            return Err(exec_err(format!("session {session} does not exist")));
        }
        let tokens = self.sessions.get(session).to_vec();
        let n = tokens.len();
        // Make sure every stage holds the session (after a failure it may need a replay).
        if !self.all_local() && !self.sessions.is_synced(session) {
            self.ensure_route()?;
            self.replay(session)
                .map_err(|_| exec_err("replay before snapshot failed"))?;
        }
        let n_layer = self.info.n_layer;
        let mut layers: Vec<Option<(Vec<u8>, Vec<u8>)>> = vec![None; n_layer];
        for l in self.local.layers.clone() {
            layers[l] = self.local.export_layer(session, l, n);
        }
        if !self.all_local() {
            let rid = self.request_id();
            let route = self.route.as_ref().ok_or_else(|| exec_err("no route"))?;
            route
                .data
                .send(&pack(
                    Kind::SessionOp,
                    rid,
                    &SessionOp::Snapshot {
                        session,
                        n: n as u32,
                    },
                    &[],
                ))
                .map_err(|e| exec_err(e.to_string()))?;
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let f = route
                    .results
                    .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    .map_err(|_| exec_err("snapshot: no answer from the stages"))?;
                if f.request_id != rid {
                    continue;
                }
                match f.kind {
                    Kind::SnapshotPart => {
                        let (p, _): (SnapshotPart, _) = unpack("snapshot part", &f.payload)
                            .map_err(|e| exec_err(e.to_string()))?;
                        if (p.layer as usize) < n_layer {
                            layers[p.layer as usize] = Some((p.k, p.v));
                        }
                    }
                    Kind::SessionOpDone => break,
                    Kind::WorkResult => return Err(exec_err("snapshot: a stage failed")),
                    _ => {}
                }
            }
        }
        let model = self.local.model();
        let layers = layers
            .into_iter()
            .enumerate()
            .map(|(i, l)| l.ok_or_else(|| exec_err(format!("snapshot: no stage sent layer {i}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Snapshot {
            fingerprint: self.info.fingerprint.clone(),
            tokens,
            kv_type: self.local.kv_type(),
            n_kv_head: model.hp.n_head_kv,
            head_dim_k: model.hp.head_dim_k,
            head_dim_v: model.hp.head_dim_v,
            layers,
            last_logits: Vec::new(),
        })
    }

    fn restore(&mut self, session: SessionId, s: &Snapshot) -> Result<()> {
        s.check_model(&self.info.fingerprint)?;
        if s.layers.len() != self.info.n_layer || s.kv_type != self.local.kv_type() {
            return Err(EngineError::Snapshot(
                "snapshot KV layout (layers or KV type) differs from this cluster's".into(),
            ));
        }
        self.ensure_route()?;
        self.local
            .begin_restore(session, &s.tokens)
            .map_err(|e| exec_err(e.to_string()))?;
        for l in self.local.layers.clone() {
            let (k, v) = &s.layers[l];
            self.local
                .import_layer(session, l, k, v)
                .map_err(|e| EngineError::Snapshot(e.to_string()))?;
        }
        if !self.all_local() {
            let rid = self.request_id();
            let route = self.route.as_ref().ok_or_else(|| exec_err("no route"))?;
            let send = |op: &SessionOp| {
                route
                    .data
                    .send(&pack(Kind::SessionOp, rid, op, &[]))
                    .map_err(|e| exec_err(e.to_string()))
            };
            send(&SessionOp::Restore {
                session,
                tokens: s.tokens.clone(),
            })?;
            for l in (*self.local.layers.end() + 1)..self.info.n_layer {
                let (k, v) = &s.layers[l];
                send(&SessionOp::RestoreLayer {
                    session,
                    layer: l as u32,
                    k: k.clone(),
                    v: v.clone(),
                })?;
            }
            send(&SessionOp::Barrier)?;
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let f = route
                    .results
                    .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    .map_err(|_| exec_err("restore: no answer from the stages"))?;
                if f.kind == Kind::WorkResult && f.flags & FLAG_FAILURE != 0 {
                    let (fail, _): (StageFailure, _) =
                        unpack("failure", &f.payload).map_err(|e| exec_err(e.to_string()))?;
                    return Err(EngineError::Snapshot(format!("{fail:?}")));
                }
                if f.request_id == rid && f.kind == Kind::SessionOpDone {
                    break;
                }
            }
        }
        self.sessions.set(session, s.tokens.clone());
        Ok(())
    }

    fn stats(&self) -> Vec<(String, f64)> {
        self.local.stats()
    }

    fn chunks_long_evals(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        let mut s = format!("pipeline: {} (coordinator)", self.local.label());
        if let Some(r) = &self.route {
            for w in &r.workers {
                s.push_str(&format!(" → {} at {}", w.label(), w.listen));
            }
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
        let replayed: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
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
