//! The `Transport` port: authenticated, framed, bidirectional connections between workers.
//!
//! A [`Transport`] listens and connects; both give a [`Connection`] to one peer, already
//! authenticated (cluster secret for TCP, mutual TLS for QUIC) before any frame is decoded. A
//! connection sends and receives [`Frame`]s, checked against the transport's
//! [`WireLimits`](crate::wire::WireLimits).
//!
//! # Contract (what the conformance suite checks)
//! - `send` and `recv` take `&self`: one reader task and any number of concurrent sender tasks
//!   can share a connection through an `Arc<dyn Connection>`. Concurrent `send`s never
//!   interleave the bytes of two frames.
//! - Order: frames from one peer arrive in the order their `send` calls were *made* when each
//!   `send` was awaited before the next began (sequential sends from one task). Frames from
//!   concurrent `send`s arrive each exactly once, in some order. An adapter may deliver frames
//!   of different sizes in parallel (QUIC: one stream per frame) only if it keeps this rule.
//! - A frame is delivered whole or not at all. A peer that goes away between frames gives
//!   [`TransportError::Closed`]; one that goes away in the middle of a frame gives
//!   [`TransportError::ClosedMidFrame`]. Neither hangs.
//! - Bad bytes from a peer (garbage, oversized lengths) give [`TransportError::Wire`] and close
//!   that connection; the listener and other connections carry on.
//! - A peer that fails authentication never reaches [`Listener::accept`]: the listener logs its
//!   address and keeps accepting. The connecting side's `connect` gets
//!   [`TransportError::Authentication`].
//!
//! Timeouts are the caller's business (wrap calls in the runtime's timeout); adapters bound only
//! the authentication handshake.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use async_trait::async_trait;

use crate::auth::AuthError;
use crate::env::BadVariable;
use crate::identity::Credentials;
use crate::wire::{Frame, WireError};

/// A way to reach other workers: TCP, QUIC, ...
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// A short name for logs and benchmarks (`"tcp"`, `"quic"`).
    fn name(&self) -> &'static str;

    /// Starts listening on `addr` (port 0 picks a free port; see [`Listener::local_addr`]).
    async fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, TransportError>;

    /// Connects to a listener at `addr` and authenticates.
    async fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Connection>, TransportError>;

    /// What this worker's own credentials prove about it (see [`crate::identity`]): a shared
    /// secret proves membership (the default); a QUIC node certificate names the worker (and,
    /// issued for `rank-N`, its rank). The mesh passes it to
    /// [`check_rank_claim`](crate::identity::check_rank_claim): a worker holding a rank
    /// certificate requires one of every peer.
    fn credentials(&self) -> Credentials {
        Credentials::Membership
    }
}

/// Accepts authenticated connections. Dropping it stops listening.
#[async_trait]
pub trait Listener: Send + Sync {
    /// The address it listens on.
    fn local_addr(&self) -> SocketAddr;

    /// The next authenticated connection. Peers that fail authentication or the handshake are
    /// logged and skipped; an error here means the listener itself cannot go on.
    async fn accept(&self) -> Result<Box<dyn Connection>, TransportError>;
}

/// An authenticated connection to one peer.
#[async_trait]
pub trait Connection: Send + Sync {
    /// The peer's address.
    fn peer_addr(&self) -> SocketAddr;

    /// The kind of transport this connection runs over, in lower case: `"tcp"`, `"shm"`,
    /// `"quic"`, `"memory"`. What the agent reports per peer (see `Agent::connections` in
    /// `tensorwire-rpc`), so that a user can see which transport was chosen.
    fn transport(&self) -> &'static str;

    /// Whether sending a small frame costs no system call while the peer is busy reading
    /// (shared memory: a copy into a ring, and a wake-up only for a peer that sleeps). A driver
    /// then sends each reply as soon as it is ready rather than batching replies into fewer
    /// writes; with a socket, where every write is a system call, it batches. `false` unless
    /// the adapter says otherwise.
    fn cheap_sends(&self) -> bool {
        false
    }

