//! Snapshots of a pipeline's sessions: the coordinator exports its own layers and asks every
//! stage for theirs over the data path (in order with the work), and restores by sending each
//! stage its layers the same way. The result does not depend on the split.

use std::time::{Duration, Instant};

use engine::executor::SessionId;
use engine::snapshot::Snapshot;
use engine::{EngineError, Result};

use super::coordinator::{PipelineExecutor, exec_err};
use super::protocol::*;
use super::route::{Attempt, failure_for};
use crate::error::ClusterError;
use crate::wire::{Frame, Kind, pack, unpack};

/// How long the stages may take to send or take a session's KV.
const SESSION_OP_TIMEOUT: Duration = Duration::from_secs(120);

impl PipelineExecutor {
    pub(super) fn snapshot_session(&mut self, session: SessionId) -> Result<Snapshot> {
        if !self.sessions.contains(session) {
            return Err(exec_err(format!("session {session} does not exist")));
        }
        let tokens = self.sessions.get(session).to_vec();
        let n = tokens.len();
        // Make sure every stage holds the session (after a failure it may need a replay).
        if !self.all_local() && !self.sessions.is_synced(session) {
            self.ensure_route()?;
            self.replay_for(session, "snapshot")?;
        }
        let n_layer = self.info.n_layer;
        let mut layers: Vec<Option<(Vec<u8>, Vec<u8>)>> = vec![None; n_layer];
        for l in self.local.range().layers() {
            layers[l] = self.local.export_layer(session, l, n);
        }
        if !self.all_local() {
            let rid = self.request_id();
            self.send_op(
                rid,
                &SessionOp::Snapshot {
                    session,
                    n: n as u32,
                },
            )?;
            self.collect(rid, "the snapshot", |f| {
                if f.kind == Kind::SnapshotPart {
                    let (p, _): (SnapshotPart, _) = unpack("snapshot part", &f.payload)
                        .map_err(|e| ClusterError::link("a stage", e))?;
                    if let Some(slot) = layers.get_mut(p.layer as usize) {
                        *slot = Some((p.k, p.v));
                    }
                }
                Ok(())
            })?;
        }
        let layers = layers
            .into_iter()
            .enumerate()
            .map(|(i, l)| l.ok_or_else(|| exec_err(format!("snapshot: no stage sent layer {i}"))))
            .collect::<Result<Vec<_>>>()?;
        let snap = self.layout.assemble(tokens, layers);
        snap.check_layout(&self.layout)?;
        Ok(snap)
    }

    pub(super) fn restore_session(&mut self, session: SessionId, s: &Snapshot) -> Result<()> {
        s.check_layout(&self.layout)?;
        self.ensure_route()?;
        let range = self.local.range().clone();
        self.local
            .import(session, &s.tokens, &s.layers[range.first..=range.last])?;
        if !self.all_local() {
            let rid = self.request_id();
            self.send_op(
                rid,
                &SessionOp::Restore {
                    session,
                    tokens: s.tokens.clone(),
                },
            )?;
            for l in range.last + 1..self.info.n_layer {
                let (k, v) = &s.layers[l];
                self.send_op(
                    rid,
                    &SessionOp::RestoreLayer {
                        session,
                        layer: l as u32,
                        k: k.clone(),
                        v: v.clone(),
                    },
                )?;
            }
            self.send_op(rid, &SessionOp::Barrier)?;
            self.collect(rid, "the restore", |_| Ok(()))?;
        }
        self.sessions.set(session, s.tokens.clone());
        Ok(())
    }

    fn replay_for(&mut self, session: SessionId, what: &str) -> Result<()> {
        match self.replay(session) {
            Ok(_) => Ok(()),
            Err(Attempt::Fatal(e)) => Err(e),
            Err(Attempt::RouteLost(why)) => Err(exec_err(format!(
                "replay before {what} failed: route lost ({why})"
            ))),
            Err(Attempt::Desync(s)) => Err(exec_err(format!(
                "replay before {what} failed: session {s} diverged"
            ))),
        }
    }

    fn send_op(&self, rid: u64, op: &SessionOp) -> Result<()> {
        let route = self.route.as_ref().ok_or_else(|| exec_err("no route"))?;
        route
            .data
            .send(&pack(Kind::SessionOp, rid, op, &[]))
            .map_err(|e| ClusterError::link("the first stage", e).into())
    }

    /// Hands every frame of request `rid` to `take` until the last stage acknowledges it;
    /// a stage failure or silence past the timeout fails `what`.
    fn collect(
        &self,
        rid: u64,
        what: &str,
        mut take: impl FnMut(Frame) -> std::result::Result<(), ClusterError>,
    ) -> Result<()> {
        let route = self.route.as_ref().ok_or_else(|| exec_err("no route"))?;
        let deadline = Instant::now() + SESSION_OP_TIMEOUT;
        loop {
            let f = route
                .results
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .map_err(|_| exec_err(format!("{what}: no answer from the stages")))?;
            if let Some(fail) = failure_for(&f, rid) {
                return Err(match fail {
                    Attempt::Fatal(e) => e,
                    Attempt::RouteLost(why) => exec_err(format!("{what}: route lost ({why})")),
                    Attempt::Desync(s) => {
                        EngineError::Snapshot(format!("{what}: session {s} diverged"))
                    }
                });
            }
            if f.request_id != rid {
                continue;
            }
            if f.kind == Kind::SessionOpDone {
                return Ok(());
            }
            take(f)?;
        }
    }
}
