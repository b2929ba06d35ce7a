//! tensorwire's TCP transport: a [`Transport`] over tokio TCP.
//!
//! - Authentication first: before any frame is decoded, both sides prove that they know the
//!   cluster secret ([`tensorwire_core::auth`], HMAC-SHA256 challenge-response in both
//!   directions). A peer with a wrong or missing secret is disconnected; the accepting side logs
//!   its address (`tracing` warning), the connecting side gets
//!   [`TransportError::Authentication`].
//! - The secret comes from [`TcpConfig::new`] or the `TENSORWIRE_SECRET` environment variable
//!   ([`TcpConfig::from_env`]). Running without one needs [`TcpConfig::insecure`], and logs a
//!   warning.
//! - `TCP_NODELAY`; one vectored write per frame (preamble, message header and payloads side by
//!   side, no copy); payloads of 64 KiB and more are read straight into their final buffers,
//!   smaller segments are split off the read buffer without copying. Large receive buffers
//!   are reused once the application drops the frames that carried them.
//! - Dead peers are noticed within a bound, not after the kernel's hours: idle connections
//!   send TCP keepalive probes ([`TcpConfig::keepalive`], 5 s by default) and a connection
//!   whose data or probes stay unanswered for [`TcpConfig::dead_peer_timeout`] (30 s by
//!   default, `TCP_USER_TIMEOUT`) fails with an I/O error, so a host that died or a cut link
//!   fails the calls waiting on it. [`KEEPALIVE_ENV`] and [`DEAD_PEER_ENV`] override both.
//! - Optionally (off by default), a receive that finds nothing within [`TcpConfig::spin`] of a
//!   send on the same connection polls the socket with non-blocking `recv`s (or hands the
//!   core over with `sched_yield` where polling does not pay, as [`tensorwire_core::spin`]
//!   decides) before it waits in the runtime's `epoll`: the answer to a request is usually there within that
//!   time, and it is read without an `epoll_wait` and without the cross-core wake-up that
//!   costs tens of microseconds on a virtual machine. An idle connection never polls.
//!   [`SPIN_ENV`] sets the budget in microseconds (`0`, the default, turns polling off).
//! - `recv` is cancel-safe (usable in `select!`): a dropped `recv` loses no bytes. A `send`
//!   dropped half-way through a frame makes later sends on that connection fail, since the
//!   stream then holds part of a frame.
//!
//! ```no_run
//! use bytes::Bytes;
//! use tensorwire_core::ports::transport::Transport;
//! use tensorwire_core::wire::Frame;
//! use tensorwire_transport_tcp::{TcpConfig, TcpTransport};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let transport = TcpTransport::new(TcpConfig::from_env()?)?; // reads TENSORWIRE_SECRET
//! let listener = transport.listen("127.0.0.1:0".parse()?).await?;
//! let client = transport.connect(listener.local_addr()).await?;
//! let server = listener.accept().await?;
//! client.send(Frame::message(Bytes::from_static(b"hi"), vec![])).await?;
//! assert_eq!(&server.recv().await?.header[..], b"hi");
//! # Ok(()) }
//! ```

mod config;
mod connection;
mod handshake;
mod listener;

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use tensorwire_core::ports::transport::{Connection, Listener, Transport, TransportError};

pub use config::{
    TcpConfig, DEAD_PEER_ENV, DEFAULT_DEAD_PEER_TIMEOUT, DEFAULT_FRAME_TIMEOUT,
    DEFAULT_HANDSHAKES_PER_SOURCE, DEFAULT_KEEPALIVE, DEFAULT_SPIN, KEEPALIVE_ENV, SECRET_ENV,
    SPIN_ENV,
};
pub use tensorwire_core::auth::ClusterSecret;

/// The TCP [`Transport`].
#[derive(Debug, Clone)]
pub struct TcpTransport {
    config: Arc<TcpConfig>,
}

impl TcpTransport {
    /// A transport with `config`. Warns (through `tracing`) when it runs without a secret.
    pub fn new(config: TcpConfig) -> Result<Self, TransportError> {
        if config.secret().is_none() {
            tracing::warn!(
                "tensorwire TCP transport runs WITHOUT authentication (insecure): anyone who \
                 reaches its port can talk to this worker; set {SECRET_ENV} to a cluster secret"
            );
        }
        Ok(TcpTransport {
            config: Arc::new(config),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &TcpConfig {
        &self.config
    }
}

#[async_trait]
impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, TransportError> {
        Ok(Box::new(
            listener::TcpListener::bind(addr, self.config.clone()).await?,
        ))
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Connection>, TransportError> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| TransportError::io(addr, "connecting", &e))?;
        let mut stream = connection::prepare(stream, addr, &self.config)?;
        tokio::time::timeout(
            self.config.handshake_timeout,
            handshake::client(&mut stream, self.config.secret(), addr),
        )
        .await
        .map_err(|_| TransportError::Authentication {
            peer: addr,
            reason: format!(
                "the listener did not complete the handshake within {:?}",
                self.config.handshake_timeout
            ),
            source: None,
        })??;
        Ok(Box::new(connection::TcpConnection::new(
            stream,
            addr,
            &self.config,
        )))
    }
}