    /// Whether the frame [`recv`](Self::recv) returned last was all this connection had
    /// received: nothing more, whole or in part, waits in its buffer. A driver then sends the
    /// reply to that frame as soon as it is ready, as with [`cheap_sends`](Self::cheap_sends):
    /// no reply to a later frame of the same read could join it in one write, and handing it
    /// to a writer task would cost a wake-up and a turn of the runtime per message. `false`
    /// unless the adapter says otherwise (replies are then batched).
    fn received_all(&self) -> bool {
        false
    }

    /// From now on, the frame being received on this connection draws from `account` (the
    /// peer's memory budget, see [`crate::budget`]) as its bytes arrive, and gives them back
    /// once it is complete (its holder then counts it) or dropped; a frame whose bytes the
    /// budget refuses closes the connection with [`TransportError::OverBudget`]. The default
    /// counts nothing (an adapter whose frames arrive whole, or are bounded otherwise: shared
    /// memory's slabs, QUIC's pending bytes); a wrapper passes it on.
    fn bill_to(&self, account: crate::budget::Account) {
        let _ = account;
    }

    /// Sends one frame. Returns once the frame is handed to the operating system (or QUIC
    /// stack), not when the peer has read it. A frame over the limits fails with
    /// [`TransportError::Wire`] without sending anything.
    async fn send(&self, frame: Frame) -> Result<(), TransportError>;

    /// Sends several frames, in order, as if by consecutive [`send`](Self::send)s. An adapter
    /// may put them on the wire together (fewer system calls under load); the default sends
    /// them one by one. Frames over the limits fail before anything is sent.
    async fn send_many(&self, frames: Vec<Frame>) -> Result<(), TransportError> {
        for frame in frames {
            self.send(frame).await?;
        }
        Ok(())
    }

    /// Sends `frames` now, on this thread, if the connection takes them without waiting: no
    /// future, no box (a sender's hot path). `Some(result)` when it is done, as
    /// [`send_many`](Self::send_many) would have finished (frames over the limits fail before
    /// anything is sent). `None` when it could not finish without waiting: the frames left in
    /// `frames` are unsent, and the ones it took out are held by the connection, which writes
    /// them first in its next `send_many`: the caller must then call `send_many` with what is
    /// left (possibly nothing) before sending anything else. The default takes nothing and
    /// says `None`.
    fn try_send_now(&self, frames: &mut Vec<Frame>) -> Option<Result<(), TransportError>> {
        let _ = frames;
        None
    }

    /// Receives the next frame. Meant for one reader task; concurrent callers are served one
    /// after the other.
    async fn recv(&self) -> Result<Frame, TransportError>;

    /// Every frame this connection receives, in order, through one reader made once: for a
    /// reader task that receives until the connection ends, instead of a [`recv`](Self::recv)
    /// per frame (whose future `async_trait` boxes every time). The default calls `recv`; an
    /// adapter overrides it to keep one receive future, in one box, for all frames
    /// ([`EachFrame`]). Its frames and errors are `recv`'s; do not call `recv` besides it (an
    /// adapter whose reader takes the receive side with it fails such a `recv` at once, as
    /// [`TransportError::read_by_frames`], as TCP's and shared memory's do).
    fn into_frames(self: std::sync::Arc<Self>) -> Box<dyn FrameReader>
    where
        Self: 'static,
    {
        Box::new(EachFrame::new(self, |c| async move {
            let received = c.recv().await;
            (received, c)
        }))
    }

    /// Closes the sending direction gracefully after frames already sent: the peer's `recv`
    /// then gives [`TransportError::Closed`]. Frames can still be received.
    async fn close(&self) -> Result<(), TransportError>;

