//! The worker side of registration, shared by pipeline stages and tensor-parallel ranks: dial
//! the coordinator, announce the address where this process takes data links, and keep coming
//! back (the coordinator may start later or restart) until it says shut down, refuses this
//! process, or stays away past `give_up_after`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::error::{ClusterError, Result};
use crate::wire::{self, Connection, ConnectionReader, Hello, LinkConfig, Role, Welcome};

/// How a worker reaches its coordinator.
#[derive(Clone, Debug)]
pub struct Membership {
    /// Coordinator `host:port`.
    pub coordinator: String,
    /// Address to announce for data links (default: the local address of the link to the
    /// coordinator, with the bound port).
    pub advertise: Option<String>,
    pub link: LinkConfig,
    /// Pause between attempts to reach the coordinator.
    pub retry: Duration,
    /// Give up after this long without reaching the coordinator (`None`: never).
    pub give_up_after: Option<Duration>,
}

/// How one registration ended.
pub enum Ended {
    /// The coordinator said shut down.
    Shutdown,
    /// The link was lost: register again.
    Lost(String),
}

impl Membership {
    /// Registers as `role` and announces `data` (the bound data port).
    pub fn register(
        &self,
        role: Role,
        fingerprint: &str,
        n_ctx: usize,
        data: SocketAddr,
    ) -> Result<(Connection, ConnectionReader, Welcome)> {
        let stream = wire::dial(&self.coordinator).map_err(|source| ClusterError::Io {
            what: format!("the coordinator {}", self.coordinator),
            source,
        })?;
        let local_ip = stream
            .local_addr()
            .map_err(|source| ClusterError::Io {
                what: format!("the link to {}", self.coordinator),
                source,
            })?
            .ip();
        let listen = match &self.advertise {
            Some(a) => a.clone(),
            None if data.ip().is_unspecified() => {
                SocketAddr::new(local_ip, data.port()).to_string()
            }
            None => data.to_string(),
        };
        let hello = Hello::new(role, fingerprint, n_ctx as u32, Some(listen));
        wire::connect(stream, &self.link, hello)
            .map_err(|e| ClusterError::link(format!("the coordinator {}", self.coordinator), e))
    }

    /// Runs `serve` (one registration each) until the coordinator says shut down. A refusal
    /// ends it with the error; so does not reaching the coordinator for `give_up_after`.
    /// `on_lost` runs after each lost registration (drop state that belonged to it).
    pub fn run(
        &self,
        who: &str,
        mut serve: impl FnMut() -> Result<Ended>,
        mut on_lost: impl FnMut(),
    ) -> Result<()> {
        let mut last_contact = Instant::now();
        loop {
            match serve() {
                Ok(Ended::Shutdown) => {
                    tracing::info!("{who}: shutdown requested by the coordinator");
                    return Ok(());
                }
                Ok(Ended::Lost(why)) => {
                    tracing::warn!("{who}: {why}; registering again");
                    last_contact = Instant::now();
                    on_lost();
                }
                Err(e) if e.is_refusal() => return Err(e),
                Err(e) => {
                    if let Some(limit) = self.give_up_after
                        && last_contact.elapsed() > limit
                    {
                        return Err(e);
                    }
                    tracing::debug!("{who}: coordinator not reachable yet: {e}");
                }
            }
            std::thread::sleep(self.retry);
        }
    }
}

/// The message of a caught panic.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The exit status of a worker that panicked (after it told the coordinator).
pub const PANIC_EXIT: i32 = 101;
