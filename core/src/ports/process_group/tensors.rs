//! [`TensorCollectives`]: the tensor collectives for every [`ProcessGroup`], awaited or issued
//! as work handles (c10d's `async_op=True`).
//!
//! Each is one preparation (the checks gloo makes at the call, the [`Op`] on the tensors'
//! storage, and how the [`Done`] becomes the result), run two ways: awaited
//! ([`ProcessGroup::start`] and wait) or issued ([`ProcessGroup::spawn`], a handle).

use std::future::Future;

use bytes::Bytes;

use crate::collective::varlen::BlockLens;
use crate::collective::{CollectiveError, ElementType, ReduceOp};
use crate::tensor::{Storage, Tensor};

use super::checks::{check_count, check_list, check_root, check_stacked};
use super::{failed, map, Buf, Done, Op, ProcessGroup, ProcessGroupError, WorkHandle, UNBOUNDED};

/// How a [`Done`] becomes a collective's result.
type Finish<T> = Box<dyn FnOnce(Done) -> Result<T, ProcessGroupError> + Send>;

/// A tensor collective whose arguments passed the checks: its operation and its finish.
struct Prepared<T> {
    op: Op<'static>,
    finish: Finish<T>,
}

type Prep<T> = Result<Prepared<T>, ProcessGroupError>;

fn prepared<T>(
    op: Op<'static>,
    finish: impl FnOnce(Done) -> Result<T, ProcessGroupError> + Send + 'static,
) -> Prep<T> {
    Ok(Prepared {
        op,
        finish: Box::new(finish),
    })
}

/// A handle on a tensor collective.
pub type TensorWork<'a, T> = Box<dyn WorkHandle<'a, T> + 'a>;

/// The tensor forms of every collective, for any [`ProcessGroup`] (blanket-implemented).
///
/// The awaited forms (`all_reduce_tensor`) are issued when first polled, the `issue_*` forms
/// in the call; both are ordering points (see the [port's contract](super)). Every one checks
/// its own arguments where c10d's gloo raises, before it takes a place in the sequence: an
/// `issue_*` refused for them returns a handle that has already finished with the error
/// ([`is_completed`](WorkHandle::is_completed) true, [`error`](WorkHandle::error) `Some`,
/// `wait` gives it). What only the data of other ranks shows comes at `wait`.
pub trait TensorCollectives: ProcessGroup {
    /// Reduces `tensor` element-wise across all ranks with `op`; returns the result (same
    /// dtype, shape and device). Host backends support every dtype (`f32`, `f64`, `f16`,
    /// `bf16`, `i32`, `i64`, `u8`, `i8`, `bool`) with the ops gloo allows on it
    /// ([`ReduceOp::supports`]).
    fn all_reduce_tensor(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
    ) -> impl Future<Output = Result<Tensor, ProcessGroupError>> + Send {
        awaited(self, all_reduce(self, tensor.clone(), op))
    }

