//! The agent's counters per peer and the rules of their updates: what a call made, a remote
//! sent and a call served count, when a call is in flight, which failures are errors (a call
//! that failed and a served call whose handler did not succeed, also one that panicked or was
//! dropped; never a call its caller dropped), and how the table reads (the total, and per
//! peer by name). The agent keeps a [`PeerCounters`] per peer, counts through the guards here,
//! and exports the same updates through an [`Export`] of its own (the `metrics` facade).
//!
//! ```
//! use std::sync::Arc;
//! use tensorwire_core::protocol::metrics::{InFlight, PeerCounters, RpcMetrics, Served};
//!
//! let peer = Arc::new(PeerCounters::new("worker1".to_owned(), ()));
//! let call = InFlight::call(Arc::clone(&peer), 40);
//! assert_eq!(peer.read().in_flight, 1);
//! call.finish(false); // it failed: an error, no longer in flight
//! drop(Served::serve(Arc::clone(&peer), 8)); // a handler dropped: an error
//! let m = RpcMetrics::sum([(peer.name(), peer.read())]);
//! assert_eq!((m.total.calls_sent, m.total.errors, m.total.in_flight), (1, 2, 0));
//! ```

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use super::WorkerId;
use crate::hashing::HashMap;
use crate::tensor::Tensor;

/// One peer's counters, as read from the agent (`Agent::metrics` in the rpc crate).
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

impl RpcMetrics {
    /// The table of `peers` (each one's name and counts): the total over all of them, and per
    /// name, where two records of one name (a worker that left and joined again under another
    /// rank) add up.
    pub fn sum<'a>(peers: impl IntoIterator<Item = (&'a str, PeerMetrics)>) -> Self {
        let mut out = RpcMetrics::default();
        for (name, m) in peers {
            out.total += m;
            *out.per_peer.entry(name.to_owned()).or_default() += m;
        }
        out
    }
}

/// Bytes of an encoded value and its tensors: what a call's arguments count.
pub fn message_bytes<'a>(data: usize, tensors: impl Iterator<Item = &'a Tensor>) -> u64 {
    (data + tensors.map(Tensor::nbytes).sum::<usize>()) as u64
}

/// Where a peer's updates are reported besides its counters (the agent's `metrics` facade
/// handles); `()` reports nowhere.
pub trait Export: Send + Sync {
    /// A call or remote with `bytes` of arguments was sent.
    fn sent(&self, bytes: u64);
    /// A call with `bytes` of arguments is being served.
    fn received(&self, bytes: u64);
    /// A call failed (made or served).
    fn error(&self);
    /// The calls in flight changed by `delta`.
    fn in_flight(&self, delta: i64);
}

impl Export for () {
    fn sent(&self, _: u64) {}
    fn received(&self, _: u64) {}
    fn error(&self) {}
    fn in_flight(&self, _: i64) {}
}

/// One peer's live counters (atomic: read while calls update them), and their export `X`.
#[derive(Debug)]
pub struct PeerCounters<X> {
    name: String,
    calls_sent: AtomicU64,
    calls_received: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    errors: AtomicU64,
    in_flight: AtomicI64,
    export: X,
}

impl<X: Export> PeerCounters<X> {
    /// No counts yet, for the peer called `name`.
    pub fn new(name: String, export: X) -> Self {
        Self {
            name,
            calls_sent: AtomicU64::new(0),
            calls_received: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            in_flight: AtomicI64::new(0),
            export,
        }
    }

    /// The peer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The counts now.
    pub fn read(&self) -> PeerMetrics {
        PeerMetrics {
            calls_sent: self.calls_sent.load(Ordering::Relaxed),
            calls_received: self.calls_received.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
        }
    }

    /// A remote (a value created on the peer) with `bytes` of arguments was sent: counted as a
    /// call, never in flight (its reference says how it went).
    pub fn sent(&self, bytes: u64) {
        self.calls_sent.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        self.export.sent(bytes);
    }

    fn error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.export.error();
    }

    fn in_flight(&self, delta: i64) {
        self.in_flight.fetch_add(delta, Ordering::Relaxed);
        self.export.in_flight(delta);
    }
}

/// A call made to a peer, in flight until [`finish`](Self::finish)ed or dropped: dropped (its
/// caller stopped waiting), it is no error.
#[derive(Debug)]
pub struct InFlight<X: Export>(Option<Arc<PeerCounters<X>>>);

impl<X: Export> InFlight<X> {
    /// A call to `peer` with `bytes` of arguments was sent: counted, and in flight.
    pub fn call(peer: Arc<PeerCounters<X>>, bytes: u64) -> Self {
        peer.sent(bytes);
        peer.in_flight(1);
        Self(Some(peer))
    }

    /// Its result came: no longer in flight, and an error unless `ok`.
    pub fn finish(mut self, ok: bool) {
        if let Some(peer) = self.0.take() {
            if !ok {
                peer.error();
            }
            peer.in_flight(-1);
        }
    }
}

impl<X: Export> Drop for InFlight<X> {
    fn drop(&mut self) {
        if let Some(peer) = self.0.take() {
            peer.in_flight(-1);
        }
    }
}

