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
pub const MAX_EXTRA: usize = 32;

/// Stream tag: the prefix's dependencies, then one frame.
pub const TAG_FRAME: u8 = 0;
/// Stream tag: the peer's goodbye, after the prefix's dependencies.
pub const TAG_GOODBYE: u8 = 1;
/// Stream tag: the answer to our goodbye (nothing follows).
pub const TAG_GOODBYE_ACK: u8 = 2;

/// What a frame must wait for: every sequence number below `below`, and those in `extra`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Deps {
    /// Every sequence number below this one.
    pub below: u64,
    /// These ones too (at most [`MAX_EXTRA`]).
    pub extra: Vec<u64>,
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
pub struct RecvOrder<T> {
    done: DoneSet,
    waiting: BTreeMap<u64, (Deps, T)>,
}

impl<T> RecvOrder<T> {
    /// Starts with sequence numbers below `first` already done.
    pub fn starting_at(first: u64) -> Self {
        Self {
            done: DoneSet {
                below: first,
                above: BTreeSet::new(),
            },
            waiting: BTreeMap::new(),
        }
    }

    /// Number of frames held back.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// A frame `seq` arrived whole; returns the frames now deliverable, in delivery order.
    pub fn arrive(&mut self, seq: u64, deps: Deps, item: T) -> Vec<T> {
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
    pub fn skip(&mut self, seq: u64) -> Vec<T> {
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
pub fn encoded_len(deps: &Deps) -> usize {
    8 + 1 + 8 * deps.extra.len()
}

/// Writes `deps` as `below: u64 LE, n: u8, n × u64 LE`.
pub fn encode(deps: &Deps, out: &mut Vec<u8>) {
    out.extend_from_slice(&deps.below.to_le_bytes());
    out.push(deps.extra.len() as u8);
    for s in &deps.extra {
        out.extend_from_slice(&s.to_le_bytes());
    }
}

/// Why dependencies in front of a frame were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DepsError {
    /// More explicit dependencies than [`MAX_EXTRA`].
    TooMany(usize),
    /// A dependency not below the frame's own number (a sender cannot depend on the future).
    NotBefore {
        /// The dependency.
        dep: u64,
        /// The frame's own number.
        seq: u64,
    },
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
pub fn check(deps: &Deps, seq: u64) -> Result<(), DepsError> {
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

/// What the prefix of a stream says: its tag and, for a frame or a goodbye, its dependencies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prefix {
    /// A frame follows, to be delivered after `Deps`.
    Frame(Deps),
    /// The peer says goodbye, after `Deps`.
    Goodbye(Deps),
    /// The peer answers our goodbye.
    GoodbyeAck,
}

/// How far [`decode_prefix`] got with the bytes at the start of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// The prefix is `need` bytes long at least: read up to that many and decode again.
    Incomplete {
        /// Bytes the prefix needs, counted from the start of the stream.
        need: usize,
    },
    /// The prefix, and how many bytes it took.
    Complete(Prefix, usize),
}

/// Why the prefix of a stream was refused (the connection closes as malformed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefixError {
    /// A tag this version does not know.
    UnknownTag(u8),
    /// Dependencies that break the rules ([`check`]).
    Deps(DepsError),
}

impl std::fmt::Display for PrefixError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PrefixError::UnknownTag(tag) => write!(
                f,
                "unknown QUIC stream tag {tag} (expected {TAG_FRAME} frame, {TAG_GOODBYE} \
                 goodbye, {TAG_GOODBYE_ACK} ack)"
            ),
            PrefixError::Deps(e) => e.fmt(f),
        }
    }
}

/// Decodes the prefix at the start of stream `seq` from the bytes read so far (`head`; bytes
/// past the prefix are ignored): `tag: u8`, then for a frame or a goodbye
/// `below: u64 LE, n: u8, n × u64 LE` ([`encode`]), checked by [`check`]. Never asks for more
/// than `1 + 9 + 8 * MAX_EXTRA` bytes.
pub fn decode_prefix(head: &[u8], seq: u64) -> Result<Decoded, PrefixError> {
    let Some(&tag) = head.first() else {
        return Ok(Decoded::Incomplete { need: 1 });
    };
    if tag == TAG_GOODBYE_ACK {
        return Ok(Decoded::Complete(Prefix::GoodbyeAck, 1));
    }
    if tag != TAG_FRAME && tag != TAG_GOODBYE {
        return Err(PrefixError::UnknownTag(tag));
    }
    let Some(fixed) = head.get(1..10) else {
        return Ok(Decoded::Incomplete { need: 10 });
    };
    let below = u64::from_le_bytes(fixed[..8].try_into().unwrap_or_default());
    let n_extra = usize::from(fixed[8]);
    if n_extra > MAX_EXTRA {
        return Err(PrefixError::Deps(DepsError::TooMany(n_extra)));
    }
    let len = 10 + 8 * n_extra;
    let Some(extra) = head.get(10..len) else {
        return Ok(Decoded::Incomplete { need: len });
    };
    let extra = extra
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    let deps = Deps { below, extra };
    check(&deps, seq).map_err(PrefixError::Deps)?;
    let prefix = if tag == TAG_GOODBYE {
        Prefix::Goodbye(deps)
    } else {
        Prefix::Frame(deps)
    };
    Ok(Decoded::Complete(prefix, len))
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

    #[test]
    fn prefixes_decode_byte_by_byte_and_bad_ones_are_typed_errors() {
        let d = Deps {
            below: 7,
            extra: vec![9, 11],
        };
        let mut buf = vec![TAG_FRAME];
        encode(&d, &mut buf);
        buf.extend_from_slice(b"frame bytes");
        let whole = 1 + encoded_len(&d);
        for cut in 0..whole {
            match decode_prefix(&buf[..cut], 12) {
                Ok(Decoded::Incomplete { need }) => assert!(need > cut && need <= whole),
                other => panic!("{cut} bytes: {other:?}"),
            }
        }
        assert_eq!(
            decode_prefix(&buf, 12),
            Ok(Decoded::Complete(Prefix::Frame(d.clone()), whole))
        );
        buf[0] = TAG_GOODBYE;
        assert_eq!(
            decode_prefix(&buf, 12),
            Ok(Decoded::Complete(Prefix::Goodbye(d), whole))
        );
        assert_eq!(
            decode_prefix(&[TAG_GOODBYE_ACK, 99], 0),
            Ok(Decoded::Complete(Prefix::GoodbyeAck, 1))
        );
        assert_eq!(decode_prefix(&[3], 0), Err(PrefixError::UnknownTag(3)));
        assert_eq!(
            decode_prefix(&buf, 11),
            Err(PrefixError::Deps(DepsError::NotBefore { dep: 11, seq: 11 }))
        );
        let mut many = vec![TAG_FRAME];
        many.extend_from_slice(&0u64.to_le_bytes());
        many.push(MAX_EXTRA as u8 + 1);
        assert_eq!(
            decode_prefix(&many, 100),
            Err(PrefixError::Deps(DepsError::TooMany(MAX_EXTRA + 1)))
        );
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
