//! A pipeline stage's compute thread and the links it sends on: work items and session
//! operations are taken in arrival order from one queue, run through the stage's [`Runner`],
//! and their outcome goes downstream (hidden states) or upstream (logits, snapshot parts,
//! failures).

use std::collections::HashMap;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use engine::{RunError, Runner};
use model::{SelectionCarry, StageInput};

use super::protocol::*;
use crate::activation::ActFormat;
use crate::error::ClusterError;
use crate::wire::{Connection, Frame, Kind, WireError, pack, unpack};

pub(super) enum Job {
    Work { frame: Frame, arrived: Instant },
    Op { frame: Frame },
    Reset,
}

/// The link a stage sends on, replaced when the route changes.
pub(super) type Slot = Arc<Mutex<Option<Connection>>>;

/// What the stage's threads (compute, upstream and downstream readers, control) share.
pub(super) struct Shared {
    pub upstream: Slot,
    pub downstream: Slot,
    /// The activation format to send downstream (set with each route).
    pub act: Mutex<ActFormat>,
    /// Timing of work items forwarded downstream, attached when their result comes back.
    pub timings: Mutex<HashMap<u64, HopTiming>>,
    pub label: String,
}

pub(super) fn send_on(slot: &Slot, frame: &Frame) -> Result<(), WireError> {
    let conn = slot.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match conn {
        Some(c) => c.send(frame),
        None => Err(WireError::Closed),
    }
}

pub(super) fn failure(request_id: u64, f: &StageFailure) -> Frame {
    let mut frame = pack(Kind::WorkResult, request_id, f, &[]);
    frame.flags = FLAG_FAILURE;
    frame
}

pub(super) fn compute_loop(mut stage: Runner, jobs: Receiver<Job>, shared: Arc<Shared>) {
    let label = shared.label.clone();
    let n_embd = stage.model().hp.hidden_width();
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
                                detail: e.to_string(),
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

fn run_work(stage: &mut Runner, frame: &Frame, n_embd: usize) -> Result<WorkOut, StageFailure> {
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
    let mut carry = SelectionCarry {
        incoming: (!header.selection.is_empty()).then(|| header.selection.clone()),
        outgoing: None,
    };
    match stage.run_with_hooks(
        &header.seqs,
        &header.tokens,
        StageInput::HiddenWithTokens(&hidden, &header.tokens),
        &mut carry,
    ) {
        Ok(model::StageOutput::Logits(l)) => {
            let (h, raw) = ResultHeader::of(&l);
            Ok(WorkOut::Logits(h, raw))
        }
        Ok(model::StageOutput::Hidden(h)) => {
            let selection = carry.outgoing.unwrap_or_default();
            Ok(WorkOut::Forward(
                WorkHeader {
                    selection,
                    ..header
                },
                h,
            ))
        }
        Err(RunError::HashMismatch { range, session, .. }) => Err(StageFailure::Desync {
            stage: range,
            session,
        }),
        Err(e) => Err(failed(e.to_string())),
    }
}

fn run_op(stage: &mut Runner, frame: &Frame, shared: &Arc<Shared>) -> Result<(), ClusterError> {
    let (op, _): (SessionOp, _) =
        unpack("session op", &frame.payload).map_err(|e| ClusterError::link("upstream", e))?;
    let rid = frame.request_id;
    let range = stage.range().clone();
    let send = |slot: &Slot, f: &Frame| {
        send_on(slot, f).map_err(|e| ClusterError::link(format!("stage {range}"), e))
    };
    match &op {
        SessionOp::Destroy { session } => stage.destroy(*session),
        SessionOp::Snapshot { session, n } => {
            for layer in range.layers() {
                let (k, v) = stage
                    .export_layer(*session, layer, *n as usize)
                    .unwrap_or_default();
                let part = SnapshotPart {
                    session: *session,
                    layer: layer as u32,
                    k,
                    v,
                };
                send(&shared.upstream, &pack(Kind::SnapshotPart, rid, &part, &[]))?;
            }
        }
        SessionOp::Restore { session, tokens } => stage.begin_restore(*session, tokens)?,
        SessionOp::Barrier => {}
        SessionOp::RestoreLayer {
            session,
            layer,
            k,
            v,
        } => {
            if range.contains(*layer as usize) {
                // Layers are sent in order; this stage's own layers need no forwarding.
                return Ok(stage.import_layer(*session, *layer as usize, k, v)?);
            }
        }
    }
    let forward = match &op {
        SessionOp::RestoreLayer { layer, .. } => (*layer as usize) > range.last,
        _ => true,
    };
    let has_next = shared
        .downstream
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_some();
    if forward && has_next {
        send(&shared.downstream, frame)
    } else if matches!(op, SessionOp::RestoreLayer { .. }) {
        Ok(())
    } else {
        // The last stage acknowledges; the ack is relayed back up.
        send(&shared.upstream, &pack(Kind::SessionOpDone, rid, &(), &[]))
    }
}
