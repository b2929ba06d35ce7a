//! [`Collectives`]: the byte collectives and point-to-point messages, awaited, for every
//! [`ProcessGroup`]: each builds its [`Op`], [`start`](ProcessGroup::start)s it, waits and
//! reads the [`Done`].

use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;

use crate::collective::varlen::BlockLens;
use crate::collective::{ElementType, ReduceOp};
use crate::tensor::Storage;

use super::{Buf, Done, Now, Op, Pending, ProcessGroup, ProcessGroupError, UNBOUNDED};

/// The awaited byte forms of every collective, for any [`ProcessGroup`] (blanket-implemented).
///
/// Each is issued when its future is first polled (the ordering point, see the
/// [port's contract](super)) and completes when the collective has on this rank.
pub trait Collectives: ProcessGroup {
    /// Runs `op` to its end: [`start`](ProcessGroup::start) and wait, issued at the first
    /// poll ([`run_now`](ProcessGroup::run_now): in that poll when the backend can, else
    /// awaiting the future it gives).
    fn run<'a>(
        &'a self,
        op: Op<'a>,
    ) -> impl Future<Output = Result<Done, ProcessGroupError>> + Send + 'a {
        Run {
            pg: self,
            op: Some(op),
            rest: None,
        }
    }

    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        RunUnit {
            pg: self,
            issued: false,
            rest: None,
        }
    }

    /// Gathers one block of bytes from every rank (blocks may differ in length); the result
    /// holds them in rank order.
    fn all_gather(
        &self,
        input: &[u8],
    ) -> impl Future<Output = Result<Vec<Bytes>, ProcessGroupError>> + Send {
        gathered(self, input, BlockLens::Exchanged)
    }

    /// [`all_gather`](Self::all_gather) of blocks as long as this rank's on every rank (as
    /// a tensor all_gather's, or MPI's `Allgather`): the group need not exchange the lengths
    /// first. A rank whose block is of another length fails, and so do the ranks it meets,
    /// naming it.
    fn all_gather_equal(
        &self,
        input: &[u8],
    ) -> impl Future<Output = Result<Vec<Bytes>, ProcessGroupError>> + Send {
        gathered(self, input, BlockLens::Equal)
    }

    /// Copies `root`'s `data` into `data` on every other rank; every rank passes a buffer of
    /// the same length.
    fn broadcast(
        &self,
        data: &mut [u8],
        root: usize,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        async move {
            let op = Op::Broadcast {
                data: Buf::Mut(&mut *data),
                root,
            };
            let done = self.run(op).await?;
            written(self, "broadcast", done, data)
        }
    }

    /// Sends `root`'s bytes to every rank when only the root knows how many there are: `data`
    /// is read on the root only (pass an empty slice elsewhere); every rank returns the root's
    /// bytes.
    fn broadcast_bytes(
        &self,
        data: &[u8],
        root: usize,
    ) -> impl Future<Output = Result<Bytes, ProcessGroupError>> + Send {
        async move {
            let data = Buf::Ref(data);
            bytes(
                self,
                "broadcast",
                self.run(Op::BroadcastBytes { data, root }).await?,
            )
        }
    }

    /// Reduces `data` (little-endian elements of `element`) element-wise across all ranks
    /// with `op`; every rank ends with the same result, bit for bit.
    fn all_reduce(
        &self,
        data: &mut [u8],
        element: ElementType,
        op: ReduceOp,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        async move {
            let done = self
                .run(Op::AllReduce {
                    data: Buf::Mut(&mut *data),
                    element,
                    op,
                })
                .await?;
            written(self, "all_reduce", done, data)
        }
    }

    /// Reduces `data` (little-endian elements of `element`) element-wise across all ranks with
    /// `op` into `root`'s `data`. Other ranks' `data` is left as it was.
    fn reduce(
        &self,
        data: &mut [u8],
        element: ElementType,
        op: ReduceOp,
        root: usize,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        async move {
            let done = self
                .run(Op::Reduce {
                    data: Buf::Mut(&mut *data),
                    element,
                    op,
                    root,
                })
                .await?;
            if self.rank() == root {
                written(self, "reduce", done, data)
            } else {
                Ok(())
            }
        }
    }

    /// Reduces `input` element-wise across all ranks with `op` and returns this rank's chunk
    /// of the result: `input` is every rank's chunk in rank order, chunk i being `counts[i]`
    /// elements (chunks may differ in size; every rank passes the same `counts`). PyTorch's
    /// `reduce_scatter_tensor`; `CollectivesExt` builds the list form on it.
    fn reduce_scatter(
        &self,
        input: &[u8],
        counts: &[usize],
        element: ElementType,
        op: ReduceOp,
    ) -> impl Future<Output = Result<Vec<u8>, ProcessGroupError>> + Send {
        async move {
            let op = Op::ReduceScatter {
                input: Buf::Ref(input),
                counts: counts.to_vec(),
                element,
                op,
            };
            Ok(Vec::from(bytes(
                self,
                "reduce_scatter",
                self.run(op).await?,
            )?))
        }
    }

    /// [`reduce_scatter`](Self::reduce_scatter) by direct exchange ([`Op::ReduceScatterV`]):
    /// each rank's contribution to chunk i goes straight to rank i, which folds them in a
    /// fixed order; returns this rank's `counts[rank]` elements of the reduction. PyTorch's
    /// `reduce_scatter` with output sizes that differ from rank to rank.
    fn reduce_scatter_v(
        &self,
        input: &[u8],
        counts: &[usize],
        element: ElementType,
        op: ReduceOp,
    ) -> impl Future<Output = Result<Vec<u8>, ProcessGroupError>> + Send {
        async move {
            let op = Op::ReduceScatterV {
                input: Buf::Ref(input),
                counts: counts.to_vec(),
                element,
                op,
            };
            Ok(Vec::from(bytes(
                self,
                "reduce_scatter_v",
                self.run(op).await?,
            )?))
        }
    }

    /// Gathers one block of bytes from every rank (blocks may differ in length) on `root`:
    /// `Some` of the blocks in rank order there, `None` on every other rank.
    fn gather(
        &self,
        input: &[u8],
        root: usize,
    ) -> impl Future<Output = Result<Option<Vec<Bytes>>, ProcessGroupError>> + Send {
        async move {
            let input = Buf::Ref(input);
            match self.run(Op::Gather { input, root }).await? {
                Done::Gathered(None) => Ok(None),
                Done::Gathered(Some(blocks)) => host_blocks(self, "gather", blocks).map(Some),
                other => Err(unexpected(self, "gather", &other)),
            }
        }
    }

    /// Sends block i of `root`'s `blocks` to rank i (blocks may differ in length) and returns
    /// this rank's block. `blocks` is read on the root only (pass an empty slice elsewhere);
    /// there it must hold one block per rank.
    fn scatter(
        &self,
        blocks: &[Bytes],
        root: usize,
    ) -> impl Future<Output = Result<Bytes, ProcessGroupError>> + Send {
        async move {
            let blocks = blocks.to_vec();
            bytes(
                self,
                "scatter",
                self.run(Op::Scatter { blocks, root }).await?,
            )
        }
    }

    /// Sends `inputs[i]` to rank i and returns what every rank sent this one, in rank order;
    /// `output_lens[i]` is the length rank i sends here (blocks may differ in length; rank i's
    /// `inputs[r]` must be `output_lens[i]` bytes on rank r, or rank r fails with
    /// [`Mismatch`](ProcessGroupError::Mismatch) naming rank i).
    fn all_to_all(
        &self,
        inputs: &[Bytes],
        output_lens: &[usize],
    ) -> impl Future<Output = Result<Vec<Bytes>, ProcessGroupError>> + Send {
        async move {
            let op = Op::AllToAll {
                inputs: inputs.to_vec(),
                output_lens: output_lens.to_vec(),
            };
            blocks(self, "all_to_all", self.run(op).await?)
        }
    }

    /// [`all_to_all`](Self::all_to_all) of one buffer: `input` split into blocks of
    /// `input_splits` bytes (one per rank, summing to its length) goes out, and the blocks
    /// received (`output_splits` bytes from each rank) come back concatenated in rank order.
    /// PyTorch's `all_to_all_single` with explicit splits.
    fn all_to_all_single(
        &self,
        input: &[u8],
        input_splits: &[usize],
        output_splits: &[usize],
    ) -> impl Future<Output = Result<Vec<u8>, ProcessGroupError>> + Send {
        async move {
            let op = Op::AllToAllSingle {
                input: Buf::Ref(input),
                input_splits: input_splits.to_vec(),
                output_splits: output_splits.to_vec(),
            };
            Ok(Vec::from(bytes(self, "all_to_all", self.run(op).await?)?))
        }
    }

    /// Sends `data` to rank `dst` with `tag`; rank `dst` receives it with
    /// [`recv`](Self::recv)`(this rank, tag)`. Messages between two ranks with one tag are
    /// received in the order they were sent. Point-to-point messages take no place in the
    /// group's sequence of collectives. Returns once the message is handed to the transport.
    fn send(
        &self,
        data: &[u8],
        dst: usize,
        tag: u32,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        async move {
            let data = Buf::Ref(data);
            unit(self, "send", self.run(Op::Send { data, dst, tag }).await?)
        }
    }

    /// Receives the next message rank `src` sent here with `tag` (see [`send`](Self::send)),
    /// waiting up to the group's timeout.
    fn recv(
        &self,
        src: usize,
        tag: u32,
    ) -> impl Future<Output = Result<Bytes, ProcessGroupError>> + Send {
        async move { bytes(self, "recv", self.run(Op::Recv { src, tag }).await?) }
    }

    /// Receives the next message any other rank sent here with `tag` (PyTorch's `recv` with
    /// `src=None`, which gloo implements): returns the sender's rank and the bytes, waiting
    /// up to the group's timeout. The message taken is the one that arrives first; it counts
    /// as that sender's next message with `tag`, so a later [`recv`](Self::recv) from that
    /// sender gets the one after it.
    fn recv_any(
        &self,
        tag: u32,
    ) -> impl Future<Output = Result<(usize, Bytes), ProcessGroupError>> + Send {
        async move {
            match self.run(Op::RecvAny { tag }).await? {
                Done::Received {
                    src,
                    data: Storage::Host(data),
                } => Ok((src, data)),
                other => Err(unexpected(self, "recv", &other)),
            }
        }
    }

    /// [`send`](Self::send) without waiting for it: the message is numbered in this call (so
    /// it keeps its place among this rank's messages to `dst` with `tag`), and the future
    /// gives its result. A backend with tasks sends it whether or not the future is polled
    /// ([`ProcessGroup::spawn`]).
    fn isend(&self, data: Bytes, dst: usize, tag: u32) -> Pending<'_, ()> {
        let work = self.spawn(Op::Send {
            data: Buf::Host(data),
            dst,
            tag,
        });
        Box::pin(async move { unit(self, "send", work.wait(UNBOUNDED).await?) })
    }

    /// [`recv`](Self::recv) without waiting for it: the receive is numbered in this call (so
    /// it gets the message after those of the receives issued before it), and the future
    /// gives the bytes.
    fn irecv(&self, src: usize, tag: u32) -> Pending<'_, Bytes> {
        let work = self.spawn(Op::Recv { src, tag });
        Box::pin(async move { bytes(self, "recv", work.wait(UNBOUNDED).await?) })
    }

    /// A barrier that says who did not come: rank 0 waits up to `timeout` (the group's when
    /// `None`) for every other rank, then lets them all go. When some do not arrive in time,
    /// rank 0 fails with [`MonitoredBarrier`](ProcessGroupError::MonitoredBarrier) naming
    /// every one of them with `wait_all_ranks` (PyTorch's `wait_all_ranks=True`), else the
    /// first; the others fail with a timeout naming rank 0.
    fn monitored_barrier(
        &self,
        timeout: Option<Duration>,
        wait_all_ranks: bool,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        async move {
            let op = Op::MonitoredBarrier {
                timeout,
                wait_all_ranks,
            };
            unit(self, "monitored_barrier", self.run(op).await?)
        }
    }
}

