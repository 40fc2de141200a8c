//! A tensor-parallel group: how a rank joins one (rank 0 and the workers through the same
//! [`join`]), a rank's share of one lockstep step, and rank 0's view of the whole group —
//! forming it, stepping it, and gathering the ranks' vocabulary slices of the logits.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{LayerRange, Runner, SeqWork};
use model::{Compute, KvType, Logits, Model, StageInput, StageOutput};

use super::admission::RankLink;
use super::mesh::{Mesh, MeshHooks};
use super::placement::Share;
use super::protocol::{TpCommand, TpReply, reply_of, send_command};
use super::{ExpertFactory, OffloadFactory};
use crate::error::{ClusterError, Result};
use crate::wire::{Frame, LinkConfig, f32_values};

/// How long ranks may take to join a group.
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// What a rank needs to join group `epoch`.
pub struct JoinSpec<'a> {
    /// The model, sharded for this rank.
    pub model: &'a Arc<Model>,
    pub epoch: u64,
    /// Every rank's data address, by rank.
    pub peers: &'a [String],
    pub share: &'a Share,
    pub listener: &'a TcpListener,
    pub link: &'a LinkConfig,
    pub tp_timeout: Duration,
    pub threads: usize,
    pub kv_type: KvType,
    pub n_ctx: usize,
    pub experts: Option<&'a ExpertFactory>,
    /// The rank's GPU, its held experts uploaded (`--gpu`); all on the CPU when `None`.
    pub offload: Option<&'a OffloadFactory>,
}

/// A rank inside a formed group: its mesh links and the runner of its share.
pub struct RankState {
    pub mesh: Mesh,
    pub runner: Runner,
}

/// One rank's result of a step.
pub struct StepShare {
    pub logits: Logits,
    pub exchanges: u64,
    pub exchange_time: Duration,
}

/// Joins a group: builds this rank's expert source, connects the mesh (dialing lower ranks,
/// accepting higher ones) and makes the runner of all layers and the head.
pub fn join(spec: JoinSpec) -> Result<RankState> {
    let shard = spec.model.shard();
    let (rank, n_ranks) = (shard.rank, shard.n_ranks);
    if spec.peers.len() != n_ranks {
        return Err(ClusterError::Formation(format!(
            "{} peer addresses for {n_ranks} ranks",
            spec.peers.len()
        )));
    }
    let experts = spec.share.source(spec.model, rank, spec.experts)?;
    let mesh = Mesh::connect(
        rank,
        spec.peers,
        spec.epoch,
        spec.listener,
        spec.link,
        spec.tp_timeout,
    )?;
    let mut compute = Compute::new(spec.threads);
    if let Some(make) = spec.offload {
        let device = make(spec.model, spec.share.held(rank))
            .map_err(|e| ClusterError::Formation(format!("rank {rank}'s GPU: {e}")))?;
        compute = compute.with_offload(device);
    }
    let runner = Runner::new(
        Arc::clone(spec.model),
        compute,
        LayerRange::whole(spec.model.n_layer()),
        spec.kv_type,
        spec.n_ctx,
    )
    .with_experts(Some(experts));
    Ok(RankState { mesh, runner })
}

impl RankState {
    /// This rank's share of step `step`: the item through every layer, partial sums
    /// exchanged over the mesh; the logits rows of this rank's vocabulary slice. A mesh
    /// failure is reported as such (the group must be re-formed), not as the model error it
    /// caused.
    pub fn step(&mut self, step: u64, seqs: &[SeqWork], tokens: &[u32]) -> Result<StepShare> {
        let (x0, t0) = (self.mesh.exchanges, self.mesh.exchange_time);
        let mut hooks = MeshHooks {
            mesh: &mut self.mesh,
            step,
            error: None,
        };
        let out = self
            .runner
            .run_with_hooks(seqs, tokens, StageInput::Tokens(tokens), &mut hooks);
        if let Some(detail) = hooks.error.take() {
            return Err(ClusterError::Formation(format!("mesh: {detail}")));
        }
        match out? {
            StageOutput::Logits(logits) => Ok(StepShare {
                logits,
                exchanges: self.mesh.exchanges - x0,
                exchange_time: self.mesh.exchange_time - t0,
            }),
            StageOutput::Hidden(_) => Err(ClusterError::Formation(
                "a rank's runner does not end at the head".into(),
            )),
        }
    }
}

/// Rank 0's view of a formed group.
pub struct Group {
    pub epoch: u64,
    /// The registry generation the group was formed from.
    pub generation: u64,
    pub links: Vec<Arc<RankLink>>,
    pub own: RankState,
}

/// What one step cost, for `--debug` and the executor's statistics.
pub struct StepStats {
    pub compute: Duration,
    pub gather: Duration,
    pub exchanges: u64,
    pub exchange_time: Duration,
    /// The slowest other rank's exchange wait (µs).
    pub slowest_rank_us: u64,
}

