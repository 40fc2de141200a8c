//! The tensor-parallel coordinator: rank 0 of the group. It owns tokenizer, sampling and
//! sessions (through the engine), keeps every session's transcript, forms the group from the
//! ranks that registered, and steps it. A rank that dies or stalls fails the step within
//! `--tp-timeout`; when it comes back (within `--route-wait`) the group is re-formed and every
//! session replayed.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::executor::{EvalRequest, EvalResult, Executor, ModelInfo, SessionId};
use engine::snapshot::{Snapshot, SnapshotLayout};
use engine::{EngineError, Result, SeqWork};
use model::{KvType, Model};

use super::admission::{RankAdmission, RankLink};
use super::expert_plan::ExpertPlacement;
use super::group::{Group, JoinSpec};
use super::placement::{Share, needed_experts, shares};
use super::protocol::{TpCommand, TpReply, reply_of};
use super::{BALANCE_NEEDS_RESIDENT, ExpertFactory, OffloadFactory, snapshot};
use crate::error::{ClusterError, bind};
use crate::registry::Registry;
use crate::transcripts::Transcripts;
use crate::wire::LinkConfig;

/// How long ranks may take to export or import a session's KV.
const SESSION_OP_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Clone)]
pub struct TpConfig {
    pub listen: String,
    /// Where rank 0 accepts mesh links.
    pub data_listen: String,
    pub link: LinkConfig,
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
    /// Builds rank 0's GPU for its held experts (`--gpu`); all on the CPU when `None`.
    pub offload: Option<OffloadFactory>,
    /// Deal each step's routed experts out evenly instead of by fixed ownership (resident
    /// experts only; every rank then touches every expert).
    pub balance_experts: bool,
    /// Experts held per rank and layer as planned from measured routing (`--expert-placement`),
    /// instead of contiguous shares.
    pub placement: Option<ExpertPlacement>,
}

pub struct TpExecutor {
    model: Arc<Model>,
    cfg: TpConfig,
    info: ModelInfo,
    layout: SnapshotLayout,
    kv_type: KvType,
    threads: usize,
    registry: Arc<Registry<RankAdmission>>,
    data_listener: TcpListener,
    /// The mesh port's address (its IP unspecified when bound to all interfaces: each rank is
    /// then told the address it reached the coordinator at).
    data_bound: std::net::SocketAddr,
    shares: Vec<Share>,
    group: Option<Group>,
    sessions: Transcripts,
    step: u64,
    epoch: u64,
    /// Exchanges and their total time (rank 0's view), for `stats`.
    exchanges: u64,
    exchange_time: Duration,
    steps: u64,
    /// The last step's timing, for `cluster_view`.
    last_step: Option<engine::cluster_view::TpStepTiming>,
}

/// `--tp-size 3, --expert-weights 2,1,1` (or the balanced dealing), for refusals.
fn describe_placement(cfg: &TpConfig) -> String {
    let mut s = format!("--tp-size {}", cfg.n_ranks);
    if cfg.balance_experts {
        s.push_str(", --tp-balance-experts");
    } else if let Some(p) = &cfg.placement {
        s.push_str(&format!(", --expert-placement for weights {:?}", p.weights));
    } else if !cfg.expert_weights.is_empty() {
        let w: Vec<String> = cfg.expert_weights.iter().map(f32::to_string).collect();
        s.push_str(&format!(", --expert-weights {}", w.join(",")));
    }
    s
}

fn exec_err(msg: impl Into<String>) -> EngineError {
    EngineError::Executor(msg.into())
}

