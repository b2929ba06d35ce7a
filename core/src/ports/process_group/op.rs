//! The operations a [`ProcessGroup`] runs ([`Op`]), the bytes they carry ([`Buf`]) and what
//! they give back ([`Done`]).
//!
//! An [`Op`] carries a collective's arguments and its data: bytes the caller lends (read, or
//! written in place), owned host bytes, or a device buffer (a tensor on the group's device).
//! A backend matches on it in one place; `Op` is `#[non_exhaustive]`, so every backend has a
//! last arm for the operations it has no code of its own for: tensorwire's group runs core's
//! schedule for them ([`Op::schedule`]), the others build them from simpler collectives
//! ([`compose`](super::compose::compose)).

use std::time::Duration;

use bytes::Bytes;

use crate::collective::{self, CollectiveError, ElementType, ReduceOp, Schedule, Signature};
use crate::device::Device;
use crate::tensor::{DeviceBuffer, Storage};

use super::{ProcessGroup, ProcessGroupError};

/// The data of an [`Op`].
pub enum Buf<'a> {
    /// The caller's bytes, read only.
    Ref(&'a [u8]),
    /// The caller's bytes; an in-place collective (all_reduce, reduce, broadcast) writes its
    /// result into them.
    Mut(&'a mut [u8]),
    /// Owned host bytes (a host tensor's storage, or bytes handed over); an in-place
    /// collective gives its result back as [`Done::Buffer`].
    Host(Bytes),
    /// A buffer on a device (a tensor on an NCCL group's device).
    Device(DeviceBuffer),
}

impl std::fmt::Debug for Buf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Buf::Ref(_) => "Ref",
            Buf::Mut(_) => "Mut",
            Buf::Host(_) => "Host",
            Buf::Device(_) => "Device",
        };
        write!(f, "Buf::{kind}({} bytes)", self.len())
    }
}

impl From<Storage> for Buf<'static> {
    fn from(storage: Storage) -> Self {
        match storage {
            Storage::Host(bytes) => Buf::Host(bytes),
            Storage::Device(buffer) => Buf::Device(buffer),
        }
    }
}

impl From<Bytes> for Buf<'static> {
    fn from(bytes: Bytes) -> Self {
        Buf::Host(bytes)
    }
}

impl From<Vec<u8>> for Buf<'static> {
    fn from(bytes: Vec<u8>) -> Self {
        Buf::Host(bytes.into())
    }
}

impl<'a> Buf<'a> {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Buf::Ref(b) => b.len(),
            Buf::Mut(b) => b.len(),
            Buf::Host(b) => b.len(),
            Buf::Device(b) => b.len(),
        }
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its host bytes, or [`ProcessGroupError::WrongDevice`] for a device buffer on a backend
    /// (`pg`) that works on host bytes.
    pub fn host<P: ProcessGroup + ?Sized>(
        &self,
        collective: &'static str,
        pg: &P,
    ) -> Result<&[u8], ProcessGroupError> {
        match self {
            Buf::Ref(b) => Ok(b),
            Buf::Mut(b) => Ok(b),
            Buf::Host(b) => Ok(b),
            Buf::Device(b) => Err(wrong_device(collective, pg, b.device())),
        }
    }

    /// Its host bytes as one owned message (copied unless they were owned).
    pub fn into_bytes<P: ProcessGroup + ?Sized>(
        self,
        collective: &'static str,
        pg: &P,
    ) -> Result<Bytes, ProcessGroupError> {
        match self {
            Buf::Ref(b) => Ok(Bytes::copy_from_slice(b)),
            Buf::Mut(b) => Ok(Bytes::copy_from_slice(b)),
            Buf::Host(b) => Ok(b),
            Buf::Device(b) => Err(wrong_device(collective, pg, b.device())),
        }
    }

    /// Host bytes an in-place collective may write: the caller's own, or a private copy of
    /// the others (no copy when owned bytes are held only here).
    pub fn into_host_mut<P: ProcessGroup + ?Sized>(
        self,
        collective: &'static str,
        pg: &P,
    ) -> Result<HostMut<'a>, ProcessGroupError> {
        match self {
            Buf::Mut(b) => Ok(HostMut::Lent(b)),
            Buf::Ref(b) => Ok(HostMut::Owned(b.to_vec())),
            Buf::Host(b) => Ok(HostMut::Owned(Vec::from(b))),
            Buf::Device(b) => Err(wrong_device(collective, pg, b.device())),
        }
    }
}

