//! The tensor-parallel coordinator: rank 0 of the group. It owns tokenizer, sampling and
//! sessions (through the engine), mirrors every session operation to the ranks over their
//! control links, computes its own share, and gathers the vocabulary slices of the logits. A
//! rank that dies or stalls fails the step within `--tp-timeout`; when it comes back (within
//! `--route-wait`) the group is re-formed and every session replayed.

use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use engine::executor::{EvalRequest, EvalResult, Executor, ModelInfo, SessionId};
use engine::snapshot::Snapshot;
use engine::{EngineError, Result};
use model::{
    BalancedResidentExperts, Compute, KvType, Model, OwnedResidentExperts, Shard, StageInput,
    StageOutput,
};

use super::mesh::{Mesh, MeshHooks};
use super::protocol::{TpCommand, TpReply};
use crate::pipeline::protocol::pack;
use crate::stage::{SeqWork, SharedExperts, StageRuntime};
use crate::transcripts::Transcripts;
use crate::wire::{self, AuthMode, Connection, Kind, Role, Welcome, WireError};

#[derive(Clone)]
pub struct TpConfig {
    pub listen: String,
    /// Where rank 0 accepts mesh links.
    pub data_listen: String,
    pub auth: AuthMode,
    pub n_ranks: usize,
    /// Relative expert shares per rank (equal when empty).
    pub expert_weights: Vec<f32>,
    pub route_wait: Duration,
    pub tp_timeout: Duration,
    /// Prompt tokens per evaluated chunk.
    pub chunk: usize,
    pub debug: bool,
    /// Builds an expert source for the owned experts (SSD streaming); resident when `None`.
    pub experts: Option<ExpertFactory>,
    /// Deal each step's routed experts out evenly instead of by fixed ownership (resident
    /// experts only; every rank then touches every expert).
    pub balance_experts: bool,
}

pub(crate) const BALANCE_NEEDS_RESIDENT: &str = "--tp-balance-experts needs resident experts: with --ssd-streaming each rank streams only the experts it owns";

/// Makes the expert source of a rank from its model and the experts it owns.
pub type ExpertFactory =
    Arc<dyn Fn(&Arc<Model>, Vec<bool>) -> anyhow::Result<SharedExperts> + Send + Sync>;

/// A rank's reply (with its raw payload), or why its control link failed.
type ReplyOrError = std::result::Result<(TpReply, Vec<u8>), WireError>;

struct RankLink {
    rank: usize,
    listen: String,
    conn: Connection,
    replies: Mutex<Receiver<ReplyOrError>>,
    peer: String,
}

#[derive(Default)]
struct Ranks {
    links: Vec<Option<Arc<RankLink>>>,
    generation: u64,
}

struct Registry {
    ranks: Mutex<Ranks>,
    changed: Condvar,
    fingerprint: String,
    n_ctx: usize,
    n_ranks: usize,
}