    /// [`all_reduce_tensor`](Self::all_reduce_tensor) issued now; the handle gives the
    /// reduced tensor.
    fn issue_all_reduce_tensor(&self, tensor: Tensor, op: ReduceOp) -> TensorWork<'_, Tensor> {
        issued(self, all_reduce(self, tensor, op))
    }

    /// Returns `root`'s tensor on every rank; every rank passes a tensor of the same dtype and
    /// shape (its contents are ignored except on `root`).
    fn broadcast_tensor(
        &self,
        tensor: &Tensor,
        root: usize,
    ) -> impl Future<Output = Result<Tensor, ProcessGroupError>> + Send {
        awaited(self, broadcast(self, tensor.clone(), root))
    }

    /// [`broadcast_tensor`](Self::broadcast_tensor) issued now; the handle gives `root`'s
    /// tensor.
    fn issue_broadcast_tensor(&self, tensor: Tensor, root: usize) -> TensorWork<'_, Tensor> {
        issued(self, broadcast(self, tensor, root))
    }

    /// Gathers `tensor` from every rank; the result holds one tensor per rank, in rank order.
    /// Every rank passes a tensor of the same dtype and shape.
    fn all_gather_tensor(
        &self,
        tensor: &Tensor,
    ) -> impl Future<Output = Result<Vec<Tensor>, ProcessGroupError>> + Send {
        awaited(self, all_gather(self, tensor.clone()))
    }

    /// [`all_gather_tensor`](Self::all_gather_tensor) issued now; the handle gives every
    /// rank's tensor in rank order.
    fn issue_all_gather_tensor(&self, tensor: Tensor) -> TensorWork<'_, Vec<Tensor>> {
        issued(self, all_gather(self, tensor))
    }

    /// Gathers `input` from every rank into `output` (PyTorch's `all_gather_into_tensor`):
    /// the ranks' tensors concatenated along the first dimension, in rank order, so `output`
    /// must have `input`'s dtype and shape `[world * input.shape[0], input.shape[1..]]`
    /// (`[world]` for a scalar input); its contents are replaced.
    ///
    /// # Errors
    /// [`ProcessGroupError::Arguments`] with [`CollectiveError::TensorType`] or
    /// [`CollectiveError::TensorSize`] (gloo's "invalid tensor type / size"), before the call
    /// takes a place in the group's sequence; the errors of all_gather.
    fn all_gather_into_tensor(
        &self,
        output: &mut Tensor,
        input: &Tensor,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        let prep = all_gather_into(self, output.clone(), input.clone());
        into(output, awaited(self, prep))
    }

    /// [`all_gather_into_tensor`](Self::all_gather_into_tensor) issued now; the handle gives
    /// `output` filled with every rank's `input`, concatenated in rank order.
    fn issue_all_gather_into_tensor(
        &self,
        output: Tensor,
        input: Tensor,
    ) -> TensorWork<'_, Tensor> {
        issued(self, all_gather_into(self, output, input))
    }

    /// Reduces `input` across all ranks with `op` and leaves this rank's chunk in `output`
    /// (PyTorch's `reduce_scatter_tensor`): `input` is every rank's chunk concatenated along
    /// the first dimension, so it must have `output`'s dtype and shape
    /// `[world * output.shape[0], output.shape[1..]]`; `output`'s contents are replaced.
    ///
    /// # Errors
    /// [`ProcessGroupError::Arguments`] with [`CollectiveError::TensorType`] or
    /// [`CollectiveError::TensorSize`] before the call takes a place in the sequence;
    /// [`ProcessGroupError::UnsupportedType`]; the errors of reduce_scatter.
    fn reduce_scatter_tensor(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        let prep = reduce_scatter(self, output.clone(), input.clone(), op);
        into(output, awaited(self, prep))
    }

    /// [`reduce_scatter_tensor`](Self::reduce_scatter_tensor) issued now; the handle gives
    /// `output` holding this rank's chunk of the reduction.
    fn issue_reduce_scatter_tensor(
        &self,
        output: Tensor,
        input: Tensor,
        op: ReduceOp,
    ) -> TensorWork<'_, Tensor> {
        issued(self, reduce_scatter(self, output, input, op))
    }

    /// Reduces `tensor` across all ranks with `op` into `root`'s `tensor` (PyTorch's
    /// `reduce(tensor, dst, op)`); other ranks' tensors are left as they were.
    fn reduce_tensor(
        &self,
        tensor: &mut Tensor,
        op: ReduceOp,
        root: usize,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        let prep = reduce(self, tensor.clone(), op, root);
        into(tensor, awaited(self, prep))
    }

    /// [`reduce_tensor`](Self::reduce_tensor) issued now; the handle gives the reduced tensor
    /// on `root` and `tensor` unchanged on every other rank.
    fn issue_reduce_tensor(
        &self,
        tensor: Tensor,
        op: ReduceOp,
        root: usize,
    ) -> TensorWork<'_, Tensor> {
        issued(self, reduce(self, tensor, op, root))
    }

    /// Gathers `input` from every rank into `root`'s `gather_list` (PyTorch's
    /// `gather(tensor, gather_list, dst)`): there it must hold one tensor per rank of
    /// `input`'s dtype and shape, whose contents are replaced; elsewhere it must be `None`.
    ///
    /// # Errors
    /// [`ProcessGroupError::Arguments`] with [`CollectiveError::TensorList`],
    /// [`CollectiveError::LengthsCount`], [`CollectiveError::TensorType`],
    /// [`CollectiveError::TensorSize`] or [`CollectiveError::RootOutOfRange`] before the call
    /// takes a place in the sequence; a [`ProcessGroupError::Mismatch`] when another rank's
    /// tensor has another size.
    fn gather_tensor(
        &self,
        input: &Tensor,
        gather_list: Option<&mut [Tensor]>,
        root: usize,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        let prep = gather(
            self,
            input.clone(),
            gather_list.as_deref().map(<[_]>::to_vec),
            root,
        );
        async move {
            let filled = awaited(self, prep).await?;
            if let (Some(list), Some(filled)) = (gather_list, filled) {
                list.clone_from_slice(&filled);
            }
            Ok(())
        }
    }

    /// [`gather_tensor`](Self::gather_tensor) issued now; the handle gives `Some` of the
    /// filled `gather_list` on `root` (one tensor per rank, in rank order) and `None`
    /// elsewhere.
    fn issue_gather_tensor(
        &self,
        input: Tensor,
        gather_list: Option<Vec<Tensor>>,
        root: usize,
    ) -> TensorWork<'_, Option<Vec<Tensor>>> {
        issued(self, gather(self, input, gather_list, root))
    }

    /// Scatters `root`'s `scatter_list` (one tensor per rank, each of `output`'s dtype and
    /// shape) so that rank i's `output` gets tensor i (PyTorch's
    /// `scatter(tensor, scatter_list, src)`); elsewhere `scatter_list` must be `None`.
    ///
    /// # Errors
    /// As [`gather_tensor`](Self::gather_tensor), for `scatter_list` against `output`.
    fn scatter_tensor(
        &self,
        output: &mut Tensor,
        scatter_list: Option<&[Tensor]>,
        root: usize,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        let prep = scatter(self, output.clone(), scatter_list.map(<[_]>::to_vec), root);
        into(output, awaited(self, prep))
    }

    /// [`scatter_tensor`](Self::scatter_tensor) issued now; the handle gives this rank's
    /// tensor of `root`'s `scatter_list` (in `output`'s dtype and shape).
    fn issue_scatter_tensor(
        &self,
        output: Tensor,
        scatter_list: Option<Vec<Tensor>>,
        root: usize,
    ) -> TensorWork<'_, Tensor> {
        issued(self, scatter(self, output, scatter_list, root))
    }

    /// PyTorch's `all_to_all_single(output, input, output_split_sizes, input_split_sizes)`:
    /// `input`'s rows (first dimension) split into one run per rank go out, and the runs
    /// received fill `output` in rank order. Split sizes count rows; `None` splits evenly
    /// (the first dimension must then divide by the world size). `output` has `input`'s
    /// dtype and trailing dimensions; its contents are replaced.
    ///
    /// # Errors
    /// [`ProcessGroupError::Arguments`] with [`CollectiveError::TensorType`],
    /// [`CollectiveError::TensorSize`], [`CollectiveError::LengthsCount`] or
    /// [`CollectiveError::SplitsSum`] before the call takes a place in the sequence; a
    /// [`ProcessGroupError::Mismatch`] naming a peer that sends another number of rows than
    /// `output_split_sizes` says.
    fn all_to_all_single_tensor(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        let prep = all_to_all_single(
            self,
            output.clone(),
            input.clone(),
            output_split_sizes,
            input_split_sizes,
        );
        into(output, awaited(self, prep))
    }

    /// [`all_to_all_single_tensor`](Self::all_to_all_single_tensor) issued now; the handle
    /// gives `output` filled with the rows received, in rank order.
    fn issue_all_to_all_single_tensor(
        &self,
        output: Tensor,
        input: Tensor,
        output_split_sizes: Option<Vec<usize>>,
        input_split_sizes: Option<Vec<usize>>,
    ) -> TensorWork<'_, Tensor> {
        let prep = all_to_all_single(
            self,
            output,
            input,
            output_split_sizes.as_deref(),
            input_split_sizes.as_deref(),
        );
        issued(self, prep)
    }

    /// The list form of all_to_all (PyTorch's `all_to_all(output_tensor_list,
    /// input_tensor_list)`): `inputs[j]` goes to rank j, and `outputs[i]` is replaced by what
    /// rank i sent this rank. Both lists hold one tensor a rank, all of one dtype; sizes may
    /// differ from rank to rank, but `outputs[i]` must have the size of rank i's `inputs[this
    /// rank]`. gloo's list form (PyTorch 2.x) raises unless every tensor has one size; this is
    /// NCCL's and MPI's, which allow them to differ.
    ///
    /// # Errors
    /// [`ProcessGroupError::Arguments`] with [`CollectiveError::LengthsCount`] or
    /// [`CollectiveError::TensorType`] before the call takes a place in the sequence; a
    /// [`ProcessGroupError::Mismatch`] naming the rank whose tensor for this rank has another
    /// size than `outputs` says.
    fn all_to_all_tensor(
        &self,
        outputs: &mut [Tensor],
        inputs: &[Tensor],
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        let prep = all_to_all(self, outputs.to_vec(), inputs.to_vec());
        async move {
            let filled = awaited(self, prep).await?;
            outputs.clone_from_slice(&filled);
            Ok(())
        }
    }

    /// [`all_to_all_tensor`](Self::all_to_all_tensor) issued now; the handle gives `outputs`
    /// with `outputs[i]` replaced by what rank i sent this rank.
    fn issue_all_to_all_tensor(
        &self,
        outputs: Vec<Tensor>,
        inputs: Vec<Tensor>,
    ) -> TensorWork<'_, Vec<Tensor>> {
        issued(self, all_to_all(self, outputs, inputs))
    }

    /// Sends `tensor`'s storage to rank `dst` with `tag` (PyTorch's `send(tensor, dst, tag)`);
    /// rank `dst` receives it with [`recv_tensor`](Self::recv_tensor) into a tensor of the
    /// same dtype and shape.
    fn send_tensor(
        &self,
        tensor: &Tensor,
        dst: usize,
        tag: u32,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        awaited(self, send(self, tensor.clone(), dst, tag))
    }

    /// [`send_tensor`](Self::send_tensor) issued now (c10d's `isend(tensor, dst, tag)`): the
    /// message is numbered in this call, so it keeps its place among this rank's messages to
    /// `dst` with `tag`. Checked at the call: a tensor on another device than the group's
    /// (and, by tensorwire's group, a `dst` out of range or this rank).
    fn issue_send_tensor(&self, tensor: Tensor, dst: usize, tag: u32) -> TensorWork<'_, ()> {
        issued(self, send(self, tensor, dst, tag))
    }

    /// Receives the next message rank `src` sent here with `tag` into `tensor` (PyTorch's
    /// `recv(tensor, src, tag)`): its contents are replaced, its dtype and shape kept.
    ///
    /// # Errors
    /// [`ProcessGroupError::WrongDevice`]; a [`ProcessGroupError::Mismatch`] naming `src`
    /// when the message has another length than `tensor` (the message is taken all the
    /// same).
    fn recv_tensor(
        &self,
        tensor: &mut Tensor,
        src: usize,
        tag: u32,
    ) -> impl Future<Output = Result<(), ProcessGroupError>> + Send {
        let prep = recv(self, tensor.clone(), src, tag);
        into(tensor, awaited(self, prep))
    }

    /// [`recv_tensor`](Self::recv_tensor) issued now (c10d's `irecv(tensor, src, tag)`): the
    /// receive is numbered in this call, so it gets the message after those of the receives
    /// from `src` with `tag` issued before it; the handle gives `tensor` with the message as
    /// its contents.
    fn issue_recv_tensor(&self, tensor: Tensor, src: usize, tag: u32) -> TensorWork<'_, Tensor> {
        issued(self, recv(self, tensor, src, tag))
    }

    /// Receives the next message any other rank sent here with `tag` into `tensor`
    /// (PyTorch's `recv(tensor, src=None, tag)`, which gloo implements) and returns its
    /// sender; see [`Collectives::recv_any`](super::Collectives::recv_any).
    fn recv_any_tensor(
        &self,
        tensor: &mut Tensor,
        tag: u32,
    ) -> impl Future<Output = Result<usize, ProcessGroupError>> + Send {
        let prep = recv_any(self, tensor.clone(), tag);
        async move {
            let (src, received) = awaited(self, prep).await?;
            *tensor = received;
            Ok(src)
        }
    }

    /// [`recv_any_tensor`](Self::recv_any_tensor) issued now (c10d's `irecv(tensor,
    /// src=None, tag)`, whose `Work.source_rank()` is the sender): the handle gives the
    /// sender and `tensor` with the message as its contents. Which message it takes is decided
    /// when one arrives, not in this call.
    fn issue_recv_any_tensor(&self, tensor: Tensor, tag: u32) -> TensorWork<'_, (usize, Tensor)> {
        issued(self, recv_any(self, tensor, tag))
    }

    /// A barrier issued now (c10d's `barrier(async_op=True)`).
    fn issue_barrier(&self) -> TensorWork<'_, ()> {
        let (backend, rank) = (self.backend(), self.rank());
        map(self.spawn(Op::Barrier), move |done| match done {
            Done::Unit => Ok(()),
            other => Err(wrong_result(backend, rank, "barrier", &other)),
        })
    }
}

