//! A pipeline worker: serves a layer range for a coordinator. It registers over a control link
//! (retrying while the coordinator starts), accepts its upstream data link, computes work items
//! in arrival order (`stage_loop`), forwards hidden states to the next stage itself, and relays
//! everything coming back from downstream to upstream, adding its own timing to results.

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use engine::Runner;

use super::protocol::*;
use super::stage_loop::{Job, Shared, compute_loop, failure, send_on};
use crate::activation::ActFormat;
use crate::error::{ClusterError, Result, bind};
use crate::membership::{Ended, Membership, PANIC_EXIT, panic_message};
use crate::wire::{
    self, Connection, ConnectionReader, Hello, Kind, LinkConfig, PendingHandshakes, Role,
    WireError, pack, unpack,
};

/// Work items and session operations waiting for the compute thread, at most.
const JOB_QUEUE: usize = 64;

pub struct WorkerConfig {
    /// Where to accept the upstream data link (`host:port`; port 0 picks one).
    pub listen: String,
    pub membership: Membership,
}

/// Runs a worker until the coordinator tells it to shut down (or, with `give_up_after`, until
/// the coordinator cannot be reached).
pub fn run_worker(stage: Runner, cfg: WorkerConfig) -> Result<()> {
    let (listener, bound) = bind("--data-listen", &cfg.listen)?;
    let fingerprint = stage.model().files().fingerprint().to_string();
    let n_ctx = stage.n_ctx();
    let range = stage.range().clone();
    let label = range.to_string();
    let shared = Arc::new(Shared {
        upstream: Arc::new(Mutex::new(None)),
        downstream: Arc::new(Mutex::new(None)),
        act: Mutex::new(ActFormat::F32),
        timings: Mutex::new(HashMap::new()),
        label: label.clone(),
    });
    // Bounded: an upstream that sends faster than the stage computes waits (TCP backpressure)
    // instead of growing the queue.
    let (jobs_tx, jobs_rx) = mpsc::sync_channel::<Job>(JOB_QUEUE);
    let spawn_err = |source| ClusterError::Io {
        what: "spawning the stage threads".into(),
        source,
    };
    {
        let (link, shared, jobs) = (
            cfg.membership.link.clone(),
            Arc::clone(&shared),
            jobs_tx.clone(),
        );
        std::thread::Builder::new()
            .name("stage-accept".into())
            .spawn(move || accept_upstream(listener, link, shared, jobs))
            .map_err(spawn_err)?;
    }
    {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("stage-compute".into())
            .spawn(move || {
                let label = shared.label.clone();
                let upstream = Arc::clone(&shared.upstream);
                let run = std::panic::AssertUnwindSafe(|| compute_loop(stage, jobs_rx, shared));
                if let Err(payload) = std::panic::catch_unwind(run) {
                    // Tell the coordinator (as a failure of whatever was in flight), then end
                    // the process: a stage without its compute thread must not linger.
                    let detail = format!("stage {label} panicked: {}", panic_message(&*payload));
                    tracing::error!("{detail}");
                    let fail = StageFailure::Failed {
                        stage: label,
                        detail,
                    };
                    let _ = send_on(&upstream, &failure(0, &fail));
                    std::process::exit(PANIC_EXIT);
                }
            })
            .map_err(spawn_err)?;
    }
    tracing::info!(
        "stage {label}: data port {bound}, coordinator {}",
        cfg.membership.coordinator
    );
    let role = Role::Stage {
        first: range.first as u32,
        last: range.last as u32,
        head: range.head,
    };
    cfg.membership.run(
        &format!("stage {label}"),
        || {
            let (conn, reader, welcome) =
                cfg.membership
                    .register(role.clone(), &fingerprint, n_ctx, bound)?;
            tracing::info!(
                "stage {label}: registered with {} ({})",
                conn.peer(),
                welcome.message
            );
            control_session(&cfg, conn, reader, &shared, &jobs_tx)
        },
        || {
            let _ = jobs_tx.send(Job::Reset);
            *shared.downstream.lock().unwrap_or_else(|e| e.into_inner()) = None;
        },
    )
}

/// Serves the coordinator's control messages until the link ends.
fn control_session(
    cfg: &WorkerConfig,
    conn: wire::Connection,
    mut reader: ConnectionReader,
    shared: &Arc<Shared>,
    jobs: &SyncSender<Job>,
) -> Result<Ended> {
    let link = |e| ClusterError::link("the coordinator", e);
    loop {
        let f = match reader.recv() {
            Ok(f) => f,
            Err(e) => return Ok(Ended::Lost(format!("lost the coordinator ({e})"))),
        };
        match f.kind {
            Kind::Route => {
                let msg: Control = wire::decode("control", &f.payload).map_err(link)?;
                match msg {
                    Control::Route { epoch, next, act } => {
                        *shared.act.lock().unwrap_or_else(|e| e.into_inner()) = act;
                        let reply = match connect_downstream(cfg, next.as_deref(), shared) {
                            Ok(()) => ControlReply::RouteReady { epoch },
                            Err(e) => ControlReply::RouteFailed {
                                epoch,
                                detail: e.to_string(),
                            },
                        };
                        conn.send_msg(Kind::Route, f.request_id, &reply)
                            .map_err(link)?;
                    }
                    Control::ResetSessions => {
                        let _ = jobs.send(Job::Reset);
                    }
                    Control::Shutdown => return Ok(Ended::Shutdown),
                }
            }
            other => tracing::warn!(
                "stage {}: unexpected {other:?} on the control link",
                shared.label
            ),
        }
    }
}