impl Registry {
    fn admit(self: Arc<Self>, stream: TcpStream, auth: &AuthMode) {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let mut assigned = None;
        let accepted = wire::accept(stream, auth, |h| {
            let Role::Rank { rank, .. } = h.role else {
                return Err(
                    "this coordinator runs a tensor-parallel group; the peer is not a rank".into(),
                );
            };
            if h.fingerprint != self.fingerprint {
                return Err(format!(
                    "different model: the peer has {}, the coordinator {}",
                    h.fingerprint, self.fingerprint
                ));
            }
            if (h.n_ctx as usize) < self.n_ctx {
                return Err(format!(
                    "context {} is smaller than the coordinator's {}",
                    h.n_ctx, self.n_ctx
                ));
            }
            if h.listen.is_none() {
                return Err("the rank announced no data port".into());
            }
            let st = self.ranks.lock().unwrap_or_else(|e| e.into_inner());
            let free = |r: usize| {
                r >= 1 && r < self.n_ranks && st.links.get(r).is_none_or(|l| l.is_none())
            };
            let r = match rank {
                Some(r) if free(r as usize) => r as usize,
                Some(r) => {
                    return Err(format!(
                        "rank {r} is taken or outside 1..{} (--tp-size {})",
                        self.n_ranks, self.n_ranks
                    ));
                }
                None => (1..self.n_ranks)
                    .find(|&r| free(r))
                    .ok_or_else(|| format!("the group already has its {} ranks", self.n_ranks))?,
            };
            assigned = Some(r);
            Ok(Welcome {
                message: format!("rank {r} of {}", self.n_ranks),
                rank: Some(r as u32),
                group_size: Some(self.n_ranks as u32),
            })
        });
        let (conn, mut reader, hello) = match accepted {
            Ok(x) => x,
            Err(e) => {
                wire::log_rejected(peer, &e);
                return;
            }
        };
        let rank = assigned.expect("set by the accepted check");
        let (tx, rx) = mpsc::channel();
        let link = Arc::new(RankLink {
            rank,
            listen: hello.listen.unwrap_or_default(),
            conn,
            replies: Mutex::new(rx),
            peer: peer.clone(),
        });
        {
            let mut st = self.ranks.lock().unwrap_or_else(|e| e.into_inner());
            if st.links.len() < self.n_ranks {
                st.links.resize(self.n_ranks, None);
            }
            if st.links[rank].is_some() {
                link.conn
                    .send_error(0, &format!("rank {rank} was taken meanwhile"));
                return;
            }
            st.links[rank] = Some(Arc::clone(&link));
            st.generation += 1;
        }
        self.changed.notify_all();
        tracing::info!("rank {rank} registered from {peer} (data {})", link.listen);
        loop {
            let r = super::worker::read_reply(&mut reader);
            let stop = r.is_err();
            if let Err(e) = &r {
                tracing::warn!("rank {rank} ({peer}) left: {e}");
            }
            if tx.send(r).is_err() || stop {
                break;
            }
        }
        let mut st = self.ranks.lock().unwrap_or_else(|e| e.into_inner());
        if st
            .links
            .get(rank)
            .and_then(|l| l.as_ref())
            .is_some_and(|l| Arc::ptr_eq(l, &link))
        {
            st.links[rank] = None;
            st.generation += 1;
        }
        drop(st);
        self.changed.notify_all();
    }
}

struct Group {
    epoch: u64,
    mesh: Mesh,
    links: Vec<Arc<RankLink>>,
    stage: StageRuntime,
    generation: u64,
}

pub struct TpExecutor {
    model: Arc<Model>,
    cfg: TpConfig,
    info: ModelInfo,
    kv_type: KvType,
    threads: usize,
    registry: Arc<Registry>,
    data_listener: TcpListener,
    data_addr: String,
    group: Option<Group>,
    sessions: Transcripts,
    step: u64,
    epoch: u64,
    /// Exchanges and their total time (rank 0's view), for `stats`.
    exchanges: u64,
    exchange_time: Duration,
    steps: u64,
}

fn exec_err(msg: impl Into<String>) -> EngineError {
    EngineError::Executor(msg.into())
}

/// The experts each rank owns: contiguous id ranges in proportion to `weights`.
pub fn placement(n_expert: usize, n_ranks: usize, weights: &[f32]) -> Vec<Vec<bool>> {
    let w: Vec<f64> = (0..n_ranks)
        .map(|r| weights.get(r).copied().unwrap_or(1.0).max(0.0) as f64)
        .collect();
    let total: f64 = w.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    let mut bounds = vec![0usize];
    let mut acc = 0.0;
    for wr in &w {
        acc += wr;
        bounds.push(((acc / total) * n_expert as f64).round() as usize);
    }
    *bounds.last_mut().expect("n_ranks + 1 bounds") = n_expert;
    (0..n_ranks)
        .map(|r| {
            (0..n_expert)
                .map(|e| e >= bounds[r] && e < bounds[r + 1])
                .collect()
        })
        .collect()
}

