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

use std::fmt;
use std::future::Future;
use std::sync::Arc;

pub(crate) use tensorwire_core::protocol::metrics::message_bytes;
use tensorwire_core::protocol::metrics::{Export, InFlight, PeerCounters, PeerTable, Served};
pub use tensorwire_core::protocol::metrics::{PeerMetrics, RpcMetrics};
use tensorwire_core::protocol::{MessageId, WorkerId};
use tracing::Instrument;

use crate::error::RpcError;

/// The handles of the `metrics` facade for one peer (no-ops without a recorder): core's
/// counters report their updates here.
pub(crate) struct Facade {
    calls_sent: metrics::Counter,
    calls_received: metrics::Counter,
    bytes_sent: metrics::Counter,
    bytes_received: metrics::Counter,
    errors: metrics::Counter,
    in_flight: metrics::Gauge,
}

impl Facade {
    fn new(worker: &str, peer: &str) -> Self {
        let labels = [("worker", worker.to_owned()), ("peer", peer.to_owned())];
        Self {
            calls_sent: metrics::counter!("tensorwire_rpc_calls_sent_total", &labels),
            calls_received: metrics::counter!("tensorwire_rpc_calls_received_total", &labels),
            bytes_sent: metrics::counter!("tensorwire_rpc_bytes_sent_total", &labels),
            bytes_received: metrics::counter!("tensorwire_rpc_bytes_received_total", &labels),
            errors: metrics::counter!("tensorwire_rpc_errors_total", &labels),
            in_flight: metrics::gauge!("tensorwire_rpc_calls_in_flight", &labels),
        }
    }
}

impl Export for Facade {
    fn sent(&self, bytes: u64) {
        self.calls_sent.increment(1);
        self.bytes_sent.increment(bytes);
    }
    fn received(&self, bytes: u64) {
        self.calls_received.increment(1);
        self.bytes_received.increment(bytes);
    }
    fn error(&self) {
        self.errors.increment(1);
    }
    fn in_flight(&self, delta: i64) {
        // Down as a decrement (a recorder may keep a gauge's ups and downs apart).
        match delta {
            d if d < 0 => self.in_flight.decrement(d.unsigned_abs() as f64),
            d => self.in_flight.increment(d as f64),
        }
    }
}

type Peer = PeerCounters<Facade>;

/// The counters of one agent, per peer (core's table). The agent holds one and calls it where
/// calls start and end.
pub(crate) struct AgentMetrics {
    worker: String,
    peers: PeerTable<Facade>,
}

impl fmt::Debug for AgentMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentMetrics")
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

impl AgentMetrics {
    /// No counts yet, for the agent of worker `worker`.
    pub(crate) fn new(worker: &str) -> Self {
        Self {
            worker: worker.to_owned(),
            peers: PeerTable::default(),
        }
    }

    /// The counters of peer `id`, with its facade's handles registered when it has none.
    fn peer(&self, name_of: &dyn Fn(WorkerId) -> String, id: WorkerId) -> Arc<Peer> {
        self.peers.peer(id, || {
            let name = name_of(id);
            let facade = Facade::new(&self.worker, &name);
            (name, facade)
        })
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
        let span = tracing::debug_span!(
            "rpc_call",
            peer = %peer.name(),
            function,
            id = ?id,
            bytes
        );
        CallWatch {
            guard: InFlight::call(peer, bytes),
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
        tracing::debug!(peer = %peer.name(), function, bytes, "rpc_remote");
    }

    /// A call from `from` with `bytes` of arguments is being served: returns the span it runs
    /// in and a guard that counts it as an error unless it finishes with success.
    pub(crate) fn serve(
        &self,
        name_of: &dyn Fn(WorkerId) -> String,
        from: WorkerId,
        function: &str,
        bytes: u64,
    ) -> (tracing::Span, Served<Facade>) {
        let peer = self.peer(name_of, from);
        let span = tracing::debug_span!("rpc_serve", peer = %peer.name(), function, bytes);
        (span, Served::serve(peer, bytes))
    }

    /// The counters now.
    pub(crate) fn read(&self) -> RpcMetrics {
        self.peers.read()
    }
}

/// What [`AgentMetrics::call`] counts for one call until its result's future ends.
pub(crate) struct CallWatch {
    guard: InFlight<Facade>,
    span: tracing::Span,
}

impl CallWatch {
    /// The future `result` makes, counted (in flight until it ends, an error if it fails) and
    /// in the call's span; wrapped, not boxed again (one allocation per call, the caller's).
    /// Made inside the wrapper's own state: a future passed in was copied into it at the first
    /// poll (the await's slot), 160 instructions a call.
    pub(crate) fn watch<R, F: Future<Output = Result<R, RpcError>>>(
        self,
        result: impl FnOnce() -> F,
    ) -> impl Future<Output = Result<R, RpcError>> {
        let Self { guard, span } = self;
        async move {
            let out = result().await;
            guard.finish(out.is_ok());
            out
        }
        .instrument(span)
    }
}
