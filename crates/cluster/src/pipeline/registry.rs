//! The coordinator's view of its workers: who registered which layer range, whether their
//! control link is alive, and the route (a contiguous chain ending at the head) they form.

use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::protocol::ControlReply;
use crate::stage::range_label;
use crate::wire::{self, AuthMode, Connection, Hello, Kind, Role, Welcome};

/// A registered worker.
pub struct Worker {
    pub id: u64,
    pub first: usize,
    pub last: usize,
    pub head: bool,
    /// Where it accepts its upstream data link.
    pub listen: String,
    pub control: Connection,
    pub replies: Arc<Mutex<Receiver<(u64, ControlReply)>>>,
}

impl Worker {
    pub fn label(&self) -> String {
        range_label(&(self.first..=self.last), self.head)
    }
}

#[derive(Default)]
struct State {
    workers: Vec<Arc<Worker>>,
    next_id: u64,
    /// Bumped whenever a worker joins or leaves.
    generation: u64,
}

/// What the registry checks newcomers against.
#[derive(Clone)]
pub struct Expect {
    pub fingerprint: String,
    pub n_layer: usize,
    /// Layers the coordinator itself runs: `0..=local_last`.
    pub local_last: usize,
    pub n_ctx: usize,
}

pub struct Registry {
    state: Mutex<State>,
    changed: Condvar,
    expect: Expect,
}

impl Registry {
    pub fn new(expect: Expect) -> Arc<Registry> {
        Arc::new(Registry {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            expect,
        })
    }

    pub fn generation(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .generation
    }

    pub fn workers(&self) -> Vec<Arc<Worker>> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .workers
            .clone()
    }

    /// Waits until the registry changes or `deadline` passes.
    pub fn wait_change(&self, since: u64, deadline: Instant) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while st.generation == since {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn check(&self, hello: &Hello) -> Result<(usize, usize, bool), String> {
        let e = &self.expect;
        let Role::Stage { first, last, head } = hello.role.clone() else {
            return Err(
                "this coordinator runs a pipeline; the peer is not a pipeline stage".into(),
            );
        };
        if hello.fingerprint != e.fingerprint {
            return Err(format!(
                "different model: the peer has {}, the coordinator {}",
                hello.fingerprint, e.fingerprint
            ));
        }
        let first = first as usize;
        let last = if head { e.n_layer - 1 } else { last as usize };
        if first > last || last >= e.n_layer {
            return Err(format!(
                "invalid layer range {}: the model has layers 0..={}",
                range_label(&(first..=last), head),
                e.n_layer - 1
            ));
        }
        if first <= e.local_last {
            return Err(format!(
                "overlapping range {}: the coordinator runs layers 0..={}",
                range_label(&(first..=last), head),
                e.local_last
            ));
        }
        if (hello.n_ctx as usize) < e.n_ctx {
            return Err(format!(
                "context {} is smaller than the coordinator's {}",
                hello.n_ctx, e.n_ctx
            ));
        }
        if hello.listen.is_none() {
            return Err("the stage announced no data port".into());
        }
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = st
            .workers
            .iter()
            .find(|w| first <= w.last && w.first <= last)
        {
            return Err(format!(
                "overlapping range {}: layers {} are already served by {}",
                range_label(&(first..=last), head),
                w.label(),
                w.control.peer()
            ));
        }
        Ok((first, last, head))
    }

    /// Accepts workers forever (runs on its own thread).
    pub fn serve(self: Arc<Self>, listener: TcpListener, auth: AuthMode) {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let (reg, auth) = (Arc::clone(&self), auth.clone());
            let _ = std::thread::Builder::new()
                .name("coord-handshake".into())
                .spawn(move || reg.admit(stream, &auth));
        }
    }

    fn admit(self: Arc<Self>, stream: TcpStream, auth: &AuthMode) {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let mut range = None;
        let accepted = wire::accept(stream, auth, |h| {
            let r = self.check(h)?;
            range = Some(r);
            Ok(Welcome {
                message: format!("serving layers {}", range_label(&(r.0..=r.1), r.2)),
                ..Default::default()
            })
        });
        let (conn, mut reader, hello) = match accepted {
            Ok(x) => x,
            Err(e) => {
                wire::log_rejected(peer, &e);
                return;
            }
        };
        let (first, last, head) = range.expect("set by the accepted check");
        let (tx, rx): (Sender<(u64, ControlReply)>, _) = mpsc::channel();
        let worker = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            // A concurrent registration may have taken the range meanwhile.
            if let Some(w) = st
                .workers
                .iter()
                .find(|w| first <= w.last && w.first <= last)
            {
                let reason = format!(
                    "overlapping range: layers {} are already served by {}",
                    w.label(),
                    w.control.peer()
                );
                tracing::warn!("refused {peer}: {reason}");
                conn.send_error(0, &reason);
                conn.shutdown();
                return;
            }
            st.next_id += 1;
            let w = Arc::new(Worker {
                id: st.next_id,
                first,
                last,
                head,
                listen: hello.listen.clone().unwrap_or_default(),
                control: conn,
                replies: Arc::new(Mutex::new(rx)),
            });
            st.workers.push(Arc::clone(&w));
            st.generation += 1;
            w
        };
        self.changed.notify_all();
        tracing::info!(
            "stage {} registered from {peer} (data {})",
            worker.label(),
            worker.listen
        );
        // The control link's reader: replies go to the route builder; end of stream = gone.
        loop {
            match reader.recv() {
                Ok(f) if f.kind == Kind::Route => {
                    match wire::decode::<ControlReply>("control reply", &f.payload) {
                        Ok(r) => {
                            let _ = tx.send((f.request_id, r));
                        }
                        Err(e) => tracing::warn!("stage {}: {e}", worker.label()),
                    }
                }
                Ok(f) if f.kind == Kind::Pong => {}
                Ok(f) => tracing::warn!(
                    "stage {}: unexpected {:?} on the control link",
                    worker.label(),
                    f.kind
                ),
                Err(e) => {
                    tracing::warn!("stage {} ({peer}) left: {e}", worker.label());
                    break;
                }
            }
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.workers.retain(|w| w.id != worker.id);
        st.generation += 1;
        drop(st);
        self.changed.notify_all();
    }

    /// The chain of workers covering `local_last+1..` up to the head, or the first missing layer.
    pub fn chain(&self) -> Result<Vec<Arc<Worker>>, usize> {
        let workers = self.workers();
        let mut next = self.expect.local_last + 1;
        let mut chain = Vec::new();
        loop {
            let Some(w) = workers.iter().find(|w| w.first == next) else {
                return Err(next);
            };
            chain.push(Arc::clone(w));
            if w.head {
                return Ok(chain);
            }
            next = w.last + 1;
            if next >= self.expect.n_layer {
                // Covers every layer but nobody holds the head.
                return Err(next);
            }
        }
    }
}

/// Waits for a control reply with `request_id` from `w`.
pub fn wait_reply(w: &Worker, request_id: u64, timeout: Duration) -> Result<ControlReply, String> {
    let rx = w.replies.lock().unwrap_or_else(|e| e.into_inner());
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((id, r)) if id == request_id => return Ok(r),
            Ok(_) => continue,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(format!(
                    "stage {} did not confirm the route in {timeout:?}",
                    w.label()
                ));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(format!("stage {} left", w.label()));
            }
        }
    }
}