impl TpExecutor {
    /// `model` must be unsharded; it becomes rank 0's share.
    pub fn new(
        mut model: Model,
        threads: usize,
        kv_type: KvType,
        n_ctx: usize,
        cfg: TpConfig,
    ) -> Result<TpExecutor> {
        if cfg.n_ranks < 1 {
            return Err(exec_err("--tp-size must be at least 1"));
        }
        if cfg.balance_experts && cfg.experts.is_some() {
            return Err(exec_err(BALANCE_NEEDS_RESIDENT));
        }
        model.set_tensor_parallel(0, cfg.n_ranks);
        let model = Arc::new(model);
        let info = engine::local::model_info_kv(&model, n_ctx, kv_type);
        let registry = Arc::new(Registry {
            ranks: Mutex::new(Ranks::default()),
            changed: Condvar::new(),
            fingerprint: info.fingerprint.clone(),
            n_ctx,
            n_ranks: cfg.n_ranks,
        });
        let listener = TcpListener::bind(&cfg.listen)
            .map_err(|e| exec_err(format!("binding --listen {}: {e}", cfg.listen)))?;
        let bound = listener.local_addr().map_err(|e| exec_err(e.to_string()))?;
        let data_listener = TcpListener::bind(&cfg.data_listen)
            .map_err(|e| exec_err(format!("binding the mesh port {}: {e}", cfg.data_listen)))?;
        let data_bound = data_listener
            .local_addr()
            .map_err(|e| exec_err(e.to_string()))?;
        let data_addr = if data_bound.ip().is_unspecified() {
            format!("127.0.0.1:{}", data_bound.port())
        } else {
            data_bound.to_string()
        };
        {
            let (reg, auth) = (Arc::clone(&registry), cfg.auth.clone());
            std::thread::Builder::new()
                .name("tp-listen".into())
                .spawn(move || {
                    for stream in listener.incoming() {
                        let Ok(stream) = stream else { continue };
                        let (reg, auth) = (Arc::clone(&reg), auth.clone());
                        let _ = std::thread::Builder::new()
                            .name("tp-admit".into())
                            .spawn(move || reg.admit(stream, &auth));
                    }
                })
                .map_err(|e| exec_err(e.to_string()))?;
        }
        let s = model.shard();
        tracing::info!(
            "tensor-parallel coordinator: {} ranks, attention {}, workers register at {bound}",
            cfg.n_ranks,
            if s.attention_split {
                format!("split by heads ({} per rank)", s.heads.len())
            } else {
                "replicated".into()
            }
        );
        Ok(TpExecutor {
            model,
            cfg,
            info,
            kv_type,
            threads,
            registry,
            data_listener,
            data_addr,
            group: None,
            sessions: Transcripts::default(),
            step: 0,
            epoch: 0,
            exchanges: 0,
            exchange_time: Duration::ZERO,
            steps: 0,
        })
    }

    /// Per-rank weights of balanced placement, when it is on.
    fn balance_weights(&self) -> Option<Vec<f64>> {
        self.cfg.balance_experts.then(|| {
            (0..self.cfg.n_ranks)
                .map(|r| {
                    self.cfg
                        .expert_weights
                        .get(r)
                        .copied()
                        .unwrap_or(1.0)
                        .max(0.0) as f64
                })
                .collect()
        })
    }

    fn owned(&self) -> Vec<Vec<bool>> {
        placement(
            self.info.n_expert.max(1),
            self.cfg.n_ranks,
            &self.cfg.expert_weights,
        )
    }

    fn drop_group(&mut self, why: &str) {
        if let Some(g) = self.group.take() {
            tracing::warn!("leaving group epoch {} ({why})", g.epoch);
            g.mesh.shutdown();
        }
        self.sessions.mark_all_stale();
    }

