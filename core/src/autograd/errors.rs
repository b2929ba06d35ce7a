//! The errors of distributed autograd: why a backward failed ([`BackwardError`], which travels
//! back along the chain), a local call the state does not allow ([`AutogradError`]), why a
//! recv record was refused ([`RecvError`]), and what a peer had no right to send
//! ([`ProtocolViolation`]).

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::DistAutograd;
use super::{AutogradMessageId, ContextId, RootProblem};
use crate::name::WorkerId;

/// Why a backward failed. It travels back along the chain of gradient requests, so the root
/// learns which worker was at fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum BackwardError {
    /// A worker the backward needed was lost.
    #[error("worker {worker} was lost during the backward pass of {context}")]
    PeerLost {
        /// The lost worker.
        worker: WorkerId,
        /// The context.
        context: ContextId,
    },
    /// A gradient request to a worker failed (timeout, refused, transport error).
    #[error("the gradient request to worker {worker} in {context} failed: {reason}")]
    Request {
        /// The worker that did not answer.
        worker: WorkerId,
        /// The context.
        context: ContextId,
        /// What went wrong.
        reason: String,
    },
    /// A worker's local engine failed.
    #[error("the autograd engine of worker {worker} failed in {context}: {reason}")]
    Engine {
        /// The worker whose engine failed.
        worker: WorkerId,
        /// The context.
        context: ContextId,
        /// What the engine said.
        reason: String,
    },
    /// The context was released while the backward ran.
    #[error("{context} was released on worker {worker} during the backward pass")]
    Released {
        /// The worker that released it.
        worker: WorkerId,
        /// The context.
        context: ContextId,
    },
    /// Distributed autograd stopped on a worker (it was dropped, or its agent shut down)
    /// before that worker's part of the backward pass was done.
    #[error("distributed autograd stopped on worker {worker} before its part of the backward pass of {context} was done")]
    Stopped {
        /// The worker where it stopped.
        worker: WorkerId,
        /// The context.
        context: ContextId,
    },
}

impl BackwardError {
    /// Whether the failure means the context is gone (a lost peer, a release, autograd stopped
    /// on a worker): then it is dropped everywhere. Other failures (an engine error, a request
    /// that failed) leave the context usable.
    pub fn drops_context(&self) -> bool {
        matches!(
            self,
            BackwardError::PeerLost { .. }
                | BackwardError::Released { .. }
                | BackwardError::Stopped { .. }
        )
    }

    /// The worker the error names.
    pub fn worker(&self) -> WorkerId {
        match self {
            BackwardError::PeerLost { worker, .. }
            | BackwardError::Request { worker, .. }
            | BackwardError::Engine { worker, .. }
            | BackwardError::Released { worker, .. }
            | BackwardError::Stopped { worker, .. } => *worker,
        }
    }
}

/// A local call that the state does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AutogradError {
    /// No such context on this worker (never made, or released).
    #[error("{0} does not exist on this worker (never made here, or released)")]
    UnknownContext(ContextId),
    /// A backward is already running in this context from this worker.
    #[error("a backward pass is already running in {0} from this worker")]
    BackwardRunning(ContextId),
    /// The graph was freed by an earlier backward without `retain_graph`.
    #[error("the graph of {0} was freed by an earlier backward pass; pass retain_graph = true to run backward twice")]
    GraphFreed(ContextId),
    /// The counter of contexts or messages is spent.
    #[error("worker {0} has used up its 2^32 autograd ids")]
    IdsExhausted(WorkerId),
    /// A context this worker made was dropped by a failure (a lost peer, or a release a failure caused):
    /// the cause says which worker and what happened.
    #[error("{context} was dropped on this worker: {cause}")]
    Dropped {
        /// The context.
        context: ContextId,
        /// Why it was dropped.
        cause: BackwardError,
    },
    /// The roots given to [`DistAutograd::backward`] cannot start a backward pass; nothing
    /// was changed.
    #[error("backward in {context} refused: {problem}")]
    InvalidRoots {
        /// The context.
        context: ContextId,
        /// What is wrong with the roots.
        problem: RootProblem,
    },
    /// Tracked tensors cannot go to a worker known to be lost: nothing would ever send their
    /// gradients back, and a context left with it would never be released.
    #[error("worker {worker} was lost; tracked tensors in {context} cannot be sent to it")]
    PeerLost {
        /// The lost worker.
        worker: WorkerId,
        /// The context.
        context: ContextId,
    },
}

