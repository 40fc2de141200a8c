//! A pipeline worker: serves a layer range for a coordinator. It registers over a control link
//! (retrying while the coordinator starts), accepts its upstream data link, computes work items
//! in arrival order, forwards hidden states to the next stage itself, and relays everything
//! coming back from downstream to upstream, adding its own timing to results.

use std::collections::HashMap;
use std::net::{TcpListener, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use model::StageInput;

use super::protocol::*;
use crate::activation::ActFormat;
use crate::stage::{StageError, StageRuntime};
use crate::wire::messages::build_id;
use crate::wire::{
    self, AuthMode, Connection, ConnectionReader, Frame, Hello, Kind, Role, WireError,
};

pub struct WorkerConfig {
    /// Coordinator `host:port`.
    pub coordinator: String,
    /// Where to accept the upstream data link (`host:port`; port 0 picks one).
    pub listen: String,
    /// Address to announce for the data link (default: this host as seen on the control link,
    /// with the bound port).
    pub advertise: Option<String>,
    pub auth: AuthMode,
    /// Pause between attempts to reach the coordinator.
    pub retry: Duration,
    /// Give up after this long without reaching the coordinator (`None`: never).
    pub give_up_after: Option<Duration>,
}

enum Job {
    Work { frame: Frame, arrived: Instant },
    Op { frame: Frame },
    Reset,
}

/// The link a stage sends on, replaced when the route changes.
type Slot = Arc<Mutex<Option<Connection>>>;

struct Shared {
    upstream: Slot,
    downstream: Slot,
    /// Route epoch of the downstream link, and the activation format to send.
    act: Mutex<ActFormat>,
    /// Timing of work items forwarded downstream, attached when their result comes back.
    timings: Mutex<HashMap<u64, HopTiming>>,
    label: String,
}

fn send_on(slot: &Slot, frame: &Frame) -> Result<(), WireError> {
    let conn = slot.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match conn {
        Some(c) => c.send(frame),
        None => Err(WireError::Closed),
    }
}

fn failure(request_id: u64, f: &StageFailure) -> Frame {
    let mut frame = pack(Kind::WorkResult, request_id, f, &[]);
    frame.flags = FLAG_FAILURE;
    frame
}

/// Runs a worker until the coordinator tells it to shut down (or, with `give_up_after`, until
/// the coordinator cannot be reached).
pub fn run_worker(stage: StageRuntime, cfg: WorkerConfig) -> anyhow::Result<()> {
    let listener = TcpListener::bind(&cfg.listen)
        .map_err(|e| anyhow::anyhow!("binding the data port {}: {e}", cfg.listen))?;
    let bound = listener.local_addr()?;
    let fingerprint = stage.model().files().fingerprint().to_string();
    let n_ctx = stage.n_ctx() as u32;
    let label = stage.label();
    let shared = Arc::new(Shared {
        upstream: Arc::new(Mutex::new(None)),
        downstream: Arc::new(Mutex::new(None)),
        act: Mutex::new(ActFormat::F32),
        timings: Mutex::new(HashMap::new()),
        label: label.clone(),
    });
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    {
        let (auth, shared, jobs) = (cfg.auth.clone(), Arc::clone(&shared), jobs_tx.clone());
        std::thread::Builder::new()
            .name("stage-accept".into())
            .spawn(move || accept_upstream(listener, auth, shared, jobs))?;
    }
    {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("stage-compute".into())
            .spawn(move || compute_loop(stage, jobs_rx, shared))?;
    }
    tracing::info!(
        "stage {label}: data port {bound}, coordinator {}",
        cfg.coordinator
    );
    let started = Instant::now();
    let mut last_contact = Instant::now();
    loop {
        let hello = Hello {
            protocol: wire::PROTOCOL_VERSION,
            build: build_id(),
            role: role_of(&label),
            fingerprint: fingerprint.clone(),
            n_ctx,
            listen: None,
            nonce: [0; 32],
            keyless: false,
        };
        match control_session(&cfg, hello, bound, &shared, &jobs_tx) {
            Ok(ControlEnd::Shutdown) => {
                tracing::info!("stage {label}: shutdown requested by the coordinator");
                return Ok(());
            }
            Ok(ControlEnd::Lost) => {
                tracing::warn!(
                    "stage {label}: lost the coordinator; dropping sessions and reconnecting"
                );
                last_contact = Instant::now();
                let _ = jobs_tx.send(Job::Reset);
                *shared.downstream.lock().unwrap_or_else(|e| e.into_inner()) = None;
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
                return Err(e.context(format!("stage {label}: refused by the coordinator")));
            }
            Err(e) => {
                if let Some(limit) = cfg.give_up_after
                    && last_contact.elapsed() > limit
                {
                    return Err(e.context(format!(
                        "stage {label}: no coordinator after {:.0?}",
                        started.elapsed()
                    )));
                }
                tracing::debug!("stage {label}: coordinator not reachable yet: {e:#}");
            }
        }
        std::thread::sleep(cfg.retry);
    }
}

fn role_of(label: &str) -> Role {
    let (a, b) = label.split_once(':').unwrap_or(("0", "0"));
    let first = a.parse().unwrap_or(0);
    match b {
        "output" => Role::Stage {
            first,
            last: u32::MAX,
            head: true,
        },
        x => Role::Stage {
            first,
            last: x.parse().unwrap_or(0),
            head: false,
        },
    }
}

enum ControlEnd {
    Shutdown,
    Lost,
}

fn control_session(
    cfg: &WorkerConfig,
    mut hello: Hello,
    bound: std::net::SocketAddr,
    shared: &Arc<Shared>,
    jobs: &Sender<Job>,
) -> anyhow::Result<ControlEnd> {
    let stream = wire::dial(&cfg.coordinator)?;
    let local_ip = stream.local_addr()?.ip();
    hello.listen = Some(match &cfg.advertise {
        Some(a) => a.clone(),
        None if bound.ip().is_unspecified() => format!("{local_ip}:{}", bound.port()),
        None => bound.to_string(),
    });
    let (conn, mut reader, welcome) = wire::connect(stream, &cfg.auth, hello)?;
    tracing::info!(
        "stage {}: registered with {} ({})",
        shared.label,
        conn.peer(),
        welcome.message
    );
    loop {
        let f = match reader.recv() {
            Ok(f) => f,
            Err(_) => return Ok(ControlEnd::Lost),
        };
        match f.kind {
            Kind::Route => {
                let msg: Control = wire::decode("control", &f.payload)?;
                match msg {
                    Control::Route { epoch, next, act } => {
                        *shared.act.lock().unwrap_or_else(|e| e.into_inner()) = act;
                        let reply = match connect_downstream(cfg, next.as_deref(), shared) {
                            Ok(()) => ControlReply::RouteReady { epoch },
                            Err(e) => ControlReply::RouteFailed {
                                epoch,
                                detail: format!("{e:#}"),
                            },
                        };
                        conn.send_msg(Kind::Route, f.request_id, &reply)?;
                    }
                    Control::ResetSessions => {
                        let _ = jobs.send(Job::Reset);
                    }
                    Control::Shutdown => return Ok(ControlEnd::Shutdown),
                }
            }
            Kind::Ping => conn.send(&Frame::new(Kind::Pong, f.request_id, Vec::new()))?,
            other => tracing::warn!(
                "stage {}: unexpected {other:?} on the control link",
                shared.label
            ),
        }
    }
}

fn connect_downstream(
    cfg: &WorkerConfig,
    next: Option<&str>,
    shared: &Arc<Shared>,
) -> anyhow::Result<()> {
    let old = shared
        .downstream
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some(old) = old {
        old.shutdown();
    }
    let Some(next) = next else { return Ok(()) };
    let stream = wire::dial(next)?;
    let hello = Hello {
        protocol: wire::PROTOCOL_VERSION,
        build: build_id(),
        role: Role::Hop,
        fingerprint: String::new(),
        n_ctx: 0,
        listen: None,
        nonce: [0; 32],
        keyless: false,
    };
    let (conn, reader, _) = wire::connect(stream, &cfg.auth, hello)?;
    *shared.downstream.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn);
    let shared2 = Arc::clone(shared);
    std::thread::Builder::new()
        .name("stage-relay".into())
        .spawn(move || relay_upstream(reader, shared2))?;
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

fn compute_loop(mut stage: StageRuntime, jobs: Receiver<Job>, shared: Arc<Shared>) {
    let label = shared.label.clone();
    let n_embd = stage.model().hp.n_embd;
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Reset => stage.reset_all(),
            Job::Work { frame, arrived } => {
                let started = Instant::now();
                let rid = frame.request_id;
                let outcome = run_work(&mut stage, &frame, n_embd);
                let compute = started.elapsed();
                let t_send = Instant::now();
                let mut timing = HopTiming {
                    stage: label.clone(),
                    wait_us: started.duration_since(arrived).as_micros() as u64,
                    compute_us: compute.as_micros() as u64,
                    send_us: 0,
                    bytes_in: frame.payload.len() as u64,
                    bytes_out: 0,
                };
                let out = match outcome {
                    Ok(WorkOut::Logits(h, raw)) => {
                        timing.bytes_out = raw.len() as u64;
                        let mut h = h;
                        timing.send_us = t_send.elapsed().as_micros() as u64;
                        h.timings.insert(0, timing);
                        send_on(&shared.upstream, &pack(Kind::WorkResult, rid, &h, &raw))
                    }
                    Ok(WorkOut::Forward(header, raw)) => {
                        let act = *shared.act.lock().unwrap_or_else(|e| e.into_inner());
                        let mut enc =
                            Vec::with_capacity(act.encoded_len(header.tokens.len(), n_embd));
                        act.encode(&raw, n_embd, &mut enc);
                        let h = WorkHeader { act, ..header };
                        let f = pack(Kind::Work, rid, &h, &enc);
                        timing.bytes_out = f.payload.len() as u64;
                        timing.send_us = t_send.elapsed().as_micros() as u64;
                        shared
                            .timings
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(rid, timing);
                        match send_on(&shared.downstream, &f) {
                            Ok(()) => Ok(()),
                            Err(e) => {
                                shared
                                    .timings
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .remove(&rid);
                                let detail = format!("cannot reach the next stage: {e}");
                                send_on(
                                    &shared.upstream,
                                    &failure(
                                        rid,
                                        &StageFailure::LinkLost {
                                            stage: label.clone(),
                                            detail,
                                        },
                                    ),
                                )
                            }
                        }
                    }
                    Err(fail) => send_on(&shared.upstream, &failure(rid, &fail)),
                };
                if let Err(e) = out {
                    tracing::warn!(
                        "stage {label}: could not send the result of request {rid}: {e}"
                    );
                }
            }
            Job::Op { frame } => {
                if let Err(e) = run_op(&mut stage, &frame, &shared) {
                    let _ = send_on(
                        &shared.upstream,
                        &failure(
                            frame.request_id,
                            &StageFailure::Failed {
                                stage: label.clone(),
                                detail: e,
                            },
                        ),
                    );
                }
            }
        }
    }
}