/// A call being served for a peer: an error unless [`finish`](Self::finish)ed with success (a
/// handler that panicked or was dropped failed).
#[derive(Debug)]
pub struct Served<X: Export>(Option<Arc<PeerCounters<X>>>);

impl<X: Export> Served<X> {
    /// A call from `peer` with `bytes` of arguments is being served: counted.
    pub fn serve(peer: Arc<PeerCounters<X>>, bytes: u64) -> Self {
        peer.calls_received.fetch_add(1, Ordering::Relaxed);
        peer.bytes_received.fetch_add(bytes, Ordering::Relaxed);
        peer.export.received(bytes);
        Self(Some(peer))
    }

    /// The handler finished; `ok`: it succeeded.
    pub fn finish(mut self, ok: bool) {
        if let Some(peer) = self.0.take() {
            if !ok {
                peer.error();
            }
        }
    }
}

impl<X: Export> Drop for Served<X> {
    fn drop(&mut self) {
        if let Some(peer) = self.0.take() {
            peer.error();
        }
    }
}

/// The counters of every peer an agent talked to, by rank: a peer's are made when it is
/// first counted, under the name it has then (a worker that left and joined again under
/// another rank has two, added up by name when read). Shared by the agent's tasks.
///
/// Every call made and served looks its peer up: the ranks below [`PeerTable::SLOTS`] (every
/// worker of a group that size) each have a slot set once and read with one atomic load, no
/// lock and no hashing; the ranks above it are kept in a map behind a lock.
pub struct PeerTable<X> {
    /// The counters of peers `0..SLOTS`, each set once.
    first: [OnceLock<Arc<PeerCounters<X>>>; PEER_SLOTS],
    /// Those of peers from `SLOTS` on.
    rest: RwLock<HashMap<WorkerId, Arc<PeerCounters<X>>>>,
}

/// [`PeerTable::SLOTS`].
const PEER_SLOTS: usize = 64;

impl<X> Default for PeerTable<X> {
    fn default() -> Self {
        Self {
            first: std::array::from_fn(|_| OnceLock::new()),
            rest: RwLock::new(HashMap::default()),
        }
    }
}

impl<X: Export> PeerTable<X> {
    /// How many ranks, from 0, have a slot of their own (looked up without a lock).
    pub const SLOTS: usize = PEER_SLOTS;