impl Group {
    /// Forms group `spec.epoch` with `links` (ranks 1.., in order): every rank is told the
    /// peers (rank 0 at the address `mesh_addr` gives for that rank's link) and its share,
    /// rank 0 joins, and every other rank must confirm.
    pub fn form(
        links: Vec<Arc<RankLink>>,
        generation: u64,
        shares: &[Share],
        spec: JoinSpec,
        mesh_addr: impl Fn(&RankLink) -> String,
    ) -> Result<Group> {
        let n_ranks = spec.peers.len() as u32;
        for l in &links {
            let mut peers = spec.peers.to_vec();
            peers[0] = mesh_addr(l);
            tracing::info!("{}: mesh peers {peers:?}", l.name);
            let cmd = TpCommand::Start {
                epoch: spec.epoch,
                n_ranks,
                peers,
                share: shares[l.claim].clone(),
            };
            send_command(&l.control, 0, &cmd).map_err(|e| ClusterError::link(&l.name, e))?;
        }
        let epoch = spec.epoch;
        let own = join(spec)?;
        // Replies left from an earlier attempt (a Ready or StartFailed of an older epoch, a
        // step's answer of the group before) are skipped: taking one for this attempt's answer
        // would fail every later attempt too, each one reading its predecessor's reply.
        let this_attempt = |f: Frame| {
            let r = reply_of(f)?;
            match &r {
                Ok((TpReply::Ready { epoch: e } | TpReply::StartFailed { epoch: e, .. }, _))
                    if *e < epoch =>
                {
                    None
                }
                Ok((TpReply::Ready { .. } | TpReply::StartFailed { .. }, _)) | Err(_) => Some(r),
                Ok(_) => None,
            }
        };
        for l in &links {
            match l.wait("the group start", JOIN_TIMEOUT, &this_attempt)? {
                (TpReply::Ready { epoch: e }, _) if e == epoch => {}
                (TpReply::StartFailed { detail, .. }, _) => {
                    return Err(ClusterError::peer(&l.name, detail));
                }
                (other, _) => {
                    return Err(ClusterError::peer(&l.name, format!("unexpected {other:?}")));
                }
            }
        }
        Ok(Group {
            epoch,
            generation,
            links,
            own,
        })
    }

    /// Sends `cmd` to every other rank.
    pub fn broadcast(&self, step: u64, cmd: &TpCommand) -> Result<()> {
        for l in &self.links {
            send_command(&l.control, step, cmd).map_err(|e| ClusterError::link(&l.name, e))?;
        }
        Ok(())
    }

    /// One lockstep evaluation of `seqs` on every rank; the gathered logits rows (all of the
    /// vocabulary, `n_vocab` each). `tp_timeout` bounds how long a rank may lag behind rank 0.
    pub fn step(
        &mut self,
        step: u64,
        seqs: &[SeqWork],
        tokens: &[u32],
        n_vocab: usize,
        tp_timeout: Duration,
    ) -> Result<(Vec<f32>, StepStats)> {
        let t0 = Instant::now();
        let cmd = TpCommand::Eval {
            step,
            seqs: seqs.to_vec(),
            tokens: tokens.to_vec(),
        };
        self.broadcast(step, &cmd)?;
        let own = self.own.step(step, seqs, tokens)?;
        let compute = t0.elapsed();
        let t_gather = Instant::now();
        let n_rows = own.logits.rows.len();
        let mut out = vec![0f32; n_rows * n_vocab];
        place_slice(&mut out, n_rows, n_vocab, &own.logits, "rank 0")?;
        let mut slowest_rank_us = 0;
        for l in &self.links {
            match l.wait("its logits", tp_timeout + compute, reply_of)? {
                (
                    TpReply::Logits {
                        step: s,
                        n_rows: r,
                        n_vocab: width,
                        vocab_offset,
                        exchange_us,
                        ..
                    },
                    raw,
                ) if s == step && r as usize == n_rows => {
                    let slice = Logits {
                        rows: Vec::new(),
                        n_vocab: width as usize,
                        vocab_offset: vocab_offset as usize,
                        data: f32_values(&raw),
                    };
                    place_slice(&mut out, n_rows, n_vocab, &slice, &l.name)?;
                    slowest_rank_us = slowest_rank_us.max(exchange_us);
                }
                (TpReply::Failed { detail, .. }, _) => {
                    return Err(ClusterError::peer(&l.name, detail));
                }
                (other, _) => {
                    return Err(ClusterError::peer(
                        &l.name,
                        format!("out of step: {other:?}"),
                    ));
                }
            }
        }
        let stats = StepStats {
            compute,
            gather: t_gather.elapsed(),
            exchanges: own.exchanges,
            exchange_time: own.exchange_time,
            slowest_rank_us,
        };
        Ok((out, stats))
    }

    pub fn shutdown(&self) {
        self.own.mesh.shutdown();
    }
}

/// Copies a rank's vocabulary slice (`n_rows` rows of `slice.n_vocab` values starting at
/// `slice.vocab_offset`) into `out` (`n_rows` rows of `n_vocab`), refusing a slice that does
/// not fit instead of indexing out of bounds.
fn place_slice(
    out: &mut [f32],
    n_rows: usize,
    n_vocab: usize,
    slice: &Logits,
    who: &str,
) -> Result<()> {
    let (offset, width) = (slice.vocab_offset, slice.n_vocab);
    if offset + width > n_vocab || slice.data.len() != n_rows * width {
        return Err(ClusterError::peer(
            who,
            format!(
                "a logits slice of {} values at {offset}+{width} does not fit {n_rows} rows of {n_vocab}",
                slice.data.len()
            ),
        ));
    }
    for r in 0..n_rows {
        out[r * n_vocab + offset..r * n_vocab + offset + width]
            .copy_from_slice(&slice.data[r * width..(r + 1) * width]);
    }
    Ok(())
}
