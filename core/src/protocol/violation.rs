//! [`ProtocolViolation`]: what a peer had no right to send.

#[cfg(doc)]
use super::{Endpoint, EndpointConfig};
use super::{ForkId, MessageId, RRefId, ShutdownSignal, WorkerId};

/// A message its sender had no right to send ([`Endpoint::handle_message`]). The endpoint's
/// state is unchanged; the driver drops the connection to that peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolViolation {
    /// A reply or acknowledgement naming an id this worker never gave out.
    #[error("it sent a {what} for message {id}, which this worker never sent")]
    UnknownId {
        /// The id named.
        id: MessageId,
        /// `reply` or `acknowledgement`.
        what: &'static str,
    },
    /// A reply or acknowledgement for a message that went to another worker.
    #[error("it sent a {what} for message {id}, which went to worker {sent_to}")]
    WrongPeer {
        /// The id named.
        id: MessageId,
        /// `reply` or `acknowledgement`.
        what: &'static str,
        /// Where the message went.
        sent_to: WorkerId,
    },
    /// A shutdown report out of order: not the round after the sender's last, more than one
    /// round ahead of ours, or an activity count that went down.
    #[error("it reported round {} (activity {}) in its shutdown after {after:?}, while this worker reported round {our_round}", .signal.round, .signal.activity)]
    ShutdownOutOfOrder {
        /// The report.
        signal: ShutdownSignal,
        /// The report it sent before (`None`: none).
        after: Option<ShutdownSignal>,
        /// The last round this worker reported (0: none).
        our_round: u32,
    },
    /// A report that the sender's graceful shutdown failed that no honest worker sends: a
    /// second one, or one whose list of missing workers is not in rank order.
    #[error("it sent {what}")]
    ForgedShutdownFailure {
        /// What was wrong with it.
        what: &'static str,
    },
    /// A creation (`remote`) of a reference that another worker made: only the worker that
    /// made a reference's id may ask its owner to create its value.
    #[error("it asked this worker to create remote reference {rref}, which worker {creator} made")]
    ForeignCreation {
        /// The reference.
        rref: RRefId,
        /// The worker whose id it is.
        creator: WorkerId,
    },
    /// A creation of a reference whose creation already arrived (creations from one worker
    /// arrive in the order they were made), or for a fork other than the reference's own.
    #[error("it asked this worker to create remote reference {rref} again (or under fork {fork})")]
    RepeatedCreation {
        /// The reference.
        rref: RRefId,
        /// The fork it named.
        fork: ForkId,
    },
    /// RPC traffic from a worker that is not (or no longer) a member of the dynamic group.
    #[error("it sent RPC traffic without being a member of the group")]
    NotAMember,
    /// A membership message the dynamic group's protocol refused, with its error.
    #[error("it broke the membership protocol: {0}")]
    Membership(#[source] crate::protocol::membership::MembershipError),
    /// A membership message to a worker of a static group (which has no membership protocol).
    #[error("it sent a membership message to a worker of a static group")]
    MembershipInStaticGroup,
    /// A contribution to a dynamic group's gather that no honest member sends
    /// ([`GatherError::is_forgery`](crate::protocol::gather::GatherError::is_forgery)): an
    /// empty or unsorted member list, or one without its sender. Found by the leader's
    /// [`GatherLeader`](crate::protocol::gather::GatherLeader) and applied by the driver.
    #[error("it broke the gather protocol: {0}")]
    Gather(crate::protocol::gather::GatherError),
    /// A same-host CUDA IPC message (or descriptor) it had no right to send.
    #[error("it broke the IPC protocol: {0}")]
    Ipc(crate::ipc::IpcViolation),
    /// A distributed autograd message it had no right to send (a gradient or release for a
    /// context it has no part in, a context forged under this worker's id, a forged message
    /// id): found by this worker's autograd state ([`crate::autograd::DistAutograd`]) above
    /// the endpoint, and applied by the driver as the endpoint's own violations are.
    #[error("it broke the distributed autograd protocol: {0}")]
    Autograd(crate::autograd::ProtocolViolation),
    /// A frame whose bytes are no valid message (the driver decodes it before the endpoint
    /// sees it: a header that does not parse, tensors it announces and does not carry, ...).
    #[error("it sent a malformed message: {0}")]
    Malformed(#[source] MalformedMessage),
    /// A fork request for a reference not created here while the sender already has
    /// [`EndpointConfig::pending_forks_per_peer`] records of such references.
    #[error("it asked for forks of more than {limit} references this worker has not created")]
    TooManyPendingForks {
        /// The bound.
        limit: usize,
    },
    /// A call, remote or fetch under the id of one of its requests still being served here:
    /// ids are never reused, and a copy would run a second handler outside the sender's
    /// share ([`EndpointConfig::requests_per_peer`]).
    #[error("it sent request {id} again while this worker was still serving it")]
    RepeatedRequest {
        /// The request's id.
        id: MessageId,
    },
    /// A fork request for one more fork while the sender already holds
    /// [`EndpointConfig::references_per_peer`] forks of values owned here.
    #[error("it asked to hold more than {limit} references to values this worker owns (references_per_peer)")]
    TooManyReferences {
        /// The bound.
        limit: usize,
    },
    /// A fetch, method call or remote method on a reference through a fork the sender does
    /// not hold: another worker's, one it deleted, one of another reference, or one never
    /// made; or a call (or remote) passing such a fork in its arguments to the owner, or
    /// passing any fork it did not make itself. Only a holder may read a value, call its
    /// methods, or hand it to its owner's functions.
    #[error("worker {sender} sent a {what} on remote reference {rref} through fork {fork}, which it does not hold")]
    NotAHolder {
        /// `fetch`, `method call`, `remote method call` or `call with the reference in its
        /// arguments`.
        what: &'static str,
        /// The reference.
        rref: RRefId,
        /// The fork it named.
        fork: ForkId,
        /// The worker that sent it.
        sender: WorkerId,
    },
    /// A fork request whose capability is not the reference's: the sender was never given
    /// the reference (it knows or guessed the ids), so it may not hold it. Found when the
    /// request arrives, or, for a reference whose creation had not arrived yet, when it does
    /// (reported then by [`Event::Misbehaved`](super::Event::Misbehaved)).
    #[error("worker {sender} asked for fork {fork} of remote reference {rref} without its capability: it was never given the reference")]
    ForgedFork {
        /// The reference.
        rref: RRefId,
        /// The fork it asked for.
        fork: ForkId,
        /// The worker that sent it.
        sender: WorkerId,
    },
    /// A message for a fork that another worker holds: a fork request or delete naming the
    /// creator's own fork (the reference's id) from anyone else, a delete of a fork only
    /// others hold, a child-accept for a child made for another worker, an abandonment of a
    /// reference someone else created. (A fork request naming a fork id that another worker
    /// holds is not one: forks are registered per holder, so it registers the sender's own
    /// entry and takes nothing from the other, whichever arrives first.)
    #[error("it spoke for fork {fork} of remote reference {rref}, which worker {holder} holds")]
    ForeignFork {
        /// The reference.
        rref: RRefId,
        /// The fork.
        fork: ForkId,
        /// The worker that holds it.
        holder: WorkerId,
    },
}

/// How a frame's bytes are no valid message ([`ProtocolViolation::Malformed`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MalformedMessage {
    /// Its header (or a control frame's message) does not parse as the format it must be.
    #[error(transparent)]
    Undecodable(#[from] crate::codec::Undecodable),
    /// Its payloads are not one per tensor its envelope announces (after the value's own).
    #[error("a message that announces {announced} tensors and carries {carried}")]
    TensorCount {
        /// The tensors the envelope announces.
        announced: usize,
        /// The tensor payloads the frame carries.
        carried: usize,
    },
    /// A frame of a kind that never reaches an agent (a process group's own, which the group
    /// takes before the agent reads the connection): see [`route`](super::node::route).
    #[error("a frame of kind {kind:?}, which is no agent's")]
    UnexpectedKind {
        /// Its kind.
        kind: crate::wire::FrameKind,
    },
}
