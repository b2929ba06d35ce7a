//! What the ranks of one collective must agree on, carried in the header of every message.
//!
//! A rank that receives a message compares the sender's [`Signature`] with its own for the
//! same sequence number, byte for byte, before it looks at the payload: two ranks that run
//! different collectives, or the same collective with a different op, element type, element
//! count or root, are told so instead of reducing one another's bytes as garbage. The encoding
//! is fixed-size ([`SIGNATURE_LEN`] bytes), so the check is one comparison of a few bytes.

use std::fmt;

use super::{ElementType, ReduceOp};

/// Bytes of an encoded [`Signature`]: tag, op, element type (one byte each), root (`u32`),
/// count (`u64`), little-endian.
pub const SIGNATURE_LEN: usize = 15;

/// One round of a collective, with the arguments every rank must pass alike.
///
/// A collective of several rounds (a variable-size all_gather, a broadcast of bytes whose
/// length only the root knows) has one signature per round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Signature {
    /// A barrier.
    Barrier,
    /// The first round of a variable-size all_gather: one fixed-size slot per rank with its
    /// block's length and, when it fits, the block itself (see [`super::varlen`]).
    AllGatherLengths,
    /// An all_gather of blocks whose lengths every rank knows (build it with
    /// [`Signature::all_gather`]).
    AllGather {
        /// The bytes of all blocks together.
        total: u64,
        /// A hash of the block lengths (FNV-1a), so that ranks that pass other lengths with
        /// the same total disagree too.
        lengths: u32,
    },
    /// The first round of a broadcast of bytes whose length only the root knows: a fixed-size
    /// slot with the length and, when they fit, the bytes.
    BroadcastLength {
        /// The root.
        root: u32,
    },
    /// A broadcast of `len` bytes from `root`.
    Broadcast {
        /// The root.
        root: u32,
        /// The bytes broadcast.
        len: u64,
    },
    /// An all_reduce of `count` elements of `element` with `op`.
    AllReduce {
        /// The operation.
        op: ReduceOp,
        /// The element type.
        element: ElementType,
        /// The number of elements.
        count: u64,
    },
    /// A reduce of `count` elements of `element` with `op` to `root`.
    Reduce {
        /// The operation.
        op: ReduceOp,
        /// The element type.
        element: ElementType,
        /// The root.
        root: u32,
        /// The number of elements.
        count: u64,
    },
    /// A reduce_scatter (build it with [`Signature::reduce_scatter`]).
    ReduceScatter {
        /// The operation.
        op: ReduceOp,
        /// The element type.
        element: ElementType,
        /// The elements of all chunks together.
        total: u64,
        /// A hash of the chunk sizes (FNV-1a).
        counts: u32,
    },
    /// A reduce_scatter_v (build it with [`Signature::reduce_scatter_v`]).
    ReduceScatterV {
        /// The operation.
        op: ReduceOp,
        /// The element type.
        element: ElementType,
        /// The elements of all chunks together.
        total: u64,
        /// A hash of the chunk sizes (FNV-1a).
        counts: u32,
    },
    /// The first round of a gather: one fixed-size slot per rank with its block's length and,
    /// when it fits, the block.
    GatherLengths {
        /// The root.
        root: u32,
    },
    /// The second round of a gather: the blocks too large for a slot (only the root knows all
    /// their lengths, so they are not part of the signature; each message's length is
    /// checked against the slot that announced it).
    Gather {
        /// The root.
        root: u32,
    },
    /// The first round of a scatter: one slot from the root to each rank.
    ScatterLengths {
        /// The root.
        root: u32,
    },
    /// The second round of a scatter: the blocks too large for a slot.
    Scatter {
        /// The root.
        root: u32,
    },
    /// An all_to_all (also all_to_all_single). Block lengths are per pair of ranks; each
    /// message's length is checked against what its receiver expects.
    AllToAll,
    /// A point-to-point message with `tag`.
    Send {
        /// The tag.
        tag: u32,
    },
    /// A monitored barrier.
    MonitoredBarrier,
}

impl Signature {
    /// The signature of an all_gather of blocks of `lens` bytes (one per rank).
    pub fn all_gather(lens: &[usize]) -> Signature {
        Signature::AllGather {
            total: lens
                .iter()
                .fold(0u64, |acc, len| acc.saturating_add(*len as u64)),
            lengths: fnv(lens),
        }
    }