impl TpExecutor {
    /// `model` is rank 0's share (loaded with `Model::from_gguf_rank(.., 0, n_ranks)`).
    pub fn new(
        model: Arc<Model>,
        threads: usize,
        kv_type: KvType,
        n_ctx: usize,
        cfg: TpConfig,
    ) -> Result<TpExecutor> {
        let shard = model.shard();
        if shard.rank != 0 || shard.n_ranks != cfg.n_ranks.max(1) {
            return Err(exec_err(format!(
                "the coordinator needs rank 0 of {} ranks, the model was loaded as rank {} of {}",
                cfg.n_ranks, shard.rank, shard.n_ranks
            )));
        }
        if cfg.balance_experts && cfg.experts.is_some() {
            return Err(exec_err(BALANCE_NEEDS_RESIDENT));
        }
        let info = engine::local::model_info_kv(&model, n_ctx, kv_type);
        let layout = SnapshotLayout::of(&model, kv_type, n_ctx);
        let (listener, bound) = bind("--listen", &cfg.listen)?;
        let (data_listener, data_bound) = bind("the mesh port", &cfg.data_listen)?;
        let shares = match &cfg.placement {
            Some(p) => {
                if cfg.balance_experts || !cfg.expert_weights.is_empty() {
                    return Err(exec_err(
                        "--expert-placement already says where experts go and the ranks' \
                         weights: leave out --tp-balance-experts and --expert-weights",
                    ));
                }
                let routed: Vec<bool> = (0..model.n_layer())
                    .map(|l| model.is_moe_layer(l))
                    .collect();
                p.check(&info.fingerprint, &routed, info.n_expert, cfg.n_ranks)
                    .map_err(|e| exec_err(format!("--expert-placement: {e}")))?;
                vec![Share::Placed(p.clone()); cfg.n_ranks]
            }
            None => shares(
                info.n_expert,
                cfg.n_ranks,
                &cfg.expert_weights,
                cfg.balance_experts,
            ),
        };
        let needed: Vec<_> = shares
            .iter()
            .enumerate()
            .map(|(r, s)| needed_experts(s, r, info.n_expert))
            .collect();
        model
            .check_role(&model::Role::Rank {
                rank: 0,
                n_ranks: cfg.n_ranks,
                experts: needed[0].clone(),
            })
            .map_err(|e| exec_err(format!("rank 0 (this process): {e}")))?;
        let admission = RankAdmission {
            fingerprint: info.fingerprint.clone(),
            n_ctx,
            n_ranks: cfg.n_ranks,
            needed,
            placement: describe_placement(&cfg),
        };
        let registry = Registry::start(admission, listener, cfg.link.clone())?;
        tracing::info!(
            "tensor-parallel coordinator: {} ranks, attention {}, mesh port {data_bound}, workers register at {bound}",
            cfg.n_ranks,
            if shard.attention_split {
                format!("split by heads ({} per rank)", shard.heads.len())
            } else {
                "replicated".into()
            }
        );
        Ok(TpExecutor {
            model,
            cfg,
            info,
            layout,
            kv_type,
            threads,
            registry,
            data_listener,
            data_bound,
            shares,
            group: None,
            sessions: Transcripts::default(),
            step: 0,
            epoch: 0,
            exchanges: 0,
            exchange_time: Duration::ZERO,
            steps: 0,
            last_step: None,
        })
    }

    fn drop_group(&mut self, why: &str) {
        if let Some(g) = self.group.take() {
            tracing::warn!("leaving group epoch {} ({why})", g.epoch);
            g.shutdown();
        }
        self.sessions.mark_all_stale();
    }

    /// The ranks 1.. in order when all of them are registered, else the first missing one.
    fn complete_links(&self) -> (std::result::Result<Vec<Arc<RankLink>>, usize>, u64) {
        let (members, generation) = self.registry.members();
        let links = (1..self.cfg.n_ranks)
            .map(|r| members.iter().find(|m| m.claim == r).cloned().ok_or(r))
            .collect();
        (links, generation)
    }

