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

    /// The backend's name, for errors and logs (`"tensorwire"`, `"nccl"`).
    fn backend(&self) -> &'static str {
        "tensorwire"
    }

    /// The device the tensor collectives work on: `cpu` for host backends, `cuda:N` for NCCL.
    fn device(&self) -> Device {
        Device::Cpu
    }

    /// Reduces `tensor` element-wise across all ranks with `op`; returns the result (same
    /// dtype, shape and device). Host backends support `f32`, `f64`, `i32` and `i64`.
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

    /// Leaves the group cleanly: peers learn that this rank shut down (rather than died) and
    /// later collectives here fail with [`ProcessGroupError::ShutDown`]. Call it before the
    /// process exits, or peers still running a collective may see this rank as dead. The
    /// default does nothing.
    async fn shutdown(&self) {}
}

/// The most bytes [`ProcessGroup::broadcast_bytes`] accepts from a root (1 GiB, the
/// transports' default frame limit); a larger announced length is refused before anything is
/// allocated for it.
pub const MAX_BROADCAST_BYTES: usize = 1 << 30;

/// The host bytes of `tensor`, or the error for a tensor that is not on the group's device.
fn host_storage<'t>(
    backend: &'static str,
    group: Device,
    collective: &'static str,
    tensor: &'t Tensor,
) -> Result<&'t [u8], ProcessGroupError> {
    match tensor.storage() {
        Storage::Host(bytes) if group == Device::Cpu => Ok(bytes),
        _ => Err(ProcessGroupError::WrongDevice {
            collective,
            backend,
            tensor: tensor.device(),
            group,
        }),
    }
}

/// `tensor`'s dtype and shape with `data` (of the same length) as host storage.
fn with_host_bytes(tensor: &Tensor, data: impl Into<Bytes>) -> Tensor {
    tensor
        .with_storage(Storage::Host(data.into()))
        .expect("a collective keeps the byte length")
}

/// Why a collective (or setting up a group) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessGroupError {
    /// The collective did not complete within the group's timeout.
    #[error(
        "{collective} #{seq} on rank {rank} timed out after {timeout:?} waiting for rank(s) {}",
        RankList(.waiting_on)
    )]
    Timeout {
        /// The collective (`"barrier"`, `"all_gather"`, ...).
        collective: &'static str,
        /// Its sequence number in the group.
        seq: u64,
        /// This rank.
        rank: usize,
        /// The ranks whose messages had not arrived (or that had not taken ours).
        waiting_on: Vec<usize>,
        /// The timeout.
        timeout: Duration,
    },
    /// A peer's connection broke without a clean shutdown: the process died or the network
    /// failed. The group cannot be used any more.
    #[error("rank {rank} died{}: {reason}", reported_by.map(|r| format!(" (reported by rank {r})")).unwrap_or_default())]
    PeerDied {
        /// The rank that died.
        rank: usize,
        /// Another rank that saw it die and told us, if we did not see it ourselves.
        reported_by: Option<usize>,
        /// What was seen (the transport error).
        reason: String,
    },
    /// A peer shut its group down cleanly while this rank still expected messages from it.
    #[error("rank {rank} left the group (shut down) while {collective} #{seq} still expected a message from it")]
    PeerLeft {
        /// The rank that left.
        rank: usize,
        /// The collective that needed it.
        collective: &'static str,
        /// Its sequence number.
        seq: u64,
    },
    /// Ranks disagree about the collective: a message's kind or length does not match.
    #[error("rank {peer} disagrees about {collective} #{seq}: {reason}")]
    Mismatch {
        /// The peer whose message did not fit.
        peer: usize,
        /// The collective this rank is running.
        collective: &'static str,
        /// Its sequence number.
        seq: u64,
        /// What did not match.
        reason: String,
    },
    /// Ranks ran different collectives, or one collective with different arguments (op,
    /// element type, element count, root), under the same sequence number. The rank that saw
    /// it breaks the group and tells every other rank, whose group breaks with this error too:
    /// a rank fails at once if it still waits in that collective, else at the latest in its
    /// next collective that needs a message from the rank that saw it (every barrier,
    /// all_gather and all_reduce does; a broadcast needs only its root's).
    #[error("rank {peer} ran {theirs} as collective #{seq}, {}", Side::new(*.rank, .ours, *.here))]
    Disagreement {
        /// The collective's sequence number.
        seq: u64,
        /// The rank whose message disagreed.
        peer: usize,
        /// What it ran.
        theirs: Signature,
        /// The rank that received the message and saw the disagreement.
        rank: usize,
        /// What that rank ran.
        ours: Signature,
        /// Whether this error arose on this rank (else `rank` reported it).
        here: bool,
    },
    /// The arguments are invalid (rank out of range, buffer not whole elements, ...).
    #[error("invalid {collective} arguments: {source}")]
    Arguments {
        /// The collective.
        collective: &'static str,
        /// What was wrong.
        #[source]
        source: CollectiveError,
    },
    /// Sending to a peer failed.
    #[error("sending to rank {rank} failed: {reason}")]
    Send {
        /// The peer.
        rank: usize,
        /// The transport error.
        reason: String,
    },
    /// A tensor is not on the device the group works on.
    #[error("{collective}: the tensor is on {tensor}, but this {backend} group works on {group} tensors{}", if *.group == Device::Cpu { " (use an nccl group for CUDA tensors)" } else { "" })]
    WrongDevice {
        /// The collective.
        collective: &'static str,
        /// The group's backend.
        backend: &'static str,
        /// Where the tensor is.
        tensor: Device,
        /// Where the group works.
        group: Device,
    },
    /// The backend cannot run the collective on tensors of this dtype.
    #[error("{collective}: the {backend} backend does not support {dtype} tensors")]
    UnsupportedType {
        /// The collective.
        collective: &'static str,
        /// The group's backend.
        backend: &'static str,
        /// The tensor's dtype.
        dtype: String,
    },
    /// The backend's library reported an error (NCCL); the group cannot be used any more.
    #[error("{backend} {collective} #{seq} on rank {rank} failed: {reason}")]
    Backend {
        /// The group's backend.
        backend: &'static str,
        /// The collective.
        collective: &'static str,
        /// Its sequence number in the group.
        seq: u64,
        /// This rank.
        rank: usize,
        /// The library's message.
        reason: String,
    },
    /// Setting up the group failed (rendezvous, store, connections).
    #[error("process group setup on rank {rank}: {reason}")]
    Setup {
        /// This rank.
        rank: usize,
        /// What failed.
        reason: String,
    },
    /// The group was shut down on this rank.
    #[error("the process group was shut down")]
    ShutDown,
    /// Encoding or decoding an object (`all_gather_object`) failed.
    #[error("object from rank {rank} could not be {op}: {reason}")]
    Object {
        /// The rank whose object it is.
        rank: usize,
        /// `"encoded"` or `"decoded"`.
        op: &'static str,
        /// The serde error.
        reason: String,
    },
}

