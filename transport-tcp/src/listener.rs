//! Accepting connections: a background task accepts and authenticates, `accept` hands out the
//! authenticated ones.

use std::net::SocketAddr;
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
        let config = config.clone();
        let ready = ready.clone();
        // Handshakes run concurrently so a slow or silent peer does not block others.
        tokio::spawn(async move {
            let _permit = permit;
            let mut stream = match prepare(stream, peer, &config) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(peer = %peer, error = %e, "dropping connection");
                    return;
                }
            };
            let outcome = tokio::time::timeout(
                config.handshake_timeout,
                handshake::server(&mut stream, config.secret(), peer),
            )
            .await;
            match outcome {
                Ok(Ok(())) => {
                    tracing::debug!(peer = %peer, "authenticated connection");
                    let _ = ready
                        .send(TcpConnection::new(
                            stream,
                            peer,
                            config.limits,
                            config.buffer_reuse,
                        ))
                        .await;
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
