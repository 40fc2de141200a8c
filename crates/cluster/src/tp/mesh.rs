//! The data mesh of a tensor-parallel group: one authenticated connection between every pair
//! of ranks, a reader thread per peer, and the all-reduce. Every rank sends its partial sum to
//! every other rank and adds all of them in rank order, so every rank ends with the same bits
//! after one network hop. Partials travel as f64: the forward path keeps reductions in f64 so
//! that the split does not change the result.

use std::net::TcpListener;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use crate::error::{ClusterError, Result};
use crate::wire::{
    self, Connection, Frame, Hello, Kind, LinkConfig, PendingHandshakes, Role, WireError,
};

/// One peer of the mesh.
struct Peer {
    rank: usize,
    conn: Connection,
    frames: Receiver<std::result::Result<Frame, WireError>>,
}

pub struct Mesh {
    pub rank: usize,
    pub n_ranks: usize,
    pub epoch: u64,
    peers: Vec<Peer>,
    timeout: Duration,
    /// Exchanges done and time spent in them (for telemetry).
    pub exchanges: u64,
    pub exchange_time: Duration,
    /// The fastest exchange seen: the rank that arrives last at an exchange waits for nobody,
    /// so this approaches the pure round trip (send, the peers' frames already in flight,
    /// the sum) without the load imbalance that the mean includes.
    pub exchange_min: Duration,
}

/// How long an exchange polls for a peer's partial before it sleeps on the channel. A partial
/// usually lands within tens of microseconds (the ranks run the same layer), and waking a
/// sleeping thread costs about as much again at every one of a decode step's exchanges
/// (48 for OLMoE's 16 layers).
const SPIN: Duration = Duration::from_micros(200);