    /// The signature of a reduce_scatter of chunks of `counts` elements (one per rank).
    pub fn reduce_scatter(op: ReduceOp, element: ElementType, counts: &[usize]) -> Signature {
        Signature::ReduceScatter {
            op,
            element,
            total: counts
                .iter()
                .fold(0u64, |acc, c| acc.saturating_add(*c as u64)),
            counts: fnv(counts),
        }
    }

    /// The signature of a reduce_scatter_v of chunks of `counts` elements (one per rank).
    pub fn reduce_scatter_v(op: ReduceOp, element: ElementType, counts: &[usize]) -> Signature {
        match Signature::reduce_scatter(op, element, counts) {
            Signature::ReduceScatter {
                op,
                element,
                total,
                counts,
            } => Signature::ReduceScatterV {
                op,
                element,
                total,
                counts,
            },
            _ => unreachable!("reduce_scatter builds a ReduceScatter"),
        }
    }

    /// The collective's name as users call it (`"all_gather"` for both of its rounds), for
    /// errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Signature::Barrier => "barrier",
            Signature::AllGatherLengths | Signature::AllGather { .. } => "all_gather",
            Signature::BroadcastLength { .. } | Signature::Broadcast { .. } => "broadcast",
            Signature::AllReduce { .. } => "all_reduce",
            Signature::Reduce { .. } => "reduce",
            Signature::ReduceScatter { .. } => "reduce_scatter",
            Signature::ReduceScatterV { .. } => "reduce_scatter_v",
            Signature::GatherLengths { .. } | Signature::Gather { .. } => "gather",
            Signature::ScatterLengths { .. } | Signature::Scatter { .. } => "scatter",
            Signature::AllToAll => "all_to_all",
            Signature::Send { .. } => "send",
            Signature::MonitoredBarrier => "monitored_barrier",
        }
    }

    /// The fixed-size encoding carried in every message header.
    pub fn encode(&self) -> [u8; SIGNATURE_LEN] {
        let (tag, a, b, root, count) = match *self {
            Signature::Barrier => (1u8, 0u8, 0u8, 0u32, 0u64),
            Signature::AllGatherLengths => (2, 0, 0, 0, 0),
            Signature::AllGather { total, lengths } => (3, 0, 0, lengths, total),
            Signature::BroadcastLength { root } => (4, 0, 0, root, 0),
            Signature::Broadcast { root, len } => (5, 0, 0, root, len),
            Signature::AllReduce { op, element, count } => {
                (6, op_code(op), element_code(element), 0, count)
            }
            Signature::Reduce {
                op,
                element,
                root,
                count,
            } => (7, op_code(op), element_code(element), root, count),
            Signature::ReduceScatter {
                op,
                element,
                total,
                counts,
            } => (8, op_code(op), element_code(element), counts, total),
            Signature::ReduceScatterV {
                op,
                element,
                total,
                counts,
            } => (16, op_code(op), element_code(element), counts, total),
            Signature::GatherLengths { root } => (9, 0, 0, root, 0),
            Signature::Gather { root } => (10, 0, 0, root, 0),
            Signature::ScatterLengths { root } => (11, 0, 0, root, 0),
            Signature::Scatter { root } => (12, 0, 0, root, 0),
            Signature::AllToAll => (13, 0, 0, 0, 0),
            Signature::Send { tag } => (14, 0, 0, tag, 0),
            Signature::MonitoredBarrier => (15, 0, 0, 0, 0),
        };
        let mut out = [0u8; SIGNATURE_LEN];
        out[0] = tag;
        out[1] = a;
        out[2] = b;
        out[3..7].copy_from_slice(&root.to_le_bytes());
        out[7..15].copy_from_slice(&count.to_le_bytes());
        out
    }

    /// Decodes [`encode`](Self::encode)'s bytes; `None` for anything it never produces (a
    /// wrong length, an unknown tag or code, or bytes that must be zero and are not).
    pub fn decode(bytes: &[u8]) -> Option<Signature> {
        let bytes: &[u8; SIGNATURE_LEN] = bytes.try_into().ok()?;
        let (tag, a, b) = (bytes[0], bytes[1], bytes[2]);
        let root = u32::from_le_bytes(bytes[3..7].try_into().ok()?);
        let count = u64::from_le_bytes(bytes[7..15].try_into().ok()?);
        let signature = match tag {
            1 => Signature::Barrier,
            2 => Signature::AllGatherLengths,
            3 => Signature::AllGather {
                total: count,
                lengths: root,
            },
            4 => Signature::BroadcastLength { root },
            5 => Signature::Broadcast { root, len: count },
            6 => Signature::AllReduce {
                op: *ReduceOp::ALL.get(usize::from(a))?,
                element: *ElementType::ALL.get(usize::from(b))?,
                count,
            },
            7 => Signature::Reduce {
                op: *ReduceOp::ALL.get(usize::from(a))?,
                element: *ElementType::ALL.get(usize::from(b))?,
                root,
                count,
            },
            8 => Signature::ReduceScatter {
                op: *ReduceOp::ALL.get(usize::from(a))?,
                element: *ElementType::ALL.get(usize::from(b))?,
                total: count,
                counts: root,
            },
            9 => Signature::GatherLengths { root },
            10 => Signature::Gather { root },
            11 => Signature::ScatterLengths { root },
            12 => Signature::Scatter { root },
            13 => Signature::AllToAll,
            14 => Signature::Send { tag: root },
            15 => Signature::MonitoredBarrier,
            16 => Signature::ReduceScatterV {
                op: *ReduceOp::ALL.get(usize::from(a))?,
                element: *ElementType::ALL.get(usize::from(b))?,
                total: count,
                counts: root,
            },
            _ => return None,
        };
        // One encoding per signature: unused fields must be zero.
        (signature.encode() == *bytes).then_some(signature)
    }
}