impl<P: ProcessGroup + ?Sized> TensorCollectives for P {}

/// Runs a prepared collective to its end.
async fn awaited<P: ProcessGroup + ?Sized, T: Send + 'static>(
    pg: &P,
    prep: Prep<T>,
) -> Result<T, ProcessGroupError> {
    let Prepared { op, finish } = prep?;
    finish(pg.start(op).wait(UNBOUNDED).await?)
}

/// Issues a prepared collective now, or a handle that has failed with its error.
fn issued<P: ProcessGroup + ?Sized, T: Send + 'static>(pg: &P, prep: Prep<T>) -> TensorWork<'_, T> {
    match prep {
        Ok(Prepared { op, finish }) => map(pg.spawn(op), finish),
        Err(e) => failed(e),
    }
}

/// Puts the result of `run` into `slot`.
async fn into(
    slot: &mut Tensor,
    run: impl Future<Output = Result<Tensor, ProcessGroupError>>,
) -> Result<(), ProcessGroupError> {
    *slot = run.await?;
    Ok(())
}

/// The storage of `tensor` as an operation's data, if it is on the group's device.
fn data<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    tensor: &Tensor,
) -> Result<Buf<'static>, ProcessGroupError> {
    if tensor.device() != pg.device() {
        return Err(ProcessGroupError::WrongDevice {
            collective,
            backend: pg.backend(),
            tensor: tensor.device(),
            group: pg.device(),
        });
    }
    Ok(Buf::from(tensor.storage().clone()))
}