    /// Whether the peer's credentials let it be the worker named `name`.
    ///
    /// A cluster secret (TCP, shared memory) authenticates membership, not a name: every member
    /// may be any worker, and such an adapter says `Ok`. An adapter whose peers hold
    /// credentials of their own (QUIC's node certificates) checks that the peer's are issued
    /// for `name`, so that a member cannot take another member's name. The agent asks this of
    /// every peer's connection before it believes the name the peer gives for itself. There is
    /// no default, so that a wrapper around another connection cannot skip the check by
    /// forgetting to pass it on.
    fn check_peer_name(&self, name: &str) -> Result<(), IdentityError>;

    /// What the peer's credentials prove about who it is: [`Credentials::Membership`] for a
    /// cluster secret, the names of its certificate (verified against the cluster CA) for
    /// QUIC. The mesh checks every rank a peer claims against it, with
    /// [`check_rank_claim`](crate::identity::check_rank_claim). No default, for the reason
    /// [`check_peer_name`](Self::check_peer_name) has none.
    fn peer_credentials(&self) -> Credentials;
}

/// The frames of one connection, read by one long-lived reader
/// ([`Connection::into_frames`]).
pub trait FrameReader: Send {
    /// The next frame, as [`Connection::recv`] gives it; `Pending` registers `cx`'s waker.
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Frame, TransportError>>;
}

/// A [`FrameReader`] made of a function that turns its state into one receive, which gives
/// the state back with the frame: each receive's future is written over the last one's, in
/// the one box made with the reader (no allocation per frame).
pub struct EachFrame<S, Fut> {
    make: fn(S) -> Fut,
    fut: Pin<Box<Fut>>,
}

impl<S, Fut> EachFrame<S, Fut>
where
    Fut: Future<Output = (Result<Frame, TransportError>, S)>,
{
    /// A reader whose first receive is `make(state)` (not polled before the reader is).
    pub fn new(state: S, make: fn(S) -> Fut) -> Self {
        EachFrame {
            make,
            fut: Box::pin(make(state)),
        }
    }
}

impl<S, Fut> FrameReader for EachFrame<S, Fut>
where
    S: Send,
    Fut: Future<Output = (Result<Frame, TransportError>, S)> + Send,
{
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Frame, TransportError>> {
        let (received, state) = std::task::ready!(self.fut.as_mut().poll(cx));
        self.fut.set((self.make)(state));
        Poll::Ready(received)
    }
}

/// A peer's credentials do not name the worker it says it is
/// ([`Connection::check_peer_name`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{peer}'s credentials are not issued for the worker name {name:?}: {reason}")]
pub struct IdentityError {
    /// The peer.
    pub peer: SocketAddr,
    /// The name it gave.
    pub name: String,
    /// What its credentials say instead, in words.
    pub reason: String,
}

