//! Collective schedules: which rank sends which bytes to whom, step by step.
//!
//! A schedule is a pure function of the rank, the world size and the message size. It says
//! nothing about sockets or time (sans-IO, like quinn-proto): an executor in an adapter crate
//! runs it over a transport. Every collective works on one byte buffer per rank:
//!
//! 1. allocate [`Schedule::buffer_len`] bytes and write this rank's input into
//!    [`Schedule::input_range`];
//! 2. for each [`Step`] in order: send each [`Transfer`] (its ranges of the buffer concatenated
//!    into one message) to its peer, receive one message from each [`Receive`]'s peer, and
//!    [`apply`](Receive::apply) it;
//! 3. the whole buffer is the result.
//!
//! | collective | schedule | rounds | buffer |
//! |---|---|---|---|
//! | [`barrier`] | dissemination: round k sends to `r + 2^k`, receives from `r - 2^k` | ⌈log₂ N⌉ | empty; zero-length messages |
//! | [`broadcast`] | binomial tree from any root | ⌈log₂ N⌉ | the payload |
//! | [`all_gather`] | recursive doubling (N a power of two) or Bruck for small, ring for large | ⌈log₂ N⌉ or N − 1 | the blocks of all ranks, in rank order; blocks may differ in size |
//! | [`all_reduce`] | recursive doubling (extra ranks folded in) for small, ring reduce-scatter + all-gather for large | ⌊log₂ N⌋ (+2) or 2(N − 1) | `count` elements |
//! | [`reduce`](fn@reduce) | binomial tree towards any root | ⌈log₂ N⌉ | `count` elements; the result on the root |
//! | [`reduce_scatter`] | ring | N − 1 | every rank's chunk, in rank order; chunks may differ in size |
//! | [`reduce_scatter_v`] | direct: step k sends chunk `r + k` to its owner | N − 1 | as reduce_scatter |
//! | [`gather`] | flat: every rank sends its block to the root | 1 | the root: every block; others: their own |
//! | [`scatter`] | flat: the root sends each rank its block | 1 | the root: every block; others: their own |
//! | [`all_to_all`] | pairwise shifts: step k sends to `r + k`, receives from `r − k` | N − 1 | the blocks sent, then the blocks received |
//! | [`monitored_barrier`] | rank 0 hears from every rank, then answers each | 2 | empty |
//!
//! Ranks on one host run the [`arena`] plans instead; a group across hosts runs barrier,
//! all_reduce, reduce, broadcast and all_gather in the stages of a [`hierarchy::HostPlan`]
//! (each host's arena, then one leader per host over these schedules).
//!
//! [`AllGatherAlgorithm::select`] and [`AllReduceAlgorithm::select`] pick the algorithm from
//! the sizes; every rank must pick the same one, which holds when they pass the same arguments.
//!
//! # Rules an executor follows
//! - **Send and receive concurrently within a step.** In a ring step every rank sends to its
//!   right while receiving from its left; the schedules are free of deadlock even if a send
//!   completes only when the peer receives it, but not if a rank waits for its sends to finish
//!   before it starts receiving.
//! - **Sends read the buffer as it was at the start of the step.** A [`Receive`] that stores
//!   never overlaps the step's sends, so it may land in place while sends are in flight; a
//!   reducing receive may overlap them (recursive doubling reduces into the bytes it sends),
//!   so apply it once the step's sends have been handed off.
//! - **Messages between two ranks are matched in order.** Each ordered pair of ranks is a FIFO;
//!   the n-th message rank a sends to rank b is the n-th receive b posts from a. Tag messages
//!   with a collective sequence number if several collectives may be in flight.
//! - A step waiting too long should fail naming [`Step::waits_on`]: the ranks it receives from.
//! - **Every message carries the round's [`Signature`]** (kind, op, element type, count,
//!   root) and the receiver compares it with its own before touching the payload, so ranks
//!   that disagree about the collective fail instead of combining each other's bytes.
//!
//! # Several collectives in flight
//! Each round of each collective has a sequence number, and messages are matched by (peer,
//! sequence number). The numbers are handed out **when a collective is issued**, in the order
//! the collectives are issued on that rank, and a collective of several rounds (see
//! [`varlen`]) reserves all its numbers at once; arguments are checked before any number is
//! taken, so a call refused locally leaves the numbering as it was. Ranks that issue the same
//! collectives in the same order therefore agree on every number, however the collectives
//! then interleave. Taking a later round's number when the earlier round *ends* would not do:
//! rounds end in different orders on different ranks.
//!
//! # Reproducible floats
//! Float sums depend on the order of operands. Every rank ends with **bitwise identical**
//! results: the ring computes each chunk once and copies it to everyone, and in recursive
//! doubling both partners combine the lower rank's data first (see [`reduce_into`]). Results
//! may differ in the last bits from a sequential sum, and between the two algorithms.
//!
//! # Example
//! An executor's loop, for rank 1 of 3 gathering 4-byte blocks (the transport calls are
//! comments; a message stands in for what would arrive):
//! ```
//! use tensorwire_core::collective::{all_gather, AllGatherAlgorithm, CollectiveError};
//!
//! let lens = [4, 4, 4];
//! let schedule = all_gather(1, &lens, AllGatherAlgorithm::select(&lens))?;
//! let mut buffer = vec![0u8; schedule.buffer_len()];
//! buffer[schedule.input_range()].copy_from_slice(b"abcd");
//! for step in schedule.steps() {
//!     for send in step.sends() {
//!         let pieces = send.slices(&buffer).expect("buffer has buffer_len bytes");
//!         assert!(!pieces.is_empty()); // transport.send(send.peer(), &pieces)
//!     }
//!     for recv in step.receives() {
//!         // transport.recv(recv.peer(), recv.len()), naming recv.peer() on timeout
//!         let message = vec![b'x'; recv.len()];
//!         recv.apply(&mut buffer, &message)?;
//!     }
//! }
//! assert_eq!(&buffer[4..8], b"abcd");
//! # Ok::<(), CollectiveError>(())
//! ```