/// Why a recv record was refused ([`DistAutograd::handle_recv`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecvError {
    /// The message breaks the protocol.
    #[error(transparent)]
    Violation(#[from] ProtocolViolation),
    /// The sender was declared lost before its message was handled (the message raced the
    /// news of its death): recording it would leave a context that nobody releases.
    #[error("worker {from} was lost; its message in {context} is not recorded")]
    PeerLost {
        /// The lost sender.
        from: WorkerId,
        /// The context.
        context: ContextId,
    },
    /// The message is in a context this worker made and has since dropped (released, or
    /// failed by a loss): it crossed the release. Recording it would make the context again
    /// where nobody releases it any more.
    #[error("worker {from} sent a message in {context}, which this worker made and has dropped")]
    ContextGone {
        /// The sender.
        from: WorkerId,
        /// The context.
        context: ContextId,
    },
    /// The message is in a context that carries this worker's id but that this worker never
    /// made. A forgery, but not necessarily the sender's: an honest worker that was called in
    /// a forged context passes it on to the workers it calls, so the message is refused (the
    /// call fails with this error) and the sender is not dropped.
    #[error(
        "worker {from} sent a message in {context}, a context of this worker's that it never made"
    )]
    NeverMade {
        /// The sender.
        from: WorkerId,
        /// The context.
        context: ContextId,
    },
    /// The message presented a capability for `context` other than the one this worker holds
    /// for it and that its creator stands behind (the creator's own, or one the creator's
    /// message presented here, or that the creator vouched for when asked), or one the
    /// creator, asked, did not vouch for ([`DistAutograd::handle_vouch`]). Only
    /// the workers a context was passed to know its capability, so one that guessed the id
    /// cannot join a context this worker holds (and then release it under its members). As
    /// with [`NeverMade`](Self::NeverMade), the sender may be an honest worker passing on a
    /// forged context: the message is refused and the sender stays.
    #[error("worker {from} sent a message in {context} with a capability other than the one this worker holds for it")]
    WrongCapability {
        /// The sender.
        from: WorkerId,
        /// The context.
        context: ContextId,
    },
    /// The message would make this worker hold one more context of another worker's for the
    /// sender, which already made it hold `limit` of them
    /// ([`DistAutograd::set_contexts_per_peer`]). Nothing is recorded; an honest sender gets
    /// the call's error and may retry once some of its contexts are released.
    #[error("worker {from} already made this worker hold {limit} autograd contexts of other workers, its bound per peer (contexts_per_peer); {context} is not made")]
    TooManyContexts {
        /// The sender.
        from: WorkerId,
        /// The context it would have made.
        context: ContextId,
        /// The bound.
        limit: usize,
    },
}

impl RecvError {
    /// The violation, when the refusal is one (the driver drops the sender for it); the other
    /// refusals (a lost sender, a context gone, a bound reached) are answered and the sender
    /// stays.
    pub fn violation(&self) -> Option<&ProtocolViolation> {
        match self {
            RecvError::Violation(v) => Some(v),
            _ => None,
        }
    }
}

/// A message that a peer had no right to send. The state is unchanged; the driver drops the
/// peer for it (`tensorwire_core::protocol::ProtocolViolation::Autograd`), as for a violation
/// of the RPC protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolViolation {
    /// A gradient for a context this worker does not have.
    #[error("worker {from} sent a gradient for {context}, which this worker does not have")]
    UnknownContext {
        /// The sender.
        from: WorkerId,
        /// The context.
        context: ContextId,
    },
    /// A message in a context the sender is not part of here.
    #[error("worker {from} is not part of {context} on this worker")]
    NotInContext {
        /// The sender.
        from: WorkerId,
        /// The context.
        context: ContextId,
    },
    /// A gradient for a message this worker never sent to that worker.
    #[error("worker {from} sent a gradient for {message} in {context}, which this worker never sent to it")]
    UnknownMessage {
        /// The sender.
        from: WorkerId,
        /// The context.
        context: ContextId,
        /// The message id it named.
        message: AutogradMessageId,
    },
    /// A forward call or its answer whose requires-grad flags do not match its tensors (one
    /// flag per tensor; an honest sender always sends both).
    #[error("worker {from} sent {message} with {tensors} tensors but {flags} requires-grad flags")]
    MismatchedFlags {
        /// The sender.
        from: WorkerId,
        /// The message id.
        message: AutogradMessageId,
        /// How many tensors it carried.
        tensors: usize,
        /// How many flags.
        flags: usize,
    },
    /// A message whose autograd id does not carry its sender's worker id, or repeats one.
    #[error("worker {from} sent {message} in {context}: not an id of its own, or a repeated one")]
    BadMessageId {
        /// The sender.
        from: WorkerId,
        /// The context.
        context: ContextId,
        /// The message id.
        message: AutogradMessageId,
    },
    /// Gradients for a message that do not match its tensors: another count than the
    /// message carried, or a gradient of another shape or element type than its tensor. An
    /// honest worker computes them against the very tensors it received, which kept their
    /// type on the wire, and its engine gives a leaf's gradient the leaf's type (torch casts
    /// every gradient to its input's dtype), so another type is refused, not cast. (The state
    /// machine does not hold tensors: the driver, which does, finds this.)
    #[error("worker {from} sent gradients for {message} in {context} that do not match its tensors: {detail}")]
    MismatchedGradients {
        /// The sender.
        from: WorkerId,
        /// The context.
        context: ContextId,
        /// The message whose send function they were for.
        message: AutogradMessageId,
        /// What does not match.
        detail: String,
    },
}