/// The host bytes of `tensor` for a collective that works on host bytes only (the lists of
/// scatter and all_to_all): a device tensor is [`ProcessGroupError::Unsupported`].
fn host_bytes<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    tensor: &Tensor,
) -> Result<Bytes, ProcessGroupError> {
    match data(pg, collective, tensor)? {
        Buf::Host(b) => Ok(b),
        _ => Err(ProcessGroupError::Unsupported {
            collective,
            backend: pg.backend(),
        }),
    }
}

fn element_of<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    tensor: &Tensor,
) -> Result<ElementType, ProcessGroupError> {
    ElementType::from_dtype(tensor.dtype()).ok_or_else(|| ProcessGroupError::UnsupportedType {
        collective,
        backend: pg.backend(),
        dtype: format!("{:?}", tensor.dtype()),
    })
}

fn wrong_result(
    backend: &'static str,
    rank: usize,
    collective: &'static str,
    done: &Done,
) -> ProcessGroupError {
    ProcessGroupError::Backend {
        backend,
        collective,
        seq: 0,
        rank,
        reason: format!("the backend gave {} back", done.kind()),
    }
}

/// `tensor` with `storage` (of its byte length), or the error for a backend that gave
/// another length.
fn with_storage(
    backend: &'static str,
    rank: usize,
    collective: &'static str,
    tensor: &Tensor,
    storage: Storage,
) -> Result<Tensor, ProcessGroupError> {
    let len = storage.len();
    tensor
        .with_storage(storage)
        .map_err(|_| ProcessGroupError::Backend {
            backend,
            collective,
            seq: 0,
            rank,
            reason: format!(
                "it gave {len} bytes back for a tensor of {} bytes",
                tensor.nbytes()
            ),
        })
}