use std::ops::Range;

mod algorithms;
pub mod arena;
pub mod arena_cache;
#[cfg(test)]
mod arena_sim;
pub mod arena_wait;
pub mod check;
pub mod disagreement;
mod fold;
pub mod hierarchy;
pub mod inbox;
mod reduce;
mod signature;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod sim_many;
pub mod stage_failure;
#[cfg(test)]
mod tests;
pub mod varlen;
mod violation;

pub use algorithms::{
    all_gather, all_reduce, all_to_all, barrier, broadcast, gather, monitored_barrier,
    monitored_barrier_missing, reduce, reduce_scatter, reduce_scatter_v, scatter,
};
pub use check::{agreement_check, DebugLevel, UnknownDebugLevel, DEBUG_ENV};
pub use fold::{fold_in_order, FOLD_BLOCK};
pub use reduce::{reduce_into, ElementType, ReduceOp};
pub use signature::{Signature, SIGNATURE_LEN, WORD_EXACT_BITS};
pub use violation::MeshViolation;

/// Total bytes below which [`all_gather`] uses recursive doubling when the world size is a
/// power of two (MPICH's long-message threshold for all_gather).
pub const ALL_GATHER_DOUBLING_MAX_BYTES: usize = 512 * 1024;
/// Total bytes below which [`all_gather`] uses Bruck when the world size is not a power of
/// two (MPICH's short-message threshold for all_gather).
pub const ALL_GATHER_BRUCK_MAX_BYTES: usize = 80 * 1024;
/// Buffer bytes from which [`all_reduce`] uses the ring.
///
/// Recursive doubling costs about `log₂N·(α + nβ)`, the ring `2(N−1)·α + 2n(N−1)/N·β` (α the
/// latency of a message, β the time per byte). With α around 25 µs and β around 1 ns/byte
/// (loopback or a 10 Gb/s link) the ring wins from about 220 KB at 8 ranks, later at more;
/// 256 KiB rounds that up.
pub const ALL_REDUCE_RING_MIN_BYTES: usize = 256 * 1024;