/// The next frame of a peer: polled for up to [`SPIN`], then waited for up to `timeout`.
fn receive<T>(frames: &Receiver<T>, timeout: Duration) -> std::result::Result<T, RecvTimeoutError> {
    let spin_until = Instant::now() + SPIN;
    loop {
        match frames.try_recv() {
            Ok(f) => return Ok(f),
            Err(mpsc::TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
            Err(mpsc::TryRecvError::Empty) if Instant::now() < spin_until => {
                std::hint::spin_loop();
            }
            Err(mpsc::TryRecvError::Empty) => return frames.recv_timeout(timeout),
        }
    }
}

fn spawn_reader(
    mut reader: wire::ConnectionReader,
) -> Result<Receiver<std::result::Result<Frame, WireError>>> {
    // Bounded: a rank cannot be more than one exchange ahead of the slowest (it waits for
    // everyone's partial before sending its next), so a few frames suffice.
    let (tx, rx) = mpsc::sync_channel(8);
    std::thread::Builder::new()
        .name("tp-mesh-reader".into())
        .spawn(move || {
            loop {
                let r = reader.recv();
                let stop = r.is_err();
                if tx.send(r).is_err() || stop {
                    return;
                }
            }
        })
        .map_err(|source| ClusterError::Io {
            what: "spawning a mesh reader".into(),
            source,
        })?;
    Ok(rx)
}

fn hello(rank: usize, epoch: u64) -> Hello {
    let role = Role::Rank {
        rank: Some(rank as u32),
        expert_weight: 0.0,
        held: None,
    };
    Hello::new(role, &format!("mesh-epoch-{epoch}"), 0, None)
}

fn formation(detail: String) -> ClusterError {
    ClusterError::Formation(detail)
}

impl Mesh {
    /// Connects rank `rank` to every other rank of `peers` (data addresses by rank): it dials
    /// lower ranks and accepts higher ones on `listener`.
    pub fn connect(
        rank: usize,
        peers: &[String],
        epoch: u64,
        listener: &TcpListener,
        link: &LinkConfig,
        timeout: Duration,
    ) -> Result<Mesh> {
        let n = peers.len();
        let mut out: Vec<Peer> = Vec::with_capacity(n.saturating_sub(1));
        for (r, addr) in peers.iter().enumerate().take(rank) {
            let stream = wire::dial(addr).map_err(|e| formation(format!("rank {r}: {e}")))?;
            let (conn, reader, _) = wire::connect(stream, link, hello(rank, epoch))
                .map_err(|e| ClusterError::link(format!("rank {r} at {addr}"), e))?;
            out.push(Peer {
                rank: r,
                conn,
                frames: spawn_reader(reader)?,
            });
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let io = |source| ClusterError::Io {
            what: "the mesh port".into(),
            source,
        };
        listener.set_nonblocking(true).map_err(io)?;
        // Handshakes run on their own threads (a slow or hostile connection cannot hold up the
        // others); the ranks they admit are collected here, a duplicate rank refused.
        let (admitted, arrivals) = mpsc::channel::<(usize, Connection, wire::ConnectionReader)>();
        let pending = PendingHandshakes::default();
        let want = format!("mesh-epoch-{epoch}");
        while out.len() < n - 1 {
            while let Ok((r, conn, reader)) = arrivals.try_recv() {
                if out.iter().any(|p| p.rank == r) {
                    tracing::warn!("rank {rank}: refused a second mesh link claiming rank {r}");
                    conn.shutdown();
                    continue;
                }
                out.push(Peer {
                    rank: r,
                    conn,
                    frames: spawn_reader(reader)?,
                });
            }
            if out.len() >= n - 1 {
                break;
            }
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).map_err(io)?;
                    let (admitted, link, want) = (admitted.clone(), link.clone(), want.clone());
                    pending.spawn(stream, move |stream, slot| {
                        let accepted = wire::accept(stream, &link, |h| match h.role {
                            Role::Rank { rank: Some(r), .. }
                                if (r as usize) > rank
                                    && (r as usize) < n
                                    && h.fingerprint == want =>
                            {
                                Ok(wire::Welcome::default())
                            }
                            _ => Err(format!(
                                "not a rank of mesh epoch {epoch} above rank {rank}"
                            )),
                        });
                        drop(slot);
                        match accepted {
                            Ok((conn, reader, h)) => {
                                if let Role::Rank { rank: Some(r), .. } = h.role {
                                    let _ = admitted.send((r as usize, conn, reader));
                                }
                            }
                            Err(e) => tracing::warn!("rank {rank}: refused a mesh link: {e}"),
                        }
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        listener.set_nonblocking(false).ok();
                        return Err(formation(format!(
                            "rank {rank}: only {} of {} mesh links within 30 s",
                            out.len(),
                            n - 1
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(io(e)),
            }
        }
        listener.set_nonblocking(false).map_err(io)?;
        out.sort_by_key(|p| p.rank);
        Ok(Mesh {
            rank,
            n_ranks: n,
            epoch,
            peers: out,
            timeout,
            exchanges: 0,
            exchange_time: Duration::ZERO,
            exchange_min: Duration::MAX,
        })
    }

    /// Sums `data` across all ranks in rank order, in place. `tag` identifies the exchange
    /// (step, layer, point) so a rank out of step is caught.
    pub fn all_reduce(&mut self, tag: u64, data: &mut [f64]) -> std::result::Result<(), String> {
        if self.n_ranks <= 1 {
            return Ok(());
        }
        let t0 = Instant::now();
        let payload: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let frame = Frame::new(Kind::TpExchange, tag, payload);
        for p in &self.peers {
            p.conn
                .send(&frame)
                .map_err(|e| format!("sending to rank {}: {e}", p.rank))?;
        }
        let mut partials: Vec<Option<Vec<f64>>> = vec![None; self.n_ranks];
        for p in &self.peers {
            let f = match receive(&p.frames, self.timeout) {
                Ok(Ok(f)) => f,
                Ok(Err(e)) => return Err(format!("rank {} link: {e}", p.rank)),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!(
                        "rank {} sent no partial sum within {:?} (--tp-timeout)",
                        p.rank, self.timeout
                    ));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(format!("rank {} link closed", p.rank));
                }
            };
            if f.kind != Kind::TpExchange
                || f.request_id != tag
                || f.payload.len() != data.len() * 8
            {
                return Err(format!(
                    "rank {} is out of step (exchange {tag:#x}, got {:#x})",
                    p.rank, f.request_id
                ));
            }
            partials[p.rank] = Some(
                f.payload
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            );
        }
        partials[self.rank] = Some(data.to_vec());
        // Every rank appears once (the mesh refuses duplicates), so each slot is filled; the
        // sum starts from rank 0's partial (not from zero, which would turn -0.0 into +0.0).
        let mut parts = partials
            .into_iter()
            .enumerate()
            .map(|(r, p)| p.ok_or_else(|| format!("no partial sum from rank {r}")));
        let mut acc = parts.next().ok_or("a mesh without ranks")??;
        for p in parts {
            for (a, b) in acc.iter_mut().zip(&p?) {
                *a += b;
            }
        }
        data.copy_from_slice(&acc);
        let took = t0.elapsed();
        self.exchanges += 1;
        self.exchange_time += took;
        self.exchange_min = self.exchange_min.min(took);
        Ok(())
    }

    pub fn shutdown(&self) {
        for p in &self.peers {
            p.conn.shutdown();
        }
    }
}

/// `model::Hooks` that all-reduce over a mesh; exchanges are tagged with the step, the layer and
/// the point.
pub struct MeshHooks<'a> {
    pub mesh: &'a mut Mesh,
    pub step: u64,
    pub error: Option<String>,
}

impl model::Hooks for MeshHooks<'_> {
    fn all_reduce(
        &mut self,
        layer: usize,
        point: model::ReducePoint,
        data: &mut [f64],
    ) -> model::Result<()> {
        let p = match point {
            model::ReducePoint::AttentionOutput => 0,
            model::ReducePoint::FfnOutput => 1,
            model::ReducePoint::QkNormSums => 2,
        };
        let tag = (self.step << 20) | ((layer as u64) << 2) | p;
        self.mesh.all_reduce(tag, data).map_err(|detail| {
            self.error = Some(detail.clone());
            model::ModelError::Collective { layer, detail }
        })
    }
}