impl Signature {
    /// This signature as the one word the group arena compares between the ranks of a phase
    /// (a shared segment has a word per rank for it, not [`SIGNATURE_LEN`] bytes), with
    /// `extra`: arguments the link path checks per message instead (a gather's block lengths,
    /// an all_to_all's matrix), which the arena must compare up front.
    ///
    /// The top [`WORD_EXACT_BITS`] bits are the encoding's tag, op and element type as they
    /// are, so two signatures that differ in kind, op or element type (i8, u8 and bool are one
    /// byte each) always have different words; the rest is FNV-1a (64-bit) over the root, the
    /// count and `extra`, folded, so signatures that differ only there collide once in 2^40.
    pub fn word(&self, extra: &[usize]) -> u64 {
        let encoded = self.encode();
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |byte: u8| {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        };
        encoded[3..].iter().copied().for_each(&mut eat);
        for v in extra {
            (*v as u64).to_le_bytes().into_iter().for_each(&mut eat);
        }
        let low_bits = 64 - WORD_EXACT_BITS;
        let low = (hash ^ (hash >> low_bits)) & ((1u64 << low_bits) - 1);
        let exact =
            u64::from(encoded[0]) << 16 | u64::from(encoded[1]) << 8 | u64::from(encoded[2]);
        exact << low_bits | low
    }
}

/// Bits of a [`Signature::word`] that hold the tag, op and element type exactly.
pub const WORD_EXACT_BITS: u32 = 24;

/// FNV-1a over the values as little-endian `u64`s.
fn fnv(values: &[usize]) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for v in values {
        for byte in (*v as u64).to_le_bytes() {
            hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
        }
    }
    hash
}

/// `op`'s code: its place in [`ReduceOp::ALL`] (the arena's plan keys use it too).
pub(super) fn op_code(op: ReduceOp) -> u8 {
    ReduceOp::ALL.iter().position(|o| *o == op).unwrap_or(0) as u8
}

/// `element`'s code: its place in [`ElementType::ALL`] (the arena's plan keys use it too).
pub(super) fn element_code(element: ElementType) -> u8 {
    ElementType::ALL
        .iter()
        .position(|e| *e == element)
        .unwrap_or(0) as u8
}

