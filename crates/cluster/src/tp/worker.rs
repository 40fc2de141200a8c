//! A tensor-parallel rank: registers with the coordinator (retrying while it starts), loads the
//! model with its share (heads, FFN columns, vocabulary slice, owned experts), joins the data
//! mesh, and executes the coordinator's commands in order.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use model::{
    BalancedResidentExperts, Compute, KvType, Model, OwnedResidentExperts, StageInput, StageOutput,
};

use super::mesh::{Mesh, MeshHooks};
use super::protocol::{TpCommand, TpReply};
use crate::pipeline::protocol::{pack, unpack};
use crate::stage::{SharedExperts, StageRuntime};
use crate::wire::messages::build_id;
use crate::wire::{self, AuthMode, Connection, ConnectionReader, Hello, Kind, Role, WireError};

pub struct TpWorkerConfig {
    pub coordinator: String,
    /// Where to accept mesh links from higher ranks.
    pub data_listen: String,
    pub advertise: Option<String>,
    pub auth: AuthMode,
    pub rank: Option<u32>,
    pub expert_weight: f32,
    pub retry: Duration,
    pub give_up_after: Option<Duration>,
    pub tp_timeout: Duration,
    pub threads: usize,
    pub kv_type: KvType,
    pub n_ctx: usize,
    /// Builds an expert source for the owned experts (SSD streaming); resident when `None`.
    pub experts: Option<super::coordinator::ExpertFactory>,
}

enum End {
    Shutdown,
    Lost(String),
}

/// Runs a rank until the coordinator says shut down. `load` opens the model (unsharded).
pub fn run_tp_worker(
    load: impl Fn() -> anyhow::Result<Model>,
    cfg: TpWorkerConfig,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(&cfg.data_listen)
        .map_err(|e| anyhow::anyhow!("binding --data-listen {}: {e}", cfg.data_listen))?;
    let bound = listener.local_addr()?;
    let probe = load()?;
    let fingerprint = probe.files().fingerprint().to_string();
    drop(probe);
    let mut last_contact = Instant::now();
    loop {
        match serve_once(&load, &cfg, &listener, bound, &fingerprint) {
            Ok(End::Shutdown) => return Ok(()),
            Ok(End::Lost(why)) => {
                tracing::warn!("tensor-parallel rank: {why}; re-registering");
                last_contact = Instant::now();
            }
            Err(e)
                if e.downcast_ref::<WireError>().is_some_and(|w| {
                    matches!(
                        w,
                        WireError::Rejected { .. }
                            | WireError::Auth(_)
                            | WireError::VersionMismatch { .. }
                    )
                }) =>
            {
                return Err(e.context("refused by the coordinator"));
            }
            Err(e) => {
                if let Some(limit) = cfg.give_up_after
                    && last_contact.elapsed() > limit
                {
                    return Err(e.context("no coordinator"));
                }
                tracing::debug!("coordinator not reachable yet: {e:#}");
            }
        }
        std::thread::sleep(cfg.retry);
    }
}