/// `tensor`'s result from a collective that gives one buffer, or leaves it as it was.
fn one_tensor<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    tensor: Tensor,
) -> impl FnOnce(Done) -> Result<Tensor, ProcessGroupError> + Send + 'static {
    let (backend, rank) = (pg.backend(), pg.rank());
    move |done| match done {
        Done::Unit => Ok(tensor),
        Done::Buffer(storage) => with_storage(backend, rank, collective, &tensor, storage),
        other => Err(wrong_result(backend, rank, collective, &other)),
    }
}

/// A [`ProcessGroupError::Mismatch`] for a block of `len` bytes from `peer` where `expected`
/// were due.
fn size_mismatch(
    collective: &'static str,
    peer: usize,
    len: usize,
    expected: usize,
    whose: &str,
) -> ProcessGroupError {
    ProcessGroupError::Mismatch {
        peer,
        collective,
        seq: 0,
        reason: format!("its tensor has {len} bytes, {whose} has {expected}"),
    }
}

fn all_reduce<P: ProcessGroup + ?Sized>(pg: &P, tensor: Tensor, op: ReduceOp) -> Prep<Tensor> {
    const NAME: &str = "all_reduce";
    let data = data(pg, NAME, &tensor)?;
    let element = element_of(pg, NAME, &tensor)?;
    let finish = one_tensor(pg, NAME, tensor);
    prepared(Op::AllReduce { data, element, op }, finish)
}

