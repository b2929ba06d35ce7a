//! The `ProcessGroup` port: collectives among a fixed set of ranks.
//!
//! A process group is `size()` ranks that run the same collectives in the same order. Each
//! collective works on bytes (tensors travel as their little-endian storage); typed helpers
//! live with the implementations.
//!
//! # Contract
//! - Every rank calls the same collectives, in the same order, with compatible arguments (the
//!   same root, the same element type and count, the same buffer length for `broadcast`).
//! - **Order means issue order.** A collective is *issued* when its future is first polled
//!   (an `async fn` does nothing before): that is when it checks its arguments and takes its
//!   place in the group's sequence, all its rounds at once. Several collectives may be in
//!   flight together (`tokio::join!`, which polls its futures in argument order, or
//!   futures polled one by one before any is awaited) as long as every rank first-polls them
//!   in the same order; spawning each on its own task leaves that order to the scheduler.
//!   A call refused for its own arguments takes no place in the sequence.
//! - Ranks that disagree (another collective, op, element type, count or root under the same
//!   place in the sequence) are told, never given garbage: the backend fails the collective
//!   with [`Disagreement`](ProcessGroupError::Disagreement) naming both sides.
//! - A collective either completes on this rank or fails with a [`ProcessGroupError`] that
//!   names the rank(s) it was waiting on: [`Timeout`](ProcessGroupError::Timeout) after the
//!   group's timeout, [`PeerDied`](ProcessGroupError::PeerDied) as soon as a peer's connection
//!   breaks. It never hangs.
//! - After a peer has died the group is broken: every later collective fails with the same
//!   error, naming the dead rank.
//!
//! # Tensors
//! The `*_tensor` collectives take a [`Tensor`] on the group's [`device`](ProcessGroup::device)
//! and return new tensors (tensors are immutable values here; PyTorch's in-place forms become
//! "returns the result"). Their default implementations serve host backends: they check the
//! device and run the byte collectives on the tensor's storage. A device backend (NCCL)
//! overrides them and works on device buffers; its byte collectives stage through its device.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::collective::{CollectiveError, ElementType, ReduceOp, Signature};
use crate::device::Device;
use crate::tensor::{Storage, Tensor};

pub mod owned;

/// Collectives among the ranks of a group.
#[async_trait]
pub trait ProcessGroup: Send + Sync {
    /// This process's rank, in `0..size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn size(&self) -> usize;

    /// Returns once every rank has entered the barrier.
    async fn barrier(&self) -> Result<(), ProcessGroupError>;

    /// Gathers one block of bytes from every rank (blocks may differ in length); the result
    /// holds them in rank order.
    async fn all_gather(&self, input: &[u8]) -> Result<Vec<Bytes>, ProcessGroupError>;

    /// Copies `root`'s `data` into `data` on every other rank; every rank passes a buffer of
    /// the same length.
    async fn broadcast(&self, data: &mut [u8], root: usize) -> Result<(), ProcessGroupError>;

    /// Sends `root`'s bytes to every rank when only the root knows how many there are: `data`
    /// is read on the root only (pass an empty slice elsewhere); every rank returns the root's
    /// bytes.
    ///
    /// The default runs two [`broadcast`](Self::broadcast)s, the length first, one after the
    /// other. A backend that lets several collectives be in flight at once overrides it so
    /// that both rounds are numbered when it is issued (see the contract above).
    async fn broadcast_bytes(&self, data: &[u8], root: usize) -> Result<Bytes, ProcessGroupError> {
        let mut len = (data.len() as u64).to_le_bytes();
        self.broadcast(&mut len, root).await?;
        let len = u64::from_le_bytes(len);
        let len = usize::try_from(len)
            .ok()
            .filter(|len| *len <= MAX_BROADCAST_BYTES)
            .ok_or_else(|| ProcessGroupError::Mismatch {
                peer: root,
                collective: "broadcast",
                seq: 0,
                reason: format!("it announced {len} bytes, more than {MAX_BROADCAST_BYTES}"),
            })?;
        let mut out = if self.rank() == root {
            data.to_vec()
        } else {
            vec![0u8; len]
        };
        self.broadcast(&mut out, root).await?;
        Ok(out.into())
    }

    /// Reduces `data` (little-endian elements of `element`) element-wise across all ranks
    /// with `op`; every rank ends with the same result, bit for bit.
    async fn all_reduce(
        &self,
        data: &mut [u8],
        element: ElementType,
        op: ReduceOp,
    ) -> Result<(), ProcessGroupError>;

    /// Reduces `data` (little-endian elements of `element`) element-wise across all ranks with
    /// `op` into `root`'s `data`. Other ranks' `data` is left as it was.
    ///
    /// The default runs [`all_reduce`](Self::all_reduce) on a copy everywhere but the root;
    /// backends override it with a tree that moves the data once.
    async fn reduce(
        &self,
        data: &mut [u8],
        element: ElementType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), ProcessGroupError> {
        check_root("reduce", root, self.size())?;
        if self.rank() == root {
            self.all_reduce(data, element, op).await
        } else {
            self.all_reduce(&mut data.to_vec(), element, op).await
        }
    }