fn wrong_device<P: ProcessGroup + ?Sized>(
    collective: &'static str,
    pg: &P,
    tensor: Device,
) -> ProcessGroupError {
    ProcessGroupError::WrongDevice {
        collective,
        backend: pg.backend(),
        tensor,
        group: pg.device(),
    }
}

/// Host bytes an in-place collective writes ([`Buf::into_host_mut`]).
#[derive(Debug)]
pub enum HostMut<'a> {
    /// The caller's bytes, written in place.
    Lent(&'a mut [u8]),
    /// A copy of their own, given back as the result.
    Owned(Vec<u8>),
}

impl HostMut<'_> {
    /// What the collective gives back once it wrote its result here: nothing for the
    /// caller's own bytes (they hold it), the bytes otherwise.
    pub fn done(self) -> Done {
        match self {
            HostMut::Lent(_) => Done::Unit,
            HostMut::Owned(v) => Done::Buffer(Storage::Host(v.into())),
        }
    }
}

impl std::ops::Deref for HostMut<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            HostMut::Lent(b) => b,
            HostMut::Owned(v) => v,
        }
    }
}

impl std::ops::DerefMut for HostMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            HostMut::Lent(b) => b,
            HostMut::Owned(v) => v,
        }
    }
}

/// One operation of a process group: a collective or a point-to-point message, with its
/// arguments and data. Each variant says what it gives back ([`Done`]); the extension
/// traits ([`Collectives`](super::Collectives), [`TensorCollectives`](super::TensorCollectives))
/// build them and read the results.
#[derive(Debug)]
#[non_exhaustive]
pub enum Op<'a> {
    /// Returns once every rank has entered it. Gives [`Done::Unit`].
    Barrier,
    /// A barrier that names who did not come (see
    /// [`Collectives::monitored_barrier`](super::Collectives::monitored_barrier)). Gives
    /// [`Done::Unit`].
    MonitoredBarrier {
        /// How long rank 0 waits; the group's timeout when `None`.
        timeout: Option<Duration>,
        /// Name every missing rank rather than the first.
        wait_all_ranks: bool,
    },
    /// Reduces `data` element-wise across all ranks; every rank ends with the result, bit for
    /// bit. Gives [`Done::Unit`] for [`Buf::Mut`] (written in place), else [`Done::Buffer`].
    AllReduce {
        /// Little-endian elements of `element`.
        data: Buf<'a>,
        /// The element type.
        element: ElementType,
        /// The reduction.
        op: ReduceOp,
    },
    /// Reduces `data` across all ranks into `root`'s; other ranks' data is left as it was.
    /// Gives the root's result as [`AllReduce`](Op::AllReduce) does, [`Done::Unit`] elsewhere.
    Reduce {
        /// Little-endian elements of `element`.
        data: Buf<'a>,
        /// The element type.
        element: ElementType,
        /// The reduction.
        op: ReduceOp,
        /// The rank that gets the result.
        root: usize,
    },
    /// Copies `root`'s `data` to every rank; every rank passes as many bytes. Gives
    /// [`Done::Unit`] for [`Buf::Mut`] (written in place), else [`Done::Buffer`].
    Broadcast {
        /// The bytes.
        data: Buf<'a>,
        /// The rank whose bytes everyone gets.
        root: usize,
    },
    /// `root`'s bytes to every rank when only the root knows how many (`data` is read on the
    /// root only). Gives [`Done::Buffer`].
    BroadcastBytes {
        /// The root's bytes (anything elsewhere).
        data: Buf<'a>,
        /// The root.
        root: usize,
    },
    /// Every rank's block (blocks may differ in length), in rank order. Gives
    /// [`Done::Buffers`].
    AllGather {
        /// This rank's block.
        input: Buf<'a>,
        /// What the caller knows of every rank's length: with them known
        /// ([`BlockLens::known`](collective::varlen::BlockLens::known)), a group may skip
        /// exchanging them (a backend may always exchange them, or need none); a rank whose
        /// block is not as long as the others were told fails, naming it.
        lens: collective::varlen::BlockLens,
    },
    /// Every rank's block on `root`. Gives [`Done::Gathered`]: `Some` on the root.
    Gather {
        /// This rank's block.
        input: Buf<'a>,
        /// The rank that gets the blocks.
        root: usize,
    },
    /// Block i of `root`'s `blocks` to rank i (`blocks` read on the root only, where it
    /// holds one block per rank). Gives [`Done::Buffer`]: this rank's block.
    Scatter {
        /// The root's blocks.
        blocks: Vec<Bytes>,
        /// The root.
        root: usize,
    },
    /// Reduces `input` element-wise across all ranks and gives this rank's chunk of the
    /// result ([`Done::Buffer`]): `input` is every rank's chunk in rank order, chunk i being
    /// `counts[i]` elements; every rank passes the same `counts`.
    ReduceScatter {
        /// Every chunk, in rank order.
        input: Buf<'a>,
        /// Elements per rank's chunk.
        counts: Vec<usize>,
        /// The element type.
        element: ElementType,
        /// The reduction.
        op: ReduceOp,
    },
    /// [`ReduceScatter`](Op::ReduceScatter)'s contract by direct exchange
    /// ([`collective::reduce_scatter_v`]: each contribution goes straight to its chunk's
    /// owner, which folds them in a fixed order). Gives [`Done::Buffer`]: this rank's
    /// `counts[rank]` elements.
    ReduceScatterV {
        /// Every chunk, in rank order.
        input: Buf<'a>,
        /// Elements per rank's chunk.
        counts: Vec<usize>,
        /// The element type.
        element: ElementType,
        /// The reduction.
        op: ReduceOp,
    },
    /// `inputs[i]` to rank i; gives what every rank sent here, in rank order
    /// ([`Done::Buffers`]), `output_lens[i]` bytes from rank i.
    AllToAll {
        /// One block per rank.
        inputs: Vec<Bytes>,
        /// The bytes each rank sends here.
        output_lens: Vec<usize>,
    },
    /// [`AllToAll`](Op::AllToAll) of one buffer split into `input_splits` bytes; gives the
    /// blocks received concatenated ([`Done::Buffer`]).
    AllToAllSingle {
        /// The blocks, concatenated.
        input: Buf<'a>,
        /// Bytes to each rank.
        input_splits: Vec<usize>,
        /// Bytes from each rank.
        output_splits: Vec<usize>,
    },
    /// `data` to rank `dst` with `tag`. Gives [`Done::Unit`] once handed to the transport.
    Send {
        /// The message.
        data: Buf<'a>,
        /// The receiver.
        dst: usize,
        /// The tag.
        tag: u32,
    },
    /// The next message from `src` with `tag`. Gives [`Done::Buffer`].
    Recv {
        /// The sender.
        src: usize,
        /// The tag.
        tag: u32,
    },
    /// The next message from any other rank with `tag`. Gives [`Done::Received`].
    RecvAny {
        /// The tag.
        tag: u32,
    },
}