/// Errors from building a schedule or applying a received message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// The world size was zero.
    #[error("world size must be at least 1")]
    EmptyWorld,
    /// The rank is not below the world size.
    #[error("rank {rank} is out of range for a world of {world} ranks")]
    RankOutOfRange {
        /// The rank asked for.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// The root (of a broadcast, reduce, gather or scatter) is not below the world size.
    #[error("root {root} is out of range for a world of {world} ranks")]
    RootOutOfRange {
        /// The root asked for.
        root: usize,
        /// The world size.
        world: usize,
    },
    /// Recursive-doubling all_gather was asked for a world size that is not a power of two.
    #[error(
        "recursive-doubling all_gather needs a power-of-two world size, got {world}; use Bruck or ring"
    )]
    NotPowerOfTwo {
        /// The world size.
        world: usize,
    },
    /// The buffer size does not fit in `usize`.
    #[error("the collective's buffer size overflows usize")]
    SizeOverflow,
    /// A received message does not have the length the schedule expects.
    #[error("message from rank {peer} has {actual} bytes, the schedule expects {expected}")]
    MessageLength {
        /// The rank the message came from.
        peer: usize,
        /// The length the schedule expects.
        expected: usize,
        /// The length received.
        actual: usize,
    },
    /// The buffer passed to [`Receive::apply`] is shorter than the schedule's ranges need.
    #[error("buffer has {actual} bytes, the receive from rank {peer} writes up to byte {needed}")]
    BufferTooShort {
        /// The rank the message came from.
        peer: usize,
        /// The length the ranges need.
        needed: usize,
        /// The buffer's length.
        actual: usize,
    },
    /// A tensor of the wrong shape for the collective (gloo's "invalid tensor size").
    #[error("invalid {tensor} tensor size (expected {expected:?}, got {actual:?})")]
    TensorSize {
        /// Which tensor (`"output"`, `"input"`).
        tensor: &'static str,
        /// The shape the collective needs.
        expected: Vec<usize>,
        /// The tensor's shape.
        actual: Vec<usize>,
    },
    /// Tensors of different dtypes where the collective needs one (gloo's "invalid tensor
    /// type").
    #[error("invalid {tensor} tensor type (expected {expected}, got {actual})")]
    TensorType {
        /// Which tensor (`"output"`).
        tensor: &'static str,
        /// The input's dtype.
        expected: String,
        /// The tensor's dtype.
        actual: String,
    },
    /// A tensor list missing on the root or given elsewhere (PyTorch's "Argument
    /// `gather_list` must be specified on destination rank").
    #[error(
        "argument {list} must {} on {}",
        if *.on_root { "be specified" } else { "NOT be specified" },
        if *.on_root { "the root" } else { "ranks other than the root" }
    )]
    TensorList {
        /// The argument (`"gather_list"`, `"scatter_list"`).
        list: &'static str,
        /// True when it is missing on the root, false when given elsewhere.
        on_root: bool,
    },
    /// An all_gather was given a number of block lengths other than the world size.
    #[error("{lens} block lengths for a world of {world} ranks")]
    LengthsCount {
        /// The lengths given.
        lens: usize,
        /// The world size.
        world: usize,
    },
    /// A rank's input is not as long as the block length given for it.
    #[error("rank {rank}'s input has {actual} bytes, but its block length says {expected}")]
    InputLength {
        /// The rank.
        rank: usize,
        /// The block length given for it.
        expected: usize,
        /// The input's length.
        actual: usize,
    },
    /// The reduction is not defined on the element type (see [`ReduceOp::supports`]): gloo
    /// refuses it too.
    #[error(
        "{op} is not defined on {element} elements (as in gloo: band, bor and bxor take integers \
         and bool, avg takes floating types)"
    )]
    UnsupportedReduction {
        /// The operation.
        op: ReduceOp,
        /// The element type.
        element: ElementType,
    },
    /// A block-length list that must sum to the input's length does not.
    #[error("splits sum to {sum} bytes, but the input has {actual}")]
    SplitsSum {
        /// The sum of the splits.
        sum: usize,
        /// The input's length.
        actual: usize,
    },
    /// An arena's slot is too small for the world: it must hold at least one
    /// [`ARENA_ALIGN`](arena::ARENA_ALIGN)-byte piece per rank.
    #[error(
        "an arena slot of {slot_bytes} bytes is too small for {world} ranks (at least 64 bytes a rank, in multiples of 64)"
    )]
    ArenaTooSmall {
        /// The bytes of one half of a slot.
        slot_bytes: usize,
        /// The world size.
        world: usize,
    },
    /// A point-to-point peer is this rank.
    #[error("rank {rank} cannot send to or receive from itself")]
    PeerIsSelf {
        /// This rank.
        rank: usize,
    },
    /// The slices given to a reduction differ in length or are not whole elements.
    #[error(
        "cannot reduce {incoming} bytes into {acc} bytes of {element}: lengths must match and be a multiple of {} bytes",
        .element.size()
    )]
    ReduceLength {
        /// The element type.
        element: ElementType,
        /// Length of the accumulator.
        acc: usize,
        /// Length of the incoming data.
        incoming: usize,
    },
}

