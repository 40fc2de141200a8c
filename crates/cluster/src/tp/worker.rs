//! A tensor-parallel rank: registers with the coordinator (retrying while it starts), takes
//! its share of the model once its rank is known (heads, FFN columns, vocabulary slice, owned
//! experts), joins the data mesh, and executes the coordinator's commands in order.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use gguf::GgufModel;
use model::{KvType, Model};

use super::group::{JoinSpec, RankState, join};
use super::protocol::{TpCommand, TpReply, send_reply};
use super::{ExpertFactory, OffloadFactory};
use crate::error::{ClusterError, Result, bind};
use crate::membership::{Ended, Membership, PANIC_EXIT, panic_message};
use crate::wire::{Connection, ConnectionReader, HeldExperts, Kind, Role, f32_bytes, unpack};

pub struct TpWorkerConfig {
    pub membership: Membership,
    /// Where to accept mesh links from higher ranks.
    pub data_listen: String,
    pub rank: Option<u32>,
    pub expert_weight: f32,
    /// What the rank's shard file holds (`None` for a full file), told to the coordinator.
    pub held: Option<HeldExperts>,
    pub tp_timeout: Duration,
    pub threads: usize,
    pub kv_type: KvType,
    pub n_ctx: usize,
    /// Builds an expert source for the owned experts (SSD streaming); resident when `None`.
    pub experts: Option<ExpertFactory>,
    /// Builds the rank's GPU for its held experts (`--gpu`); all on the CPU when `None`.
    pub offload: Option<OffloadFactory>,
}

/// Runs a rank of the model in `files` until the coordinator says shut down. The files are
/// opened once; each registration binds them as the rank it was given.
pub fn run_tp_worker(files: Arc<GgufModel>, cfg: TpWorkerConfig) -> Result<()> {
    let (listener, bound) = bind("--data-listen", &cfg.data_listen)?;
    let fingerprint = files.fingerprint().to_string();
    let role = Role::Rank {
        rank: cfg.rank,
        expert_weight: cfg.expert_weight,
        held: cfg.held.clone(),
    };
    cfg.membership.run(
        "tensor-parallel rank",
        || {
            let (conn, reader, welcome) =
                cfg.membership
                    .register(role.clone(), &fingerprint, cfg.n_ctx, bound)?;
            let (Some(rank), Some(n_ranks)) = (welcome.rank, welcome.group_size) else {
                return Err(ClusterError::peer(
                    conn.peer(),
                    "the coordinator assigned no rank (is it running --tensor-parallel?)",
                ));
            };
            let (rank, n_ranks) = (rank as usize, n_ranks as usize);
            tracing::info!(
                "tensor-parallel rank {rank} of {n_ranks}: registered with {}",
                conn.peer()
            );
            let model = Arc::new(Model::from_gguf_rank(Arc::clone(&files), rank, n_ranks)?);
            let control = conn.clone();
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                serve(&model, &cfg, &listener, conn, reader)
            }));
            served.unwrap_or_else(|payload| {
                // Tell the coordinator, then end the process: nothing is left half running.
                let detail = format!("rank {rank} panicked: {}", panic_message(&*payload));
                tracing::error!("{detail}");
                control.send_error(0, &detail);
                control.shutdown();
                std::process::exit(PANIC_EXIT)
            })
        },
        || {},
    )
}

/// Executes the coordinator's commands until the control link ends.
fn serve(
    model: &Arc<Model>,
    cfg: &TpWorkerConfig,
    listener: &TcpListener,
    conn: Connection,
    mut reader: ConnectionReader,
) -> Result<Ended> {
    let rank = model.shard().rank;
    let link = |e| ClusterError::link("the coordinator", e);
    let mut group: Option<RankState> = None;
    loop {
        let f = match reader.recv() {
            Ok(f) if f.kind == Kind::TpOp => f,
            Ok(f) => {
                tracing::warn!("rank {rank}: unexpected {:?} on the control link", f.kind);
                continue;
            }
            Err(e) => return Ok(Ended::Lost(format!("control link to the coordinator: {e}"))),
        };
        let (cmd, _): (TpCommand, _) = unpack("tp command", &f.payload).map_err(link)?;
        let not_in_group = |step| TpReply::Failed {
            step,
            detail: format!("rank {rank} is not in a group"),
        };
        let (reply, raw) = match cmd {
            TpCommand::Start {
                epoch,
                n_ranks: _,
                peers,
                share,
            } => {
                if let Some(old) = group.take() {
                    old.mesh.shutdown();
                }
                let spec = JoinSpec {
                    model,
                    epoch,
                    peers: &peers,
                    share: &share,
                    listener,
                    link: &cfg.membership.link,
                    tp_timeout: cfg.tp_timeout,
                    threads: cfg.threads,
                    kv_type: cfg.kv_type,
                    n_ctx: cfg.n_ctx,
                    experts: cfg.experts.as_ref(),
                    offload: cfg.offload.as_ref(),
                };
                let reply = match join(spec) {
                    Ok(state) => {
                        tracing::info!("rank {rank}: joined group epoch {epoch}");
                        group = Some(state);
                        TpReply::Ready { epoch }
                    }
                    Err(e) => TpReply::StartFailed {
                        epoch,
                        detail: e.to_string(),
                    },
                };
                (reply, Vec::new())
            }
            TpCommand::Eval { step, seqs, tokens } => match group.as_mut() {
                None => (not_in_group(step), Vec::new()),
                Some(state) => match state.step(step, &seqs, &tokens) {
                    Ok(share) => (
                        TpReply::Logits {
                            step,
                            n_rows: share.logits.rows.len() as u32,
                            n_vocab: share.logits.n_vocab as u32,
                            vocab_offset: share.logits.vocab_offset as u32,
                            exchanges: share.exchanges as u32,
                            exchange_us: share.exchange_time.as_micros() as u64,
                        },
                        f32_bytes(&share.logits.data),
                    ),
                    Err(e) => {
                        if matches!(e, ClusterError::Formation(_)) {
                            // A peer is gone: leave the group; the coordinator forms a new one.
                            if let Some(old) = group.take() {
                                old.mesh.shutdown();
                            }
                        }
                        let detail = e.to_string();
                        (TpReply::Failed { step, detail }, Vec::new())
                    }
                },
            },
            TpCommand::Destroy { session } => {
                if let Some(state) = group.as_mut() {
                    state.runner.destroy(session);
                }
                continue;
            }
            TpCommand::Reset => {
                if let Some(state) = group.as_mut() {
                    state.runner.reset_all();
                }
                continue;
            }
            TpCommand::Snapshot { step, session, n } => match group.as_ref() {
                None => (not_in_group(step), Vec::new()),
                Some(state) => match state.runner.export(session, n as usize) {
                    Ok(layers) => (TpReply::Snapshot { step, layers }, Vec::new()),
                    Err(e) => (
                        TpReply::Failed {
                            step,
                            detail: e.to_string(),
                        },
                        Vec::new(),
                    ),
                },
            },
            TpCommand::Restore {
                step,
                session,
                tokens,
                layers,
            } => match group.as_mut() {
                None => (not_in_group(step), Vec::new()),
                Some(state) => match state.runner.import(session, &tokens, &layers) {
                    Ok(()) => (TpReply::Restored { step }, Vec::new()),
                    Err(e) => (
                        TpReply::Failed {
                            step,
                            detail: e.to_string(),
                        },
                        Vec::new(),
                    ),
                },
            },
            TpCommand::Shutdown => return Ok(Ended::Shutdown),
        };
        send_reply(&conn, &reply, &raw).map_err(link)?;
    }
}