fn broadcast<P: ProcessGroup + ?Sized>(pg: &P, tensor: Tensor, root: usize) -> Prep<Tensor> {
    const NAME: &str = "broadcast";
    let data = data(pg, NAME, &tensor)?;
    let finish = one_tensor(pg, NAME, tensor);
    prepared(Op::Broadcast { data, root }, finish)
}

fn reduce<P: ProcessGroup + ?Sized>(
    pg: &P,
    tensor: Tensor,
    op: ReduceOp,
    root: usize,
) -> Prep<Tensor> {
    const NAME: &str = "reduce";
    check_root(NAME, root, pg.size())?;
    let data = data(pg, NAME, &tensor)?;
    let element = element_of(pg, NAME, &tensor)?;
    let on_root = pg.rank() == root;
    let finish = one_tensor(pg, NAME, tensor.clone());
    let op = Op::Reduce {
        data,
        element,
        op,
        root,
    };
    prepared(
        op,
        move |done| if on_root { finish(done) } else { Ok(tensor) },
    )
}

fn all_gather<P: ProcessGroup + ?Sized>(pg: &P, tensor: Tensor) -> Prep<Vec<Tensor>> {
    const NAME: &str = "all_gather";
    let input = data(pg, NAME, &tensor)?;
    let (backend, rank) = (pg.backend(), pg.rank());
    // Every rank's tensor has this one's shape (PyTorch's contract): no lengths to exchange.
    let op = Op::AllGather {
        input,
        lens: BlockLens::Equal,
    };
    prepared(op, move |done| {
        let Done::Buffers(blocks) = done else {
            return Err(wrong_result(backend, rank, NAME, &done));
        };
        blocks
            .into_iter()
            .enumerate()
            .map(|(peer, block)| {
                if block.len() != tensor.nbytes() {
                    return Err(size_mismatch(
                        NAME,
                        peer,
                        block.len(),
                        tensor.nbytes(),
                        "this rank's",
                    ));
                }
                with_storage(backend, rank, NAME, &tensor, block)
            })
            .collect()
    })
}

fn all_gather_into<P: ProcessGroup + ?Sized>(
    pg: &P,
    output: Tensor,
    input: Tensor,
) -> Prep<Tensor> {
    const NAME: &str = "all_gather_into_tensor";
    check_stacked(NAME, "output", &output, &input, pg.size())?;
    let data = data(pg, NAME, &input)?;
    self::data(pg, NAME, &output)?;
    let (backend, rank) = (pg.backend(), pg.rank());
    let op = Op::AllGather {
        input: data,
        lens: BlockLens::Equal,
    };
    prepared(op, move |done| {
        let Done::Buffers(blocks) = done else {
            return Err(wrong_result(backend, rank, NAME, &done));
        };
        let mut out = Vec::with_capacity(output.nbytes());
        for (peer, block) in blocks.iter().enumerate() {
            if block.len() != input.nbytes() {
                return Err(size_mismatch(
                    NAME,
                    peer,
                    block.len(),
                    input.nbytes(),
                    "this rank's",
                ));
            }
            match block {
                Storage::Host(b) => out.extend_from_slice(b),
                Storage::Device(_) => {
                    return Err(ProcessGroupError::Unsupported {
                        collective: NAME,
                        backend,
                    })
                }
            }
        }
        with_storage(backend, rank, NAME, &output, Storage::Host(out.into()))
    })
}

fn reduce_scatter<P: ProcessGroup + ?Sized>(
    pg: &P,
    output: Tensor,
    input: Tensor,
    op: ReduceOp,
) -> Prep<Tensor> {
    const NAME: &str = "reduce_scatter_tensor";
    check_stacked(NAME, "input", &input, &output, pg.size())?;
    let data = data(pg, NAME, &input)?;
    self::data(pg, NAME, &output)?;
    let element = element_of(pg, NAME, &input)?;
    let count = output.nbytes() / element.size();
    let op = Op::ReduceScatter {
        input: data,
        counts: vec![count; pg.size()],
        element,
        op,
    };
    prepared(op, one_tensor(pg, NAME, output))
}