impl<P: ProcessGroup + ?Sized> Collectives for P {}

/// [`Collectives::run`]'s future, written out (an `async` block's state machine cost about 130
/// instructions per collective on the synchronous path, counted): its first poll calls
/// [`run_now`](ProcessGroup::run_now), the later ones poll the rest it gave.
struct Run<'a, P: ?Sized> {
    pg: &'a P,
    /// The operation, until the first poll issues it.
    op: Option<Op<'a>>,
    /// What `run_now` left to await.
    rest: Option<Pending<'a, Done>>,
}

/// The barrier's future: [`Run`]'s of [`Op::Barrier`], whose result is [`Done::Unit`], with
/// no operation kept to move out at the first poll (the barrier holds nothing) and no `Run`
/// inside to poll through (about 50 instructions per barrier on the synchronous path, counted).
struct RunUnit<'a, P: ?Sized> {
    pg: &'a P,
    /// Whether the first poll issued it.
    issued: bool,
    /// What `run_now` left to await.
    rest: Option<Pending<'a, Done>>,
}

impl<P: ProcessGroup + ?Sized> Future for RunUnit<'_, P> {
    type Output = Result<(), ProcessGroupError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Self::Output> {
        let this = &mut *self;
        if !this.issued {
            this.issued = true;
            match this.pg.run_now(Op::Barrier, cx) {
                Now::Done(result) => return Poll::Ready(result.and_then(|d| barrier(this.pg, d))),
                Now::Later(rest) => this.rest = Some(rest),
            }
        }
        let rest = this
            .rest
            .as_mut()
            .expect("`Collectives::barrier`'s future polled after it completed");
        let result = std::task::ready!(rest.as_mut().poll(cx));
        this.rest = None;
        Poll::Ready(result.and_then(|d| barrier(this.pg, d)))
    }
}

