//! Links between workers: the one place that dials, greets and accepts.
//!
//! Process groups (`Group::connect`, through the [mesh](crate::Mesh)) and the RPC
//! agent's dynamic groups set their connections up with these functions, so there is one hello,
//! one retry policy and one way to refuse a stranger:
//!
//! - [`dial`] connects with exponential backoff and jitter ([`Backoff`]) until a deadline (a
//!   failed authentication is final, not retried: `dial_gives_up`), then sends the [`Hello`].
//! - [`read_hello`] reads the first frame of an accepted connection, bounded by a deadline.
//!
//! Who dials whom in a group of known size is decided in core
//! ([`StaticJoin`](tensorwire_core::protocol::membership::StaticJoin): the lower rank of each
//! pair dials the higher one); the transport authenticates the peer (cluster secret for TCP,
//! mutual TLS for QUIC) before the hello is read.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tensorwire_core::ports::handshake::dial_gives_up;
use tensorwire_core::ports::runtime::Runtime;
use tensorwire_core::ports::transport::{Connection, Transport, TransportError};
use tensorwire_core::protocol::mesh::MeshFrameError;
use tracing::debug;

use tensorwire_store::backoff::Backoff;

/// The first frame on every link (a [`Control`](tensorwire_core::wire::FrameKind::Control)
/// frame): who is dialling, and for which group. Encoded and decoded in core
/// ([`tensorwire_core::protocol::mesh`]).
pub use tensorwire_core::protocol::mesh::Hello;

/// Why a link could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// Connecting failed until the deadline, or for good (authentication).
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// Where it dialled.
        addr: SocketAddr,
        /// The last failure.
        #[source]
        reason: LinkStepError,
    },
    /// The connection is up but the hello could not be sent.
    #[error("cannot greet {addr}: {reason}")]
    Greet {
        /// Where it dialled.
        addr: SocketAddr,
        /// What failed.
        #[source]
        reason: LinkStepError,
    },
    /// An accepted connection sent no valid hello by the deadline.
    #[error("the connection from {addr} sent no valid hello: {reason}")]
    NoHello {
        /// The peer's address.
        addr: SocketAddr,
        /// What it sent instead, or what failed.
        #[source]
        reason: LinkStepError,
    },
}

/// What failed in one step of a link's setup ([`LinkError`]'s cause).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkStepError {
    /// The step did not complete by the deadline.
    #[error("timed out")]
    TimedOut,
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The peer's first frame is not a hello.
    #[error(transparent)]
    NotAHello(#[from] MeshFrameError),
}

/// The retry policy of [`dial`]: 10 ms doubling to 1 s, jittered.
pub fn dial_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(10), Duration::from_secs(1))
}

/// Connects to `addr` over `transport`, retrying with [`dial_backoff`] until `deadline` on
/// `rt`'s clock, and sends `hello`. An authentication's verdict is final; a handshake cut
/// short is retried a few times (a listener going away cuts it so: see
/// [`dial_gives_up`]).
pub async fn dial(
    rt: &dyn Runtime,
    transport: &dyn Transport,
    addr: SocketAddr,
    hello: &Hello,
    deadline: Instant,
) -> Result<Box<dyn Connection>, LinkError> {
    let mut backoff = dial_backoff();
    // Handshakes that ended without a verdict so far (core decides when that is final).
    let mut closed = 0;
    let conn = loop {
        let failed = |reason: LinkStepError| LinkError::Connect { addr, reason };
        let attempt = rt.timeout_at(deadline, transport.connect(addr)).await;
        match attempt {
            Ok(Ok(conn)) => break conn,
            Ok(Err(e)) if dial_gives_up(&e, closed) => return Err(failed(e.into())),
            Ok(Err(e)) => {
                if matches!(e, TransportError::Authentication { .. }) {
                    closed += 1;
                }
                let delay = backoff.next_delay();
                if rt.now() + delay > deadline {
                    return Err(failed(e.into()));
                }
                debug!("connect to {addr} failed ({e}); retrying in {delay:?}");
                rt.sleep(delay).await;
            }
            Err(_) => return Err(failed(LinkStepError::TimedOut)),
        }
    };
    match rt.timeout_at(deadline, conn.send(hello.frame())).await {
        Ok(Ok(())) => Ok(conn),
        Ok(Err(e)) => Err(LinkError::Greet {
            addr,
            reason: e.into(),
        }),
        Err(_) => Err(LinkError::Greet {
            addr,
            reason: LinkStepError::TimedOut,
        }),
    }
}

/// Reads the [`Hello`] an accepted connection starts with, by `deadline` on `rt`'s clock.
pub async fn read_hello(
    rt: &dyn Runtime,
    conn: &dyn Connection,
    deadline: Instant,
) -> Result<Hello, LinkError> {
    let addr = conn.peer_addr();
    let no_hello = |reason: LinkStepError| LinkError::NoHello { addr, reason };
    match rt.timeout_at(deadline, conn.recv()).await {
        Ok(Ok(frame)) => Hello::from_frame(&frame).map_err(|e| no_hello(e.into())),
        Ok(Err(e)) => Err(no_hello(e.into())),
        Err(_) => Err(no_hello(LinkStepError::TimedOut)),
    }
}
