//! Per-connection delivery order for frames that travel on separate streams (pure, no I/O).
//!
//! Every frame has its own QUIC stream, numbered by the stream index (`seq`). The transport's
//! contract asks that a frame be delivered after every frame whose `send` *completed* before its
//! own `send` began, and allows anything else to overtake. So the sender records, when a send
//! begins, which sends have completed ([`Deps`]: "everything below `below`, plus `extra`"), and
//! writes that in front of the frame; the receiver holds a frame back until all of its
//! dependencies are delivered (or known cancelled). Sequential sends thus arrive in order, while
//! a small frame sent concurrently with a large one does not wait for it.
//!
//! Dependencies always have smaller numbers than the frame: they completed before the frame's
//! stream was opened, and streams are numbered in the order they are opened.

use std::collections::{BTreeMap, BTreeSet};

/// Most explicit dependencies written in front of one frame. Past that, the sender falls back
/// to "everything below the largest one", which is stricter but still correct.
pub(crate) const MAX_EXTRA: usize = 32;

/// What a frame must wait for: every sequence number below `below`, and those in `extra`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Deps {
    pub(crate) below: u64,
    pub(crate) extra: Vec<u64>,
}

/// A set of completed sequence numbers: all below `below`, plus `above`.
#[derive(Debug, Default)]
struct DoneSet {
    below: u64,
    above: BTreeSet<u64>,
}

impl DoneSet {
    fn contains(&self, seq: u64) -> bool {
        seq < self.below || self.above.contains(&seq)
    }

    fn insert(&mut self, seq: u64) {
        if seq < self.below {
            return;
        }
        self.above.insert(seq);
        while self.above.remove(&self.below) {
            self.below += 1;
        }
    }

    fn covers(&self, deps: &Deps) -> bool {
        let range_done =
            deps.below <= self.below || (self.below..deps.below).all(|s| self.above.contains(&s));
        range_done && deps.extra.iter().all(|&s| self.contains(s))
    }
}

/// The sender's record of completed sends.
#[derive(Debug, Default)]
pub(crate) struct SendOrder {
    done: DoneSet,
}

impl SendOrder {
    /// Starts with sequence numbers below `first` already complete (streams used before frames).
    pub(crate) fn starting_at(first: u64) -> Self {
        Self {
            done: DoneSet {
                below: first,
                above: BTreeSet::new(),
            },
        }
    }

    /// What a send beginning now must be delivered after.
    pub(crate) fn begin(&self) -> Deps {
        if self.done.above.len() <= MAX_EXTRA {
            Deps {
                below: self.done.below,
                extra: self.done.above.iter().copied().collect(),
            }
        } else {
            let max = self.done.above.iter().next_back().copied().unwrap_or(0);
            Deps {
                below: max + 1,
                extra: Vec::new(),
            }
        }
    }

    /// Records that the send with `seq` completed (or was cancelled).
    pub(crate) fn complete(&mut self, seq: u64) {
        self.done.insert(seq);
    }
}

/// The receiver's reorder buffer: frames arrive in any order and leave in an order that honours
/// their dependencies.
#[derive(Debug)]
pub(crate) struct RecvOrder<T> {
    done: DoneSet,
    waiting: BTreeMap<u64, (Deps, T)>,
}

impl<T> RecvOrder<T> {
    /// Starts with sequence numbers below `first` already done.
    pub(crate) fn starting_at(first: u64) -> Self {
        Self {
            done: DoneSet {
                below: first,
                above: BTreeSet::new(),
            },
            waiting: BTreeMap::new(),
        }
    }

    /// Number of frames held back.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// A frame `seq` arrived whole; returns the frames now deliverable, in delivery order.
    pub(crate) fn arrive(&mut self, seq: u64, deps: Deps, item: T) -> Vec<T> {
        let mut out = Vec::new();
        if self.done.covers(&deps) {
            self.done.insert(seq);
            out.push(item);
            self.release(&mut out);
        } else {
            self.waiting.insert(seq, (deps, item));
        }
        out
    }

    /// Stream `seq` carried no frame to deliver (cancelled, or a control stream).
    pub(crate) fn skip(&mut self, seq: u64) -> Vec<T> {
        let mut out = Vec::new();
        self.done.insert(seq);
        self.release(&mut out);
        out
    }

    fn release(&mut self, out: &mut Vec<T>) {
        loop {
            let ready = self
                .waiting
                .iter()
                .find(|(_, (deps, _))| self.done.covers(deps))
                .map(|(&seq, _)| seq);
            let Some(seq) = ready else { return };
            if let Some((_, item)) = self.waiting.remove(&seq) {
                self.done.insert(seq);
                out.push(item);
            }
        }
    }
}

/// Encoded size of `deps` in front of a frame.
pub(crate) fn encoded_len(deps: &Deps) -> usize {
    8 + 1 + 8 * deps.extra.len()
}

/// Writes `deps` as `below: u64 LE, n: u8, n × u64 LE`.
pub(crate) fn encode(deps: &Deps, out: &mut Vec<u8>) {
    out.extend_from_slice(&deps.below.to_le_bytes());
    out.push(deps.extra.len() as u8);
    for s in &deps.extra {
        out.extend_from_slice(&s.to_le_bytes());
    }
}

/// Why dependencies in front of a frame were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DepsError {
    /// More explicit dependencies than [`MAX_EXTRA`].
    TooMany(usize),
    /// A dependency not below the frame's own number (a sender cannot depend on the future).
    NotBefore { dep: u64, seq: u64 },
}