/// A barrier's result from what the backend gave ([`unit()`]'s, in the future's poll).
#[inline(always)]
fn barrier<P: ProcessGroup + ?Sized>(pg: &P, done: Done) -> Result<(), ProcessGroupError> {
    if let Done::Unit = done {
        // Holds nothing: forgotten rather than dropped through the result's glue.
        std::mem::forget(done);
        return Ok(());
    }
    Err(unexpected(pg, "barrier", &done))
}

impl<P: ProcessGroup + ?Sized> Future for Run<'_, P> {
    type Output = Result<Done, ProcessGroupError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(op) = this.op.take() {
            match this.pg.run_now(op, cx) {
                Now::Done(result) => return Poll::Ready(result),
                Now::Later(rest) => this.rest = Some(rest),
            }
        }
        this.rest
            .as_mut()
            .expect("`Collectives::run`'s future polled after it completed")
            .as_mut()
            .poll(cx)
    }
}

/// The error for a backend that gave another kind of result than `collective`'s.
pub(super) fn unexpected<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    done: &Done,
) -> ProcessGroupError {
    ProcessGroupError::Backend {
        backend: pg.backend(),
        collective,
        seq: 0,
        rank: pg.rank(),
        reason: format!("the backend gave {} back", done.kind()),
    }
}

