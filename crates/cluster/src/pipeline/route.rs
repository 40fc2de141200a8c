//! The coordinator's route: the chain of workers after its own layers, told their next hops
//! back to front, the data link to the first of them, and the thread that collects what comes
//! back (results, snapshot parts, failures) from that link.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

use engine::EngineError;

use super::protocol::*;
use super::registry::{StageAdmission, Worker, chain};
use crate::activation::ActFormat;
use crate::error::{ClusterError, Result};
use crate::registry::Registry;
use crate::wire::{self, Connection, Frame, Hello, Kind, LinkConfig, Role, pack, unpack};

/// Frames from the first stage waiting for the coordinator, at most.
const RESULT_QUEUE: usize = 1024;

/// How long a worker may take to confirm its next hop.
const ROUTE_CONFIRM: Duration = Duration::from_secs(15);

/// Why an evaluation attempt failed.
pub(super) enum Attempt {
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

impl From<ClusterError> for Attempt {
    fn from(e: ClusterError) -> Self {
        Attempt::Fatal(e.into())
    }
}

pub(super) struct Route {
    pub workers: Vec<Arc<Worker>>,
    pub data: Connection,
    pub results: Receiver<Frame>,
    broken: Arc<AtomicBool>,
    generation: u64,
}

/// What a route needs to know of its coordinator.
pub(super) struct RouteParams<'a> {
    pub epoch: u64,
    pub act: ActFormat,
    pub link: &'a LinkConfig,
    pub fingerprint: &'a str,
    pub n_ctx: usize,
}

impl Route {
    /// Wires `chain` (registry generation `generation`): each worker learns its next hop,
    /// back to front so that every hop is listening when its upstream connects.
    pub fn wire(chain: Vec<Arc<Worker>>, generation: u64, p: RouteParams) -> Result<Route> {
        for (i, w) in chain.iter().enumerate().rev() {
            let next = chain.get(i + 1).map(|n| n.listen.clone());
            let msg = Control::Route {
                epoch: p.epoch,
                next,
                act: p.act,
            };
            // The reset goes first: the stage queues it before it answers the route, so it
            // lands ahead of any work on the new data link. Sent after the route, it could be
            // queued between a replay's first chunk and the next ones (a false desync).
            w.control
                .send_msg(Kind::Route, 0, &Control::ResetSessions)
                .map_err(|e| ClusterError::link(&w.name, e))?;
            w.control
                .send_msg(Kind::Route, p.epoch, &msg)
                .map_err(|e| ClusterError::link(&w.name, e))?;
            let reply = w.wait("the route", ROUTE_CONFIRM, |f| {
                (f.kind == Kind::Route && f.request_id == p.epoch)
                    .then(|| wire::decode::<ControlReply>("control reply", &f.payload))
            })?;
            if let ControlReply::RouteFailed { detail, .. } = reply {
                return Err(ClusterError::peer(&w.name, detail));
            }
        }
        let first = &chain[0];
        let stream = wire::dial(&first.listen).map_err(|source| ClusterError::Io {
            what: format!("data link to {}", first.name),
            source,
        })?;
        let hello = Hello::new(Role::Hop, p.fingerprint, p.n_ctx as u32, None);
        let (data, mut reader, _) = wire::connect(stream, p.link, hello)
            .map_err(|e| ClusterError::link(format!("data link to {}", first.name), e))?;
        let broken = Arc::new(AtomicBool::new(false));
        // Bounded: results come only for items in flight (a window) and snapshot parts that the
        // coordinator is collecting; a stage that floods the link waits.
        let (tx, results) = mpsc::sync_channel(RESULT_QUEUE);
        let flag = Arc::clone(&broken);
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
                            flag.store(true, Ordering::Release);
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
            .map_err(|source| ClusterError::Io {
                what: "spawning the result reader".into(),
                source,
            })?;
        Ok(Route {
            workers: chain,
            data,
            results,
            broken,
            generation,
        })
    }

    /// Whether the data link is up and no stage joined or left since the route was wired.
    pub fn is_ok(&self, registry: &Registry<StageAdmission>) -> bool {
        !self.broken.load(Ordering::Acquire) && self.generation == registry.generation()
    }

    pub fn send(&self, frame: &Frame) -> std::result::Result<(), Attempt> {
        self.data
            .send(frame)
            .map_err(|e| Attempt::RouteLost(format!("sending to the first stage: {e}")))
    }