    /// Makes sure a group of every rank is formed (waiting up to `--route-wait` for ranks).
    fn ensure_group(&mut self) -> Result<()> {
        let generation = self.registry.generation();
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
            let (links, generation) = self.complete_links();
            let links = match links {
                Ok(links) => links,
                Err(missing) => {
                    if Instant::now() >= deadline {
                        return Err(ClusterError::Formation(format!(
                            "the tensor-parallel group is incomplete after {:?}: rank {missing} has not joined",
                            self.cfg.route_wait
                        ))
                        .into());
                    }
                    self.registry.wait_change(
                        generation,
                        deadline.min(Instant::now() + Duration::from_millis(250)),
                    );
                    continue;
                }
            };
            match self.form(links, generation) {
                Ok(g) => {
                    self.group = Some(g);
                    self.sessions.mark_all_stale();
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!("could not form the group: {e}");
                    if Instant::now() >= deadline {
                        return Err(e.into());
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
            }
        }
    }

    fn form(&mut self, links: Vec<Arc<RankLink>>, generation: u64) -> crate::Result<Group> {
        self.epoch += 1;
        let mut peers = vec![self.data_bound.to_string()];
        peers.extend(links.iter().map(|l| l.listen.clone()));
        let spec = JoinSpec {
            model: &self.model,
            epoch: self.epoch,
            peers: &peers,
            share: &self.shares[0],
            listener: &self.data_listener,
            link: &self.cfg.link,
            tp_timeout: self.cfg.tp_timeout,
            threads: self.threads,
            kv_type: self.kv_type,
            n_ctx: self.info.n_ctx,
            experts: self.cfg.experts.as_ref(),
            offload: self.cfg.offload.as_ref(),
        };
        let data = self.data_bound;
        let mesh_addr = |l: &RankLink| {
            let ip = if data.ip().is_unspecified() {
                l.control.local().ip()
            } else {
                data.ip()
            };
            std::net::SocketAddr::new(ip, data.port()).to_string()
        };
        let group = Group::form(links, generation, &self.shares, spec, mesh_addr)?;
        tracing::info!(
            "tensor-parallel group epoch {}: {}",
            group.epoch,
            std::iter::once(format!("rank 0 (here, {})", self.shares[0].describe(0)))
                .chain(group.links.iter().map(|l| format!(
                    "{} ({})",
                    l.name,
                    self.shares[l.claim].describe(l.claim)
                )))
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(group)
    }

    fn next_step(&mut self) -> u64 {
        self.step += 1;
        self.step
    }

    fn group(&mut self) -> crate::Result<&mut Group> {
        self.group
            .as_mut()
            .ok_or_else(|| ClusterError::Formation("no group".into()))
    }

    /// One lockstep evaluation of an item on every rank; the gathered logits rows.
    fn step_all(&mut self, seqs: &[SeqWork], tokens: &[u32]) -> crate::Result<Vec<f32>> {
        let t_step = Instant::now();
        let step = self.next_step();
        let (n_vocab, timeout) = (self.info.n_vocab, self.cfg.tp_timeout);
        let (rows, st) = self.group()?.step(step, seqs, tokens, n_vocab, timeout)?;
        self.steps += 1;
        self.exchanges += st.exchanges;
        self.exchange_time += st.exchange_time;
        self.last_step = Some(engine::cluster_view::TpStepTiming {
            tokens: tokens.len(),
            step_us: t_step.elapsed().as_micros() as u64,
            compute_us: st.compute.as_micros() as u64,
            gather_us: st.gather.as_micros() as u64,
            exchanges: st.exchanges,
            exchange_us: st.exchange_time.as_micros() as u64,
            slowest_rank_us: st.slowest_rank_us,
        });
        if self.cfg.debug {
            eprintln!(
                "[tp] step {step}: {} tokens, step {:.0?}, compute {:.0?}, logits gather {:.0?}, {} exchanges taking {:.0?} (mean {:.0} µs), slowest rank {} µs",
                tokens.len(),
                t_step.elapsed(),
                st.compute,
                st.gather,
                st.exchanges,
                st.exchange_time,
                st.exchange_time.as_micros() as f64 / st.exchanges.max(1) as f64,
                st.slowest_rank_us
            );
        }
        Ok(rows)
    }

    fn replay(&mut self, session: SessionId) -> crate::Result<()> {
        tracing::info!(
            "replaying session {session} ({} tokens) on the group",
            self.sessions.len(session)
        );
        for (seqs, tokens) in self.sessions.replay_items(session, self.cfg.chunk) {
            self.step_all(&seqs, &tokens)?;
        }
        self.sessions.mark_synced(session);
        Ok(())
    }

    fn attempt(&mut self, batch: &[EvalRequest]) -> crate::Result<Vec<EvalResult>> {
        for r in batch {
            if !self.sessions.is_synced(r.session) && self.sessions.len(r.session) > 0 {
                self.replay(r.session)?;
            }
            self.sessions.mark_synced(r.session);
        }
        // A single request may come in several chunks, a batch as one item: either way the
        // rows arrive in request order.
        let mut rows = Vec::new();
        for (seqs, tokens) in self.sessions.eval_items(batch, self.cfg.chunk) {
            rows.extend(self.step_all(&seqs, &tokens)?);
        }
        Ok(EvalResult::split(batch, &rows, self.info.n_vocab))
    }

    /// Waits for every other rank's answer to a session command.
    fn collect<T>(
        &self,
        what: &'static str,
        mut take: impl FnMut(TpReply) -> Option<T>,
    ) -> Result<Vec<T>> {
        let g = self.group.as_ref().ok_or_else(|| exec_err("no group"))?;
        g.links
            .iter()
            .map(|l| {
                let (reply, _) = l.wait(what, SESSION_OP_TIMEOUT, reply_of)?;
                match reply {
                    TpReply::Failed { detail, .. } => Err(ClusterError::peer(&l.name, detail)),
                    other => {
                        let text = format!("{other:?}");
                        take(other).ok_or_else(|| {
                            ClusterError::peer(&l.name, format!("unexpected {text}"))
                        })
                    }
                }
            })
            .collect::<crate::Result<Vec<T>>>()
            .map_err(EngineError::from)
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
                    let first = first_error.get_or_insert(e.to_string()).clone();
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
        // Every rank drops the same sliding-window positions (they run the same steps), so
        // this rank's cache answers for all. A session to be replayed keeps nothing anyway.
        if let Some(g) = &self.group
            && self.sessions.is_synced(session)
            && !g.own.runner.can_rewind(session, n)
        {
            return Err(EngineError::CannotRewind {
                session,
                n,
                why: "the sliding-window or recurrent layers no longer reach that position".into(),
            });
        }
        self.sessions.truncate(session, n);
        Ok(())
    }

    fn rewind_point(&self, session: SessionId, n: usize) -> usize {
        match &self.group {
            Some(g) if self.sessions.is_synced(session) => g.own.runner.rewind_point(session, n),
            _ => n,
        }
    }

    fn session_len(&self, session: SessionId) -> usize {
        self.sessions.len(session)
    }

    fn destroy(&mut self, session: SessionId) {
        self.sessions.remove(session);
        if let Some(g) = self.group.as_mut() {
            g.own.runner.destroy(session);
            let _ = g.broadcast(0, &TpCommand::Destroy { session });
        }
    }

    fn snapshot(&mut self, session: SessionId) -> Result<Snapshot> {
        if !self.sessions.contains(session) {
            return Err(exec_err(format!("session {session} does not exist")));
        }
        let tokens = self.sessions.get(session).to_vec();
        self.ensure_group()?;
        if !self.sessions.is_synced(session) {
            self.replay(session)?;
        }
        let n = tokens.len();
        let step = self.next_step();
        let g = self.group.as_ref().ok_or_else(|| exec_err("no group"))?;
        let cmd = TpCommand::Snapshot {
            step,
            session,
            n: n as u32,
        };
        g.broadcast(step, &cmd)?;
        let mut per_rank = vec![g.own.runner.export(session, n)?];
        per_rank.extend(self.collect("the snapshot", |r| match r {
            TpReply::Snapshot { layers, .. } => Some(layers),
            _ => None,
        })?);
        let layers = snapshot::merge(&self.model, self.kv_type, n, &per_rank)?;
        let snap = self.layout.assemble(tokens, layers);
        snap.check_layout(&self.layout)?;
        Ok(snap)
    }

    fn restore(&mut self, session: SessionId, s: &Snapshot) -> Result<()> {
        s.check_layout(&self.layout)?;
        let n = s.tokens.len();
        let shares = snapshot::split(&self.model, self.kv_type, n, &s.layers)?;
        self.ensure_group()?;
        let step = self.next_step();
        let g = self.group.as_mut().ok_or_else(|| exec_err("no group"))?;
        for l in &g.links {
            let cmd = TpCommand::Restore {
                step,
                session,
                tokens: s.tokens.clone(),
                layers: shares[l.claim].clone(),
            };
            super::protocol::send_command(&l.control, step, &cmd)
                .map_err(|e| ClusterError::link(&l.name, e))?;
        }
        g.own.runner.import(session, &s.tokens, &shares[0])?;
        self.collect("the restore", |r| match r {
            TpReply::Restored { .. } => Some(()),
            _ => None,
        })?;
        self.sessions.set(session, s.tokens.clone());
        Ok(())
    }

    fn describe(&self) -> String {
        let experts = match &self.shares[0] {
            Share::Balanced(w) => format!("experts dealt out per step by weights {w:?}"),
            Share::Owned(_) | Share::Placed(_) => format!(
                "experts {:?}",
                self.shares
                    .iter()
                    .enumerate()
                    .map(|(r, s)| s.describe(r))
                    .collect::<Vec<_>>()
            ),
        };
        format!(
            "tensor-parallel: {} ranks, attention {}, {experts}",
            self.cfg.n_ranks,
            if self.model.shard().attention_split {
                "split by heads"
            } else {
                "replicated"
            },
        )
    }

    fn cluster_view(&self) -> engine::ClusterView {
        use engine::cluster_view::{ClusterKind, NodeView};
        let (mut members, _) = self.registry.members();
        members.sort_by_key(|m| m.claim);
        let all = engine::LayerRange::whole(self.info.n_layer).to_string();
        let here = NodeView {
            role: "coordinator".into(),
            layers: all.clone(),
            rank: Some(0),
            address: Some(self.data_bound.to_string()),
        };
        let ranks = members.iter().map(|m| NodeView {
            role: "rank".into(),
            layers: all.clone(),
            rank: Some(m.claim),
            address: Some(m.listen.clone()),
        });
        engine::ClusterView {
            kind: ClusterKind::TensorParallel,
            complete: self.group.is_some(),
            nodes: std::iter::once(here).chain(ranks).collect(),
            tp_step: self.last_step.clone(),
            ..Default::default()
        }
    }

    fn stats(&self) -> Vec<(String, f64)> {
        let mut stats = self
            .group
            .as_ref()
            .map(|g| g.own.runner.stats())
            .unwrap_or_default();
        let mesh = self.group.as_ref().map(|g| &g.own.mesh);
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
                mesh.filter(|m| m.exchanges > 0)
                    .map_or(0.0, |m| m.exchange_min.as_secs_f64() * 1e6),
            ),
        ]);
        stats
    }
}