fn gather<P: ProcessGroup + ?Sized>(
    pg: &P,
    input: Tensor,
    gather_list: Option<Vec<Tensor>>,
    root: usize,
) -> Prep<Option<Vec<Tensor>>> {
    const NAME: &str = "gather";
    check_root(NAME, root, pg.size())?;
    check_list(
        NAME,
        "gather_list",
        gather_list.as_deref(),
        &input,
        root,
        pg,
    )?;
    let data = data(pg, NAME, &input)?;
    let (backend, rank) = (pg.backend(), pg.rank());
    prepared(Op::Gather { input: data, root }, move |done| {
        let blocks = match done {
            Done::Gathered(blocks) => blocks,
            other => return Err(wrong_result(backend, rank, NAME, &other)),
        };
        let (Some(mut list), Some(blocks)) = (gather_list, blocks) else {
            return Ok(None);
        };
        for (peer, (slot, block)) in list.iter_mut().zip(blocks).enumerate() {
            if block.len() != input.nbytes() {
                return Err(size_mismatch(
                    NAME,
                    peer,
                    block.len(),
                    input.nbytes(),
                    "the root's",
                ));
            }
            *slot = with_storage(backend, rank, NAME, slot, block)?;
        }
        Ok(Some(list))
    })
}

fn scatter<P: ProcessGroup + ?Sized>(
    pg: &P,
    output: Tensor,
    scatter_list: Option<Vec<Tensor>>,
    root: usize,
) -> Prep<Tensor> {
    const NAME: &str = "scatter";
    check_root(NAME, root, pg.size())?;
    check_list(
        NAME,
        "scatter_list",
        scatter_list.as_deref(),
        &output,
        root,
        pg,
    )?;
    data(pg, NAME, &output)?;
    let blocks = scatter_list
        .iter()
        .flatten()
        .map(|t| host_bytes(pg, NAME, t))
        .collect::<Result<Vec<_>, _>>()?;
    let (backend, rank) = (pg.backend(), pg.rank());
    prepared(Op::Scatter { blocks, root }, move |done| {
        let Done::Buffer(mine) = done else {
            return Err(wrong_result(backend, rank, NAME, &done));
        };
        if mine.len() != output.nbytes() {
            return Err(ProcessGroupError::Mismatch {
                peer: root,
                collective: NAME,
                seq: 0,
                reason: format!(
                    "its tensor for this rank has {} bytes, the output {}",
                    mine.len(),
                    output.nbytes()
                ),
            });
        }
        with_storage(backend, rank, NAME, &output, mine)
    })
}

fn all_to_all_single<P: ProcessGroup + ?Sized>(
    pg: &P,
    output: Tensor,
    input: Tensor,
    output_split_sizes: Option<&[usize]>,
    input_split_sizes: Option<&[usize]>,
) -> Prep<Tensor> {
    const NAME: &str = "all_to_all_single";
    let world = pg.size();
    let arguments = |source| ProcessGroupError::Arguments {
        collective: NAME,
        source,
    };
    if output.dtype() != input.dtype() {
        return Err(arguments(CollectiveError::TensorType {
            tensor: "output",
            expected: format!("{:?}", input.dtype()),
            actual: format!("{:?}", output.dtype()),
        }));
    }
    let (Some((&out_rows, out_rest)), Some((&in_rows, in_rest))) =
        (output.shape().split_first(), input.shape().split_first())
    else {
        return Err(arguments(CollectiveError::TensorSize {
            tensor: if output.shape().is_empty() {
                "output"
            } else {
                "input"
            },
            expected: vec![world],
            actual: Vec::new(),
        }));
    };
    if out_rest != in_rest {
        let mut expected = vec![out_rows];
        expected.extend_from_slice(in_rest);
        return Err(arguments(CollectiveError::TensorSize {
            tensor: "output",
            expected,
            actual: output.shape().to_vec(),
        }));
    }
    let row = in_rest.iter().product::<usize>() * input.dtype().size();
    let splits = |given: Option<&[usize]>, rows: usize| match given {
        Some(s) => {
            check_count(NAME, s.len(), world)?;
            let sum = s.iter().try_fold(0usize, |a, x| a.checked_add(*x));
            if sum != Some(rows) {
                return Err(arguments(CollectiveError::SplitsSum {
                    sum: sum.unwrap_or(usize::MAX),
                    actual: rows,
                }));
            }
            Ok(s.iter().map(|x| x * row).collect::<Vec<_>>())
        }
        None if rows % world == 0 => Ok(vec![rows / world * row; world]),
        None => Err(arguments(CollectiveError::SplitsSum {
            sum: rows / world * world,
            actual: rows,
        })),
    };
    let output_splits = splits(output_split_sizes, out_rows)?;
    let input_splits = splits(input_split_sizes, in_rows)?;
    let data = data(pg, NAME, &input)?;
    self::data(pg, NAME, &output)?;
    let op = Op::AllToAllSingle {
        input: data,
        input_splits,
        output_splits,
    };
    prepared(op, one_tensor(pg, NAME, output))
}