    /// Reduces `input` element-wise across all ranks with `op` and returns this rank's chunk
    /// of the result: `input` is every rank's chunk in rank order, chunk i being `counts[i]`
    /// elements (chunks may differ in size; every rank passes the same `counts`). PyTorch's
    /// `reduce_scatter_tensor`; the implementations' typed helpers build the list form on it.
    ///
    /// The default runs [`all_reduce`](Self::all_reduce) on a copy and keeps this rank's chunk.
    async fn reduce_scatter(
        &self,
        input: &[u8],
        counts: &[usize],
        element: ElementType,
        op: ReduceOp,
    ) -> Result<Vec<u8>, ProcessGroupError> {
        let range = chunk_range("reduce_scatter", input.len(), counts, element, self)?;
        let mut data = input.to_vec();
        self.all_reduce(&mut data, element, op).await?;
        Ok(data[range].to_vec())
    }

    /// Gathers one block of bytes from every rank (blocks may differ in length) on `root`:
    /// `Some` of the blocks in rank order there, `None` on every other rank.
    ///
    /// The default runs [`all_gather`](Self::all_gather).
    async fn gather(
        &self,
        input: &[u8],
        root: usize,
    ) -> Result<Option<Vec<Bytes>>, ProcessGroupError> {
        check_root("gather", root, self.size())?;
        let blocks = self.all_gather(input).await?;
        Ok((self.rank() == root).then_some(blocks))
    }

    /// Sends block i of `root`'s `blocks` to rank i (blocks may differ in length) and returns
    /// this rank's block. `blocks` is read on the root only (pass an empty slice elsewhere);
    /// there it must hold one block per rank.
    ///
    /// The default broadcasts every block with [`broadcast_bytes`](Self::broadcast_bytes).
    async fn scatter(&self, blocks: &[Bytes], root: usize) -> Result<Bytes, ProcessGroupError> {
        check_root("scatter", root, self.size())?;
        let encoded = if self.rank() == root {
            check_count("scatter", blocks.len(), self.size())?;
            encode_blocks(blocks)
        } else {
            Vec::new()
        };
        let all = self.broadcast_bytes(&encoded, root).await?;
        decode_blocks(&all, self.size())
            .and_then(|mut blocks| blocks.get_mut(self.rank()).map(std::mem::take))
            .ok_or_else(|| ProcessGroupError::Mismatch {
                peer: root,
                collective: "scatter",
                seq: 0,
                reason: "its blocks do not decode".to_owned(),
            })
    }