enum WorkOut {
    Logits(ResultHeader, Vec<u8>),
    Forward(WorkHeader, Vec<f32>),
}

fn run_work(
    stage: &mut StageRuntime,
    frame: &Frame,
    n_embd: usize,
) -> Result<WorkOut, StageFailure> {
    let label = stage.label();
    let failed = |detail: String| StageFailure::Failed {
        stage: label.clone(),
        detail,
    };
    let (header, raw): (WorkHeader, &[u8]) =
        unpack("work", &frame.payload).map_err(|e| failed(e.to_string()))?;
    if header.n_embd as usize != n_embd {
        return Err(failed(format!(
            "hidden size {} but this model has {n_embd}",
            header.n_embd
        )));
    }
    let hidden = header
        .act
        .decode(raw, header.tokens.len(), n_embd)
        .ok_or_else(|| {
            failed(format!(
                "{} activation bytes for {} rows",
                raw.len(),
                header.tokens.len()
            ))
        })?;
    match stage.run(&header.seqs, &header.tokens, StageInput::Hidden(&hidden)) {
        Ok(model::StageOutput::Logits(l)) => {
            let raw: Vec<u8> = l.data.iter().flat_map(|v| v.to_le_bytes()).collect();
            let h = ResultHeader {
                n_rows: l.rows.len() as u32,
                n_vocab: l.n_vocab as u32,
                rows: l.rows.iter().map(|&r| r as u32).collect(),
                timings: Vec::new(),
            };
            Ok(WorkOut::Logits(h, raw))
        }
        Ok(model::StageOutput::Hidden(h)) => Ok(WorkOut::Forward(header, h)),
        Err(StageError::HashMismatch { stage, session, .. }) => {
            Err(StageFailure::Desync { stage, session })
        }
        Err(e) => Err(failed(e.to_string())),
    }
}