pub(super) fn unit<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    done: Done,
) -> Result<(), ProcessGroupError> {
    match done {
        Done::Unit => {
            // Holds nothing: forgotten rather than dropped through the result's glue (12
            // instructions per barrier, counted).
            std::mem::forget(done);
            Ok(())
        }
        other => Err(unexpected(pg, collective, &other)),
    }
}

/// The result of an in-place collective on `data`: written there already, or given back.
fn written<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    done: Done,
    data: &mut [u8],
) -> Result<(), ProcessGroupError> {
    match done {
        Done::Unit => Ok(()),
        Done::Buffer(Storage::Host(b)) if b.len() == data.len() => {
            data.copy_from_slice(&b);
            Ok(())
        }
        other => Err(unexpected(pg, collective, &other)),
    }
}

pub(super) fn bytes<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    done: Done,
) -> Result<Bytes, ProcessGroupError> {
    match done {
        Done::Buffer(Storage::Host(b)) => Ok(b),
        other => Err(unexpected(pg, collective, &other)),
    }
}

/// The blocks of an all_gather whose lengths are as `lens` says (both forms of
/// [`Collectives`]).
async fn gathered<P: Collectives + ?Sized>(
    pg: &P,
    input: &[u8],
    lens: BlockLens,
) -> Result<Vec<Bytes>, ProcessGroupError> {
    let op = Op::AllGather {
        input: Buf::Ref(input),
        lens,
    };
    blocks(pg, "all_gather", pg.run(op).await?)
}

fn blocks<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    done: Done,
) -> Result<Vec<Bytes>, ProcessGroupError> {
    match done {
        Done::Buffers(blocks) => host_blocks(pg, collective, blocks),
        other => Err(unexpected(pg, collective, &other)),
    }
}

fn host_blocks<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    blocks: Vec<Storage>,
) -> Result<Vec<Bytes>, ProcessGroupError> {
    blocks
        .into_iter()
        .map(|s| match s {
            Storage::Host(b) => Ok(b),
            other => Err(unexpected(pg, collective, &Done::Buffer(other))),
        })
        .collect()
}
