//! Accepting connections: a task accepts, checks the user and authenticates; `accept` hands out
//! the connections that passed.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use rustix::net::SocketFlags;
use tensorwire_core::ports::transport::{Connection, Listener, TransportError};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{mpsc, Mutex, Semaphore};
use tokio::task::JoinHandle;

use crate::config::ShmConfig;
use crate::connection::ShmConnection;
use crate::{handshake, sock};

/// Authenticated connections waiting for `accept`.
const BACKLOG: usize = 128;
/// Handshakes in progress at most.
const MAX_HANDSHAKES: usize = 256;
/// Tries to find a free id for `listen` on port 0.
const ID_TRIES: usize = 256;

pub(crate) struct ShmListener {
    local: SocketAddr,
    ready: Mutex<mpsc::Receiver<ShmConnection>>,
    task: JoinHandle<()>,
}

/// How the accepting side names a peer: its process id, as `127.0.0.(pid >> 16):(pid & 0xffff)`
/// (so most pids read as the port).
pub(crate) fn peer_name(pid: u32) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, (pid >> 16) as u8], pid as u16))
}

impl ShmListener {
    pub(crate) fn bind(addr: SocketAddr, config: Arc<ShmConfig>) -> Result<Self, TransportError> {
        let fd = sock::socket().map_err(|e| TransportError::io(addr, "listening", &e))?;
        let port = if addr.port() != 0 {
            let name = sock::listener_name(addr.port())
                .map_err(|e| TransportError::io(addr, "listening", &e))?;
            rustix::net::bind(&fd, &name)
                .map_err(|e| TransportError::io(addr, "listening", &e.into()))?;
            addr.port()
        } else {
            let mut bound = None;
            for _ in 0..ID_TRIES {
                let port = rand::random::<u16>().max(1024);
                let name = sock::listener_name(port)
                    .map_err(|e| TransportError::io(addr, "listening", &e))?;
                match rustix::net::bind(&fd, &name) {
                    Ok(()) => {
                        bound = Some(port);
                        break;
                    }
                    Err(rustix::io::Errno::ADDRINUSE) => {}
                    Err(e) => return Err(TransportError::io(addr, "listening", &e.into())),
                }
            }
            bound.ok_or_else(|| TransportError::Io {
                addr,
                op: "listening",
                kind: std::io::ErrorKind::AddrInUse,
                message: format!("no free shared-memory listener id after {ID_TRIES} tries"),
            })?
        };
        Self::start(fd, SocketAddr::new(addr.ip(), port), config)
    }

    /// A listener bound to the abstract name `name`, reporting `local` as its address.
    #[cfg(feature = "tcp")]
    pub(crate) fn bind_name(
        name: &rustix::net::SocketAddrUnix,
        local: SocketAddr,
        config: Arc<ShmConfig>,
    ) -> Result<Self, TransportError> {
        let fd = sock::socket().map_err(|e| TransportError::io(local, "listening", &e))?;
        rustix::net::bind(&fd, name)
            .map_err(|e| TransportError::io(local, "listening", &e.into()))?;
        Self::start(fd, local, config)
    }

    fn start(
        fd: OwnedFd,
        local: SocketAddr,
        config: Arc<ShmConfig>,
    ) -> Result<Self, TransportError> {
        rustix::net::listen(&fd, BACKLOG as i32)
            .map_err(|e| TransportError::io(local, "listening", &e.into()))?;
        let fd = sock::register(fd, Interest::READABLE)
            .map_err(|e| TransportError::io(local, "listening", &e))?;
        let (tx, rx) = mpsc::channel(BACKLOG);
        let task = tokio::spawn(accept_loop(fd, local, config, tx));
        Ok(ShmListener {
            local,
            ready: Mutex::new(rx),
            task,
        })
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(
    socket: AsyncFd<OwnedFd>,
    local: SocketAddr,
    config: Arc<ShmConfig>,
    ready: mpsc::Sender<ShmConnection>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let Ok(permit) = handshakes.clone().acquire_owned().await else {
            return;
        };
        let accepted = socket
            .async_io(Interest::READABLE, |fd| {
                Ok(rustix::net::accept_with(
                    fd,
                    SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
                )?)
            })
            .await;
        let stream = match accepted {
            Ok(s) => s,
            Err(e) => {
                // Out of file descriptors and the like: transient; keep going without spinning.
                tracing::warn!(listener = %local, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let config = config.clone();
        let ready = ready.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let unnamed = SocketAddr::from(([127, 0, 0, 0], 0));
            let peer = match handshake::check_same_user(&stream, unnamed) {
                Ok(pid) => peer_name(pid),
                Err(e) => {
                    tracing::warn!(listener = %local, error = %e, "refused connection");
                    return;
                }
            };
            let stream = match sock::register(stream, Interest::READABLE | Interest::WRITABLE) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(peer = %peer, error = %e, "dropping connection");
                    return;
                }
            };
            let outcome = tokio::time::timeout(
                config.handshake_timeout,
                handshake::server(stream, config.secret(), config.ring_bytes, peer),
            )
            .await;
            let link = match outcome {
                Ok(Ok(link)) => link,
                Ok(Err(e)) => {
                    tracing::warn!(peer = %peer, listener = %local, error = %e,
                        "refused connection: authentication or setup failed");
                    return;
                }
                Err(_) => {
                    tracing::warn!(peer = %peer, listener = %local,
                        timeout = ?config.handshake_timeout,
                        "refused connection: authentication failed (handshake timed out)");
                    return;
                }
            };
            match ShmConnection::new(
                link,
                peer,
                config.limits,
                config.segment_min,
                (config.slab_min, config.slab_bytes),
                config.spin,
                config.buffer_reuse,
            ) {
                Ok(conn) => {
                    tracing::debug!(peer = %peer, "authenticated shared-memory connection");
                    let _ = ready.send(conn).await;
                }
                Err(e) => tracing::warn!(peer = %peer, error = %e, "dropping connection"),
            }
        });
    }
}

#[async_trait]
impl Listener for ShmListener {
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