/// The all_gather algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllGatherAlgorithm {
    /// Partners `r XOR 2^k` exchange everything they hold; ⌈log₂ N⌉ rounds, N a power of two.
    RecursiveDoubling,
    /// Bruck: round k sends what this rank holds to `r − 2^k`; ⌈log₂ N⌉ rounds, any N.
    Bruck,
    /// Ring: N − 1 rounds, each passing one block to the right neighbour.
    Ring,
}

impl AllGatherAlgorithm {
    /// The algorithm for these block sizes (one per rank): recursive doubling below
    /// [`ALL_GATHER_DOUBLING_MAX_BYTES`] in total when the world size is a power of two,
    /// Bruck below [`ALL_GATHER_BRUCK_MAX_BYTES`] otherwise, and the ring above.
    pub fn select(block_lens: &[usize]) -> Self {
        let total = block_lens
            .iter()
            .fold(0usize, |acc, len| acc.saturating_add(*len));
        if block_lens.len().is_power_of_two() {
            if total < ALL_GATHER_DOUBLING_MAX_BYTES {
                return AllGatherAlgorithm::RecursiveDoubling;
            }
        } else if total < ALL_GATHER_BRUCK_MAX_BYTES {
            return AllGatherAlgorithm::Bruck;
        }
        AllGatherAlgorithm::Ring
    }
}

/// The all_reduce algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllReduceAlgorithm {
    /// Partners `r XOR 2^k` exchange and reduce the whole buffer; ranks beyond the largest
    /// power of two first fold their data into a partner and get the result back at the end.
    RecursiveDoubling,
    /// Ring reduce-scatter (each rank ends with one fully reduced chunk) followed by a ring
    /// all-gather of the chunks; bandwidth-optimal.
    Ring,
}

impl AllReduceAlgorithm {
    /// The algorithm for `count` elements of `element` over `world` ranks: the ring from
    /// [`ALL_REDUCE_RING_MIN_BYTES`] when there are more than two ranks and at least one
    /// element per rank, recursive doubling otherwise.
    pub fn select(world: usize, count: usize, element: ElementType) -> Self {
        let bytes = count.saturating_mul(element.size());
        if world > 2 && count >= world && bytes >= ALL_REDUCE_RING_MIN_BYTES {
            AllReduceAlgorithm::Ring
        } else {
            AllReduceAlgorithm::RecursiveDoubling
        }
    }
}

/// The steps one rank runs for one collective, with the size of its buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    rank: usize,
    world: usize,
    buffer_len: usize,
    input: Range<usize>,
    /// Where this rank's result lies in the buffer.
    output: Range<usize>,
    /// Bytes to copy within the buffer after the input is written, before the first step.
    local: Option<(Range<usize>, Range<usize>)>,
    steps: Vec<Step>,
}

impl Schedule {
    /// The rank this schedule is for.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The length of the buffer the steps read and write; the whole buffer is the result.
    pub fn buffer_len(&self) -> usize {
        self.buffer_len
    }

    /// The part of the buffer this rank fills with its input before the first step: its own
    /// block for all_gather, everything for all_reduce and for the broadcast root, nothing for
    /// other broadcast ranks and for barrier.
    pub fn input_range(&self) -> Range<usize> {
        self.input.clone()
    }

    /// The part of the buffer that is this rank's result once the steps have run: the whole
    /// buffer for barrier, broadcast, all_gather and all_reduce; the reduced buffer on the
    /// root of a [`reduce`](fn@reduce) and nothing elsewhere; this rank's chunk of a [`reduce_scatter`];
    /// the gathered blocks on the root of a [`gather`] and nothing elsewhere; this rank's
    /// block of a [`scatter`]; the received blocks of an [`all_to_all`].
    pub fn output_range(&self) -> Range<usize> {
        self.output.clone()
    }