/// Why a transport operation failed. Every variant names the peer (or local) address. It is
/// plain data (`Clone`, `Eq`), so a peer's loss keeps it as it is (the protocol's
/// `LostCause::Transport`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The handshake failed: the peer does not know the cluster secret, we do not, or (QUIC)
    /// its certificate is not signed by the cluster CA.
    #[error("authentication with {peer} failed: {reason}")]
    Authentication {
        /// The peer.
        peer: SocketAddr,
        /// Why, in words.
        reason: String,
        /// The core handshake error, when the shared challenge-response decided.
        #[source]
        source: Option<AuthError>,
    },
    /// The peer closed the connection between frames.
    #[error("connection to {peer} closed by the peer")]
    Closed {
        /// The peer.
        peer: SocketAddr,
    },
    /// The peer closed the connection (or it broke) in the middle of a frame.
    #[error("connection to {peer} closed in the middle of a frame: {source}")]
    ClosedMidFrame {
        /// The peer.
        peer: SocketAddr,
        /// How much of the frame had arrived.
        #[source]
        source: WireError,
    },
    /// A frame that had started did not complete within the transport's per-frame deadline
    /// (the peer stalled mid-frame). The connection is closed and its buffers freed.
    #[error("a frame from {peer} did not complete within {after:?} of its start ({received} bytes had arrived)")]
    FrameTimeout {
        /// The peer.
        peer: SocketAddr,
        /// The deadline.
        after: std::time::Duration,
        /// Bytes of the frame that had arrived (prefix, frame header and segments so far).
        received: u64,
    },
    /// The peer made this side hold more bytes of frames not yet taken by `recv` than the
    /// transport's bound allows. The connection is closed.
    #[error("{peer} sent more than {limit} bytes of frames not yet received")]
    PendingBytes {
        /// The peer.
        peer: SocketAddr,
        /// The bound.
        limit: usize,
    },
    /// The frame being received passed the peer's memory budget (with what else the peer
    /// makes this worker hold). The connection is closed and the frame's buffers freed.
    #[error("closed the connection to {peer}: {source}")]
    OverBudget {
        /// The peer.
        peer: SocketAddr,
        /// The budget, what the peer held and what it asked for.
        #[source]
        source: crate::budget::OverBudget,
    },
    /// The peer sent bytes that are not a valid frame, or a frame to send breaks the limits.
    /// The connection is closed.
    #[error("bad frame on the connection to {peer}: {source}")]
    Wire {
        /// The peer.
        peer: SocketAddr,
        /// What was wrong.
        #[source]
        source: WireError,
    },
    /// The connection ended in a way that is neither a clean close nor an operating system's
    /// error: what the transport's own protocol said (QUIC: an idle timeout, a close with an
    /// error code, a reset), kept as data.
    #[error("connection to {peer} ended while {op}: {how}")]
    Ended {
        /// The peer.
        peer: SocketAddr,
        /// What was being done (`"connecting"`, `"sending"`, `"receiving"`, ...).
        op: &'static str,
        /// How it ended.
        #[source]
        how: Ended,
    },
    /// An operating-system error, or a condition of the adapter's own it describes in words.
    #[error("I/O error on {addr} while {op}: {message}")]
    Io {
        /// The peer's address, or the local address for `listen`.
        addr: SocketAddr,
        /// What was being done (`"connecting"`, `"sending"`, ...).
        op: &'static str,
        /// The error kind, where the OS gave one.
        kind: std::io::ErrorKind,
        /// The error message.
        message: String,
    },
    /// The transport is misconfigured (no secret and not explicitly insecure, a bad value in
    /// one of its environment variables, an unreadable certificate, ...).
    #[error("transport configuration: {0}")]
    Config(#[from] ConfigError),
}

/// What is wrong with a transport's settings ([`TransportError::Config`]): each variant names
/// the setting or variable and, where there is one, the value found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// No cluster secret was given, and running without one was not asked for.
    #[error(
        "no cluster secret: set {var} (the same value on every worker) or configure one; to run \
         without authentication, ask for it explicitly ({insecure})"
    )]
    NoSecret {
        /// The environment variable that holds the secret.
        var: &'static str,
        /// How to ask for no authentication (`ShmConfig::insecure`, ...).
        insecure: &'static str,
    },
    /// The cluster secret given cannot be used.
    #[error("{var}: {source}")]
    Secret {
        /// Where it came from (the environment variable).
        var: &'static str,
        /// Why.
        #[source]
        source: AuthError,
    },
    /// An environment variable holds a value its setting does not take.
    #[error(transparent)]
    Variable(#[from] BadVariable),
    /// A setting is outside the values it may take.
    #[error("{setting} is {value}; it must be {expected}")]
    Setting {
        /// The setting (`ShmConfig::ring_bytes`, ...).
        setting: &'static str,
        /// Its value.
        value: u64,
        /// What it must be.
        expected: String,
    },
    /// The shared-memory transport was required, but no shared-memory listener of this host
    /// answers for the peer's address.
    #[error(
        "{var}=shm, but no tensorwire shared-memory listener answers for {addr} on this host (is \
         the peer on another host, or does it run with {var}=tcp?)"
    )]
    NoSharedMemoryPeer {
        /// The peer's address.
        addr: SocketAddr,
        /// The variable that asked for shared memory.
        var: &'static str,
    },
    /// The name a TLS peer is checked against is not a valid DNS name.
    #[error("the TLS server name {name:?} is not a valid DNS name")]
    ServerName {
        /// The name.
        name: String,
    },
    /// A client connection was asked of an endpoint configured without a client side.
    #[error("no {transport} client configuration")]
    NoClientConfig {
        /// The transport (`"QUIC"`).
        transport: &'static str,
    },
    /// The in-memory network handed out every port number.
    #[error("the in-memory network ran out of ports")]
    PortsExhausted,
    /// A setting of the adapter's own that core cannot name (certificate files, TLS material),
    /// in the adapter's words: its error type is not plain data (it holds I/O and library
    /// errors), and this error is.
    #[error("{transport}: {message}")]
    Adapter {
        /// The transport.
        transport: &'static str,
        /// The adapter's error, rendered.
        message: String,
    },
}