    /// The counters of peer `id`; made with `make` (its name and export) if it has none yet.
    /// `make` runs with no lock of the table held (it may look the name up elsewhere); made by
    /// two threads at once, one is kept and the other dropped.
    pub fn peer(&self, id: WorkerId, make: impl FnOnce() -> (String, X)) -> Arc<PeerCounters<X>> {
        let slot = usize::try_from(id).ok().and_then(|i| self.first.get(i));
        if let Some(slot) = slot {
            if let Some(p) = slot.get() {
                return Arc::clone(p);
            }
            let (name, export) = make();
            return Arc::clone(slot.get_or_init(|| Arc::new(PeerCounters::new(name, export))));
        }
        if let Some(p) = self
            .rest
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&id)
        {
            return Arc::clone(p);
        }
        let (name, export) = make();
        Arc::clone(
            self.rest
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .entry(id)
                .or_insert_with(|| Arc::new(PeerCounters::new(name, export))),
        )
    }

    /// The table now ([`RpcMetrics::sum`] of every peer's counters).
    pub fn read(&self) -> RpcMetrics {
        let rest = self
            .rest
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let first = self.first.iter().filter_map(OnceLock::get);
        RpcMetrics::sum(first.chain(rest.values()).map(|p| (p.name(), p.read())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// An export that records what it was told, to check it hears what the counters count.
    #[derive(Debug, Default)]
    struct Told(Mutex<Vec<String>>);

    impl Export for Told {
        fn sent(&self, bytes: u64) {
            self.0.lock().unwrap().push(format!("sent {bytes}"));
        }
        fn received(&self, bytes: u64) {
            self.0.lock().unwrap().push(format!("received {bytes}"));
        }
        fn error(&self) {
            self.0.lock().unwrap().push("error".into());
        }
        fn in_flight(&self, delta: i64) {
            self.0.lock().unwrap().push(format!("in flight {delta}"));
        }
    }

    fn peer(name: &str) -> Arc<PeerCounters<Told>> {
        Arc::new(PeerCounters::new(name.to_owned(), Told::default()))
    }

    fn told(p: &PeerCounters<Told>) -> Vec<String> {
        p.export.0.lock().unwrap().clone()
    }

    #[test]
    fn a_call_is_in_flight_until_it_ends_and_an_error_only_if_it_failed() {
        let p = peer("w1");
        let ok = InFlight::call(Arc::clone(&p), 10);
        let failed = InFlight::call(Arc::clone(&p), 5);
        let m = p.read();
        assert_eq!(
            (m.calls_sent, m.bytes_sent, m.in_flight, m.errors),
            (2, 15, 2, 0)
        );
        ok.finish(true);
        failed.finish(false);
        let m = p.read();
        assert_eq!((m.in_flight, m.errors), (0, 1));
        assert_eq!(
            told(&p),
            [
                "sent 10",
                "in flight 1",
                "sent 5",
                "in flight 1",
                "in flight -1",
                "error",
                "in flight -1"
            ]
        );
    }

    #[test]
    fn a_call_its_caller_dropped_leaves_flight_without_an_error() {
        let p = peer("w1");
        drop(InFlight::call(Arc::clone(&p), 3));
        let m = p.read();
        assert_eq!((m.calls_sent, m.in_flight, m.errors), (1, 0, 0));
        assert_eq!(told(&p), ["sent 3", "in flight 1", "in flight -1"]);
    }

    #[test]
    fn a_remote_counts_as_a_call_sent_and_is_never_in_flight() {
        let p = peer("w1");
        p.sent(7);
        let m = p.read();
        assert_eq!((m.calls_sent, m.bytes_sent, m.in_flight), (1, 7, 0));
        assert_eq!(told(&p), ["sent 7"]);
    }

    #[test]
    fn a_served_call_is_an_error_unless_it_finished_with_success() {
        let p = peer("w1");
        Served::serve(Arc::clone(&p), 4).finish(true);
        assert_eq!(p.read().errors, 0);
        Served::serve(Arc::clone(&p), 4).finish(false);
        assert_eq!(p.read().errors, 1);
        // Dropped (the handler panicked, or its task was cancelled): failed.
        drop(Served::serve(Arc::clone(&p), 4));
        let m = p.read();
        assert_eq!((m.calls_received, m.bytes_received, m.errors), (3, 12, 2));
        assert_eq!(
            told(&p),
            ["received 4", "received 4", "error", "received 4", "error"]
        );
    }

    #[test]
    fn the_table_sums_all_peers_and_adds_up_records_of_one_name() {
        let (a, b, again) = (peer("a"), peer("b"), peer("a"));
        a.sent(1);
        b.sent(2);
        let _flying = InFlight::call(Arc::clone(&again), 4);
        let m = RpcMetrics::sum([&a, &b, &again].map(|p| (p.name(), p.read())));
        assert_eq!(
            (m.total.calls_sent, m.total.bytes_sent, m.total.in_flight),
            (3, 7, 1)
        );
        assert_eq!(m.per_peer.len(), 2);
        let a = m.per_peer["a"];
        assert_eq!((a.calls_sent, a.bytes_sent, a.in_flight), (2, 5, 1));
        assert_eq!(m.per_peer["b"].bytes_sent, 2);
    }

    #[test]
    fn message_bytes_counts_the_encoded_value_and_its_tensors() {
        let t = Tensor::from_f32(vec![3], &[1.0, 2.0, 3.0]).unwrap();
        assert_eq!(message_bytes(5, [&t, &t].into_iter()), 5 + 2 * 12);
        assert_eq!(message_bytes(0, std::iter::empty()), 0);
    }

    #[test]
    fn a_peers_counters_are_made_once_under_its_first_name() {
        let table = PeerTable::<()>::default();
        let first = table.peer(1, || ("w1".to_owned(), ()));
        first.sent(10);
        let again = table.peer(1, || panic!("made once"));
        assert!(Arc::ptr_eq(&first, &again));
        // A worker that left and joined again under another rank: added up by name.
        table.peer(2, || ("w1".to_owned(), ())).sent(5);
        table.peer(3, || ("w3".to_owned(), ()));
        let m = table.read();
        assert_eq!(m.total.bytes_sent, 15);
        assert_eq!(m.per_peer["w1"].calls_sent, 2);
        assert_eq!(m.per_peer["w3"], PeerMetrics::default());
    }

    /// The ranks with a slot and those in the map behind it are made once each and read
    /// together, the last slot and the first rank past the slots alike.
    #[test]
    fn peers_past_the_slots_are_made_once_and_read_with_the_others() {
        let table = PeerTable::<()>::default();
        let slots = u32::try_from(PeerTable::<()>::SLOTS).unwrap();
        for id in [0, slots - 1, slots, u32::MAX] {
            let made = table.peer(id, || (format!("w{id}"), ()));
            made.sent(u64::from(id % 1000) + 1);
            let again = table.peer(id, || panic!("made once"));
            assert!(Arc::ptr_eq(&made, &again), "rank {id}");
        }
        // Ranks past the slots under a name a slot has too: added up by name.
        table.peer(slots + 1, || ("w0".to_owned(), ())).sent(7);
        let m = table.read();
        assert_eq!(m.per_peer.len(), 4);
        assert_eq!(m.per_peer["w0"].bytes_sent, 1 + 7);
        assert_eq!(m.per_peer[&format!("w{}", slots - 1)].bytes_sent, 64);
        assert_eq!(m.per_peer[&format!("w{slots}")].bytes_sent, 65);
        assert_eq!(m.per_peer[&format!("w{}", u32::MAX)].calls_sent, 1);
        assert_eq!(m.total.calls_sent, 5);
    }
}