impl<'a> Op<'a> {
    /// The collective's name as errors and logs give it (`"all_reduce"`, `"recv"`).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Barrier => "barrier",
            Op::MonitoredBarrier { .. } => "monitored_barrier",
            Op::AllReduce { .. } => "all_reduce",
            Op::Reduce { .. } => "reduce",
            Op::Broadcast { .. } | Op::BroadcastBytes { .. } => "broadcast",
            Op::AllGather { .. } => "all_gather",
            Op::Gather { .. } => "gather",
            Op::Scatter { .. } => "scatter",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::ReduceScatterV { .. } => "reduce_scatter_v",
            Op::AllToAll { .. } | Op::AllToAllSingle { .. } => "all_to_all",
            Op::Send { .. } => "send",
            Op::Recv { .. } | Op::RecvAny { .. } => "recv",
        }
    }

    /// The operation as one schedule of core's, for the operations that are one (`None` for
    /// the others): a backend that runs core's schedules (tensorwire's group) runs any
    /// operation it has no code of its own for this way, so a collective that is one schedule
    /// needs nothing but its variant here and its schedule in [`collective`].
    ///
    /// Checks the arguments for rank `rank` of `world` ranks; an error is the operation's
    /// answer, before it takes a place in the group's sequence.
    pub fn schedule(
        self,
        rank: usize,
        world: usize,
    ) -> Option<Result<Scheduled<'a>, ProcessGroupError>> {
        let name = self.name();
        let arguments = |source| ProcessGroupError::Arguments {
            collective: name,
            source,
        };
        match self {
            Op::ReduceScatter {
                input,
                counts,
                element,
                op,
            } => Some(
                check_counts(&counts, world)
                    .and_then(|()| collective::reduce_scatter(rank, &counts, element, op))
                    .map_err(arguments)
                    .and_then(|schedule| {
                        Scheduled::new(
                            name,
                            schedule,
                            Signature::reduce_scatter(op, element, &counts),
                            input,
                            Some((op, element)),
                        )
                    }),
            ),
            Op::ReduceScatterV {
                input,
                counts,
                element,
                op,
            } => Some(
                check_counts(&counts, world)
                    .and_then(|()| collective::reduce_scatter_v(rank, &counts, element, op))
                    .map_err(arguments)
                    .and_then(|schedule| {
                        Scheduled::new(
                            name,
                            schedule,
                            Signature::reduce_scatter_v(op, element, &counts),
                            input,
                            Some((op, element)),
                        )
                    }),
            ),
            _ => None,
        }
    }
}