/// How a connection ended ([`TransportError::Ended`]) when it was neither a clean close nor an
/// operating system's error. The words a peer sent with a close are its own (text from another
/// process, bounded by the transport).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Ended {
    /// No word from the peer for the idle timeout, keep-alives unanswered: it died or the
    /// network between the two failed.
    #[error(
        "no word from the peer for the idle timeout (keep-alives unanswered): it died or the \
         network failed"
    )]
    IdleTimeout,
    /// The peer's application closed the connection with an error code (not the code of a
    /// clean close).
    #[error("the peer closed it with error code {code}{}", said(.reason))]
    ClosedByPeer {
        /// The code.
        code: u64,
        /// Its words.
        reason: String,
    },
    /// The transport's protocol failed (a QUIC transport error, raised here or by the peer).
    #[error("the transport's protocol failed with code {code:#x}{}", said(.reason))]
    Protocol {
        /// The transport error code.
        code: u64,
        /// The words that came with it.
        reason: String,
    },
    /// The peer reset the connection: it no longer knows it (it restarted, or lost its state).
    #[error("the peer reset it (it no longer knows this connection)")]
    Reset,
    /// The peer speaks no version of the transport's protocol this side does.
    #[error("the peer speaks no protocol version this side does")]
    VersionMismatch,
    /// The connection ran out of connection ids.
    #[error("it ran out of connection ids")]
    IdsExhausted,
    /// This side closed it, or said goodbye on it, before the operation.
    #[error("this side had closed it already")]
    ClosedHere,
    /// The peer stopped the stream the operation wrote, with this code.
    #[error("the peer stopped the stream with code {code}")]
    StreamStopped {
        /// The code.
        code: u64,
    },
    /// The stream had been finished or reset on this side already.
    #[error("the stream was finished or reset already")]
    StreamClosed,
    /// Early (0-RTT) data was rejected by the peer.
    #[error("the peer rejected early (0-RTT) data")]
    EarlyDataRejected,
    /// The local endpoint is stopping or stopped.
    #[error("the local endpoint stopped")]
    EndpointStopped,
}

/// `": words"`, or nothing when there are none.
fn said(reason: &str) -> String {
    if reason.is_empty() {
        String::new()
    } else {
        format!(": {reason}")
    }
}

impl TransportError {
    /// An [`Io`](Self::Io) error from a [`std::io::Error`].
    pub fn io(addr: SocketAddr, op: &'static str, err: &std::io::Error) -> Self {
        TransportError::Io {
            addr,
            op,
            kind: err.kind(),
            message: err.to_string(),
        }
    }