fn connect_downstream(cfg: &WorkerConfig, next: Option<&str>, shared: &Arc<Shared>) -> Result<()> {
    let old = shared
        .downstream
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some(old) = old {
        old.shutdown();
    }
    let Some(next) = next else { return Ok(()) };
    let stream = wire::dial(next).map_err(|source| ClusterError::Io {
        what: format!("the next stage {next}"),
        source,
    })?;
    let hello = Hello::new(Role::Hop, "", 0, None);
    let (conn, reader, _) = wire::connect(stream, &cfg.membership.link, hello)
        .map_err(|e| ClusterError::link(format!("the next stage {next}"), e))?;
    let conn_of_relay = conn.clone();
    *shared.downstream.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn);
    let shared2 = Arc::clone(shared);
    std::thread::Builder::new()
        .name("stage-relay".into())
        .spawn(move || relay_upstream(conn_of_relay, reader, shared2))
        .map_err(|source| ClusterError::Io {
            what: "spawning the relay thread".into(),
            source,
        })?;
    Ok(())
}

/// Everything from downstream goes upstream; results get this stage's timing first. When the
/// link fails, it is closed (both halves) and the failure reported upstream.
fn relay_upstream(conn: Connection, mut reader: ConnectionReader, shared: Arc<Shared>) {
    loop {
        let mut f = match reader.recv() {
            Ok(f) => f,
            Err(e) => {
                conn.shutdown();
                let detail = format!("link to the next stage ({}) lost: {e}", reader.peer());
                tracing::warn!("stage {}: {detail}", shared.label);
                let _ = send_on(
                    &shared.upstream,
                    &failure(
                        0,
                        &StageFailure::LinkLost {
                            stage: shared.label.clone(),
                            detail,
                        },
                    ),
                );
                return;
            }
        };
        if f.kind == Kind::WorkResult && f.flags & FLAG_FAILURE == 0 {
            let mine = shared
                .timings
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&f.request_id);
            if let (Some(t), Ok((mut h, raw))) =
                (mine, unpack::<ResultHeader>("result", &f.payload))
            {
                h.timings.insert(0, t);
                let flags = f.flags;
                f = pack(Kind::WorkResult, f.request_id, &h, raw);
                f.flags = flags;
            }
        }
        if send_on(&shared.upstream, &f).is_err() {
            tracing::debug!("stage {}: no upstream to relay to", shared.label);
        }
    }
}

fn accept_upstream(
    listener: TcpListener,
    link: LinkConfig,
    shared: Arc<Shared>,
    jobs: SyncSender<Job>,
) {
    let pending = PendingHandshakes::default();
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let (link, shared, jobs) = (link.clone(), Arc::clone(&shared), jobs.clone());
        pending.spawn(stream, move |stream, slot| {
            let peer = stream
                .peer_addr()
                .map(|a| a.to_string())
                .unwrap_or_default();
            let accepted = wire::accept(stream, &link, |h| match h.role {
                Role::Hop => Ok(wire::Welcome {
                    message: format!("stage {}", shared.label),
                    ..Default::default()
                }),
                _ => Err("this port only takes the upstream data link of a pipeline".into()),
            });
            drop(slot);
            let (conn, reader, _) = match accepted {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("stage {}: refused data link from {peer}: {e}", shared.label);
                    return;
                }
            };
            tracing::info!("stage {}: upstream data link from {peer}", shared.label);
            let old = shared
                .upstream
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .replace(conn.clone());
            if let Some(old) = old {
                old.shutdown();
            }
            read_upstream(reader, jobs, shared.label.clone());
            // A link we no longer read must not look alive (its heartbeats would go on), or
            // the upstream stage would wait on it forever.
            conn.shutdown();
        });
    }
}

fn read_upstream(mut reader: ConnectionReader, jobs: SyncSender<Job>, label: String) {
    loop {
        match reader.recv() {
            Ok(f) if f.kind == Kind::Work => {
                if jobs
                    .send(Job::Work {
                        frame: f,
                        arrived: Instant::now(),
                    })
                    .is_err()
                {
                    return;
                }
            }
            Ok(f) if f.kind == Kind::SessionOp => {
                if jobs.send(Job::Op { frame: f }).is_err() {
                    return;
                }
            }
            Ok(f) => tracing::warn!("stage {label}: unexpected {:?} from upstream", f.kind),
            Err(WireError::Closed) => return,
            Err(e) => {
                tracing::warn!("stage {label}: upstream link: {e}");
                return;
            }
        }
    }
}