impl std::fmt::Display for DepsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DepsError::TooMany(n) => {
                write!(
                    f,
                    "{n} ordering dependencies, more than the {MAX_EXTRA} allowed"
                )
            }
            DepsError::NotBefore { dep, seq } => {
                write!(f, "stream {seq} depends on later stream {dep}")
            }
        }
    }
}

/// Checks decoded dependencies of frame `seq`.
pub(crate) fn check(deps: &Deps, seq: u64) -> Result<(), DepsError> {
    if deps.extra.len() > MAX_EXTRA {
        return Err(DepsError::TooMany(deps.extra.len()));
    }
    if deps.below > seq {
        return Err(DepsError::NotBefore {
            dep: deps.below - 1,
            seq,
        });
    }
    if let Some(&dep) = deps.extra.iter().find(|&&d| d >= seq) {
        return Err(DepsError::NotBefore { dep, seq });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sequential_sends_arrive_in_order_whatever_the_arrival_order() {
        let mut tx = SendOrder::default();
        let mut deps = Vec::new();
        for seq in 0..5 {
            deps.push(tx.begin());
            tx.complete(seq);
        }
        let mut rx = RecvOrder::starting_at(0);
        let mut got = Vec::new();
        for seq in [4u64, 2, 3, 0, 1] {
            got.extend(rx.arrive(seq, deps[seq as usize].clone(), seq));
        }
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        assert_eq!(rx.waiting(), 0);
    }

    #[test]
    fn a_small_frame_overtakes_a_large_concurrent_one() {
        let mut tx = SendOrder::default();
        let big = tx.begin(); // seq 0, still in flight
        let small = tx.begin(); // seq 1, concurrent
        tx.complete(1);
        let after_small = tx.begin(); // seq 2, after 1 completed
        let mut rx = RecvOrder::starting_at(0);
        assert_eq!(rx.arrive(1, small, "small"), vec!["small"]);
        assert_eq!(rx.arrive(2, after_small, "next"), vec!["next"]);
        assert_eq!(rx.arrive(0, big, "big"), vec!["big"]);
    }

    #[test]
    fn cancelled_streams_unblock_their_dependents() {
        let mut tx = SendOrder::default();
        let _ = tx.begin();
        tx.complete(0); // cancelled: counted as complete
        let d1 = tx.begin();
        let mut rx = RecvOrder::starting_at(0);
        assert!(rx.arrive(1, d1, 1).is_empty());
        assert_eq!(rx.skip(0), vec![1]);
    }

    #[test]
    fn too_many_extras_fall_back_to_a_stricter_bound() {
        let mut tx = SendOrder::default();
        for seq in 1..=(MAX_EXTRA as u64 + 1) {
            tx.complete(seq);
        }
        let d = tx.begin();
        assert!(d.extra.is_empty());
        assert_eq!(d.below, MAX_EXTRA as u64 + 2);
    }

    #[test]
    fn deps_round_trip_and_are_checked() {
        let d = Deps {
            below: 7,
            extra: vec![9, 11],
        };
        let mut buf = Vec::new();
        encode(&d, &mut buf);
        assert_eq!(buf.len(), encoded_len(&d));
        assert_eq!(check(&d, 12), Ok(()));
        assert_eq!(
            check(&d, 11),
            Err(DepsError::NotBefore { dep: 11, seq: 11 })
        );
        assert!(matches!(check(&d, 5), Err(DepsError::NotBefore { .. })));
    }

    proptest! {
        /// Random interleavings of begin/complete at the sender and random arrival orders at
        /// the receiver: every frame is delivered exactly once, and never before a frame that
        /// completed before it began.
        #[test]
        fn delivery_respects_completion_order(
            ops in proptest::collection::vec(any::<bool>(), 1..60),
            arrival_seed in any::<u64>(),
        ) {
            let mut tx = SendOrder::default();
            let mut in_flight: Vec<u64> = Vec::new();
            let mut deps: Vec<Deps> = Vec::new();
            let mut completed_before: Vec<Vec<u64>> = Vec::new();
            let mut completed: Vec<u64> = Vec::new();
            for (i, begin) in ops.iter().enumerate() {
                if *begin || in_flight.is_empty() {
                    let seq = deps.len() as u64;
                    deps.push(tx.begin());
                    completed_before.push(completed.clone());
                    in_flight.push(seq);
                } else {
                    let idx = i % in_flight.len();
                    let seq = in_flight.remove(idx);
                    tx.complete(seq);
                    completed.push(seq);
                }
            }
            for seq in in_flight.drain(..) {
                tx.complete(seq);
            }
            let n = deps.len() as u64;
            for (seq, d) in deps.iter().enumerate() {
                prop_assert!(check(d, seq as u64).is_ok());
            }
            // A deterministic shuffle of arrival order.
            let mut order: Vec<u64> = (0..n).collect();
            let mut x = arrival_seed | 1;
            for i in (1..order.len()).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let mut rx = RecvOrder::starting_at(0);
            let mut delivered = Vec::new();
            for seq in order {
                delivered.extend(rx.arrive(seq, deps[seq as usize].clone(), seq));
            }
            prop_assert_eq!(delivered.len() as u64, n);
            let pos = |s: u64| delivered.iter().position(|&d| d == s).unwrap();
            for seq in 0..n {
                for &before in &completed_before[seq as usize] {
                    prop_assert!(pos(before) < pos(seq), "{} delivered before {}", seq, before);
                }
            }
        }
    }
}