impl fmt::Display for Signature {
    /// `barrier`, `all_gather(lengths)`, `all_gather(300 bytes in all, lengths #0badf00d)`,
    /// `broadcast(root 2, length)`, `broadcast(root 0, 8 bytes)`, `all_reduce(sum, i64 x1)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Signature::Barrier => f.write_str("barrier"),
            Signature::AllGatherLengths => f.write_str("all_gather(lengths)"),
            Signature::AllGather { total, lengths } => {
                write!(
                    f,
                    "all_gather({total} bytes in all, lengths #{lengths:08x})"
                )
            }
            Signature::BroadcastLength { root } => write!(f, "broadcast(root {root}, length)"),
            Signature::Broadcast { root, len } => write!(f, "broadcast(root {root}, {len} bytes)"),
            Signature::AllReduce { op, element, count } => {
                write!(f, "all_reduce({op}, {element} x{count})")
            }
            Signature::Reduce {
                op,
                element,
                root,
                count,
            } => write!(f, "reduce({op}, {element} x{count}, root {root})"),
            Signature::ReduceScatter {
                op,
                element,
                total,
                counts,
            } => write!(
                f,
                "reduce_scatter({op}, {element} x{total} in all, counts #{counts:08x})"
            ),
            Signature::ReduceScatterV {
                op,
                element,
                total,
                counts,
            } => write!(
                f,
                "reduce_scatter_v({op}, {element} x{total} in all, counts #{counts:08x})"
            ),
            Signature::GatherLengths { root } => write!(f, "gather(root {root}, lengths)"),
            Signature::Gather { root } => write!(f, "gather(root {root})"),
            Signature::ScatterLengths { root } => write!(f, "scatter(root {root}, lengths)"),
            Signature::Scatter { root } => write!(f, "scatter(root {root})"),
            Signature::AllToAll => f.write_str("all_to_all"),
            Signature::Send { tag } => write!(f, "send(tag {tag})"),
            Signature::MonitoredBarrier => f.write_str("monitored_barrier"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_signature() -> impl Strategy<Value = Signature> {
        prop_oneof![
            Just(Signature::Barrier),
            Just(Signature::AllGatherLengths),
            (any::<u64>(), any::<u32>())
                .prop_map(|(total, lengths)| Signature::AllGather { total, lengths }),
            any::<u32>().prop_map(|root| Signature::BroadcastLength { root }),
            (any::<u32>(), any::<u64>()).prop_map(|(root, len)| Signature::Broadcast { root, len }),
            (
                proptest::sample::select(ReduceOp::ALL.to_vec()),
                proptest::sample::select(ElementType::ALL.to_vec()),
                any::<u64>()
            )
                .prop_map(|(op, element, count)| Signature::AllReduce {
                    op,
                    element,
                    count
                }),
            (
                proptest::sample::select(ReduceOp::ALL.to_vec()),
                proptest::sample::select(ElementType::ALL.to_vec()),
                any::<u32>(),
                any::<u64>()
            )
                .prop_map(|(op, element, root, count)| Signature::Reduce {
                    op,
                    element,
                    root,
                    count
                }),
            (
                proptest::sample::select(ReduceOp::ALL.to_vec()),
                proptest::sample::select(ElementType::ALL.to_vec()),
                any::<u64>(),
                any::<u32>()
            )
                .prop_map(|(op, element, total, counts)| Signature::ReduceScatter {
                    op,
                    element,
                    total,
                    counts
                }),
            (
                proptest::sample::select(ReduceOp::ALL.to_vec()),
                proptest::sample::select(ElementType::ALL.to_vec()),
                any::<u64>(),
                any::<u32>()
            )
                .prop_map(|(op, element, total, counts)| Signature::ReduceScatterV {
                    op,
                    element,
                    total,
                    counts
                }),
            any::<u32>().prop_map(|root| Signature::GatherLengths { root }),
            any::<u32>().prop_map(|root| Signature::Gather { root }),
            any::<u32>().prop_map(|root| Signature::ScatterLengths { root }),
            any::<u32>().prop_map(|root| Signature::Scatter { root }),
            Just(Signature::AllToAll),
            any::<u32>().prop_map(|tag| Signature::Send { tag }),
            Just(Signature::MonitoredBarrier),
        ]
    }

    #[test]
    fn displays_what_a_user_called() {
        let mine = Signature::AllReduce {
            op: ReduceOp::Sum,
            element: ElementType::F32,
            count: 2,
        };
        assert_eq!(mine.to_string(), "all_reduce(sum, f32 x2)");
        assert_eq!(
            Signature::Broadcast { root: 3, len: 8 }.to_string(),
            "broadcast(root 3, 8 bytes)"
        );
        assert_eq!(Signature::Barrier.name(), "barrier");
        assert_eq!(Signature::AllGatherLengths.name(), "all_gather");
        assert_eq!(
            Signature::Reduce {
                op: ReduceOp::BXor,
                element: ElementType::U8,
                root: 2,
                count: 5
            }
            .to_string(),
            "reduce(bxor, u8 x5, root 2)"
        );
        // Other chunk sizes with the same total are another reduce_scatter.
        assert_ne!(
            Signature::reduce_scatter(ReduceOp::Sum, ElementType::F16, &[1, 2]),
            Signature::reduce_scatter(ReduceOp::Sum, ElementType::F16, &[2, 1])
        );
        assert_eq!(Signature::Gather { root: 1 }.name(), "gather");
        assert_eq!(Signature::Send { tag: 9 }.to_string(), "send(tag 9)");
        // The same total in other blocks is another all_gather.
        let a = Signature::all_gather(&[3, 5]);
        let b = Signature::all_gather(&[5, 3]);
        assert_ne!(a, b);
        assert!(a
            .to_string()
            .starts_with("all_gather(8 bytes in all, lengths #"));
        assert_eq!(a, Signature::all_gather(&[3, 5]));
    }

    #[test]
    fn garbage_does_not_decode() {
        assert_eq!(Signature::decode(&[]), None);
        assert_eq!(Signature::decode(&[0u8; SIGNATURE_LEN]), None);
        let mut barrier = Signature::Barrier.encode();
        barrier[9] = 1; // a count on a barrier
        assert_eq!(Signature::decode(&barrier), None);
        let mut reduce = Signature::AllReduce {
            op: ReduceOp::Max,
            element: ElementType::I64,
            count: 1,
        }
        .encode();
        reduce[1] = 8; // no such op
        assert_eq!(Signature::decode(&reduce), None);
    }

    #[test]
    fn the_arenas_word_tells_every_op_and_element_type_apart() {
        // Every op on every element type (i8, u8 and bool are one byte each, f16 and bf16
        // two, and were once taken for one another), in each reduction: one word each.
        let mut words = std::collections::HashMap::new();
        for op in ReduceOp::ALL {
            for element in ElementType::ALL {
                let all = [
                    Signature::AllReduce {
                        op,
                        element,
                        count: 1,
                    },
                    Signature::Reduce {
                        op,
                        element,
                        root: 0,
                        count: 1,
                    },
                    Signature::reduce_scatter(op, element, &[1, 1]),
                    Signature::reduce_scatter_v(op, element, &[1, 1]),
                ];
                for s in all {
                    assert_eq!(words.insert(s.word(&[]), s), None, "{s}");
                }
            }
        }
        // The arguments the link path checks per message count when given.
        let gather = Signature::Gather { root: 1 };
        assert_ne!(gather.word(&[3, 5]), gather.word(&[5, 3]));
        assert_ne!(gather.word(&[]), gather.word(&[0]));
        assert_eq!(
            gather.word(&[3, 5]),
            Signature::Gather { root: 1 }.word(&[3, 5])
        );
        assert_ne!(gather.word(&[]), Signature::Gather { root: 2 }.word(&[]));
    }

    proptest! {
        #[test]
        fn the_arenas_word_keeps_kind_op_and_element_exact(
            a in any_signature(),
            b in any_signature(),
            extra in proptest::collection::vec(any::<usize>(), 0..4),
        ) {
            let (ea, eb) = (a.encode(), b.encode());
            let shift = 64 - WORD_EXACT_BITS;
            prop_assert_eq!(a.word(&extra) >> shift, u64::from(ea[0]) << 16 | u64::from(ea[1]) << 8 | u64::from(ea[2]));
            if ea[..3] != eb[..3] {
                prop_assert_ne!(a.word(&extra), b.word(&extra));
            }
            if a == b {
                prop_assert_eq!(a.word(&extra), b.word(&extra));
            }
        }

        #[test]
        fn encoding_round_trips_and_tells_signatures_apart(a in any_signature(), b in any_signature()) {
            prop_assert_eq!(Signature::decode(&a.encode()), Some(a));
            prop_assert_eq!(a.encode() == b.encode(), a == b);
        }

        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..20)) {
            if let Some(s) = Signature::decode(&bytes) {
                prop_assert_eq!(&s.encode()[..], &bytes[..]);
            }
        }
    }
}
