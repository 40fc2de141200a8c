//! A pipeline worker: serves a layer range for a coordinator. It registers over a control link
//! (retrying while the coordinator starts), accepts its upstream data link, computes work items
//! in arrival order (`stage_loop`), forwards hidden states to the next stage itself, and relays
//! everything coming back from downstream to upstream, adding its own timing to results.

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use engine::Runner;

use super::protocol::*;
use super::stage_loop::{Job, Shared, compute_loop, failure, send_on};
use crate::activation::ActFormat;
use crate::error::{ClusterError, Result, bind};
use crate::membership::{Ended, Membership};
use crate::wire::{
    self, AuthMode, ConnectionReader, Frame, Hello, Kind, Role, WireError, pack, unpack,
};

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
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let spawn_err = |source| ClusterError::Io {
        what: "spawning the stage threads".into(),
        source,
    };
    {
        let (auth, shared, jobs) = (
            cfg.membership.auth.clone(),
            Arc::clone(&shared),
            jobs_tx.clone(),
        );
        std::thread::Builder::new()
            .name("stage-accept".into())
            .spawn(move || accept_upstream(listener, auth, shared, jobs))
            .map_err(spawn_err)?;
    }
    {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("stage-compute".into())
            .spawn(move || compute_loop(stage, jobs_rx, shared))
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
    jobs: &Sender<Job>,
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
            Kind::Ping => conn
                .send(&Frame::new(Kind::Pong, f.request_id, Vec::new()))
                .map_err(link)?,
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
    let (conn, reader, _) = wire::connect(stream, &cfg.membership.auth, hello)
        .map_err(|e| ClusterError::link(format!("the next stage {next}"), e))?;
    *shared.downstream.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn);
    let shared2 = Arc::clone(shared);
    std::thread::Builder::new()
        .name("stage-relay".into())
        .spawn(move || relay_upstream(reader, shared2))
        .map_err(|source| ClusterError::Io {
            what: "spawning the relay thread".into(),
            source,
        })?;
    Ok(())
}

/// Everything from downstream goes upstream; results get this stage's timing first.
fn relay_upstream(mut reader: ConnectionReader, shared: Arc<Shared>) {
    loop {
        let mut f = match reader.recv() {
            Ok(f) => f,
            Err(e) => {
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

fn accept_upstream(listener: TcpListener, auth: AuthMode, shared: Arc<Shared>, jobs: Sender<Job>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let accepted = wire::accept(stream, &auth, |h| match h.role {
            Role::Hop => Ok(wire::Welcome {
                message: format!("stage {}", shared.label),
                ..Default::default()
            }),
            _ => Err("this port only takes the upstream data link of a pipeline".into()),
        });
        let (conn, reader, _) = match accepted {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("stage {}: refused data link from {peer}: {e}", shared.label);
                continue;
            }
        };
        tracing::info!("stage {}: upstream data link from {peer}", shared.label);
        let old = shared
            .upstream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(conn);
        if let Some(old) = old {
            old.shutdown();
        }
        let jobs = jobs.clone();
        let label = shared.label.clone();
        let _ = std::thread::Builder::new()
            .name("stage-upstream".into())
            .spawn(move || read_upstream(reader, jobs, label));
    }
}

fn read_upstream(mut reader: ConnectionReader, jobs: Sender<Job>, label: String) {
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
