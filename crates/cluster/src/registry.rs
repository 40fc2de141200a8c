//! A coordinator's registry of the peers that registered with it: admission (handshake and
//! the coordinator's checks, each on its own thread), the control link of every member, and a
//! generation counter that changes whenever a member joins or leaves. The pipeline (members
//! claim layer ranges) and the tensor-parallel group (members claim ranks) both use it; what a
//! claim is and when it conflicts is their [`Admission`].

use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{ClusterError, Result};
use crate::wire::{
    self, Connection, Frame, HandshakeSlot, Hello, LinkConfig, PendingHandshakes, Welcome,
    WireError,
};

/// What a coordinator accepts from a registering peer.
pub trait Admission: Send + Sync + 'static {
    /// What a member holds (a layer range, a rank).
    type Claim: Clone + Send + Sync + 'static;

    /// Validates a hello (role, model, context, data address) against the current `members`
    /// and decides the newcomer's claim, or the reason to refuse it.
    fn claim(
        &self,
        hello: &Hello,
        members: &[Arc<Member<Self::Claim>>],
    ) -> std::result::Result<Self::Claim, String>;

    /// Why `claim` cannot join `members` now (checked again under the lock when it joins,
    /// since another peer may have taken the claim during its handshake).
    fn conflict(&self, claim: &Self::Claim, members: &[Arc<Member<Self::Claim>>])
    -> Option<String>;

    /// What the newcomer is told.
    fn welcome(&self, claim: &Self::Claim) -> Welcome;

    /// How logs name a member: `stage 4:output`, `rank 2`.
    fn describe(claim: &Self::Claim) -> String;
}

/// The checks every coordinator makes of a newcomer: the same model, at least the
/// coordinator's context, and a data address to reach it at.
pub fn check_peer(
    hello: &Hello,
    fingerprint: &str,
    n_ctx: usize,
) -> std::result::Result<(), String> {
    if hello.fingerprint != fingerprint {
        return Err(format!(
            "different model: the peer has {}, the coordinator {fingerprint}",
            hello.fingerprint
        ));
    }
    if (hello.n_ctx as usize) < n_ctx {
        return Err(format!(
            "context {} is smaller than the coordinator's {n_ctx}",
            hello.n_ctx
        ));
    }
    if hello.listen.is_none() {
        return Err("the peer announced no data port".into());
    }
    Ok(())
}

/// A registered peer.
pub struct Member<C> {
    pub id: u64,
    pub claim: C,
    /// `stage 4:output (10.0.0.2:5123)`: the claim and the address of its control link.
    pub name: String,
    /// Where it accepts data links (as it announced).
    pub listen: String,
    pub control: Connection,
    frames: Mutex<Receiver<std::result::Result<Frame, WireError>>>,
}

impl<C> Member<C> {
    /// Waits up to `timeout` for a frame on the control link that `pick` takes (`Some`);
    /// frames it passes over are dropped. `what` names the awaited answer in errors.
    pub fn wait<T>(
        &self,
        what: &'static str,
        timeout: Duration,
        mut pick: impl FnMut(Frame) -> Option<std::result::Result<T, WireError>>,
    ) -> Result<T> {
        let rx = self.frames.lock().unwrap_or_else(|e| e.into_inner());
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Ok(f)) => match pick(f) {
                    Some(r) => return r.map_err(|e| ClusterError::link(&self.name, e)),
                    None => continue,
                },
                Ok(Err(e)) => return Err(ClusterError::link(&self.name, e)),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(ClusterError::Timeout {
                        peer: self.name.clone(),
                        what,
                        timeout,
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(ClusterError::Left {
                        peer: self.name.clone(),
                    });
                }
            }
        }
    }
}

struct State<C> {
    members: Vec<Arc<Member<C>>>,
    next_id: u64,
    /// Bumped whenever a member joins or leaves.
    generation: u64,
}

pub struct Registry<A: Admission> {
    admission: A,
    state: Mutex<State<A::Claim>>,
    changed: Condvar,
}

impl<A: Admission> Registry<A> {
    /// Accepts peers on `listener` from now on (a thread per handshake, a bounded number at once).
    pub fn start(admission: A, listener: TcpListener, link: LinkConfig) -> Result<Arc<Self>> {
        let registry = Arc::new(Registry {
            admission,
            state: Mutex::new(State {
                members: Vec::new(),
                next_id: 0,
                generation: 0,
            }),
            changed: Condvar::new(),
        });
        let reg = Arc::clone(&registry);
        std::thread::Builder::new()
            .name("registry-accept".into())
            .spawn(move || {
                let pending = PendingHandshakes::default();
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    let (reg, link) = (Arc::clone(&reg), link.clone());
                    pending.spawn(stream, move |stream, slot| reg.admit(stream, slot, &link));
                }
            })
            .map_err(|source| ClusterError::Io {
                what: "spawning the registry thread".into(),
                source,
            })?;
        Ok(registry)
    }

    pub fn admission(&self) -> &A {
        &self.admission
    }

    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// The members and the generation they belong to, read together.
    pub fn members(&self) -> (Vec<Arc<Member<A::Claim>>>, u64) {
        let st = self.lock();
        (st.members.clone(), st.generation)
    }

    /// Waits until the registry changes from generation `since` or `deadline` passes.
    pub fn wait_change(&self, since: u64, deadline: Instant) {
        let mut st = self.lock();
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

    fn lock(&self) -> std::sync::MutexGuard<'_, State<A::Claim>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn admit(self: Arc<Self>, stream: TcpStream, slot: HandshakeSlot, link: &LinkConfig) {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let mut claimed = None;
        let accepted = wire::accept(stream, link, |hello| {
            let members = self.lock().members.clone();
            let claim = self.admission.claim(hello, &members)?;
            let welcome = self.admission.welcome(&claim);
            claimed = Some(claim);
            Ok(welcome)
        });
        drop(slot);
        let (conn, mut reader, hello) = match accepted {
            Ok(x) => x,
            Err(e) => {
                wire::log_rejected(peer, &e);
                return;
            }
        };
        let Some(claim) = claimed else { return };
        let name = format!("{} ({peer})", A::describe(&claim));
        // Bounded: a member answers commands; one that sends unasked frames faster than they
        // are taken stalls its own link (and is dropped when it stays stalled).
        let (tx, rx) = mpsc::sync_channel(64);
        let member = {
            let mut st = self.lock();
            if let Some(reason) = self.admission.conflict(&claim, &st.members) {
                drop(st);
                tracing::warn!("refused {name}: {reason}");
                conn.send_error(0, &reason);
                conn.shutdown();
                return;
            }
            st.next_id += 1;
            let member = Arc::new(Member {
                id: st.next_id,
                claim,
                name,
                listen: hello.listen.unwrap_or_default(),
                control: conn,
                frames: Mutex::new(rx),
            });
            st.members.push(Arc::clone(&member));
            st.generation += 1;
            member
        };
        self.changed.notify_all();
        tracing::info!("{} registered (data {})", member.name, member.listen);
        // The control link's reader: frames go to whoever waits on the member; the end of the
        // stream removes it.
        loop {
            match reader.recv() {
                Ok(f) => {
                    if tx.send(Ok(f)).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!("{} left: {e}", member.name);
                    let _ = tx.send(Err(e));
                    break;
                }
            }
        }
        let mut st = self.lock();
        st.members.retain(|m| m.id != member.id);
        st.generation += 1;
        drop(st);
        self.changed.notify_all();
    }
}