    fn ensure_group(&mut self) -> Result<()> {
        let generation = self
            .registry
            .ranks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .generation;
        if self
            .group
            .as_ref()
            .is_some_and(|g| g.generation == generation)
        {
            return Ok(());
        }
        if self.group.is_some() {
            self.drop_group("a rank joined or left");
        }
        let deadline = Instant::now() + self.cfg.route_wait;
        loop {
            let (links, generation) = {
                let st = self
                    .registry
                    .ranks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                let links: Vec<Option<Arc<RankLink>>> = (1..self.cfg.n_ranks)
                    .map(|r| st.links.get(r).cloned().flatten())
                    .collect();
                (links, st.generation)
            };
            if let Some(missing) = links.iter().position(Option::is_none) {
                if Instant::now() >= deadline {
                    return Err(exec_err(format!(
                        "the tensor-parallel group is incomplete after {:?}: rank {} has not joined",
                        self.cfg.route_wait,
                        missing + 1
                    )));
                }
                let st = self
                    .registry
                    .ranks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if st.generation == generation {
                    let _ = self
                        .registry
                        .changed
                        .wait_timeout(st, Duration::from_millis(250));
                }
                continue;
            }
            let links: Vec<Arc<RankLink>> =
                links.into_iter().map(|l| l.expect("checked")).collect();
            match self.start_group(links, generation) {
                Ok(g) => {
                    self.group = Some(g);
                    self.sessions.mark_all_stale();
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!("could not form the group: {e}");
                    if Instant::now() >= deadline {
                        return Err(exec_err(format!(
                            "could not form the tensor-parallel group: {e}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
            }
        }
    }

    fn start_group(
        &mut self,
        links: Vec<Arc<RankLink>>,
        generation: u64,
    ) -> std::result::Result<Group, String> {
        self.epoch += 1;
        let epoch = self.epoch;
        let owned = self.owned();
        let mut peers = vec![self.data_addr.clone()];
        peers.extend(links.iter().map(|l| l.listen.clone()));
        for l in &links {
            let cmd = TpCommand::Start {
                epoch,
                n_ranks: self.cfg.n_ranks as u32,
                peers: peers.clone(),
                owned: owned[l.rank].clone(),
                balance: self.balance_weights(),
            };
            l.conn
                .send(&pack(Kind::TpOp, 0, &cmd, &[]))
                .map_err(|e| format!("rank {}: {e}", l.rank))?;
        }
        let mesh = Mesh::connect(
            0,
            &peers,
            epoch,
            &self.data_listener,
            &self.cfg.auth,
            self.cfg.tp_timeout,
        )?;
        for l in &links {
            match wait_reply(l, Duration::from_secs(60))? {
                (TpReply::Ready { epoch: e }, _) if e == epoch => {}
                (TpReply::StartFailed { detail, .. }, _) => {
                    return Err(format!("rank {}: {detail}", l.rank));
                }
                (other, _) => return Err(format!("rank {}: unexpected {other:?}", l.rank)),
            }
        }
        let experts: SharedExperts = match (&self.cfg.experts, self.balance_weights()) {
            (Some(make), None) => {
                make(&self.model, owned[0].clone()).map_err(|e| format!("{e:#}"))?
            }
            (None, None) => Arc::new(OwnedResidentExperts::new(
                Arc::clone(&self.model),
                owned[0].clone(),
            )),
            (None, Some(w)) => {
                Arc::new(BalancedResidentExperts::new(Arc::clone(&self.model), 0, w))
            }
            (Some(_), Some(_)) => return Err(BALANCE_NEEDS_RESIDENT.into()),
        };
        let last = self.model.n_layer() - 1;
        let stage = StageRuntime::new(
            Arc::clone(&self.model),
            Compute::new(self.threads),
            0..=last,
            true,
            self.kv_type,
            self.info.n_ctx,
        )
        .with_experts(experts);
        let share = |r: usize| match self.cfg.balance_experts {
            true => "experts dealt out per step".to_string(),
            false => format!("{} experts", owned[r].iter().filter(|&&o| o).count()),
        };
        tracing::info!(
            "tensor-parallel group epoch {epoch}: {}",
            std::iter::once(format!("rank 0 (here, {})", share(0)))
                .chain(links.iter().map(|l| format!(
                    "rank {} {} ({})",
                    l.rank,
                    l.peer,
                    share(l.rank)
                )))
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(Group {
            epoch,
            mesh,
            links,
            stage,
            generation,
        })
    }

    /// One lockstep evaluation of `seqs` on every rank; returns the gathered logits rows.
    fn step_all(
        &mut self,
        seqs: Vec<SeqWork>,
        tokens: Vec<u32>,
    ) -> std::result::Result<Vec<f32>, String> {
        let t_step = Instant::now();
        self.step += 1;
        let step = self.step;
        let g = self.group.as_mut().ok_or("no group")?;
        let cmd = TpCommand::Eval {
            step,
            seqs: seqs.clone(),
            tokens: tokens.clone(),
        };
        for l in &g.links {
            l.conn
                .send(&pack(Kind::TpOp, step, &cmd, &[]))
                .map_err(|e| format!("rank {}: {e}", l.rank))?;
        }
        let t0 = Instant::now();
        let (x0, et0) = (g.mesh.exchanges, g.mesh.exchange_time);
        let mut hooks = MeshHooks {
            mesh: &mut g.mesh,
            step,
            error: None,
        };
        let own = g
            .stage
            .run_with_hooks(&seqs, &tokens, StageInput::Tokens(&tokens), &mut hooks);
        let mesh_error = hooks.error.take();
        let own = match own {
            Ok(StageOutput::Logits(l)) => l,
            Ok(StageOutput::Hidden(_)) => return Err("rank 0 produced no logits".into()),
            Err(e) => return Err(mesh_error.unwrap_or_else(|| e.to_string())),
        };
        let compute = t0.elapsed();
        let t_gather = Instant::now();
        // Gather every rank's vocabulary slice, in rank order.
        let n_rows = own.rows.len();
        let mut slices = vec![(own.vocab_offset, own.n_vocab, own.data)];
        let mut worst = (0u32, 0u64);
        for l in &g.links {
            match wait_reply(l, self.cfg.tp_timeout + compute)? {
                (
                    TpReply::Logits {
                        step: s,
                        n_rows: r,
                        n_vocab,
                        vocab_offset,
                        exchanges,
                        exchange_us,
                    },
                    raw,
                ) if s == step && r as usize == n_rows => {
                    let data = raw
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    slices.push((vocab_offset as usize, n_vocab as usize, data));
                    worst = worst.max((exchanges, exchange_us));
                }
                (TpReply::Failed { detail, .. }, _) => {
                    return Err(format!("rank {}: {detail}", l.rank));
                }
                (other, _) => return Err(format!("rank {} is out of step: {other:?}", l.rank)),
            }
        }
        let gather = t_gather.elapsed();
        self.steps += 1;
        self.exchanges += g.mesh.exchanges - x0;
        self.exchange_time += g.mesh.exchange_time - et0;
        if self.cfg.debug {
            let n_x = g.mesh.exchanges - x0;
            let t_x = g.mesh.exchange_time - et0;
            eprintln!(
                "[tp] step {step}: {} tokens, step {:.0?}, compute {:.0?}, logits gather {:.0?}, {n_x} exchanges taking {:.0?} (mean {:.0} µs), slowest rank {:.0} µs",
                tokens.len(),
                t_step.elapsed(),
                compute,
                gather,
                t_x,
                t_x.as_micros() as f64 / n_x.max(1) as f64,
                worst.1 as f64
            );
        }
        slices.sort_by_key(|s| s.0);
        let n_vocab = self.info.n_vocab;
        let mut out = vec![0f32; n_rows * n_vocab];
        for (offset, width, data) in &slices {
            for r in 0..n_rows {
                out[r * n_vocab + offset..r * n_vocab + offset + width]
                    .copy_from_slice(&data[r * width..(r + 1) * width]);
            }
        }
        Ok(out)
    }

    fn replay(&mut self, session: SessionId) -> std::result::Result<(), String> {
        tracing::info!(
            "replaying session {session} ({} tokens) on the group",
            self.sessions.len(session)
        );
        for (seqs, tokens) in self.sessions.replay_items(session, self.cfg.chunk) {
            self.step_all(seqs, tokens)?;
        }
        self.sessions.mark_synced(session);
        Ok(())
    }

    fn attempt(&mut self, batch: &[EvalRequest]) -> std::result::Result<Vec<EvalResult>, String> {
        for r in batch {
            if !self.sessions.is_synced(r.session) && self.sessions.len(r.session) > 0 {
                self.replay(r.session)?;
            }
            self.sessions.mark_synced(r.session);
        }
        let n_vocab = self.info.n_vocab;
        let mut results: Vec<EvalResult> = batch
            .iter()
            .map(|_| EvalResult {
                n_vocab,
                ..Default::default()
            })
            .collect();
        for (seqs, tokens) in self.sessions.eval_items(batch, self.cfg.chunk) {
            let rows = self.step_all(seqs, tokens)?;
            if let [only] = results.as_mut_slice() {
                // One request, possibly in several chunks: rows accumulate in order.
                only.n_rows += rows.len() / n_vocab;
                only.logits.extend_from_slice(&rows);
                continue;
            }
            // A batch travels as one item; its rows come in request order.
            let mut off = 0;
            for (r, res) in batch.iter().zip(results.iter_mut()) {
                let n = match r.logits {
                    model::LogitsWanted::None => 0,
                    model::LogitsWanted::Last => usize::from(!r.tokens.is_empty()),
                    model::LogitsWanted::All => r.tokens.len(),
                };
                res.n_rows = n;
                res.logits
                    .extend_from_slice(&rows[off * n_vocab..(off + n) * n_vocab]);
                off += n;
            }
        }
        Ok(results)
    }

    /// Shard of rank `r` (each rank computes its own the same way).
    fn shard_of(&self, r: usize) -> Shard {
        let o_dtype = self.model.layer(0).attn.o.dtype;
        Shard::new(
            &self.model.hp,
            self.model.spec.qk_norm,
            o_dtype,
            r,
            self.cfg.n_ranks,
        )
    }
}

fn wait_reply(l: &RankLink, timeout: Duration) -> std::result::Result<(TpReply, Vec<u8>), String> {
    let rx = l.replies.lock().unwrap_or_else(|e| e.into_inner());
    match rx.recv_timeout(timeout) {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(format!("rank {} ({}): {e}", l.rank, l.peer)),
        Err(RecvTimeoutError::Timeout) => Err(format!(
            "rank {} ({}) did not answer within {timeout:?}",
            l.rank, l.peer
        )),
        Err(RecvTimeoutError::Disconnected) => Err(format!("rank {} ({}) left", l.rank, l.peer)),
    }
}

impl Executor for TpExecutor {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn eval(&mut self, batch: &[EvalRequest]) -> Result<Vec<EvalResult>> {
        self.sessions.check_fits(batch, self.info.n_ctx)?;
        let deadline = Instant::now() + self.cfg.route_wait;
        let mut first_error: Option<String> = None;
        loop {
            self.ensure_group().map_err(|e| match &first_error {
                Some(f) => exec_err(format!("{f}; then: {e}")),
                None => e,
            })?;
            match self.attempt(batch) {
                Ok(results) => {
                    self.sessions.commit(batch);
                    return Ok(results);
                }
                Err(e) => {
                    tracing::warn!("tensor-parallel step failed: {e}");
                    let first = first_error.get_or_insert(e).clone();
                    self.drop_group("a step failed");
                    if Instant::now() >= deadline {
                        return Err(exec_err(format!(
                            "{first} (no recovery within {:?})",
                            self.cfg.route_wait
                        )));
                    }
                    // Wait for the failed rank to leave the registry (or come back) before re-forming.
                    std::thread::sleep(Duration::from_millis(300));
                }
            }
        }
    }

    fn truncate(&mut self, session: SessionId, n: usize) -> Result<()> {
        self.sessions.truncate(session, n);
        Ok(())
    }

    fn session_len(&self, session: SessionId) -> usize {
        self.sessions.len(session)
    }

    fn destroy(&mut self, session: SessionId) {
        self.sessions.remove(session);
        if let Some(g) = self.group.as_mut() {
            g.stage.destroy(session);
            for l in &g.links {
                let _ = l
                    .conn
                    .send(&pack(Kind::TpOp, 0, &TpCommand::Destroy { session }, &[]));
            }
        }
    }

    fn snapshot(&mut self, session: SessionId) -> Result<Snapshot> {
        if !self.sessions.contains(session) {
            return Err(exec_err(format!("session {session} does not exist")));
        }
        let tokens = self.sessions.get(session).to_vec();
        self.ensure_group()?;
        if !self.sessions.is_synced(session) {
            self.replay(session).map_err(exec_err)?;
        }
        let n = tokens.len();
        self.step += 1;
        let step = self.step;
        let g = self.group.as_ref().ok_or_else(|| exec_err("no group"))?;
        for l in &g.links {
            l.conn
                .send(&pack(
                    Kind::TpOp,
                    step,
                    &TpCommand::Snapshot {
                        step,
                        session,
                        n: n as u32,
                    },
                    &[],
                ))
                .map_err(|e| exec_err(e.to_string()))?;
        }
        let n_layer = self.info.n_layer;
        let mut per_rank: Vec<Vec<(Vec<u8>, Vec<u8>)>> = vec![
            (0..n_layer)
                .map(|l| g.stage.export_layer(session, l, n).unwrap_or_default())
                .collect(),
        ];
        for l in &g.links {
            match wait_reply(l, Duration::from_secs(120)).map_err(exec_err)? {
                (TpReply::Snapshot { layers, .. }, _) => per_rank.push(layers),
                (other, _) => {
                    return Err(exec_err(format!("rank {}: unexpected {other:?}", l.rank)));
                }
            }
        }
        let hp = &self.model.hp;
        let esz = self.kv_type.bytes();
        let split = self.model.shard().attention_split;
        let layers = (0..n_layer)
            .map(|il| {
                if !split {
                    return per_rank[0][il].clone();
                }
                // Interleave the ranks' kv heads back into [pos][head][dim].
                let (mut k, mut v) = (Vec::new(), Vec::new());
                for p in 0..n {
                    for (r, layers) in per_rank.iter().enumerate() {
                        let heads = self.shard_of(r).kv_heads.len();
                        let (kr, vr) = (heads * hp.head_dim_k * esz, heads * hp.head_dim_v * esz);
                        k.extend_from_slice(&layers[il].0[p * kr..(p + 1) * kr]);
                        v.extend_from_slice(&layers[il].1[p * vr..(p + 1) * vr]);
                    }
                }
                (k, v)
            })
            .collect();
        Ok(Snapshot {
            fingerprint: self.info.fingerprint.clone(),
            tokens,
            kv_type: self.kv_type,
            n_kv_head: hp.n_head_kv,
            head_dim_k: hp.head_dim_k,
            head_dim_v: hp.head_dim_v,
            layers,
            last_logits: Vec::new(),
        })
    }

    fn restore(&mut self, session: SessionId, s: &Snapshot) -> Result<()> {
        s.check_model(&self.info.fingerprint)?;
        let hp = self.model.hp.clone();
        if s.layers.len() != self.info.n_layer
            || s.kv_type != self.kv_type
            || s.n_kv_head != hp.n_head_kv
        {
            return Err(EngineError::Snapshot(
                "snapshot KV layout differs from this group's".into(),
            ));
        }
        self.ensure_group()?;
        let n = s.tokens.len();
        let esz = self.kv_type.bytes();
        let split = self.model.shard().attention_split;
        let share = |r: usize| -> Vec<(Vec<u8>, Vec<u8>)> {
            if !split {
                return s.layers.clone();
            }
            let heads = self.shard_of(r).kv_heads;
            let (kf, vf) = (
                hp.n_head_kv * hp.head_dim_k * esz,
                hp.n_head_kv * hp.head_dim_v * esz,
            );
            let (k0, k1) = (
                heads.start * hp.head_dim_k * esz,
                heads.end * hp.head_dim_k * esz,
            );
            let (v0, v1) = (
                heads.start * hp.head_dim_v * esz,
                heads.end * hp.head_dim_v * esz,
            );
            s.layers
                .iter()
                .map(|(k, v)| {
                    let mut kk = Vec::new();
                    let mut vv = Vec::new();
                    for p in 0..n {
                        kk.extend_from_slice(&k[p * kf + k0..p * kf + k1]);
                        vv.extend_from_slice(&v[p * vf + v0..p * vf + v1]);
                    }
                    (kk, vv)
                })
                .collect()
        };
        let shares: Vec<_> = (0..self.cfg.n_ranks).map(share).collect();
        self.step += 1;
        let step = self.step;
        let g = self.group.as_mut().ok_or_else(|| exec_err("no group"))?;
        for l in &g.links {
            let cmd = TpCommand::Restore {
                step,
                session,
                tokens: s.tokens.clone(),
                layers: shares[l.rank].clone(),
            };
            l.conn
                .send(&pack(Kind::TpOp, step, &cmd, &[]))
                .map_err(|e| exec_err(e.to_string()))?;
        }
        g.stage
            .begin_restore(session, &s.tokens)
            .map_err(|e| EngineError::Snapshot(e.to_string()))?;
        for (il, (k, v)) in shares[0].iter().enumerate() {
            g.stage
                .import_layer(session, il, k, v)
                .map_err(|e| EngineError::Snapshot(e.to_string()))?;
        }
        for l in &g.links {
            match wait_reply(l, Duration::from_secs(120)).map_err(exec_err)? {
                (TpReply::Restored { .. }, _) => {}
                (other, _) => return Err(exec_err(format!("rank {}: {other:?}", l.rank))),
            }
        }
        self.sessions.set(session, s.tokens.clone());
        Ok(())
    }

    fn describe(&self) -> String {
        let s = self.model.shard();
        let experts = match self.balance_weights() {
            Some(w) => format!("experts dealt out per step by weights {w:?}"),
            None => format!(
                "experts {:?}",
                self.owned()
                    .iter()
                    .map(|o| o.iter().filter(|&&x| x).count())
                    .collect::<Vec<_>>()
            ),
        };
        format!(
            "tensor-parallel: {} ranks, attention {}, {experts}",
            self.cfg.n_ranks,
            if s.attention_split {
                "split by heads"
            } else {
                "replicated"
            },
        )
    }

    fn stats(&self) -> Vec<(String, f64)> {
        let mut stats = self
            .group
            .as_ref()
            .map(|g| g.stage.stats())
            .unwrap_or_default();
        stats.extend(vec![
            ("tp_steps".into(), self.steps as f64),
            ("tp_exchanges".into(), self.exchanges as f64),
            (
                "tp_exchanges_per_step".into(),
                self.exchanges as f64 / self.steps.max(1) as f64,
            ),
            (
                "tp_exchange_mean_us".into(),
                self.exchange_time.as_micros() as f64 / self.exchanges.max(1) as f64,
            ),
            (
                "tp_exchange_min_us".into(),
                self.group
                    .as_ref()
                    .filter(|g| g.mesh.exchanges > 0)
                    .map_or(0.0, |g| g.mesh.exchange_min.as_secs_f64() * 1e6),
            ),
        ]);
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::placement;

    #[test]
    fn placement_is_contiguous_proportional_and_complete() {
        let p = placement(64, 2, &[2.0, 1.0]);
        assert_eq!(p[0].iter().filter(|&&x| x).count(), 43);
        assert_eq!(p[1].iter().filter(|&&x| x).count(), 21);
        for e in 0..64 {
            assert_eq!(
                p.iter().filter(|r| r[e]).count(),
                1,
                "expert {e} owned exactly once"
            );
        }
        let p = placement(8, 3, &[]);
        assert_eq!(
            p.iter()
                .map(|r| r.iter().filter(|&&x| x).count())
                .collect::<Vec<_>>(),
            vec![3, 2, 3]
        );
    }
}
