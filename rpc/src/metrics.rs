//! The agent's counters: calls, bytes, errors and calls in flight, per peer, readable from the
//! agent ([`Agent::metrics`](crate::Agent::metrics)) and exported through the [`metrics`] facade, so that a Prometheus
//! exporter (or any recorder) installed by the application sees them.
//!
//! Exported names (labels `worker`: this agent's name, `peer`: the other worker's):
//!
//! | name | kind | what |
//! | --- | --- | --- |
//! | `tensorwire_rpc_calls_sent_total` | counter | calls and remotes this worker made |
//! | `tensorwire_rpc_calls_received_total` | counter | calls and remotes it served |
//! | `tensorwire_rpc_bytes_sent_total` | counter | argument bytes (encoded value and tensors) it sent |
//! | `tensorwire_rpc_bytes_received_total` | counter | argument bytes it received |
//! | `tensorwire_rpc_errors_total` | counter | calls it made that failed, and calls it served that failed |
//! | `tensorwire_rpc_calls_in_flight` | gauge | calls it made still waiting for their result |
//!
//! Install the recorder before `init_rpc`: the agent registers a peer's handles when it first
//! talks to it. Each call also runs in a `tracing` span at debug level: `rpc_call` (peer,
//! function, id, bytes) on the caller, `rpc_serve` (peer, function, bytes) on the callee.
//!
//! ```no_run
//! # async fn run(agent: tensorwire_rpc::Agent) {
//! let m = agent.metrics();
//! println!("{} calls sent, {} in flight", m.total.calls_sent, m.total.in_flight);
//! for (peer, p) in &m.per_peer {
//!     println!("{peer}: {} bytes sent, {} errors", p.bytes_sent, p.errors);
//! }
//! # }
//! ```

use std::collections::BTreeMap;

use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use tensorwire_core::hashing::HashMap;

use tensorwire_core::protocol::{MessageId, WorkerId};
use tensorwire_core::tensor::Tensor;
use tracing::Instrument;

use std::future::Future;

use crate::error::RpcError;

/// One peer's counters, as read from [`Agent::metrics`](crate::Agent::metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerMetrics {
    /// Calls and remotes made to the peer.
    pub calls_sent: u64,
    /// Calls and remotes served for the peer.
    pub calls_received: u64,
    /// Argument bytes (encoded value and tensor bytes) sent to the peer.
    pub bytes_sent: u64,
    /// Argument bytes received from the peer.
    pub bytes_received: u64,
    /// Calls to the peer that failed, and calls served for it that failed.
    pub errors: u64,
    /// Calls to the peer still waiting for their result.
    pub in_flight: i64,
}

impl std::ops::AddAssign for PeerMetrics {
    fn add_assign(&mut self, o: Self) {
        self.calls_sent += o.calls_sent;
        self.calls_received += o.calls_received;
        self.bytes_sent += o.bytes_sent;
        self.bytes_received += o.bytes_received;
        self.errors += o.errors;
        self.in_flight += o.in_flight;
    }
}

/// The agent's counters: the total and each peer's (by name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RpcMetrics {
    /// The sum over all peers.
    pub total: PeerMetrics,
    /// Per peer, by worker name.
    pub per_peer: BTreeMap<String, PeerMetrics>,
}

/// A peer's live counters and their exported handles.
struct Peer {
    name: String,
    calls_sent: AtomicU64,
    calls_received: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    errors: AtomicU64,
    in_flight: AtomicI64,
    export: Export,
}

/// The handles of the `metrics` facade for one peer (no-ops without a recorder).
struct Export {
    calls_sent: metrics::Counter,
    calls_received: metrics::Counter,
    bytes_sent: metrics::Counter,
    bytes_received: metrics::Counter,
    errors: metrics::Counter,
    in_flight: metrics::Gauge,
}

impl Peer {
    fn new(worker: &str, name: String) -> Self {
        let labels = [("worker", worker.to_owned()), ("peer", name.clone())];
        Self {
            export: Export {
                calls_sent: metrics::counter!("tensorwire_rpc_calls_sent_total", &labels),
                calls_received: metrics::counter!("tensorwire_rpc_calls_received_total", &labels),
                bytes_sent: metrics::counter!("tensorwire_rpc_bytes_sent_total", &labels),
                bytes_received: metrics::counter!("tensorwire_rpc_bytes_received_total", &labels),
                errors: metrics::counter!("tensorwire_rpc_errors_total", &labels),
                in_flight: metrics::gauge!("tensorwire_rpc_calls_in_flight", &labels),
            },
            name,
            calls_sent: AtomicU64::new(0),
            calls_received: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            in_flight: AtomicI64::new(0),
        }
    }

    fn read(&self) -> PeerMetrics {
        PeerMetrics {
            calls_sent: self.calls_sent.load(Ordering::Relaxed),
            calls_received: self.calls_received.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
        }
    }

    fn sent(&self, bytes: u64) {
        self.calls_sent.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        self.export.calls_sent.increment(1);
        self.export.bytes_sent.increment(bytes);
    }

    fn error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.export.errors.increment(1);
    }
}

/// The counters of one agent, per peer. The agent holds one and calls it where calls start
/// and end.
pub(crate) struct AgentMetrics {
    worker: String,
    peers: RwLock<HashMap<WorkerId, Arc<Peer>>>,
}