/// The receiving side of a [`ProcessGroupError::Disagreement`].
struct Side<'a> {
    rank: usize,
    ours: &'a Signature,
    here: bool,
}

impl<'a> Side<'a> {
    fn new(rank: usize, ours: &'a Signature, here: bool) -> Self {
        Side { rank, ours, here }
    }
}

impl std::fmt::Display for Side<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Side { rank, ours, here } = self;
        if *here {
            write!(f, "this rank ({rank}) {ours}")
        } else {
            write!(f, "rank {rank} {ours} (reported by rank {rank})")
        }
    }
}

/// Displays ranks as `1, 3`, or says that they are unknown.
struct RankList<'a>(&'a [usize]);

impl std::fmt::Display for RankList<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(unknown: the backend does not say which)");
        }
        for (i, rank) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{rank}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_ranks() {
        let e = ProcessGroupError::Timeout {
            collective: "barrier",
            seq: 3,
            rank: 0,
            waiting_on: vec![2, 5],
            timeout: Duration::from_secs(1),
        };
        assert_eq!(
            e.to_string(),
            "barrier #3 on rank 0 timed out after 1s waiting for rank(s) 2, 5"
        );
        let e = ProcessGroupError::PeerDied {
            rank: 2,
            reported_by: Some(1),
            reason: "connection reset".into(),
        };
        assert_eq!(
            e.to_string(),
            "rank 2 died (reported by rank 1): connection reset"
        );
        let e = ProcessGroupError::PeerDied {
            rank: 4,
            reported_by: None,
            reason: "closed".into(),
        };
        assert_eq!(e.to_string(), "rank 4 died: closed");
    }

    #[test]
    fn disagreements_name_both_sides() {
        let e = ProcessGroupError::Disagreement {
            seq: 7,
            peer: 1,
            theirs: Signature::AllReduce {
                op: ReduceOp::Sum,
                element: ElementType::I64,
                count: 1,
            },
            rank: 0,
            ours: Signature::AllReduce {
                op: ReduceOp::Sum,
                element: ElementType::F32,
                count: 2,
            },
            here: true,
        };
        assert_eq!(
            e.to_string(),
            "rank 1 ran all_reduce(sum, i64 x1) as collective #7, this rank (0) all_reduce(sum, f32 x2)"
        );
        let mut reported = e.clone();
        if let ProcessGroupError::Disagreement { here, .. } = &mut reported {
            *here = false;
        }
        assert_eq!(
            reported.to_string(),
            "rank 1 ran all_reduce(sum, i64 x1) as collective #7, rank 0 all_reduce(sum, f32 x2) (reported by rank 0)"
        );
    }

    #[test]
    fn the_trait_is_object_safe() {
        fn takes(_: Option<&dyn ProcessGroup>) {}
        takes(None);
    }
}