    /// Sends `inputs[i]` to rank i and returns what every rank sent this one, in rank order;
    /// `output_lens[i]` is the length rank i sends here (blocks may differ in length; rank i's
    /// `inputs[r]` must be `output_lens[i]` bytes on rank r, or rank r fails with
    /// [`Mismatch`](ProcessGroupError::Mismatch) naming rank i).
    ///
    /// The default gathers every rank's blocks with [`all_gather`](Self::all_gather) and keeps
    /// its own column: correct, but it moves every block to every rank.
    async fn all_to_all(
        &self,
        inputs: &[Bytes],
        output_lens: &[usize],
    ) -> Result<Vec<Bytes>, ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        check_count("all_to_all", inputs.len(), world)?;
        check_count("all_to_all", output_lens.len(), world)?;
        let all = self.all_gather(&encode_blocks(inputs)).await?;
        let mut out = Vec::with_capacity(world);
        for (peer, encoded) in all.iter().enumerate() {
            let mismatch = |reason: String| ProcessGroupError::Mismatch {
                peer,
                collective: "all_to_all",
                seq: 0,
                reason,
            };
            let mut blocks = decode_blocks(encoded, world)
                .ok_or_else(|| mismatch("its blocks do not decode".to_owned()))?;
            let block = std::mem::take(&mut blocks[rank]);
            if block.len() != output_lens[peer] {
                return Err(mismatch(format!(
                    "it sent {} bytes, this rank expects {}",
                    block.len(),
                    output_lens[peer]
                )));
            }
            out.push(block);
        }
        Ok(out)
    }

    /// [`all_to_all`](Self::all_to_all) of one buffer: `input` split into blocks of
    /// `input_splits` bytes (one per rank, summing to its length) goes out, and the blocks
    /// received (`output_splits` bytes from each rank) come back concatenated in rank order.
    /// PyTorch's `all_to_all_single` with explicit splits.
    ///
    /// The default splits `input` and runs [`all_to_all`](Self::all_to_all).
    async fn all_to_all_single(
        &self,
        input: &[u8],
        input_splits: &[usize],
        output_splits: &[usize],
    ) -> Result<Vec<u8>, ProcessGroupError> {
        check_count("all_to_all", input_splits.len(), self.size())?;
        let sum = input_splits
            .iter()
            .try_fold(0usize, |acc, s| acc.checked_add(*s));
        if sum != Some(input.len()) {
            return Err(ProcessGroupError::Arguments {
                collective: "all_to_all",
                source: CollectiveError::SplitsSum {
                    sum: sum.unwrap_or(usize::MAX),
                    actual: input.len(),
                },
            });
        }
        let mut blocks = Vec::with_capacity(input_splits.len());
        let mut offset = 0;
        for len in input_splits {
            blocks.push(Bytes::copy_from_slice(&input[offset..offset + len]));
            offset += len;
        }
        let out = self.all_to_all(&blocks, output_splits).await?;
        Ok(out.concat())
    }

    /// Sends `data` to rank `dst` with `tag`; rank `dst` receives it with
    /// [`recv`](Self::recv)`(this rank, tag)`. Messages between two ranks with one tag are
    /// received in the order they were sent. Point-to-point messages take no place in the
    /// group's sequence of collectives. Returns once the message is handed to the transport.
    ///
    /// The default refuses with [`Unsupported`](ProcessGroupError::Unsupported).
    async fn send(&self, data: &[u8], dst: usize, tag: u32) -> Result<(), ProcessGroupError> {
        let _ = (data, dst, tag);
        Err(ProcessGroupError::Unsupported {
            collective: "send",
            backend: self.backend(),
        })
    }

    /// Receives the next message rank `src` sent here with `tag` (see [`send`](Self::send)),
    /// waiting up to the group's timeout.
    ///
    /// The default refuses with [`Unsupported`](ProcessGroupError::Unsupported).
    async fn recv(&self, src: usize, tag: u32) -> Result<Bytes, ProcessGroupError> {
        let _ = (src, tag);
        Err(ProcessGroupError::Unsupported {
            collective: "recv",
            backend: self.backend(),
        })
    }

    /// Receives the next message any other rank sent here with `tag` (PyTorch's `recv` with
    /// `src=None`, which gloo implements): returns the sender's rank and the bytes, waiting
    /// up to the group's timeout. The message taken is the one that arrives first; it counts
    /// as that sender's next message with `tag`, so a later [`recv`](Self::recv) from that
    /// sender gets the one after it.
    ///
    /// The default refuses with [`Unsupported`](ProcessGroupError::Unsupported).
    async fn recv_any(&self, tag: u32) -> Result<(usize, Bytes), ProcessGroupError> {
        let _ = tag;
        Err(ProcessGroupError::Unsupported {
            collective: "recv",
            backend: self.backend(),
        })
    }

    /// [`send`](Self::send) without waiting for it: returns a future of its result. A backend
    /// that can overlap point-to-point messages issues the send when this returns (numbering
    /// it, so that it keeps its place among this rank's messages to `dst` with `tag`) and
    /// carries it out whether or not the future is polled; the default sends when the
    /// future is first polled.
    fn isend(&self, data: Bytes, dst: usize, tag: u32) -> Pending<'_, ()> {
        Box::pin(async move { self.send(&data, dst, tag).await })
    }

    /// [`recv`](Self::recv) without waiting for it: returns a future of the bytes. A backend
    /// that can overlap point-to-point messages issues the receive when this returns (so it
    /// gets the message after those of the receives issued before it); the default receives
    /// when the future is first polled.
    fn irecv(&self, src: usize, tag: u32) -> Pending<'_, Bytes> {
        Box::pin(self.recv(src, tag))
    }

    /// A barrier that says who did not come: rank 0 waits up to `timeout` (the group's when
    /// `None`) for every other rank, then lets them all go. When some do not arrive in time,
    /// rank 0 fails with [`MonitoredBarrier`](ProcessGroupError::MonitoredBarrier) naming
    /// every one of them with `wait_all_ranks` (PyTorch's `wait_all_ranks=True`), else the
    /// first; the others fail with a timeout naming rank 0.
    ///
    /// The default refuses with [`Unsupported`](ProcessGroupError::Unsupported).
    async fn monitored_barrier(
        &self,
        timeout: Option<Duration>,
        wait_all_ranks: bool,
    ) -> Result<(), ProcessGroupError> {
        let _ = (timeout, wait_all_ranks);
        Err(ProcessGroupError::Unsupported {
            collective: "monitored_barrier",
            backend: self.backend(),
        })
    }

    /// A subgroup of the world ranks `ranks` (PyTorch's `new_group(ranks)`), on a group a
    /// user got as `dyn ProcessGroup` (from `new_group`): every rank of this group calls it
    /// with the same ranks, in the same order as its other `new_group` calls; the members get
    /// `Some`, the other ranks `None`.
    ///
    /// The default refuses with [`Unsupported`](ProcessGroupError::Unsupported).
    fn new_group(
        &self,
        ranks: &[usize],
    ) -> Result<Option<std::sync::Arc<dyn ProcessGroup>>, ProcessGroupError> {
        let _ = ranks;
        Err(ProcessGroupError::Unsupported {
            collective: "new_group",
            backend: self.backend(),
        })
    }

    /// The backend's name, for errors and logs (`"tensorwire"`, `"nccl"`).
    fn backend(&self) -> &'static str {
        "tensorwire"
    }

    /// The device the tensor collectives work on: `cpu` for host backends, `cuda:N` for NCCL.
    fn device(&self) -> Device {
        Device::Cpu
    }

    /// Reduces `tensor` element-wise across all ranks with `op`; returns the result (same
    /// dtype, shape and device). Host backends support every dtype (`f32`, `f64`, `f16`,
    /// `bf16`, `i32`, `i64`, `u8`, `i8`, `bool`) with the ops gloo allows on it
    /// ([`ReduceOp::supports`]).
    async fn all_reduce_tensor(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
    ) -> Result<Tensor, ProcessGroupError> {
        let bytes = host_storage(self.backend(), self.device(), "all_reduce", tensor)?;
        let element = ElementType::from_dtype(tensor.dtype()).ok_or_else(|| {
            ProcessGroupError::UnsupportedType {
                collective: "all_reduce",
                backend: self.backend(),
                dtype: format!("{:?}", tensor.dtype()),
            }
        })?;
        let mut data = bytes.to_vec();
        self.all_reduce(&mut data, element, op).await?;
        Ok(with_host_bytes(tensor, data))
    }

    /// Gathers `tensor` from every rank; the result holds one tensor per rank, in rank order.
    /// Every rank passes a tensor of the same dtype and shape.
    async fn all_gather_tensor(&self, tensor: &Tensor) -> Result<Vec<Tensor>, ProcessGroupError> {
        let bytes = host_storage(self.backend(), self.device(), "all_gather", tensor)?;
        let blocks = self.all_gather(bytes).await?;
        blocks
            .into_iter()
            .enumerate()
            .map(|(peer, block)| {
                if block.len() != tensor.nbytes() {
                    return Err(ProcessGroupError::Mismatch {
                        peer,
                        collective: "all_gather",
                        seq: 0,
                        reason: format!(
                            "its tensor has {} bytes, this rank's has {}",
                            block.len(),
                            tensor.nbytes()
                        ),
                    });
                }
                Ok(with_host_bytes(tensor, block))
            })
            .collect()
    }

    /// Gathers `input` from every rank into `output` (PyTorch's `all_gather_into_tensor`):
    /// the ranks' tensors concatenated along the first dimension, in rank order, so `output`
    /// must have `input`'s dtype and shape `[world * input.shape[0], input.shape[1..]]`
    /// (`[world]` for a scalar input); its contents are replaced.
    ///
    /// # Errors
    /// [`ProcessGroupError::Arguments`] with [`CollectiveError::TensorType`] or
    /// [`CollectiveError::TensorSize`] (gloo's "invalid tensor type / size"), before the call
    /// takes a place in the group's sequence; the errors of [`all_gather`](Self::all_gather).
    async fn all_gather_into_tensor(
        &self,
        output: &mut Tensor,
        input: &Tensor,
    ) -> Result<(), ProcessGroupError> {
        const NAME: &str = "all_gather_into_tensor";
        check_stacked(NAME, "output", output, input, self.size())?;
        let bytes = host_storage(self.backend(), self.device(), NAME, input)?;
        host_storage(self.backend(), self.device(), NAME, output)?;
        let blocks = self.all_gather(bytes).await?;
        let mut data = Vec::with_capacity(output.nbytes());
        for (peer, block) in blocks.iter().enumerate() {
            if block.len() != input.nbytes() {
                return Err(ProcessGroupError::Mismatch {
                    peer,
                    collective: NAME,
                    seq: 0,
                    reason: format!(
                        "its tensor has {} bytes, this rank's has {}",
                        block.len(),
                        input.nbytes()
                    ),
                });
            }
            data.extend_from_slice(block);
        }
        *output = with_host_bytes(output, data);
        Ok(())
    }

    /// Reduces `input` across all ranks with `op` and leaves this rank's chunk in `output`
    /// (PyTorch's `reduce_scatter_tensor`): `input` is every rank's chunk concatenated along
    /// the first dimension, so it must have `output`'s dtype and shape
    /// `[world * output.shape[0], output.shape[1..]]`; `output`'s contents are replaced.
    ///
    /// # Errors
    /// [`ProcessGroupError::Arguments`] with [`CollectiveError::TensorType`] or
    /// [`CollectiveError::TensorSize`] before the call takes a place in the sequence;
    /// [`ProcessGroupError::UnsupportedType`]; the errors of
    /// [`reduce_scatter`](Self::reduce_scatter).
    async fn reduce_scatter_tensor(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), ProcessGroupError> {
        const NAME: &str = "reduce_scatter_tensor";
        check_stacked(NAME, "input", input, output, self.size())?;
        let bytes = host_storage(self.backend(), self.device(), NAME, input)?;
        host_storage(self.backend(), self.device(), NAME, output)?;
        let element = ElementType::from_dtype(input.dtype()).ok_or_else(|| {
            ProcessGroupError::UnsupportedType {
                collective: NAME,
                backend: self.backend(),
                dtype: format!("{:?}", input.dtype()),
            }
        })?;
        let count = output.nbytes() / element.size();
        let chunk = self
            .reduce_scatter(bytes, &vec![count; self.size()], element, op)
            .await?;
        *output = with_host_bytes(output, chunk);
        Ok(())
    }

    /// Reduces `tensor` across all ranks with `op` into `root`'s `tensor` (PyTorch's
    /// `reduce(tensor, dst, op)`); other ranks' tensors are left as they were.
    ///
    /// # Errors
    /// [`ProcessGroupError::UnsupportedType`]; the errors of [`reduce`](Self::reduce).
    async fn reduce_tensor(
        &self,
        tensor: &mut Tensor,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), ProcessGroupError> {
        let bytes = host_storage(self.backend(), self.device(), "reduce", tensor)?;
        let element = ElementType::from_dtype(tensor.dtype()).ok_or_else(|| {
            ProcessGroupError::UnsupportedType {
                collective: "reduce",
                backend: self.backend(),
                dtype: format!("{:?}", tensor.dtype()),
            }
        })?;
        let mut data = bytes.to_vec();
        self.reduce(&mut data, element, op, root).await?;
        if self.rank() == root {
            *tensor = with_host_bytes(tensor, data);
        }
        Ok(())
    }

    /// Gathers `input` from every rank into `root`'s `gather_list` (PyTorch's
    /// `gather(tensor, gather_list, dst)`): there it must hold one tensor per rank of
    /// `input`'s dtype and shape, whose contents are replaced; elsewhere it must be `None`.
    ///
    /// # Errors
    /// [`ProcessGroupError::Arguments`] with [`CollectiveError::TensorList`],
    /// [`CollectiveError::LengthsCount`], [`CollectiveError::TensorType`] or
    /// [`CollectiveError::TensorSize`] before the call takes a place in the sequence; a
    /// [`ProcessGroupError::Mismatch`] when another rank's tensor has another size; the
    /// errors of [`gather`](Self::gather).
    async fn gather_tensor(
        &self,
        input: &Tensor,
        gather_list: Option<&mut [Tensor]>,
        root: usize,
    ) -> Result<(), ProcessGroupError> {
        const NAME: &str = "gather";
        check_root(NAME, root, self.size())?;
        check_list(
            NAME,
            "gather_list",
            gather_list.as_deref(),
            input,
            root,
            self,
        )?;
        let bytes = host_storage(self.backend(), self.device(), NAME, input)?;
        let blocks = self.gather(bytes, root).await?;
        if let (Some(list), Some(blocks)) = (gather_list, blocks) {
            for (peer, (slot, block)) in list.iter_mut().zip(blocks).enumerate() {
                if block.len() != input.nbytes() {
                    return Err(ProcessGroupError::Mismatch {
                        peer,
                        collective: NAME,
                        seq: 0,
                        reason: format!(
                            "its tensor has {} bytes, the root's has {}",
                            block.len(),
                            input.nbytes()
                        ),
                    });
                }
                *slot = with_host_bytes(slot, block);
            }
        }
        Ok(())
    }

    /// Scatters `root`'s `scatter_list` (one tensor per rank, each of `output`'s dtype and
    /// shape) so that rank i's `output` gets tensor i (PyTorch's
    /// `scatter(tensor, scatter_list, src)`); elsewhere `scatter_list` must be `None`.
    ///
    /// # Errors
    /// As [`gather_tensor`](Self::gather_tensor), with the errors of
    /// [`scatter`](Self::scatter).
    async fn scatter_tensor(
        &self,
        output: &mut Tensor,
        scatter_list: Option<&[Tensor]>,
        root: usize,
    ) -> Result<(), ProcessGroupError> {
        const NAME: &str = "scatter";
        check_root(NAME, root, self.size())?;
        check_list(NAME, "scatter_list", scatter_list, output, root, self)?;
        host_storage(self.backend(), self.device(), NAME, output)?;
        let blocks = match scatter_list {
            Some(list) => list
                .iter()
                .map(|t| {
                    host_storage(self.backend(), self.device(), NAME, t).map(Bytes::copy_from_slice)
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => Vec::new(),
        };
        let mine = self.scatter(&blocks, root).await?;
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
        *output = with_host_bytes(output, mine);
        Ok(())
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
    /// [`CollectiveError::SplitsSum`] before the call takes a place in the sequence; the
    /// errors of [`all_to_all`](Self::all_to_all).
    async fn all_to_all_single_tensor(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
    ) -> Result<(), ProcessGroupError> {
        const NAME: &str = "all_to_all_single";
        let world = self.size();
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
        let out_splits = splits(output_split_sizes, out_rows)?;
        let in_splits = splits(input_split_sizes, in_rows)?;
        let bytes = host_storage(self.backend(), self.device(), NAME, input)?;
        host_storage(self.backend(), self.device(), NAME, output)?;
        let data = self
            .all_to_all_single(bytes, &in_splits, &out_splits)
            .await?;
        *output = with_host_bytes(output, data);
        Ok(())
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
    /// size than `outputs` says; the errors of [`all_to_all`](Self::all_to_all).
    async fn all_to_all_tensor(
        &self,
        outputs: &mut [Tensor],
        inputs: &[Tensor],
    ) -> Result<(), ProcessGroupError> {
        const NAME: &str = "all_to_all";
        let world = self.size();
        check_count(NAME, inputs.len(), world)?;
        check_count(NAME, outputs.len(), world)?;
        let dtype = inputs[0].dtype();
        for (name, list) in [
            ("input_tensor_list", &*inputs),
            ("output_tensor_list", &*outputs),
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
        let mut blocks = Vec::with_capacity(world);
        for t in inputs {
            let bytes = host_storage(self.backend(), self.device(), NAME, t)?;
            blocks.push(Bytes::copy_from_slice(bytes));
        }
        let mut lens = Vec::with_capacity(world);
        for t in outputs.iter() {
            host_storage(self.backend(), self.device(), NAME, t)?;
            lens.push(t.nbytes());
        }
        let received = self.all_to_all(&blocks, &lens).await?;
        for (slot, block) in outputs.iter_mut().zip(received) {
            *slot = with_host_bytes(slot, block);
        }
        Ok(())
    }

    /// Returns `root`'s tensor on every rank; every rank passes a tensor of the same dtype and
    /// shape (its contents are ignored except on `root`).
    async fn broadcast_tensor(
        &self,
        tensor: &Tensor,
        root: usize,
    ) -> Result<Tensor, ProcessGroupError> {
        let bytes = host_storage(self.backend(), self.device(), "broadcast", tensor)?;
        let mut data = bytes.to_vec();
        self.broadcast(&mut data, root).await?;
        Ok(with_host_bytes(tensor, data))
    }

    /// Sends `tensor`'s storage to rank `dst` with `tag` (PyTorch's `send(tensor, dst, tag)`):
    /// [`send`](Self::send) of its bytes; rank `dst` receives it with
    /// [`recv_tensor`](Self::recv_tensor) into a tensor of the same dtype and shape.
    ///
    /// # Errors
    /// [`ProcessGroupError::WrongDevice`]; the errors of [`send`](Self::send).
    async fn send_tensor(
        &self,
        tensor: &Tensor,
        dst: usize,
        tag: u32,
    ) -> Result<(), ProcessGroupError> {
        let bytes = host_storage(self.backend(), self.device(), "send", tensor)?;
        self.send(bytes, dst, tag).await
    }

    /// Receives the next message rank `src` sent here with `tag` into `tensor` (PyTorch's
    /// `recv(tensor, src, tag)`): its contents are replaced, its dtype and shape kept.
    ///
    /// # Errors
    /// [`ProcessGroupError::WrongDevice`]; a [`ProcessGroupError::Mismatch`] naming `src`
    /// when the message has another length than `tensor` (the message is taken all the
    /// same); the errors of [`recv`](Self::recv).
    async fn recv_tensor(
        &self,
        tensor: &mut Tensor,
        src: usize,
        tag: u32,
    ) -> Result<(), ProcessGroupError> {
        host_storage(self.backend(), self.device(), "recv", tensor)?;
        let bytes = self.recv(src, tag).await?;
        *tensor = received_into(tensor, src, bytes)?;
        Ok(())
    }

    /// Receives the next message any other rank sent here with `tag` into `tensor`
    /// (PyTorch's `recv(tensor, src=None, tag)`, which gloo implements) and returns its
    /// sender; see [`recv_any`](Self::recv_any).
    ///
    /// # Errors
    /// As [`recv_tensor`](Self::recv_tensor), with the errors of [`recv_any`](Self::recv_any).
    async fn recv_any_tensor(
        &self,
        tensor: &mut Tensor,
        tag: u32,
    ) -> Result<usize, ProcessGroupError> {
        host_storage(self.backend(), self.device(), "recv", tensor)?;
        let (src, bytes) = self.recv_any(tag).await?;
        *tensor = received_into(tensor, src, bytes)?;
        Ok(src)
    }

    /// [`barrier`](Self::barrier) issued now (c10d's `async_op=True`): returns a
    /// [`WorkHandle`] to ask or wait on. **The call is the ordering point**: issue on every
    /// rank in the same order, as for the collectives themselves.
    ///
    /// The default polls the collective once here and then only when the handle is asked
    /// ([`is_completed`](WorkHandle::is_completed), [`error`](WorkHandle::error)) or waited
    /// on, and [`wait`](WorkHandle::wait) is bounded by the group's own timeout rather than
    /// its argument (a port has no timer). tensorwire's `Group` overrides it: the collective
    /// runs on a task of its own from this call on, and `wait`'s timeout makes it time out.
    ///
    /// Every `issue_*` checks its own arguments in the call, where c10d's gloo raises: a call
    /// refused for them returns a handle that has already finished with the error
    /// ([`is_completed`](WorkHandle::is_completed) true, [`error`](WorkHandle::error) `Some`,
    /// `wait` gives it) and took no place in the sequence. Each `issue_*` says which errors
    /// these are; what only the data of other ranks shows comes at `wait`.
    fn issue_barrier(&self) -> Box<dyn WorkHandle<'_, ()> + '_> {
        Box::new(LazyWork::new(Box::pin(async move { self.barrier().await })))
    }

    /// [`all_reduce_tensor`](Self::all_reduce_tensor) issued now; the handle gives the
    /// reduced tensor. See [`issue_barrier`](Self::issue_barrier).
    fn issue_all_reduce_tensor(
        &self,
        tensor: Tensor,
        op: ReduceOp,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            self.all_reduce_tensor(&tensor, op).await
        })))
    }

    /// [`broadcast_tensor`](Self::broadcast_tensor) issued now; the handle gives `root`'s
    /// tensor. See [`issue_barrier`](Self::issue_barrier).
    fn issue_broadcast_tensor(
        &self,
        tensor: Tensor,
        root: usize,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            self.broadcast_tensor(&tensor, root).await
        })))
    }

    /// [`all_gather_tensor`](Self::all_gather_tensor) issued now; the handle gives every
    /// rank's tensor in rank order. See [`issue_barrier`](Self::issue_barrier).
    fn issue_all_gather_tensor(&self, tensor: Tensor) -> Box<dyn WorkHandle<'_, Vec<Tensor>> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            self.all_gather_tensor(&tensor).await
        })))
    }

    /// [`reduce_tensor`](Self::reduce_tensor) issued now; the handle gives the reduced tensor
    /// on `root` and `tensor` unchanged on every other rank. See
    /// [`issue_barrier`](Self::issue_barrier).
    ///
    /// Checked at the call, as gloo raises there: a `root` out of range and a dtype the
    /// backend cannot reduce with `op` (the handle returned has already finished with
    /// [`ProcessGroupError::Arguments`] or [`ProcessGroupError::UnsupportedType`], and the
    /// call took no place in the sequence). What other ranks did wrong shows at `wait`.
    fn issue_reduce_tensor(
        &self,
        tensor: Tensor,
        op: ReduceOp,
        root: usize,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            owned::reduce_tensor(self, tensor, op, root).await
        })))
    }

    /// [`gather_tensor`](Self::gather_tensor) issued now; the handle gives `Some` of the
    /// filled `gather_list` on `root` (one tensor per rank, in rank order) and `None`
    /// elsewhere. See [`issue_barrier`](Self::issue_barrier).
    ///
    /// Checked at the call, as gloo raises there: a `root` out of range, a list given on
    /// another rank or missing on the root, of another length than the world, or holding a
    /// tensor of another dtype or shape than `input`. Another rank's tensor of another size
    /// shows at `wait`, as a [`ProcessGroupError::Mismatch`] on the root.
    fn issue_gather_tensor(
        &self,
        input: Tensor,
        gather_list: Option<Vec<Tensor>>,
        root: usize,
    ) -> Box<dyn WorkHandle<'_, Option<Vec<Tensor>>> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            owned::gather_tensor(self, input, gather_list, root).await
        })))
    }

    /// [`scatter_tensor`](Self::scatter_tensor) issued now; the handle gives this rank's
    /// tensor of `root`'s `scatter_list` (in `output`'s dtype and shape). See
    /// [`issue_barrier`](Self::issue_barrier).
    ///
    /// Checked at the call, as gloo raises there: as
    /// [`issue_gather_tensor`](Self::issue_gather_tensor), for `scatter_list` against
    /// `output`. A root's tensor for this rank of another size than `output` shows at `wait`,
    /// as a [`ProcessGroupError::Mismatch`] naming the root.
    fn issue_scatter_tensor(
        &self,
        output: Tensor,
        scatter_list: Option<Vec<Tensor>>,
        root: usize,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            owned::scatter_tensor(self, output, scatter_list, root).await
        })))
    }

    /// [`all_to_all_single_tensor`](Self::all_to_all_single_tensor) issued now; the handle
    /// gives `output` filled with the rows received, in rank order. See
    /// [`issue_barrier`](Self::issue_barrier).
    ///
    /// Checked at the call, as gloo raises there: dtypes that differ, split sizes that are not
    /// one per rank or do not sum to the tensors' first dimensions, and (without splits) a
    /// first dimension the world size does not divide. A peer that sends this rank another
    /// number of rows than `output_split_sizes` says shows at `wait`, as a
    /// [`ProcessGroupError::Mismatch`] naming it.
    fn issue_all_to_all_single_tensor(
        &self,
        output: Tensor,
        input: Tensor,
        output_split_sizes: Option<Vec<usize>>,
        input_split_sizes: Option<Vec<usize>>,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            owned::all_to_all_single_tensor(
                self,
                output,
                input,
                output_split_sizes,
                input_split_sizes,
            )
            .await
        })))
    }

    /// [`all_to_all_tensor`](Self::all_to_all_tensor) issued now; the handle gives `outputs`
    /// with `outputs[i]` replaced by what rank i sent this rank. See
    /// [`issue_barrier`](Self::issue_barrier).
    ///
    /// Checked at the call, as gloo raises there: lists that do not hold one tensor per rank,
    /// tensors of more than one dtype. gloo also raises at the call for tensors of different
    /// sizes, which are allowed here; a peer whose tensor for this rank has another size than
    /// `outputs` says shows at `wait`, as a [`ProcessGroupError::Mismatch`] naming it.
    fn issue_all_to_all_tensor(
        &self,
        outputs: Vec<Tensor>,
        inputs: Vec<Tensor>,
    ) -> Box<dyn WorkHandle<'_, Vec<Tensor>> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            owned::all_to_all_tensor(self, outputs, inputs).await
        })))
    }

    /// [`all_gather_into_tensor`](Self::all_gather_into_tensor) issued now; the handle gives
    /// `output` filled with every rank's `input`, concatenated in rank order. See
    /// [`issue_barrier`](Self::issue_barrier).
    ///
    /// Checked at the call, as gloo raises there: an `output` of another dtype than `input`,
    /// or not of shape `[world * input.shape[0], input.shape[1..]]`. Another rank's input of
    /// another size shows at `wait`.
    fn issue_all_gather_into_tensor(
        &self,
        output: Tensor,
        input: Tensor,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            owned::all_gather_into_tensor(self, output, input).await
        })))
    }

    /// [`reduce_scatter_tensor`](Self::reduce_scatter_tensor) issued now; the handle gives
    /// `output` holding this rank's chunk of the reduction. See
    /// [`issue_barrier`](Self::issue_barrier).
    ///
    /// Checked at the call, as gloo raises there: an `input` of another dtype than `output`,
    /// or not of shape `[world * output.shape[0], output.shape[1..]]`, and a dtype the
    /// backend cannot reduce with `op`. Another rank's input of another size shows at `wait`.
    fn issue_reduce_scatter_tensor(
        &self,
        output: Tensor,
        input: Tensor,
        op: ReduceOp,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            owned::reduce_scatter_tensor(self, output, input, op).await
        })))
    }

    /// [`send_tensor`](Self::send_tensor) issued now (c10d's `isend(tensor, dst, tag)`):
    /// the message is numbered in this call, so it keeps its place among this rank's
    /// messages to `dst` with `tag`. See [`issue_barrier`](Self::issue_barrier).
    ///
    /// Checked at the call, as gloo raises there: a `dst` out of range or this rank, and a
    /// tensor on another device than the group's.
    fn issue_send_tensor(
        &self,
        tensor: Tensor,
        dst: usize,
        tag: u32,
    ) -> Box<dyn WorkHandle<'_, ()> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            self.send_tensor(&tensor, dst, tag).await
        })))
    }

    /// [`recv_tensor`](Self::recv_tensor) issued now (c10d's `irecv(tensor, src, tag)`): the
    /// receive is numbered in this call, so it gets the message after those of the receives
    /// from `src` with `tag` issued before it; the handle gives `tensor` with the message as
    /// its contents. See [`issue_barrier`](Self::issue_barrier).
    ///
    /// Checked at the call, as gloo raises there: a `src` out of range or this rank, and a
    /// tensor on another device than the group's. A message of another length than `tensor`
    /// shows at `wait`, as a [`ProcessGroupError::Mismatch`] naming `src`.
    fn issue_recv_tensor(
        &self,
        tensor: Tensor,
        src: usize,
        tag: u32,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            owned::recv_tensor(self, tensor, src, tag).await
        })))
    }

    /// [`recv_any_tensor`](Self::recv_any_tensor) issued now (c10d's `irecv(tensor,
    /// src=None, tag)`, whose `Work.source_rank()` is the sender): the handle gives the
    /// sender and `tensor` with the message as its contents. Which message it takes is decided
    /// when one arrives, not in this call (see [`recv_any`](Self::recv_any)). See
    /// [`issue_barrier`](Self::issue_barrier).
    ///
    /// Checked at the call: a tensor on another device than the group's, and a group of one
    /// rank (no other rank could send).
    fn issue_recv_any_tensor(
        &self,
        tensor: Tensor,
        tag: u32,
    ) -> Box<dyn WorkHandle<'_, (usize, Tensor)> + '_> {
        Box::new(LazyWork::new(Box::pin(async move {
            owned::recv_any_tensor(self, tensor, tag).await
        })))
    }

    /// Leaves the group cleanly: peers learn that this rank shut down (rather than died) and
    /// later collectives here fail with [`ProcessGroupError::ShutDown`]. Call it before the
    /// process exits, or peers still running a collective may see this rank as dead. The
    /// default does nothing.
    async fn shutdown(&self) {}
}