    /// What a [`Connection::recv`] besides the connection's frame reader gets (see
    /// [`Connection::into_frames`]), at once, from an adapter whose reader owns the receive
    /// side: an [`Io`](Self::Io) error of op `"receiving"`.
    pub fn read_by_frames(addr: SocketAddr) -> Self {
        TransportError::Io {
            addr,
            op: "receiving",
            kind: std::io::ErrorKind::Other,
            message: "the connection's frames go to its reader (into_frames)".to_owned(),
        }
    }

    /// Whether this is a clean close between frames.
    pub fn is_clean_close(&self) -> bool {
        matches!(self, TransportError::Closed { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traits_are_object_safe_and_shareable() {
        fn assert_send_sync<T: Send + Sync + ?Sized>() {}
        assert_send_sync::<dyn Transport>();
        assert_send_sync::<dyn Listener>();
        assert_send_sync::<dyn Connection>();
        let _: Option<std::sync::Arc<dyn Connection>> = None;
    }

    /// One box for all frames: each receive starts from the state the last one gave back,
    /// and a pending receive is polled again, not restarted.
    #[test]
    fn each_frame_reuses_its_receive_and_passes_the_state_on() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::task::Waker;
        static MADE: AtomicUsize = AtomicUsize::new(0);
        struct Twice(bool, u8);
        impl Future for Twice {
            type Output = (Result<Frame, TransportError>, u8);
            fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
                if !self.0 {
                    self.0 = true;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                let n = self.1;
                let frame = Frame {
                    kind: crate::wire::FrameKind::Message,
                    header: vec![n].into(),
                    payloads: crate::wire::Payloads::new(),
                };
                Poll::Ready((Ok(frame), n + 1))
            }
        }
        let mut reader = EachFrame::new(0u8, |n| {
            MADE.fetch_add(1, Ordering::Relaxed);
            Twice(false, n)
        });
        let mut cx = Context::from_waker(Waker::noop());
        for n in 0..3u8 {
            assert!(reader.poll_recv(&mut cx).is_pending());
            match reader.poll_recv(&mut cx) {
                Poll::Ready(Ok(frame)) => assert_eq!(&frame.header[..], &[n]),
                other => panic!("frame {n}: {:?}", other.map(|r| r.map(|_| ()))),
            }
        }
        // The first and one after each frame, and never one per poll.
        assert_eq!(MADE.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn errors_name_the_peer() {
        let peer: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let e = TransportError::Authentication {
            peer,
            reason: "wrong secret".into(),
            source: Some(AuthError::ServerProofMismatch),
        };
        assert!(e.to_string().contains("127.0.0.1:4000"));
        assert!(e.to_string().contains("authentication"));
        let e = TransportError::io(peer, "sending", &std::io::Error::other("boom"));
        assert!(e.to_string().contains("127.0.0.1:4000") && e.to_string().contains("boom"));
        assert!(TransportError::Closed { peer }.is_clean_close());
    }

    /// An ended connection keeps how it ended as data, and says the peer's words only when
    /// it sent some.
    #[test]
    fn an_ended_connection_says_how_as_data() {
        let peer: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let e = TransportError::Ended {
            peer,
            op: "receiving",
            how: Ended::ClosedByPeer {
                code: 7,
                reason: "going away".into(),
            },
        };
        assert_eq!(
            e.to_string(),
            "connection to 127.0.0.1:4000 ended while receiving: the peer closed it with error \
             code 7: going away"
        );
        assert!(!e.is_clean_close());
        let quiet = Ended::ClosedByPeer {
            code: 7,
            reason: String::new(),
        };
        assert_eq!(quiet.to_string(), "the peer closed it with error code 7");
        let source = std::error::Error::source(&e).map(ToString::to_string);
        assert_eq!(
            source.as_deref(),
            Some("the peer closed it with error code 7: going away")
        );
        assert!(Ended::IdleTimeout.to_string().contains("idle timeout"));
    }
}
