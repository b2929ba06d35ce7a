//! The `ProcessGroup` port: collectives among a fixed set of ranks.
//!
//! A process group is `size()` ranks that run the same collectives in the same order. The
//! port is small: a backend implements [`ProcessGroup::start`], which runs one [`Op`] (a
//! collective or a point-to-point message, with its arguments and data) and returns its
//! [work handle](WorkHandle). Every form users call is an extension method built on it,
//! for every `ProcessGroup` alike:
//! - [`Collectives`]: the byte collectives, awaited (`all_reduce(&mut bytes, ..)`), and
//!   `isend`/`irecv`;
//! - [`TensorCollectives`]: the tensor collectives, awaited (`all_reduce_tensor`) or issued
//!   as c10d's `async_op=True` (`issue_all_reduce_tensor`, a handle);
//! - `tensorwire-process-group`'s `CollectivesExt`: slices of numbers and serde objects.
//!
//! A new collective is a schedule in [`collective`](crate::collective), an [`Op`] variant
//! (with its [`Op::schedule`] arm) and one extension method: tensorwire's group runs any
//! operation that is one of core's schedules, and the other backends build what they have no
//! code for from simpler collectives ([`compose::compose`]).
//!
//! # Contract
//! - Every rank calls the same collectives, in the same order, with compatible arguments (the
//!   same root, the same element type and count, the same buffer length for `broadcast`).
//! - **Order means issue order.** A collective is *issued* by [`start`](ProcessGroup::start)
//!   or [`spawn`](ProcessGroup::spawn) (an awaited extension method calls `start` when its
//!   future is first polled; an `async fn` does nothing before): that is when it checks its
//!   arguments and takes its place in the group's sequence, all its rounds at once. Several
//!   collectives may be in flight together (`tokio::join!`, which polls its futures in
//!   argument order, or handles issued one after the other) as long as every rank issues
//!   them in the same order; spawning each on its own task leaves that order to the
//!   scheduler. A call refused for its own arguments takes no place in the sequence.
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
//! The tensor collectives take [`Tensor`](crate::tensor::Tensor)s on the group's
//! [`device`](ProcessGroup::device) and return new tensors (tensors are immutable values
//! here; PyTorch's in-place forms become "returns the result"). They hand the backend the
//! tensor's storage: host bytes for host backends, a device buffer for a device backend
//! (NCCL), which stages the byte forms through its device.

use std::sync::Arc;
use std::task::Context;
use std::time::Duration;

use async_trait::async_trait;

use crate::device::Device;

mod checks;
pub mod compose;
mod error;
mod ext;
mod op;
mod stage;
mod tensors;
mod work;

pub use error::{DeathCause, MeshViolation, ProcessGroupError};
pub use ext::Collectives;
pub use op::{Buf, Done, HostMut, Op, Scheduled};
pub use stage::stage_report;
pub use tensors::{TensorCollectives, TensorWork};
pub use work::{failed, lazy, map, Now, Pending, Started, WorkHandle};

/// Collectives among the ranks of a group: one [`Op`] at a time through
/// [`start`](Self::start); the forms users call are the extension traits' ([`Collectives`],
/// [`TensorCollectives`]).
#[async_trait]
pub trait ProcessGroup: Send + Sync {
    /// This process's rank, in `0..size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn size(&self) -> usize;

    /// Issues `op` and returns its handle. **The call is the ordering point**: the operation
    /// checks its arguments and takes its place in the group's sequence here (see the
    /// contract above); one refused for its arguments returns a handle that has already
    /// finished with the error and took no place. The handle gives what the [`Op`] variant
    /// says ([`Done`]).
    ///
    /// The operation runs as the handle is asked or waited on (or on its own, where the
    /// backend drives it); the extension methods that are awaited wait on it at once.
    fn start<'a>(&'a self, op: Op<'a>) -> Started<'a>;

    /// [`start`](Self::start) for an operation that owns its data, on a task of its own where
    /// the backend has one (c10d's `async_op=True`): it makes progress whether or not anyone
    /// waits, and [`wait`](WorkHandle::wait)'s timeout makes it time out. The default starts
    /// it as `start` does (polled when asked or waited on, bounded by the group's timeout).
    fn spawn(&self, op: Op<'static>) -> Started<'_> {
        self.start(op)
    }

    /// [`start`](Self::start)s `op` and waits for its result with no bound of its own (the
    /// group's timeout bounds it): what every awaited extension method ([`Collectives`]) does,
    /// from its first poll. A backend whose handle only polls a future on the caller's task
    /// may return that future itself, with no handle around it (one allocation and one poll
    /// fewer per collective); it must issue the operation in its first poll, as `start`
    /// would in the call. The default starts it and waits on the handle.
    fn run_op<'a>(&'a self, op: Op<'a>) -> Pending<'a, Done> {
        self.start(op).wait(UNBOUNDED)
    }

    /// [`run_op`](Self::run_op) that may run `op` to its end in this call, without a future:
    /// what every awaited extension method ([`Collectives`]) calls in its first poll, with
    /// that poll's `cx`. `op` is issued here in either case (the ordering point, as
    /// [`start`](Self::start)'s call); [`Now::Done`] gives the result, [`Now::Later`] a future
    /// to await for it (which may continue what the call began).
    ///
    /// A backend may finish small collectives here when they end within a short spin (a
    /// shared-memory barrier whose peers are already there): it must bound what it spends in
    /// the call (the caller's task holds its thread meanwhile), keep its waits that sleep,
    /// time out and notice failures in the future it returns, and let the caller's runtime
    /// run its other tasks as often as awaiting `run_op`'s future would (`cx` is for that: a
    /// runtime's cooperative budget). The default is `run_op`'s future, issued here.
    fn run_now<'a>(&'a self, op: Op<'a>, cx: &mut Context<'_>) -> Now<'a> {
        let _ = cx;
        Now::Later(self.run_op(op))
    }

    /// The backend's name, for errors and logs (`"tensorwire"`, `"nccl"`).
    fn backend(&self) -> &'static str {
        "tensorwire"
    }

    /// The device the tensor collectives work on: `cpu` for host backends, `cuda:N` for NCCL.
    fn device(&self) -> Device {
        Device::Cpu
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
    ) -> Result<Option<Arc<dyn ProcessGroup>>, ProcessGroupError> {
        let _ = ranks;
        Err(ProcessGroupError::Unsupported {
            collective: "new_group",
            backend: self.backend(),
        })
    }

    /// Leaves the group cleanly: peers learn that this rank shut down (rather than died) and
    /// later collectives here fail with [`ProcessGroupError::ShutDown`]. Call it before the
    /// process exits, or peers still running a collective may see this rank as dead. The
    /// default does nothing.
    async fn shutdown(&self) {}
}

/// The most bytes [`Op::BroadcastBytes`] accepts from a root (1 GiB, the transports' default
/// frame limit); a larger announced length is refused before anything is allocated for it.
pub const MAX_BROADCAST_BYTES: usize = 1 << 30;

/// How long the awaited extension methods give [`WorkHandle::wait`]: no bound of their own
/// (the group's timeout bounds every collective).
pub(crate) const UNBOUNDED: Duration = Duration::MAX;

#[cfg(test)]
mod tests;