mod checks;
use checks::{check_count, check_root, chunk_range, decode_blocks, encode_blocks};

/// A point-to-point operation in progress ([`ProcessGroup::isend`], [`ProcessGroup::irecv`]):
/// await it for the result (PyTorch's `Work.wait()`).
pub type Pending<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, ProcessGroupError>> + Send + 'a>>;

/// A collective issued on a [`ProcessGroup`] and completed later (c10d's `Work`, as the
/// `async_op=True` collectives return it): `issue_*` returns one.
///
/// | c10d's `Work` | here |
/// | --- | --- |
/// | `is_completed()` | [`is_completed`](Self::is_completed) |
/// | `exception()` | [`error`](Self::error) |
/// | `is_success()` | `is_completed() && error().is_none()` |
/// | `wait(timeout)`, then `result()` | [`wait`](Self::wait), which gives the result |
pub trait WorkHandle<'a, T>: Send + 'a {
    /// Whether the collective has finished, successfully or not, without waiting.
    fn is_completed(&mut self) -> bool;

    /// The collective's error, once it has finished with one (`None` while it runs or after
    /// it succeeded).
    fn error(&mut self) -> Option<ProcessGroupError>;

    /// Waits for the result, at most `timeout` where the backend has a timer (see
    /// [`ProcessGroup::issue_barrier`]): when it passes first, the collective times out with
    /// [`ProcessGroupError::Timeout`] naming the ranks it waited for.
    fn wait(self: Box<Self>, timeout: Duration) -> Pending<'a, T>;
}