    /// A copy within the buffer, `(from, to)`, that the executor makes after writing the
    /// input and before the first step: the block an [`all_to_all`] rank sends to itself.
    pub fn local_copy(&self) -> Option<(Range<usize>, Range<usize>)> {
        self.local.clone()
    }

    /// The steps, in the order they run.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }
}

/// One step: messages to send and messages to receive, concurrently.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    sends: Vec<Transfer>,
    receives: Vec<Receive>,
}

impl Step {
    /// The messages this step sends, one per entry.
    pub fn sends(&self) -> &[Transfer] {
        &self.sends
    }

    /// The messages this step receives, one per entry, with what to do with each.
    pub fn receives(&self) -> &[Receive] {
        &self.receives
    }

    /// The ranks this step receives from: the ranks to name when it times out.
    pub fn waits_on(&self) -> impl Iterator<Item = usize> + '_ {
        self.receives.iter().map(|r| r.peer)
    }
}

/// One message to send: the given ranges of the buffer, concatenated, to `peer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    peer: usize,
    ranges: Vec<Range<usize>>,
}

impl Transfer {
    /// The rank to send to.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The byte ranges of the buffer that make up the message, in order (at most two).
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// The message length in bytes (zero for barrier messages).
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }

    /// Whether the message is empty (a barrier message).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The message's pieces borrowed from `buffer`, ready for a vectored write; `None` when the
    /// buffer is shorter than the ranges.
    pub fn slices<'a>(&self, buffer: &'a [u8]) -> Option<Vec<&'a [u8]>> {
        self.ranges.iter().map(|r| buffer.get(r.clone())).collect()
    }
}

/// One message to receive from `peer`, and where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receive {
    peer: usize,
    ranges: Vec<Range<usize>>,
    action: Apply,
}

/// What a [`Receive`] does with its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Apply {
    /// Copy the message into the ranges.
    Store,
    /// Reduce the message into the ranges with [`reduce_into`].
    Reduce {
        /// The operation.
        op: ReduceOp,
        /// The element type.
        element: ElementType,
        /// Whether the message is the left operand (it comes from a lower rank or carries the
        /// partial result of earlier ranks).
        incoming_first: bool,
    },
}

impl Receive {
    /// The rank the message comes from.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The byte ranges of the buffer the message is split across, in order (at most two).
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// What to do with the message.
    pub fn action(&self) -> Apply {
        self.action
    }

    /// The expected message length in bytes.
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }

    /// Whether the expected message is empty (a barrier message).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Splits `message` across the ranges of `buffer`, storing or reducing as
    /// [`action`](Self::action) says.
    ///
    /// # Errors
    /// [`CollectiveError::MessageLength`] when the message is not [`len`](Self::len) bytes,
    /// [`CollectiveError::BufferTooShort`] when the buffer does not hold the ranges. The buffer
    /// is untouched on error.
    pub fn apply(&self, buffer: &mut [u8], message: &[u8]) -> Result<(), CollectiveError> {
        let expected = self.len();
        if message.len() != expected {
            return Err(CollectiveError::MessageLength {
                peer: self.peer,
                expected,
                actual: message.len(),
            });
        }
        let needed = self.ranges.iter().map(|r| r.end).max().unwrap_or(0);
        if buffer.len() < needed {
            return Err(CollectiveError::BufferTooShort {
                peer: self.peer,
                needed,
                actual: buffer.len(),
            });
        }
        if let Apply::Reduce { element, .. } = self.action {
            if let Some(range) = self
                .ranges
                .iter()
                .find(|r| (r.end - r.start) % element.size() != 0)
            {
                return Err(CollectiveError::ReduceLength {
                    element,
                    acc: range.end - range.start,
                    incoming: range.end - range.start,
                });
            }
        }
        let mut rest = message;
        for range in &self.ranges {
            let (piece, tail) = rest.split_at(range.end - range.start);
            rest = tail;
            let dst = &mut buffer[range.clone()];
            match self.action {
                Apply::Store => dst.copy_from_slice(piece),
                Apply::Reduce {
                    op,
                    element,
                    incoming_first,
                } => reduce_into(op, element, dst, piece, incoming_first)?,
            }
        }
        Ok(())
    }
}