fn serve_once(
    load: &impl Fn() -> anyhow::Result<Model>,
    cfg: &TpWorkerConfig,
    listener: &TcpListener,
    bound: std::net::SocketAddr,
    fingerprint: &str,
) -> anyhow::Result<End> {
    let stream = wire::dial(&cfg.coordinator)?;
    let local_ip = stream.local_addr()?.ip();
    let listen = match &cfg.advertise {
        Some(a) => a.clone(),
        None if bound.ip().is_unspecified() => format!("{local_ip}:{}", bound.port()),
        None => bound.to_string(),
    };
    let hello = Hello {
        protocol: wire::PROTOCOL_VERSION,
        build: build_id(),
        role: Role::Rank {
            rank: cfg.rank,
            expert_weight: cfg.expert_weight,
        },
        fingerprint: fingerprint.to_string(),
        n_ctx: cfg.n_ctx as u32,
        listen: Some(listen),
        nonce: [0; 32],
        keyless: false,
    };
    let (conn, mut reader, welcome) = wire::connect(stream, &cfg.auth, hello)?;
    let (Some(rank), Some(n_ranks)) = (welcome.rank, welcome.group_size) else {
        anyhow::bail!("the coordinator assigned no rank (is it running --tensor-parallel?)");
    };
    let (rank, n_ranks) = (rank as usize, n_ranks as usize);
    tracing::info!(
        "tensor-parallel rank {rank} of {n_ranks}: registered with {}",
        conn.peer()
    );
    let mut model = load()?;
    model.set_tensor_parallel(rank, n_ranks);
    let model = Arc::new(model);
    let mut group: Option<(Mesh, StageRuntime)> = None;
    loop {
        let f = match reader.recv() {
            Ok(f) => f,
            Err(e) => return Ok(End::Lost(format!("control link to the coordinator: {e}"))),
        };
        let (cmd, _): (TpCommand, _) = unpack("tp command", &f.payload)?;
        match cmd {
            TpCommand::Start {
                epoch,
                n_ranks: n,
                peers,
                owned,
                balance,
            } => {
                if let Some((mesh, _)) = group.take() {
                    mesh.shutdown();
                }
                let share = match balance {
                    Some(weights) => Share::Balanced(weights),
                    None => Share::Owned(owned),
                };
                let reply = start(
                    &model, cfg, rank, n as usize, epoch, &peers, share, listener,
                )
                .map(|g| {
                    group = Some(g);
                    TpReply::Ready { epoch }
                })
                .unwrap_or_else(|detail| TpReply::StartFailed { epoch, detail });
                send(&conn, &reply, &[])?;
            }
            TpCommand::Eval { step, seqs, tokens } => {
                let Some((mesh, stage)) = group.as_mut() else {
                    send(
                        &conn,
                        &TpReply::Failed {
                            step,
                            detail: format!("rank {rank} is not in a group"),
                        },
                        &[],
                    )?;
                    continue;
                };
                let (x0, t0) = (mesh.exchanges, mesh.exchange_time);
                let mut hooks = MeshHooks {
                    mesh,
                    step,
                    error: None,
                };
                let out =
                    stage.run_with_hooks(&seqs, &tokens, StageInput::Tokens(&tokens), &mut hooks);
                let broken = hooks.error.is_some();
                match out {
                    Ok(StageOutput::Logits(l)) => {
                        let raw: Vec<u8> = l.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                        let reply = TpReply::Logits {
                            step,
                            n_rows: l.rows.len() as u32,
                            n_vocab: l.n_vocab as u32,
                            vocab_offset: l.vocab_offset as u32,
                            exchanges: (mesh.exchanges - x0) as u32,
                            exchange_us: (mesh.exchange_time - t0).as_micros() as u64,
                        };
                        send(&conn, &reply, &raw)?;
                    }
                    Ok(StageOutput::Hidden(_)) => {
                        unreachable!("a rank runs every layer and the head")
                    }
                    Err(e) => send(
                        &conn,
                        &TpReply::Failed {
                            step,
                            detail: e.to_string(),
                        },
                        &[],
                    )?,
                }
                if broken {
                    // A peer is gone: leave the group; the coordinator starts a new one.
                    if let Some((mesh, _)) = group.take() {
                        mesh.shutdown();
                    }
                }
            }
            TpCommand::Destroy { session } => {
                if let Some((_, stage)) = group.as_mut() {
                    stage.destroy(session);
                }
            }
            TpCommand::Reset => {
                if let Some((_, stage)) = group.as_mut() {
                    stage.reset_all();
                }
            }
            TpCommand::Snapshot { step, session, n } => {
                let layers = group
                    .as_ref()
                    .map(|(_, stage)| {
                        stage
                            .layers
                            .clone()
                            .map(|l| {
                                stage
                                    .export_layer(session, l, n as usize)
                                    .unwrap_or_default()
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                send(&conn, &TpReply::Snapshot { step, layers }, &[])?;
            }
            TpCommand::Restore {
                step,
                session,
                tokens,
                layers,
            } => {
                let reply = match group.as_mut() {
                    Some((_, stage)) => restore(stage, session, &tokens, &layers)
                        .map(|()| TpReply::Restored { step })
                        .unwrap_or_else(|detail| TpReply::Failed { step, detail }),
                    None => TpReply::Failed {
                        step,
                        detail: format!("rank {rank} is not in a group"),
                    },
                };
                send(&conn, &reply, &[])?;
            }
            TpCommand::Shutdown => return Ok(End::Shutdown),
        }
    }
}

/// Which routed experts this rank computes.
enum Share {
    /// A fixed set.
    Owned(Vec<bool>),
    /// Each step's experts dealt out by these per-rank weights.
    Balanced(Vec<f64>),
}

#[allow(clippy::too_many_arguments)]
fn start(
    model: &Arc<Model>,
    cfg: &TpWorkerConfig,
    rank: usize,
    n: usize,
    epoch: u64,
    peers: &[String],
    share: Share,
    listener: &TcpListener,
) -> Result<(Mesh, StageRuntime), String> {
    if peers.len() != n {
        return Err(format!("{} peer addresses for {n} ranks", peers.len()));
    }
    let experts: SharedExperts = match (&cfg.experts, share) {
        (Some(make), Share::Owned(owned)) => make(model, owned).map_err(|e| format!("{e:#}"))?,
        (None, Share::Owned(owned)) => {
            Arc::new(OwnedResidentExperts::new(Arc::clone(model), owned))
        }
        (None, Share::Balanced(weights)) => Arc::new(BalancedResidentExperts::new(
            Arc::clone(model),
            rank,
            weights,
        )),
        (Some(_), Share::Balanced(_)) => {
            return Err(super::coordinator::BALANCE_NEEDS_RESIDENT.into());
        }
    };
    let mesh = Mesh::connect(rank, peers, epoch, listener, &cfg.auth, cfg.tp_timeout)?;
    let last = model.n_layer() - 1;
    let stage = StageRuntime::new(
        Arc::clone(model),
        Compute::new(cfg.threads),
        0..=last,
        true,
        cfg.kv_type,
        cfg.n_ctx,
    )
    .with_experts(experts);
    tracing::info!("rank {rank}: joined group epoch {epoch} ({n} ranks)");
    Ok((mesh, stage))
}

fn restore(
    stage: &mut StageRuntime,
    session: u64,
    tokens: &[u32],
    layers: &[(Vec<u8>, Vec<u8>)],
) -> Result<(), String> {
    stage
        .begin_restore(session, tokens)
        .map_err(|e| e.to_string())?;
    for (l, (k, v)) in layers.iter().enumerate() {
        stage
            .import_layer(session, l, k, v)
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn send(conn: &Connection, reply: &TpReply, raw: &[u8]) -> Result<(), WireError> {
    conn.send(&pack(Kind::TpDone, 0, reply, raw))
}

/// Reads one reply frame (used by the coordinator).
pub(crate) fn read_reply(reader: &mut ConnectionReader) -> Result<(TpReply, Vec<u8>), WireError> {
    let f = reader.expect(Kind::TpDone)?;
    let (r, raw): (TpReply, &[u8]) = unpack("tp reply", &f.payload)?;
    Ok((r, raw.to_vec()))
}
