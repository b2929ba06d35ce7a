//! Links between workers: the one place that dials, greets and accepts.
//!
//! Process groups (`Group::connect`, through the [mesh](crate::Mesh)) and the RPC
//! agent's dynamic groups set their connections up with these functions, so there is one hello,
//! one retry policy and one way to refuse a stranger:
//!
//! - [`dial`] connects with exponential backoff and jitter ([`Backoff`]) until a deadline (a
//!   failed authentication is final, not retried), then sends the [`Hello`].
//! - [`read_hello`] reads the first frame of an accepted connection, bounded by a deadline.
//!
//! Who dials whom in a group of known size is decided in core
//! ([`StaticJoin`](tensorwire_core::protocol::membership::StaticJoin): the lower rank of each
//! pair dials the higher one); the transport authenticates the peer (cluster secret for TCP,
//! mutual TLS for QUIC) before the hello is read.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tensorwire_core::ports::transport::{Connection, Transport, TransportError};
use tensorwire_core::wire::{Frame, FrameKind};
use tokio::time::Instant;
use tracing::debug;

use tensorwire_store::backoff::Backoff;

/// The first frame on every link (a [`FrameKind::Control`] frame, postcard-encoded): who is
/// dialling, and for which group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The group the link belongs to (a process group's name; the RPC agent's group).
    pub group: String,
    /// The dialler's rank.
    pub rank: u32,
    /// The dialler's world size; `None` in a group without one (a dynamic RPC group).
    pub world: Option<u32>,
    /// What the layer above tells about the dialler (a dynamic RPC group's joiner sends its
    /// encoded record); empty for process groups.
    pub introduction: Vec<u8>,
}

impl Hello {
    /// The hello as a frame.
    pub fn frame(&self) -> Frame {
        let header = postcard::to_allocvec(self).expect("a hello always encodes");
        Frame::control(header, Vec::new())
    }

    /// The hello a frame carries, if it is one.
    pub fn from_frame(frame: &Frame) -> Result<Hello, String> {
        if frame.kind != FrameKind::Control {
            return Err(format!("its first frame is a {:?} frame", frame.kind));
        }
        postcard::from_bytes(&frame.header).map_err(|e| format!("malformed hello ({e})"))
    }
}

/// `timeout` from now, saturating: a timeout too long to add is no deadline (30 years; a day where even that does not fit).
pub fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout.min(Duration::from_secs(30 * 365 * 86_400)))
        .unwrap_or_else(|| now + Duration::from_secs(86_400))
}

/// Why a link could not be set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// Connecting failed until the deadline, or for good (authentication).
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// Where it dialled.
        addr: SocketAddr,
        /// The last failure.
        reason: String,
    },
    /// The connection is up but the hello could not be sent.
    #[error("cannot greet {addr}: {reason}")]
    Greet {
        /// Where it dialled.
        addr: SocketAddr,
        /// What failed.
        reason: String,
    },
    /// An accepted connection sent no valid hello by the deadline.
    #[error("the connection from {addr} sent no valid hello: {reason}")]
    NoHello {
        /// The peer's address.
        addr: SocketAddr,
        /// What it sent instead, or what failed.
        reason: String,
    },
}

/// The retry policy of [`dial`]: 10 ms doubling to 1 s, jittered.
pub fn dial_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(10), Duration::from_secs(1))
}

/// Connects to `addr` over `transport`, retrying with [`dial_backoff`] until `deadline` (an
/// authentication failure is final), and sends `hello`.
pub async fn dial(
    transport: &dyn Transport,
    addr: SocketAddr,
    hello: &Hello,
    deadline: Instant,
) -> Result<Box<dyn Connection>, LinkError> {
    let mut backoff = dial_backoff();
    let conn = loop {
        let failed = |reason: String| LinkError::Connect { addr, reason };
        let attempt = tokio::time::timeout_at(deadline, transport.connect(addr)).await;
        match attempt {
            Ok(Ok(conn)) => break conn,
            Ok(Err(e @ TransportError::Authentication { .. })) => {
                return Err(failed(e.to_string()))
            }
            Ok(Err(e)) => {
                let delay = backoff.next_delay();
                if Instant::now() + delay > deadline {
                    return Err(failed(e.to_string()));
                }
                debug!("connect to {addr} failed ({e}); retrying in {delay:?}");
                tokio::time::sleep(delay).await;
            }
            Err(_) => return Err(failed("timed out".to_owned())),
        }
    };
    match tokio::time::timeout_at(deadline, conn.send(hello.frame())).await {
        Ok(Ok(())) => Ok(conn),
        Ok(Err(e)) => Err(LinkError::Greet {
            addr,
            reason: e.to_string(),
        }),
        Err(_) => Err(LinkError::Greet {
            addr,
            reason: "timed out".to_owned(),
        }),
    }
}

/// Reads the [`Hello`] an accepted connection starts with, by `deadline`.
pub async fn read_hello(conn: &dyn Connection, deadline: Instant) -> Result<Hello, LinkError> {
    let addr = conn.peer_addr();
    let no_hello = |reason: String| LinkError::NoHello { addr, reason };
    match tokio::time::timeout_at(deadline, conn.recv()).await {
        Ok(Ok(frame)) => Hello::from_frame(&frame).map_err(no_hello),
        Ok(Err(e)) => Err(no_hello(e.to_string())),
        Err(_) => Err(no_hello("none arrived in time".to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_round_trip_and_other_frames_are_not_hellos() {
        let h = Hello {
            group: "rpc".into(),
            rank: 3,
            world: Some(8),
            introduction: vec![1, 2],
        };
        assert_eq!(Hello::from_frame(&h.frame()).unwrap(), h);
        let e = Hello::from_frame(&Frame::message(h.frame().header, Vec::new())).unwrap_err();
        assert!(e.contains("Message"), "{e}");
        let e = Hello::from_frame(&Frame::control(vec![0xff; 3], Vec::new())).unwrap_err();
        assert!(e.contains("malformed hello"), "{e}");
    }
}