/// One entry per rank, or [`CollectiveError::LengthsCount`].
fn check_counts(counts: &[usize], world: usize) -> Result<(), CollectiveError> {
    if counts.len() == world {
        Ok(())
    } else {
        Err(CollectiveError::LengthsCount {
            lens: counts.len(),
            world,
        })
    }
}

/// An operation as one of core's schedules ([`Op::schedule`]): an executor writes `input` at
/// the schedule's [`input_range`](Schedule::input_range) of a buffer of
/// [`buffer_len`](Schedule::buffer_len) bytes, runs the schedule with `signature` on every
/// message, and gives [`output_range`](Schedule::output_range) of the buffer back, finished
/// with `finish` when there is one ([`ReduceOp::finish`]).
#[derive(Debug)]
pub struct Scheduled<'a> {
    /// This rank's schedule.
    pub schedule: Schedule,
    /// What every rank must agree on.
    pub signature: Signature,
    /// This rank's input: exactly the schedule's input range.
    pub input: Buf<'a>,
    /// The reduction to finish the output with (avg divides by the world size).
    pub finish: Option<(ReduceOp, ElementType)>,
}

impl<'a> Scheduled<'a> {
    /// Checks that `input` fills the schedule's input range.
    fn new(
        collective: &'static str,
        schedule: Schedule,
        signature: Signature,
        input: Buf<'a>,
        finish: Option<(ReduceOp, ElementType)>,
    ) -> Result<Self, ProcessGroupError> {
        let expected = schedule.input_range().len();
        if input.len() != expected {
            return Err(ProcessGroupError::Arguments {
                collective,
                source: CollectiveError::SplitsSum {
                    sum: expected,
                    actual: input.len(),
                },
            });
        }
        Ok(Scheduled {
            schedule,
            signature,
            input,
            finish,
        })
    }
}

/// What an [`Op`] gives back (each variant of [`Op`] says which).
#[derive(Debug)]
#[non_exhaustive]
pub enum Done {
    /// Success, nothing more (or the result was written into the caller's bytes).
    Unit,
    /// One buffer.
    Buffer(Storage),
    /// One buffer per rank, in rank order.
    Buffers(Vec<Storage>),
    /// A gather's result: `Some` of every rank's block on the root, `None` elsewhere.
    Gathered(Option<Vec<Storage>>),
    /// A message from some rank: its sender and its bytes.
    Received {
        /// The sender.
        src: usize,
        /// The message.
        data: Storage,
    },
}

impl Done {
    /// Which kind of result it is, for errors (`"Buffers(3)"`), without the bytes.
    pub fn kind(&self) -> String {
        match self {
            Done::Unit => "Unit".to_owned(),
            Done::Buffer(s) => format!("Buffer({} bytes)", s.len()),
            Done::Buffers(b) => format!("Buffers({})", b.len()),
            Done::Gathered(g) => format!("Gathered({:?})", g.as_ref().map(Vec::len)),
            Done::Received { src, data } => format!("Received(from {src}, {} bytes)", data.len()),
        }
    }
}

impl From<Bytes> for Done {
    fn from(bytes: Bytes) -> Self {
        Done::Buffer(Storage::Host(bytes))
    }
}

impl From<Vec<u8>> for Done {
    fn from(bytes: Vec<u8>) -> Self {
        Done::Buffer(Storage::Host(bytes.into()))
    }
}

impl From<Vec<Bytes>> for Done {
    fn from(blocks: Vec<Bytes>) -> Self {
        Done::Buffers(blocks.into_iter().map(Storage::Host).collect())
    }
}