    /// Waits for the result of request `rid`; stage failures and a lost link become
    /// [`Attempt`]s.
    pub fn wait_result(
        &self,
        rid: u64,
        registry: &Registry<StageAdmission>,
        n_vocab: usize,
    ) -> std::result::Result<(ResultHeader, Vec<u8>), Attempt> {
        loop {
            let f = match self.results.recv_timeout(Duration::from_millis(250)) {
                Ok(f) => f,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if self.generation != registry.generation() && chain(registry).is_err() {
                        return Err(Attempt::RouteLost("a stage left".into()));
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Attempt::RouteLost("data link closed".into()));
                }
            };
            if let Some(fail) = failure_for(&f, rid) {
                return Err(fail);
            }
            if f.request_id != rid || f.kind != Kind::WorkResult {
                continue;
            }
            let (h, raw): (ResultHeader, &[u8]) = unpack("result", &f.payload)
                .map_err(|e| Attempt::Fatal(ClusterError::link("the first stage", e).into()))?;
            // Sizes come from a peer: check them before anyone indexes by them.
            let n_rows = h.n_rows as usize;
            if h.n_vocab as usize != n_vocab
                || h.rows.len() != n_rows
                || raw.len() != n_rows * n_vocab * 4
            {
                let stage = h.timings.last().map_or("the last stage", |t| &t.stage[..]);
                return Err(Attempt::Fatal(
                    ClusterError::peer(
                        stage,
                        format!(
                            "a result of {} rows × {} vocabulary ({} bytes, {} row ids) for a model of {n_vocab}",
                            h.n_rows,
                            h.n_vocab,
                            raw.len(),
                            h.rows.len()
                        ),
                    )
                    .into(),
                ));
            }
            return Ok((h, raw.to_vec()));
        }
    }

    /// `→ 4:11 at 10.0.0.2:7001 → 12:output at …`
    pub fn describe(&self) -> String {
        self.workers
            .iter()
            .map(|w| format!(" → {} at {}", w.claim, w.listen))
            .collect()
    }
}

/// The failure a frame reports to a coordinator waiting on request `rid`, if it is a failure
/// that concerns it: one of `rid` or of a later request in flight, or of none (request 0: a
/// link or a stage lost). Failures of earlier requests are stale: they belong to the rest of an
/// attempt already given up (the later chunks of a replay that failed at its first), and taking
/// them would fail the retry too.
pub(super) fn failure_for(f: &Frame, rid: u64) -> Option<Attempt> {
    if f.kind != Kind::WorkResult || f.flags & FLAG_FAILURE == 0 {
        return None;
    }
    if f.request_id != 0 && f.request_id < rid {
        return None;
    }
    let fail: StageFailure = match unpack("stage failure", &f.payload) {
        Ok((x, _)) => x,
        Err(e) => return Some(Attempt::RouteLost(e.to_string())),
    };
    Some(match fail {
        StageFailure::Desync { session, stage } => {
            tracing::warn!("stage {stage} lost track of session {session}; replaying it");
            Attempt::Desync(session)
        }
        StageFailure::LinkLost { stage, detail } => {
            Attempt::RouteLost(format!("{stage}: {detail}"))
        }
        StageFailure::Failed { stage, detail } => {
            Attempt::Fatal(ClusterError::peer(format!("stage {stage}"), detail).into())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::stage_loop::failure;
    use super::*;

    fn desync(rid: u64) -> Frame {
        failure(
            rid,
            &StageFailure::Desync {
                stage: "2:3".into(),
                session: 1,
            },
        )
    }

    #[test]
    fn failures_of_requests_given_up_do_not_fail_the_retry() {
        // A replay of chunks 5..=8 failed at 5; the desyncs of 6, 7 and 8 are still queued
        // when the retry waits on request 9.
        for stale in [5, 6, 8] {
            assert!(failure_for(&desync(stale), 9).is_none(), "request {stale}");
        }
        assert!(matches!(
            failure_for(&desync(9), 9),
            Some(Attempt::Desync(1))
        ));
        assert!(matches!(
            failure_for(&desync(10), 9),
            Some(Attempt::Desync(1))
        ));
        let lost = failure(
            0,
            &StageFailure::LinkLost {
                stage: "2:3".into(),
                detail: "reset".into(),
            },
        );
        assert!(matches!(failure_for(&lost, 9), Some(Attempt::RouteLost(_))));
        let result = pack(Kind::WorkResult, 9, &(), &[]);
        assert!(failure_for(&result, 9).is_none());
    }
}