fn all_to_all<P: ProcessGroup + ?Sized>(
    pg: &P,
    outputs: Vec<Tensor>,
    inputs: Vec<Tensor>,
) -> Prep<Vec<Tensor>> {
    const NAME: &str = "all_to_all";
    let world = pg.size();
    check_count(NAME, inputs.len(), world)?;
    check_count(NAME, outputs.len(), world)?;
    let dtype = inputs[0].dtype();
    for (name, list) in [
        ("input_tensor_list", &inputs),
        ("output_tensor_list", &outputs),
    ] {
        if let Some(t) = list.iter().find(|t| t.dtype() != dtype) {
            return Err(ProcessGroupError::Arguments {
                collective: NAME,
                source: CollectiveError::TensorType {
                    tensor: name,
                    expected: format!("{dtype:?}"),
                    actual: format!("{:?}", t.dtype()),
                },
            });
        }
    }
    let blocks = inputs
        .iter()
        .map(|t| host_bytes(pg, NAME, t))
        .collect::<Result<Vec<_>, _>>()?;
    let mut output_lens = Vec::with_capacity(world);
    for t in &outputs {
        data(pg, NAME, t)?;
        output_lens.push(t.nbytes());
    }
    let (backend, rank) = (pg.backend(), pg.rank());
    let op = Op::AllToAll {
        inputs: blocks,
        output_lens,
    };
    prepared(op, move |done| {
        let Done::Buffers(received) = done else {
            return Err(wrong_result(backend, rank, NAME, &done));
        };
        outputs
            .iter()
            .zip(received)
            .map(|(slot, block)| with_storage(backend, rank, NAME, slot, block))
            .collect()
    })
}

fn send<P: ProcessGroup + ?Sized>(pg: &P, tensor: Tensor, dst: usize, tag: u32) -> Prep<()> {
    let data = data(pg, "send", &tensor)?;
    let (backend, rank) = (pg.backend(), pg.rank());
    prepared(Op::Send { data, dst, tag }, move |done| match done {
        Done::Unit => Ok(()),
        other => Err(wrong_result(backend, rank, "send", &other)),
    })
}

/// `tensor` with a message from `src` as its contents, or a [`ProcessGroupError::Mismatch`]
/// naming `src` when the message is not `tensor`'s length.
fn received_into(
    backend: &'static str,
    rank: usize,
    tensor: &Tensor,
    src: usize,
    message: Storage,
) -> Result<Tensor, ProcessGroupError> {
    if message.len() != tensor.nbytes() {
        return Err(ProcessGroupError::Mismatch {
            peer: src,
            collective: "recv",
            seq: 0,
            reason: format!(
                "its message has {} bytes, this rank's tensor {}",
                message.len(),
                tensor.nbytes()
            ),
        });
    }
    with_storage(backend, rank, "recv", tensor, message)
}

fn recv<P: ProcessGroup + ?Sized>(pg: &P, tensor: Tensor, src: usize, tag: u32) -> Prep<Tensor> {
    data(pg, "recv", &tensor)?;
    let (backend, rank) = (pg.backend(), pg.rank());
    prepared(Op::Recv { src, tag }, move |done| match done {
        Done::Buffer(message) => received_into(backend, rank, &tensor, src, message),
        other => Err(wrong_result(backend, rank, "recv", &other)),
    })
}

fn recv_any<P: ProcessGroup + ?Sized>(pg: &P, tensor: Tensor, tag: u32) -> Prep<(usize, Tensor)> {
    data(pg, "recv", &tensor)?;
    let (backend, rank) = (pg.backend(), pg.rank());
    prepared(Op::RecvAny { tag }, move |done| match done {
        Done::Received { src, data } => {
            Ok((src, received_into(backend, rank, &tensor, src, data)?))
        }
        other => Err(wrong_result(backend, rank, "recv", &other)),
    })
}