impl fmt::Debug for AgentMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentMetrics")
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

/// Bytes of an encoded value and its tensors.
pub(crate) fn message_bytes<'a>(data: usize, tensors: impl Iterator<Item = &'a Tensor>) -> u64 {
    (data + tensors.map(Tensor::nbytes).sum::<usize>()) as u64
}

impl AgentMetrics {
    /// No counts yet, for the agent of worker `worker`.
    pub(crate) fn new(worker: &str) -> Self {
        Self {
            worker: worker.to_owned(),
            peers: RwLock::new(HashMap::default()),
        }
    }

    fn peer(&self, name_of: &dyn Fn(WorkerId) -> String, id: WorkerId) -> Arc<Peer> {
        if let Some(p) = self
            .peers
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&id)
        {
            return Arc::clone(p);
        }
        let name = name_of(id);
        Arc::clone(
            self.peers
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .entry(id)
                .or_insert_with(|| Arc::new(Peer::new(&self.worker, name))),
        )
    }

    /// A call to `to` was sent (message `id`, `bytes` of arguments): counts it, and counts it
    /// in flight until the future the returned watch wraps resolves (or is dropped), then as
    /// an error if it failed. The future runs in the call's span.
    pub(crate) fn call(
        &self,
        name_of: &dyn Fn(WorkerId) -> String,
        to: WorkerId,
        function: &str,
        id: MessageId,
        bytes: u64,
    ) -> CallWatch {
        let peer = self.peer(name_of, to);
        peer.sent(bytes);
        let span = tracing::debug_span!(
            "rpc_call",
            peer = %peer.name,
            function,
            id = ?id,
            bytes
        );
        CallWatch {
            guard: InFlight::new(peer),
            span,
        }
    }

    /// A remote (a value created on `to`) was sent: counted as a call, with its bytes.
    pub(crate) fn remote(
        &self,
        name_of: &dyn Fn(WorkerId) -> String,
        to: WorkerId,
        function: &str,
        bytes: u64,
    ) {
        let peer = self.peer(name_of, to);
        peer.sent(bytes);
        tracing::debug!(peer = %peer.name, function, bytes, "rpc_remote");
    }

    /// A call from `from` with `bytes` of arguments is being served: returns the span it runs
    /// in and a guard that counts it as an error unless [`Served::finish`] says it succeeded.
    pub(crate) fn serve(
        &self,
        name_of: &dyn Fn(WorkerId) -> String,
        from: WorkerId,
        function: &str,
        bytes: u64,
    ) -> (tracing::Span, Served) {
        let peer = self.peer(name_of, from);
        peer.calls_received.fetch_add(1, Ordering::Relaxed);
        peer.bytes_received.fetch_add(bytes, Ordering::Relaxed);
        peer.export.calls_received.increment(1);
        peer.export.bytes_received.increment(bytes);
        let span = tracing::debug_span!("rpc_serve", peer = %peer.name, function, bytes);
        (span, Served(Some(peer)))
    }

    /// The counters now.
    pub(crate) fn read(&self) -> RpcMetrics {
        let mut out = RpcMetrics::default();
        for peer in self
            .peers
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
        {
            let m = peer.read();
            out.total += m;
            *out.per_peer.entry(peer.name.clone()).or_default() += m;
        }
        out
    }
}

/// A call in flight: counted down when finished or dropped (a dropped call is not an error).
/// What [`AgentMetrics::call`] counts for one call until its result's future ends.
pub(crate) struct CallWatch {
    guard: InFlight,
    span: tracing::Span,
}

impl CallWatch {
    /// `result` counted (in flight until it ends, an error if it fails) and in the call's
    /// span; wrapped, not boxed again (one allocation per call, the caller's).
    pub(crate) fn watch<R>(
        self,
        result: impl Future<Output = Result<R, RpcError>>,
    ) -> impl Future<Output = Result<R, RpcError>> {
        let Self { guard, span } = self;
        async move {
            let out = result.await;
            guard.finish(out.is_ok());
            out
        }
        .instrument(span)
    }
}

struct InFlight(Option<Arc<Peer>>);

impl InFlight {
    fn new(peer: Arc<Peer>) -> Self {
        peer.in_flight.fetch_add(1, Ordering::Relaxed);
        peer.export.in_flight.increment(1.0);
        Self(Some(peer))
    }

    fn finish(mut self, ok: bool) {
        if let Some(peer) = self.0.take() {
            if !ok {
                peer.error();
            }
            Self::leave(&peer);
        }
    }

    fn leave(peer: &Peer) {
        peer.in_flight.fetch_sub(1, Ordering::Relaxed);
        peer.export.in_flight.decrement(1.0);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(peer) = self.0.take() {
            Self::leave(&peer);
        }
    }
}

/// A call being served: an error unless finished with success (a panicking or dropped handler
/// counts as an error).
pub(crate) struct Served(Option<Arc<Peer>>);

impl Served {
    /// The handler finished; `ok`: it succeeded.
    pub(crate) fn finish(mut self, ok: bool) {
        if let Some(peer) = self.0.take() {
            if !ok {
                peer.error();
            }
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(peer) = self.0.take() {
            peer.error();
        }
    }
}
