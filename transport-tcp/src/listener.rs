//! Accepting connections: a background task accepts and authenticates, `accept` hands out the
//! authenticated ones.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tensorwire_core::ports::transport::{Connection, Listener, TransportError};
use tokio::sync::{mpsc, Mutex, Semaphore};
use tokio::task::JoinHandle;

use crate::config::TcpConfig;
use crate::connection::{prepare, TcpConnection};
use crate::handshake;

/// Authenticated connections waiting for `accept`.
const BACKLOG: usize = 128;
/// Handshakes in progress at most; more connections wait in the kernel's backlog, so a flood of
/// silent peers cannot exhaust file descriptors or memory.
const MAX_HANDSHAKES: usize = 256;
/// Connections from one source address that may wait for a turn, per handshake it may have in
/// progress ([`TcpConfig::handshakes_per_source`]): with the default 16, 64 wait and one
/// address holds at most 80 of the 256 slots. 64 ranks on one host dialling one listener at
/// once all get in.
const WAITING_PER_SLOT: usize = 4;

pub(crate) struct TcpListener {
    local: SocketAddr,
    ready: Mutex<mpsc::Receiver<TcpConnection>>,
    task: JoinHandle<()>,
}

impl TcpListener {
    pub(crate) async fn bind(
        addr: SocketAddr,
        config: Arc<TcpConfig>,
    ) -> Result<Self, TransportError> {
        let socket = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| TransportError::io(addr, "listening", &e))?;
        let local = socket
            .local_addr()
            .map_err(|e| TransportError::io(addr, "listening", &e))?;
        let (tx, rx) = mpsc::channel(BACKLOG);
        let task = tokio::spawn(accept_loop(socket, local, config, tx));
        Ok(TcpListener {
            local,
            ready: Mutex::new(rx),
            task,
        })
    }
}

impl Drop for TcpListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(
    socket: tokio::net::TcpListener,
    local: SocketAddr,
    config: Arc<TcpConfig>,
    ready: mpsc::Sender<TcpConnection>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    let per_source: Arc<std::sync::Mutex<HashMap<IpAddr, Source>>> = Arc::default();
    loop {
        let Ok(permit) = handshakes.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match socket.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: transient, keep the listener alive
                // but do not spin.
                tracing::warn!(listener = %local, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // One source address may hold only so many of the handshake slots, so that silent
        // connections from one place cannot keep everyone else waiting. A connection beyond
        // them waits its turn (a burst of honest peers on one host dials from one address),
        // behind at most `WAITING_PER_SLOT` times as many others from its address.
        let Some(slot) = SourceSlot::take(&per_source, peer.ip(), config.handshakes_per_source)
        else {
            tracing::warn!(peer = %peer, listener = %local, limit = config.handshakes_per_source,
                waiting = config.handshakes_per_source * WAITING_PER_SLOT,
                "refused connection: too many handshakes in progress and waiting from its address");
            continue;
        };
        let config = config.clone();
        let ready = ready.clone();
        // Handshakes run concurrently so a slow or silent peer does not block others.
        tokio::spawn(async move {
            let _permit = permit;
            // The wait for a turn and the handshake share one deadline.
            let deadline = tokio::time::Instant::now() + config.handshake_timeout;
            let Ok(Ok(_turn)) = tokio::time::timeout_at(deadline, slot.turn.acquire()).await else {
                tracing::warn!(peer = %peer, listener = %local,
                    timeout = ?config.handshake_timeout,
                    "refused connection: waited out the handshake timeout for a turn among its address's handshakes");
                return;
            };
            let mut stream = match prepare(stream, peer, &config) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(peer = %peer, error = %e, "dropping connection");
                    return;
                }
            };
            let outcome = tokio::time::timeout_at(
                deadline,
                handshake::server(&mut stream, config.secret(), peer),
            )
            .await;
            match outcome {
                Ok(Ok(())) => {
                    tracing::debug!(peer = %peer, "authenticated connection");
                    let _ = ready.send(TcpConnection::new(stream, peer, &config)).await;
                }
                Ok(Err(e)) => {
                    tracing::warn!(peer = %peer, listener = %local, error = %e,
                        "refused connection: authentication failed");
                }
                Err(_) => {
                    tracing::warn!(peer = %peer, listener = %local,
                        timeout = ?config.handshake_timeout,
                        "refused connection: authentication failed (handshake timed out)");
                }
            }
        });
    }
}

/// A source address's connections in handshake or waiting for a turn, with its turns.
struct Source {
    /// Connections counted (in handshake or waiting).
    count: usize,
    /// `handshakes_per_source` turns.
    turns: Arc<Semaphore>,
}

/// A connection's place among its source address's, given back when dropped.
struct SourceSlot {
    counts: Arc<std::sync::Mutex<HashMap<IpAddr, Source>>>,
    ip: IpAddr,
    /// The address's turns: one is held for the handshake.
    turn: Arc<Semaphore>,
}

impl SourceSlot {
    /// A place for `ip`, unless it has `limit` handshakes in progress and `limit *
    /// WAITING_PER_SLOT` connections waiting already.
    fn take(
        counts: &Arc<std::sync::Mutex<HashMap<IpAddr, Source>>>,
        ip: IpAddr,
        limit: usize,
    ) -> Option<SourceSlot> {
        let mut map = counts.lock().unwrap_or_else(|e| e.into_inner());
        let source = map.entry(ip).or_insert_with(|| Source {
            count: 0,
            turns: Arc::new(Semaphore::new(limit)),
        });
        if source.count >= limit.saturating_mul(WAITING_PER_SLOT + 1) {
            return None;
        }
        source.count += 1;
        Some(SourceSlot {
            counts: counts.clone(),
            ip,
            turn: source.turns.clone(),
        })
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut map = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(source) = map.get_mut(&self.ip) {
            source.count -= 1;
            if source.count == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

#[async_trait]
impl Listener for TcpListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    async fn accept(&self) -> Result<Box<dyn Connection>, TransportError> {
        let mut ready = self.ready.lock().await;
        match ready.recv().await {
            Some(conn) => Ok(Box::new(conn)),
            None => Err(TransportError::Io {
                addr: self.local,
                op: "accepting",
                kind: std::io::ErrorKind::Other,
                message: "the listener's accept task stopped".to_owned(),
            }),
        }
    }
}