fn run_op(stage: &mut StageRuntime, frame: &Frame, shared: &Arc<Shared>) -> Result<(), String> {
    let (op, _): (SessionOp, _) =
        unpack("session op", &frame.payload).map_err(|e| e.to_string())?;
    let rid = frame.request_id;
    match &op {
        SessionOp::Destroy { session } => stage.destroy(*session),
        SessionOp::Snapshot { session, n } => {
            for layer in stage.layers.clone() {
                let (k, v) = stage
                    .export_layer(*session, layer, *n as usize)
                    .unwrap_or_default();
                let part = SnapshotPart {
                    session: *session,
                    layer: layer as u32,
                    k,
                    v,
                };
                send_on(&shared.upstream, &pack(Kind::SnapshotPart, rid, &part, &[]))
                    .map_err(|e| e.to_string())?;
            }
        }
        SessionOp::Restore { session, tokens } => stage
            .begin_restore(*session, tokens)
            .map_err(|e| e.to_string())?,
        SessionOp::Barrier => {}
        SessionOp::RestoreLayer {
            session,
            layer,
            k,
            v,
        } => {
            if stage.layers.contains(&(*layer as usize)) {
                stage
                    .import_layer(*session, *layer as usize, k, v)
                    .map_err(|e| e.to_string())?;
                // Layers are sent in order; this stage's last layer needs no forwarding.
                return Ok(());
            }
        }
    }
    let forward = match &op {
        SessionOp::RestoreLayer { layer, .. } => (*layer as usize) > *stage.layers.end(),
        _ => true,
    };
    let has_next = shared
        .downstream
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_some();
    if forward && has_next {
        send_on(&shared.downstream, frame).map_err(|e| e.to_string())
    } else if matches!(op, SessionOp::RestoreLayer { .. }) {
        Ok(())
    } else {
        // The last stage acknowledges; the ack is relayed back up.
        send_on(&shared.upstream, &pack(Kind::SessionOpDone, rid, &(), &[]))
            .map_err(|e| e.to_string())
    }
}

/// Parses `host:port`, naming the flag on error.
pub fn check_addr(flag: &str, addr: &str) -> anyhow::Result<()> {
    addr.to_socket_addrs()
        .map_err(|e| anyhow::anyhow!("{flag} {addr}: {e}"))?;
    Ok(())
}