/// The default [`WorkHandle`]: the collective's future, polled when the handle is issued,
/// asked or waited on.
struct LazyWork<'a, T> {
    future: Option<Pending<'a, T>>,
    done: Option<Result<T, ProcessGroupError>>,
}

impl<'a, T: Send + 'a> LazyWork<'a, T> {
    /// Issues `future`: its first poll (where a collective takes its place) happens here.
    fn new(future: Pending<'a, T>) -> Self {
        let mut work = LazyWork {
            future: Some(future),
            done: None,
        };
        work.poll_once();
        work
    }

    fn poll_once(&mut self) {
        if let Some(future) = self.future.as_mut() {
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if let std::task::Poll::Ready(result) = future.as_mut().poll(&mut cx) {
                self.done = Some(result);
                self.future = None;
            }
        }
    }
}

impl<'a, T: Send + 'a> WorkHandle<'a, T> for LazyWork<'a, T> {
    fn is_completed(&mut self) -> bool {
        self.poll_once();
        self.done.is_some()
    }

    fn error(&mut self) -> Option<ProcessGroupError> {
        self.poll_once();
        self.done.as_ref().and_then(|r| r.as_ref().err().cloned())
    }

    fn wait(self: Box<Self>, _timeout: Duration) -> Pending<'a, T> {
        let LazyWork { future, done } = *self;
        Box::pin(async move {
            match (done, future) {
                (Some(result), _) => result,
                (None, Some(future)) => future.await,
                (None, None) => Err(ProcessGroupError::ShutDown),
            }
        })
    }
}

/// The most bytes [`ProcessGroup::broadcast_bytes`] accepts from a root (1 GiB, the
/// transports' default frame limit); a larger announced length is refused before anything is
/// allocated for it.
pub const MAX_BROADCAST_BYTES: usize = 1 << 30;

use checks::{check_stacked, host_storage};

use checks::{check_list, received_into, with_host_bytes};

mod error;
pub use error::{MeshViolation, ProcessGroupError};

#[cfg(test)]
mod tests;
