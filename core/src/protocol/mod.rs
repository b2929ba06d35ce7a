//! The RPC protocol as a deterministic state machine (sans-IO, in the manner of `quinn-proto`).
//!
//! An [`Endpoint`] is one worker's side of the protocol. It never touches a socket, a clock or
//! a thread: time comes in as `now`, messages come in through `handle_*`, and what must happen
//! next comes out through `poll_*`:
//!
//! - commands from the application: [`call`](Endpoint::call), [`remote`](Endpoint::remote),
//!   [`fetch`](Endpoint::fetch) (`to_here`), [`respond`](Endpoint::respond), and the RRef
//!   handle operations [`fork_for`](Endpoint::fork_for), [`accept_fork`](Endpoint::accept_fork),
//!   [`drop_handle`](Endpoint::drop_handle), [`clone_handle`](Endpoint::clone_handle);
//! - input: [`handle_message`](Endpoint::handle_message), [`handle_timeout`](Endpoint::handle_timeout),
//!   [`handle_peer_lost`](Endpoint::handle_peer_lost);
//! - output: [`poll_transmit`](Endpoint::poll_transmit) (messages to send),
//!   [`poll_event`](Endpoint::poll_event) (work for the application: run a function, release a
//!   value; results of our calls), [`poll_timeout`](Endpoint::poll_timeout) (when to call
//!   `handle_timeout` next).
//!
//! Bodies (`B`: serialized arguments, results and tensors) pass through untouched; the endpoint
//! only moves them, and sees of them only what [`Payload`] tells: the references inside (so a
//! late reply's references are released) and a method call's target (so a call on a value
//! still being created waits for it).
//!
//! # Modules
//! - this module: the types, the wire [`Header`], the endpoint's state, getters and `poll_*`;
//! - `input`: input (`handle_message`, `handle_timeout`, `handle_peer_lost`,
//!   `handle_peer_joined`), each message checked against state first (`check_message`);
//! - `calls`: commands that make calls, remotes and fetches, and answers to requests;
//! - `requests`: admitting, delivering, answering and completing requests inside the endpoint;
//! - `rrefs`: commands on reference handles (fork, accept, clone, drop, undo);
//! - `control`: the reference protocol's control messages, their acks and idempotence records;
//! - `debug`: the debug view ([`DebugInfo`]);
//! - `bounds`: what a peer can make the endpoint hold, counted per peer and bounded;
//! - [`shutdown`]: the phases of a graceful shutdown and of leaving a dynamic group;
//! - [`gather`]: barriers and all_gathers of a dynamic group through a leader
//!   ([`gather::GatherLeader`]).
//! - [`tensors`]: a message's tensors: where they land, how they travel, why they cannot.
//! - [`typed`]: the type fingerprint a typed call sends in front of its arguments, and its check.
//! - [`functions`]: the table of the functions a worker serves, and its rules.
//! - [`metrics`]: the agent's counters per peer and the rules of their updates.
//! - [`queued`]: what is queued for a peer's writer, counted against its budget.
//! - [`mesh`]: the mesh's frames (hellos and their answers, a process group's own frames).
//! - [`membership`]: joining a static group ([`StaticJoin`]: who dials whom, when the group is
//!   complete, the closing handshake), and joining and leaving a dynamic one
//!   ([`membership::DynamicMembership`]: a coordinator serializes them over the members'
//!   connections).
//!
//! # Calls
//! Every outgoing call gets a [`MessageId`] and, unless its timeout is zero, a deadline. A reply
//! completes it; the deadline, a lost peer or shutdown fail it with a [`CallError`] that says
//! which. User calls are never retried.
//!
//! # Remote references
//! PyTorch's RRef protocol: an RRef lives on its *owner*; every other holder is a *user* with
//! its own fork id, and the owner keeps the value while any fork (or a local handle) exists.
//! - `remote(owner, f, args)` gives the caller a user RRef at once (unconfirmed); the owner runs
//!   `f`, keeps the value, adds the caller's fork, and its reply confirms it.
//! - Passing a user RRef to a third worker *forks* it: the parent makes a new fork id and keeps
//!   its own reference alive until the child says the owner has confirmed the fork
//!   (fork request child→owner, acknowledged; then child-accept child→parent). Passing it to the
//!   owner gives the owner a local handle (when its application accepts the fork); passing an
//!   owner's RRef to a user registers the fork at once.
//! - A request holds the values owned here that it names — its method call's target, and the
//!   references a peer passes back to their owner in its arguments — from its arrival until it
//!   is answered, fails, or its caller is lost, whatever its outcome: the caller's delete of a
//!   reference it dropped at once travels right behind the call, and must not free the value
//!   before the function ran (nor leave a hold behind when the arguments never decode). A peer
//!   may name only forks it holds ([`ProtocolViolation::NotAHolder`]).
//! - When the last local handle of a user RRef is dropped (and it has no unconfirmed children),
//!   the user tells the owner (user-delete). When the owner has no forks and no local handles
//!   left, it emits [`Event::ReleaseValue`].
//! - Control messages (fork request, child accept, user delete) are idempotent and are resent
//!   until acknowledged.
//! - Only a holder reads or calls a value: a fetch ([`Header::Fetch`]) and a method call
//!   ([`Payload::target`]) name the caller's fork, and the owner serves them only if the
//!   caller holds that fork of that reference (its fork request, or its creation, arrived
//!   first on the same link); anything else is a [`ProtocolViolation::NotAHolder`]. Reads on
//!   the owner itself need no check.

use std::collections::{BTreeSet, VecDeque};

use crate::hashing::{HashMap, HashSet};
use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

mod bounds;
pub mod by_id;
mod calls;
mod config;
mod control;
mod deadlines;
mod debug;
pub mod envelope;
pub mod functions;
pub mod gather;
mod input;
mod lost;
pub mod membership;
pub mod mesh;
pub mod metrics;
pub mod node;
pub mod queued;
mod requests;
mod rrefs;
mod secrets;
pub mod served;
pub mod shutdown;
pub mod start;
pub mod tensors;
pub mod typed;
mod unusable;
pub mod value;
mod violation;

pub use bounds::{IDEMPOTENCE_RECORD_BYTES, PARKED_FETCH_BYTES, REFERENCE_RECORD_BYTES};
pub use config::ConfigError;
pub use debug::{DebugInfo, ForkInfo, OwnedInfo};
pub use lost::LostCause;
pub use membership::{JoinError, JoinMessage, JoinPhase, StaticJoin};
use requests::Serving;
pub use shutdown::{ShutdownError, ShutdownPhase, ShutdownSignal};
pub use unusable::{RRefError, RRefFailure};
pub use violation::{MalformedMessage, ProtocolViolation};

pub use crate::name::WorkerId;

/// The id of a message, unique among the messages one endpoint sends.
pub type MessageId = u64;

/// A globally unique id: the worker that made it and a counter local to that worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GlobalId {
    /// The worker that created the id.
    pub created_on: WorkerId,
    /// A number unique on that worker.
    pub local: u64,
}

impl fmt::Display for GlobalId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.created_on, self.local)
    }
}

/// Identifies a remote reference (all its forks share it).
pub type RRefId = GlobalId;
/// Identifies one user's fork of a remote reference.
pub type ForkId = GlobalId;
/// A reference's capability: 128 bits known to its owner and to every worker that was given the
/// reference, and to nobody else (ids are easy to guess; this is not). A fork request must
/// present it ([`ProtocolViolation::ForgedFork`]). See `secrets`.
pub type RRefSecret = u128;

/// What a worker needs to know to hold a reference: carried inside call arguments when an RRef
/// is passed to another worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RRefForkData {
    /// The reference.
    pub rref: RRefId,
    /// The fork made for the receiver (equal to `rref` when the receiver is the owner).
    pub fork: ForkId,
    /// The worker that owns the value.
    pub owner: WorkerId,
    /// The worker that passed the reference on.
    pub parent: WorkerId,
    /// The reference's capability ([`RRefSecret`]): the receiver presents it to the owner.
    pub secret: RRefSecret,
}

/// What the endpoint sees of a body it moves: the references inside it, forked for its
/// receiver. They travel beside the body, in the reply's header, so that the receiving endpoint
/// can release them itself when the body never reaches the application (a reply that arrives
/// after its call ended): otherwise their parents would stay pinned for ever.
pub trait Payload {
    /// The forks made for the receiver of this body (none by default).
    fn forks(&self) -> Vec<RRefForkData> {
        Vec::new()
    }

    /// For a method call (or a remote method): the reference whose value the method runs on,
    /// and the caller's fork of it. The owner serves it only if the caller holds that fork
    /// (else the message is a [`ProtocolViolation::NotAHolder`]). A call on a value this
    /// worker owns and is still creating waits (parked, by the caller's deadline) until the
    /// value exists.
    fn target(&self) -> Option<MethodTarget> {
        None
    }

    /// The bytes this body is counted as while a request carrying it is held back (see the
    /// node's held requests): its encoded value and its tensors' bytes (none by default).
    fn wire_bytes(&self) -> usize {
        0
    }
}

/// What a method call names as the value it runs on: the reference, and the fork of it the
/// caller holds, as proof that it may use the value (the reference's own id for the worker
/// that created it). It travels with the call's body ([`Payload::target`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MethodTarget {
    /// The reference.
    pub rref: RRefId,
    /// The caller's fork of it.
    pub fork: ForkId,
}

impl From<RRefHandle> for MethodTarget {
    fn from(h: RRefHandle) -> Self {
        Self {
            rref: h.rref,
            fork: h.fork,
        }
    }
}

/// A method call waiting for the value it runs on to be created.
#[derive(Debug)]
struct ParkedCall<B> {
    token: RequestToken,
    function: String,
    body: B,
    deadline: Option<Instant>,
}

impl Payload for Vec<u8> {
    fn wire_bytes(&self) -> usize {
        self.len()
    }
}

/// A failure reported by the callee.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind} on worker {worker}: {message}")]
pub struct RemoteError {
    /// The worker where it happened.
    pub worker: WorkerId,
    /// What kind of failure.
    pub kind: RemoteErrorKind,
    /// The message (the handler's error, the panic message, ...).
    pub message: String,
}

/// The kinds of [`RemoteError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum RemoteErrorKind {
    /// No function is registered under the name.
    UnknownFunction,
    /// The function returned an error.
    Failed,
    /// The function panicked.
    Panicked,
    /// The arguments or result could not be (de)serialized.
    Serialization,
    /// The remote reference is unknown to its owner or its value failed to be created.
    RRef,
    /// The callee is shutting down.
    ShuttingDown,
    /// A tensor in the result cannot be sent back (no reverse device map entry for its device),
    /// or cannot be placed on the device its map names.
    DeviceMap,
    /// The callee is already serving as many requests from this caller as it takes at once
    /// ([`EndpointConfig::requests_per_peer`]); nothing ran. Retry later.
    Busy,
    /// The callee waited on the caller's behalf (a fetch or a method call parked on a value
    /// still being created) until the caller's deadline, and stopped. The caller's endpoint
    /// reports it as its own deadline passing ([`CallError::Timeout`], or
    /// [`CallError::RRefCreationTimedOut`] for a `remote`), so the same condition fails the
    /// same way whichever side notices the deadline first.
    Deadline,
}

impl fmt::Display for RemoteErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::UnknownFunction => "unknown function",
            Self::Failed => "remote error",
            Self::Panicked => "remote panic",
            Self::Serialization => "serialization error",
            Self::RRef => "remote reference error",
            Self::ShuttingDown => "callee shutting down",
            Self::DeviceMap => "device map error",
            Self::Busy => "callee busy",
            Self::Deadline => "caller's deadline passed",
        })
    }
}

/// Why one of our calls failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// No reply came before the deadline.
    #[error("RPC to worker {to} timed out after {after:?}")]
    Timeout {
        /// The callee.
        to: WorkerId,
        /// The call's timeout.
        after: Duration,
    },
    /// The callee reported a failure.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// The callee is gone (for a call on a reference: the reference's owner).
    #[error("worker {peer} is unreachable: {cause}")]
    PeerLost {
        /// The callee.
        peer: WorkerId,
        /// Why it is gone.
        cause: LostCause,
    },
    /// The reference's owner is gone (it left the group or was lost): the reference is
    /// forgotten with it, also once a new worker takes the owner's rank.
    #[error("remote reference {rref}: its owner, worker {owner}, is gone: {cause}")]
    OwnerLost {
        /// The reference.
        rref: RRefId,
        /// Its owner.
        owner: WorkerId,
        /// Why the owner is gone.
        cause: LostCause,
    },
    /// Our agent is shut down or shutting down.
    #[error("RPC is no longer running on this worker")]
    NotRunning,
    /// The reference is not known here (dropped, or never created).
    #[error("unknown remote reference {0}")]
    UnknownRRef(RRefId),
    /// The call could not be sent (its tensors could not be copied off their device, ...).
    #[error("the call could not be sent: {0}")]
    Local(String),
    /// The `remote()` that created the reference timed out before the owner confirmed the
    /// value (PyTorch's "RRef creation via rpc.remote() timed out"). The value may still be
    /// created on the owner; it is freed there once no reference to it is left.
    #[error("remote reference {rref} on worker {owner}: its creation timed out after {after:?}; the value may not exist on the owner")]
    RRefCreationTimedOut {
        /// The reference.
        rref: RRefId,
        /// Its owner.
        owner: WorkerId,
        /// The `remote()` call's timeout.
        after: Duration,
    },
}

/// The header of every protocol message. Serialized with the frame; bodies ride beside it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Header {
    /// Run `function` with the body as arguments and reply with its result.
    Call {
        /// The caller's id for this call.
        id: MessageId,
        /// The registered function's name.
        function: String,
        /// The caller's timeout (zero: none), so that the callee bounds its own waits for
        /// this call (values being created, references being confirmed) by the same deadline.
        timeout: Duration,
    },
    /// Run `function`, keep its result as the value of `rref`, and reply (confirming `fork`).
    Remote {
        /// The caller's id for this call.
        id: MessageId,
        /// The registered function's name.
        function: String,
        /// The reference the value is kept under.
        rref: RRefId,
        /// The caller's fork.
        fork: ForkId,
        /// The reference's capability, chosen by its creator ([`RRefSecret`]).
        secret: RRefSecret,
        /// The caller's timeout (zero: none); see [`Header::Call`].
        timeout: Duration,
    },
    /// Reply with the value of `rref` once it exists (`to_here`).
    Fetch {
        /// The caller's id for this call.
        id: MessageId,
        /// The reference.
        rref: RRefId,
        /// The caller's fork of it (the reference's own id for its creator): the owner serves
        /// only a worker that holds that fork of that reference
        /// ([`ProtocolViolation::NotAHolder`]).
        fork: ForkId,
        /// The caller's timeout (zero: none): a fetch parked on a value still being created
        /// is answered with an error at that deadline.
        timeout: Duration,
    },
    /// The outcome of a call, remote or fetch; on success the body is the result.
    Reply {
        /// The id of the call answered.
        id: MessageId,
        /// `Ok` or the callee's error.
        outcome: Result<(), RemoteError>,
        /// The references inside the body, forked for the receiver (see [`Payload`]): released
        /// by the receiving endpoint if the call has ended when the reply arrives.
        forks: Vec<RRefForkData>,
    },
    /// Control: a child asks the owner to add its fork.
    ForkRequest {
        /// The control message's id (for the acknowledgement).
        id: MessageId,
        /// Every control message the sender sent us with a lower id is acknowledged (the
        /// receiver forgets them: see [`Header::ChildAccept`]'s `floor`).
        floor: MessageId,
        /// The reference.
        rref: RRefId,
        /// The child's fork.
        fork: ForkId,
        /// The reference's capability, as the parent gave it: the owner registers the fork
        /// only if it matches ([`ProtocolViolation::ForgedFork`]).
        secret: RRefSecret,
    },
    /// Control: a child tells its parent that the owner confirmed its fork.
    ChildAccept {
        /// The control message's id.
        id: MessageId,
        /// The sender's oldest control message to us not yet acknowledged (or its next id):
        /// nothing below it will be sent again, so the receiver keeps no record of it. This
        /// bounds the records kept to make resent control messages idempotent.
        floor: MessageId,
        /// The child's fork.
        fork: ForkId,
    },
    /// Control: a user dropped its last handle to a fork.
    UserDelete {
        /// The control message's id.
        id: MessageId,
        /// See [`Header::ChildAccept`]'s `floor`.
        floor: MessageId,
        /// The reference.
        rref: RRefId,
        /// The fork dropped.
        fork: ForkId,
    },
    /// The creation of `rref` was abandoned before its `Remote` was sent (its tensors could
    /// not be copied off their device): messages that referred to it arrive in its place, and
    /// the owner settles anything they left waiting (parked fetches fail with `reason`).
    Abandoned {
        /// The reference that will never be created.
        rref: RRefId,
        /// Why.
        reason: String,
    },
    /// Acknowledges a control message.
    Ack {
        /// The control message's id.
        id: MessageId,
    },
    /// A step of the sender's graceful shutdown (see [`shutdown`]).
    Shutdown {
        /// Which step.
        signal: ShutdownSignal,
    },
    /// The sender's graceful shutdown failed, waiting for `missing`: the receiver's fails too,
    /// naming the same workers (the cause, rather than the sender, which is about to go).
    ShutdownFailed {
        /// Who the sender waited for.
        missing: Vec<WorkerId>,
        /// Whether they were lost (else: the deadline passed).
        lost: bool,
    },
}

/// A message to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit<B> {
    /// The destination.
    pub to: WorkerId,
    /// The header.
    pub header: Header,
    /// The body (empty for control messages), if any.
    pub body: Option<B>,
}

/// Identifies an incoming request the application must answer with [`Endpoint::respond`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestToken {
    from: WorkerId,
    id: MessageId,
    kind: RequestKind,
}

impl RequestToken {
    /// The caller.
    pub fn from(&self) -> WorkerId {
        self.from
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum RequestKind {
    Call,
    Remote(RRefId),
    Fetch(RRefId),
}

/// What the application must do, or learn. Exhaustive on purpose: a driver matches every
/// variant, so a new event is a compile error in each driver, not an arm silently ignored.
#[derive(Debug, PartialEq, Eq)]
pub enum Event<B> {
    /// Run `function` on `body`; answer with [`Endpoint::respond`] and the serialized result.
    Call {
        /// Answer with this.
        token: RequestToken,
        /// The function's name.
        function: String,
        /// Its arguments.
        body: B,
        /// When the caller stops waiting (`None`: never). Waits on the caller's behalf end
        /// there too.
        deadline: Option<Instant>,
    },
    /// Run `function` on `body` and keep the result as the value of `rref`; answer with
    /// [`Endpoint::respond`] (the body of a successful answer is ignored).
    Remote {
        /// Answer with this.
        token: RequestToken,
        /// The function's name.
        function: String,
        /// Its arguments.
        body: B,
        /// Where to keep the value.
        rref: RRefId,
        /// When the caller stops waiting (`None`: never).
        deadline: Option<Instant>,
    },
    /// Serialize the value of `rref` (which exists now) and answer with [`Endpoint::respond`].
    Fetch {
        /// Answer with this.
        token: RequestToken,
        /// The reference.
        rref: RRefId,
    },
    /// One of our calls, remotes or fetches finished.
    Completed {
        /// The id [`Endpoint::call`] (or `remote`, `fetch`) returned.
        id: MessageId,
        /// The result body, or why it failed.
        outcome: Result<B, CallError>,
    },
    /// The owner confirmed our fork of `rref`.
    Confirmed {
        /// The reference.
        rref: RRefId,
        /// Our fork of it.
        fork: ForkId,
    },
    /// We own `rref` and nobody refers to it any more: drop its value.
    ReleaseValue {
        /// The reference.
        rref: RRefId,
    },
    /// A wait begun with [`Endpoint::wait_confirmed`] ended: every reference is confirmed, or
    /// why not.
    ConfirmWaitDone {
        /// The wait.
        wait: WaitId,
        /// `Ok` once every reference is confirmed.
        outcome: Result<(), ConfirmError>,
    },
    /// The graceful shutdown (or leave) begun with
    /// [`begin_graceful_shutdown`](Endpoint::begin_graceful_shutdown) or
    /// [`begin_leave`](Endpoint::begin_leave) is complete, or failed naming who it waited
    /// for. The driver stops the endpoint either way.
    ShutdownComplete {
        /// `Ok` once every member is idle (or, leaving, our calls are answered).
        outcome: Result<(), ShutdownError>,
    },
    /// `peer` is now lost (the first loss recorded since it joined, however it was found:
    /// the driver's report through [`Endpoint::handle_peer_lost`], or a violation the
    /// endpoint found itself, see [`Event::Misbehaved`]), with the cause kept. Emitted once
    /// per loss, so the driver tells its subscribers here, and only here: a later report of
    /// the same loss (a link's reader and writer may both see its end) emits nothing.
    PeerLost {
        /// The peer.
        peer: WorkerId,
        /// Why it is gone: the first cause recorded.
        cause: LostCause,
    },
    /// A peer broke the protocol in a way found only later than its message (a fork request
    /// made before the reference's creation arrived, whose capability the creation shows to
    /// be forged): the endpoint has already handled the peer as lost with
    /// [`LostCause::Misbehaved`], and reports that loss by the [`Event::PeerLost`] that
    /// follows this event; the driver drops its connection here.
    Misbehaved {
        /// The peer.
        peer: WorkerId,
        /// What it did.
        violation: ProtocolViolation,
    },
}

/// Tunables.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// How long to wait for a control message's acknowledgement before sending it again.
    pub control_retry: Duration,
    /// Records of handled control messages kept per peer to acknowledge a resent one without
    /// handling it twice. The peer's floor frees them as its acknowledgements arrive; beyond
    /// this many, the oldest are forgotten (ids below the oldest kept count as handled), so a
    /// peer that never raises its floor cannot grow them. Default 65,536.
    pub idempotence_records_per_peer: usize,
    /// Owner records a peer may make by fork requests for references that are not created
    /// here (not yet, or never): beyond this many, a fork request for another such reference
    /// is a [`ProtocolViolation::TooManyPendingForks`]. Default 16,384.
    pub pending_forks_per_peer: usize,
    /// Requests (calls, remotes, fetches) one peer may have being served here at once:
    /// handed to the application (a handler task each) or parked, not answered yet. A
    /// request beyond it is answered at once with a [`RemoteErrorKind::Busy`] error naming
    /// the bound, and runs nothing. Default 4,096.
    pub requests_per_peer: usize,
    /// Fetches (`to_here`) one peer may have parked here on values still being created (a
    /// fetch for a value that exists is a request being served, counted by
    /// [`requests_per_peer`](Self::requests_per_peer)). A fetch beyond it is answered at once
    /// with a [`RemoteErrorKind::Busy`] error naming the bound, and is not parked. Default
    /// 4,096.
    pub parked_fetches_per_peer: usize,
    /// References one peer may make this worker hold for it: forks it holds of values owned
    /// here (the creator's fork of each value it created here with `remote`, and each fork it
    /// registered with a fork request). Beyond it a `remote` from that peer creates nothing and
    /// is answered at once with a [`RemoteErrorKind::Busy`] error naming the bound, and a fork
    /// request for one more fork is a [`ProtocolViolation::TooManyReferences`]. Forks this
    /// worker gives a peer itself count too, but are never refused. Default 1,048,576.
    pub references_per_peer: usize,
    /// The memory budget of each peer, in bytes (default
    /// [`DEFAULT_PEER_BUDGET`](crate::budget::DEFAULT_PEER_BUDGET), 256 MiB): what one peer
    /// makes this worker hold, over every use, draws from it (see [`crate::budget`]). The
    /// endpoint makes the shared [`Budget`](crate::budget::Budget) ([`Endpoint::budget`]) and
    /// charges its records of each peer to it (idempotence records, references it holds,
    /// fetches it parked, fork records it made); the driver's queues, inboxes and readers
    /// report to the same budget. A `remote` or a parked fetch that would pass it is answered
    /// [`RemoteErrorKind::Busy`] naming the bound.
    pub peer_budget: usize,
}

impl Default for EndpointConfig {
    fn default() -> Self {
        Self {
            control_retry: Duration::from_secs(1),
            idempotence_records_per_peer: 1 << 16,
            pending_forks_per_peer: 1 << 14,
            requests_per_peer: 4096,
            parked_fetches_per_peer: 4096,
            references_per_peer: 1 << 20,
            peer_budget: crate::budget::DEFAULT_PEER_BUDGET,
        }
    }
}

#[derive(Debug)]
struct Pending {
    to: WorkerId,
    timeout: Duration,
    deadline: Option<Instant>,
    /// Whether its deadline is in `call_deadlines` (else in `timers`).
    queued: bool,
    /// For `remote`: the fork to confirm when the reply arrives.
    confirms: Option<RRefId>,
}

#[derive(Debug)]
struct Unacked {
    to: WorkerId,
    header: Header,
    next_try: Instant,
}

/// One holder's handle on a reference: the reference and the fork it holds it through.
/// On the owner, `fork == rref`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RRefHandle {
    /// The reference.
    pub rref: RRefId,
    /// The fork held (the reference's own id for the owner and for the worker that created it).
    pub fork: ForkId,
    /// The worker that owns the value.
    pub owner: WorkerId,
}

/// The owner's record of one of its references.
#[derive(Debug, Default)]
struct Owned {
    /// Each fork with the worker that holds it (dropped when that worker is lost). A fork is
    /// registered per holder: a peer that names a fork id another worker holds (ids are easy
    /// to guess) registers its own entry, counted against its own bound, and can never take,
    /// release or block the other's.
    forks: HashSet<(ForkId, WorkerId)>,
    local_handles: u32,
    /// `None` while the value is being created; `Some(Ok)` once kept; `Some(Err)` if that failed.
    state: Option<Result<(), RemoteError>>,
    /// Fetches parked until the value exists: caller, its message id, its deadline.
    fetches: Vec<(WorkerId, MessageId, Option<Instant>)>,
    /// The reference's capability; `None` until its creation arrives.
    secret: Option<RRefSecret>,
    /// Before then, the capability each fork request presented, by fork and sender, checked
    /// on the creation (one per fork registration, so bounded with them).
    claims: HashMap<(ForkId, WorkerId), RRefSecret>,
    /// The peer whose fork request made this record before the value existed here, while
    /// the value is not kept: it counts against that peer's
    /// [`EndpointConfig::pending_forks_per_peer`].
    placeholder_of: Option<WorkerId>,
    /// Requests being served here that name this reference (as their target, or among their
    /// arguments from a peer), counted from their arrival until they are answered (see
    /// `requests::hold_named`): the value stays while one is, whatever arrives behind it.
    request_holds: u32,
}

/// A user's record of one fork.
#[derive(Debug)]
struct Used {
    rref: RRefId,
    owner: WorkerId,
    /// Who to send child-accept to once the owner confirms (not for the creator's fork or a
    /// fork the owner gave).
    parent: Option<WorkerId>,
    confirmed: bool,
    handles: u32,
    /// Forks made from this one for other workers that the owner has not confirmed yet.
    pending_children: HashSet<ForkId>,
    /// No user-delete is needed (the value was never created).
    void: bool,
    /// Why the creator's `remote()` failed (the owner's error, or a timeout): the fork cannot
    /// be fetched or passed on, and fetching it reports this. After a timeout the fork is
    /// still deleted at the owner once dropped.
    creation_error: Option<CallError>,
    /// The reference's capability, passed on to the children.
    secret: RRefSecret,
}

/// The control messages of one sender already handled.
#[derive(Debug, Default)]
struct Seen {
    /// Everything below was handled.
    floor: MessageId,
    /// Handled ids at or above the floor.
    ids: BTreeSet<MessageId>,
}

/// Whether the endpoint accepts new work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// Serving and calling.
    Running,
    /// No new outgoing calls; incoming work is refused; pending work finishes.
    ShuttingDown,
    /// Everything failed or finished.
    Stopped,
}

/// One worker's side of the RPC protocol.
#[derive(Debug)]
pub struct Endpoint<B> {
    me: WorkerId,
    config: EndpointConfig,
    state: RunState,
    next_id: u64,
    /// Ids at or below it were never issued here (see
    /// [`begin_incarnation`](Endpoint::begin_incarnation)).
    first_id: u64,
    pending: HashMap<MessageId, Pending>,
    /// Every deadline of the endpoint in one ordered set, so that
    /// [`poll_timeout`](Self::poll_timeout) is O(log n) whatever the number of calls,
    /// references and waits (see [`Timer`]).
    timers: BTreeSet<(Instant, Timer)>,
    /// The deadlines of our calls that come in order (most: see [`deadlines`]), beside
    /// `timers`, which holds the others.
    call_deadlines: deadlines::InOrder,
    unacked: HashMap<MessageId, Unacked>,
    /// The ids of `unacked`, per destination (for each message's floor, in O(log n)).
    unacked_to: HashMap<WorkerId, BTreeSet<MessageId>>,
    incoming: Serving,
    /// For each request being served that names references owned here (its target, or
    /// references a peer passed back to their owner in its arguments), the references it holds
    /// (`Owned::request_holds`) until it is answered, fails, or its caller is lost.
    holds: HashMap<RequestToken, Vec<RRefId>>,
    owned: OwnedRecords,
    /// Per peer, the forks it holds of values owned here (the holders in `owned`'s fork
    /// records, counted), bounded by [`EndpointConfig::references_per_peer`].
    references: HashMap<WorkerId, usize>,
    used: HashMap<ForkId, Used>,
    /// Child fork -> the parent fork it was made from and the worker it was sent to.
    children: HashMap<ForkId, (ForkId, WorkerId)>,
    /// Control messages already handled, per sender, so resent ones are only acknowledged:
    /// ids at or above the sender's floor (below it, everything was handled).
    seen_control: HashMap<WorkerId, Seen>,
    /// Per peer, the owner records its fork requests made for references not created here
    /// and not kept since (the records whose `placeholder_of` names it), bounded by
    /// [`EndpointConfig::pending_forks_per_peer`]. Kept up to date as records change, so a
    /// fork request reads it in O(1) (see `bounds`).
    placeholders: HashMap<WorkerId, usize>,
    /// The fetches parked on values being created here, counted per caller and by id.
    parked: bounds::ParkedCounts,
    /// The memory budget per peer, shared with the driver ([`EndpointConfig::peer_budget`]).
    budget: crate::budget::Budget,
    /// The bytes of each peer's records charged to `budget` (see `bounds::charge_records`).
    records_charged: HashMap<WorkerId, usize>,
    transmits: VecDeque<Transmit<B>>,
    /// Per peer, messages held behind one whose body is not ready yet (see
    /// [`call_deferred`](Endpoint::call_deferred)): they leave in the order they were made.
    held: HashMap<WorkerId, VecDeque<Slot<B>>>,
    /// Messages whose body is not ready yet, by id.
    deferred: HashMap<MessageId, Deferred>,
    /// References owned here whose creation failed or was abandoned, with the error, so that
    /// fork requests and fetches arriving later (from third parties, on other links) settle at
    /// once instead of waiting for a creation that never comes. The most recent
    /// [`FAILED_KEPT`]; their records are freed as soon as nobody refers to them.
    failed: VecDeque<(RRefId, RemoteError)>,
    /// Per creator, the highest reference id it asked us to create. Creations from one worker
    /// arrive in order on its link, so a reference at or below it with no record here was
    /// created and has been released (rather than not created yet).
    created_upto: HashMap<WorkerId, u64>,
    /// Peers lost for good (until [`handle_peer_joined`](Endpoint::handle_peer_joined)), with
    /// why: the one record of a lost peer (the driver asks [`lost_cause`](Endpoint::lost_cause)).
    lost: HashMap<WorkerId, LostCause>,
    /// Method calls waiting for the value they run on, by reference.
    parked_calls: HashMap<RRefId, Vec<ParkedCall<B>>>,
    /// Functions waiting until the owners confirm the references in their arguments (see
    /// [`wait_confirmed`](Endpoint::wait_confirmed)), by wait id.
    confirm_waits: HashMap<WaitId, ConfirmWait>,
    next_wait: WaitId,
    /// Our graceful shutdown, and what peers said of theirs.
    shutdown: shutdown::ShutdownState,
    /// The latest time an input brought (for work that commands without a time cause).
    last_now: Option<Instant>,
    events: VecDeque<Event<B>>,
    /// The key of the capabilities of the references created here (see `secrets`).
    secret_key: [u8; 32],
}

/// The owner's records, by reference. In the crate's own tests, a map that counts how often it
/// is used (see `bounds::Lookups`), so that a test can bound the work one message costs.
#[cfg(not(test))]
type OwnedRecords = HashMap<RRefId, Owned>;
#[cfg(test)]
type OwnedRecords = bounds::Lookups<HashMap<RRefId, Owned>>;

/// Identifies a wait begun with [`Endpoint::wait_confirmed`].
pub type WaitId = u64;

/// What a deadline in the endpoint's timer set is for. Calls, control messages and
/// confirmation waits take their timer out when they end; the timers of fetches and method
/// calls parked on a value being created are checked when they fire instead (a value's
/// creation ends them all at once, and they expire by the caller's deadline anyway).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// A call's deadline.
    Call(MessageId),
    /// When to send an unacknowledged control message again.
    Control(MessageId),
    /// A fetch parked on this value may be due.
    Fetches(RRefId),
    /// A method call parked on this value may be due.
    ParkedCalls(RRefId),
    /// A wait for confirmations.
    ConfirmWait(WaitId),
}

/// A function's wait for the owners to confirm the references in its arguments.
#[derive(Debug)]
struct ConfirmWait {
    /// The handles not confirmed yet.
    handles: Vec<RRefHandle>,
    deadline: Option<Instant>,
}

/// Why a wait begun with [`Endpoint::wait_confirmed`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfirmError {
    /// The owner was lost (or left) before it confirmed the reference.
    #[error("remote reference {rref} in the arguments: its owner, worker {owner}, was lost before confirming it")]
    OwnerLost {
        /// The reference.
        rref: RRefId,
        /// Its owner.
        owner: WorkerId,
    },
    /// The deadline passed first.
    #[error("remote reference {rref} in the arguments: its owner, worker {owner}, did not confirm it before the call's deadline")]
    Deadline {
        /// The reference.
        rref: RRefId,
        /// Its owner.
        owner: WorkerId,
    },
    /// The reference's creation failed or timed out.
    #[error("remote reference {rref} in the arguments: {error}")]
    Creation {
        /// The reference.
        rref: RRefId,
        /// Why.
        error: CallError,
    },
}

impl ConfirmError {
    /// The reference that was not confirmed.
    pub fn rref(&self) -> RRefId {
        match self {
            Self::OwnerLost { rref, .. }
            | Self::Deadline { rref, .. }
            | Self::Creation { rref, .. } => *rref,
        }
    }
}

/// How many failed creations an owner remembers.
const FAILED_KEPT: usize = 4096;

/// A place in a peer's queue of held messages.
#[derive(Debug)]
enum Slot<B> {
    /// Ready to go once everything before it has.
    Ready(Transmit<B>),
    /// The message with this id, waiting for its body.
    Waiting(MessageId),
}

/// A message made before its body (the body's tensors are still being copied off a device).
#[derive(Debug)]
struct Deferred {
    to: WorkerId,
    /// The header to send (to another worker); for this worker itself, the request to run.
    header: Header,
    deadline: Option<Instant>,
}

impl<B: Payload> Endpoint<B> {
    /// A new endpoint for worker `me`.
    pub fn new(me: WorkerId, config: EndpointConfig) -> Self {
        Self {
            me,
            budget: crate::budget::Budget::new(config.peer_budget),
            records_charged: HashMap::default(),
            config,
            state: RunState::Running,
            next_id: 0,
            first_id: 0,
            pending: HashMap::default(),
            timers: BTreeSet::new(),
            call_deadlines: deadlines::InOrder::default(),
            unacked: HashMap::default(),
            unacked_to: HashMap::default(),
            incoming: Serving::default(),
            holds: HashMap::default(),
            owned: OwnedRecords::default(),
            references: HashMap::default(),
            used: HashMap::default(),
            children: HashMap::default(),
            seen_control: HashMap::default(),
            placeholders: HashMap::default(),
            parked: bounds::ParkedCounts::default(),
            transmits: VecDeque::new(),
            held: HashMap::default(),
            deferred: HashMap::default(),
            failed: VecDeque::new(),
            created_upto: HashMap::default(),
            lost: HashMap::default(),
            parked_calls: HashMap::default(),
            confirm_waits: HashMap::default(),
            next_wait: 0,
            shutdown: shutdown::ShutdownState::default(),
            last_now: None,
            events: VecDeque::new(),
            secret_key: crate::capability::default_key(me),
        }
    }

    // ----- getters -----

    /// This worker's id.
    pub fn id(&self) -> WorkerId {
        self.me
    }

    /// Whether the endpoint is running, shutting down or stopped.
    pub fn state(&self) -> RunState {
        self.state
    }

    /// Whether nothing is outstanding: no call awaiting a reply, no request awaiting our
    /// answer, no control message awaiting acknowledgement, no message waiting for its body.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty()
            && self.incoming.is_empty()
            && self.unacked.is_empty()
            && self.deferred.is_empty()
    }

    /// Calls awaiting a reply.
    pub fn outstanding_calls(&self) -> usize {
        self.pending.len()
    }

    /// The memory budget per peer ([`EndpointConfig::peer_budget`]) this endpoint charges its
    /// records to; the driver shares it with its queues, inboxes and readers.
    pub fn budget(&self) -> &crate::budget::Budget {
        &self.budget
    }

    /// Charges this endpoint's records to `budget` (shared with the driver's other holders)
    /// instead of the one it made from [`EndpointConfig::peer_budget`]. Meant before any
    /// message is handed in: what was charged so far stays on the old budget.
    pub fn set_budget(&mut self, budget: crate::budget::Budget) {
        self.budget = budget;
    }

    /// Why `peer` is gone, if the driver reported it lost (and it did not join again since).
    pub fn lost_cause(&self, peer: WorkerId) -> Option<&LostCause> {
        self.lost.get(&peer)
    }

    /// Whether we own `rref` and still keep it.
    pub fn owns(&self, rref: RRefId) -> bool {
        self.owned.contains_key(&rref)
    }

    /// Whether `handle` can be used for a call on its value now: this worker holds it (or owns
    /// the value) and its creation did not fail. A reference whose owner left or was lost is
    /// forgotten with it, and stays unusable when a new worker later joins under the owner's
    /// rank: the new incarnation never had the value, so a method call sent to it would wait
    /// for a creation that never comes. The application checks this when it sends a method
    /// call or remote method on a reference: [`call`](Self::call) does not check the target
    /// its body names ([`Payload::target`], which the owner checks against its holders).
    pub fn check_reference(&self, handle: RRefHandle) -> Result<(), CallError> {
        self.check_usable(handle)
    }

    /// Whether the owner has confirmed `handle`'s fork (always true on the owner); `None` if
    /// the handle is unknown here.
    pub fn is_confirmed(&self, handle: RRefHandle) -> Option<bool> {
        if handle.owner == self.me {
            return self.owned.contains_key(&handle.rref).then_some(true);
        }
        self.used.get(&handle.fork).map(|u| u.confirmed)
    }

    /// The forks the owner currently counts for `rref` (diagnostics and tests).
    pub fn owner_fork_count(&self, rref: RRefId) -> Option<usize> {
        self.owned.get(&rref).map(|o| o.forks.len())
    }

    /// The number of user forks this worker holds (diagnostics and tests).
    pub fn user_fork_count(&self) -> usize {
        self.used.len()
    }

    // ----- output -----

    /// The next message to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit<B>> {
        self.transmits.pop_front()
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event<B>> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called next, if ever.
    /// O(log n): every deadline is in one ordered set or, for calls whose deadlines come in
    /// order, one queue.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let earlier = |a: Option<Instant>, b: Option<Instant>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let first = self.timers.first().map(|(t, _)| *t);
        let call = self.call_deadlines.first().map(|(t, _)| t);
        earlier(earlier(first, call), self.shutdown_deadline())
    }

    // ----- commands -----

    fn fresh_id(&mut self) -> MessageId {
        self.next_id += 1;
        self.next_id
    }

    fn fresh_global(&mut self) -> GlobalId {
        GlobalId {
            created_on: self.me,
            local: self.fresh_id(),
        }
    }

    fn track(
        &mut self,
        id: MessageId,
        to: WorkerId,
        timeout: Duration,
        now: Instant,
        confirms: Option<RRefId>,
    ) {
        let deadline = deadline_after(now, timeout);
        let queued = deadline.is_some_and(|d| self.call_deadlines.push(d, id));
        if let (Some(d), false) = (deadline, queued) {
            self.timers.insert((d, Timer::Call(id)));
        }
        self.pending.insert(
            id,
            Pending {
                to,
                timeout,
                deadline,
                queued,
                confirms,
            },
        );
    }

    /// Stops taking new calls; incoming requests are refused with a "shutting down" error.
    /// Pending calls and control messages go on; see [`is_idle`](Self::is_idle).
    pub fn begin_shutdown(&mut self) {
        if self.state == RunState::Running {
            self.state = RunState::ShuttingDown;
        }
    }

    /// Fails every pending call with [`CallError::NotRunning`], forgets requests not yet
    /// answered and control messages not yet acknowledged, and stops.
    pub fn stop(&mut self) {
        self.state = RunState::Stopped;
        let ids: Vec<MessageId> = self.pending.keys().copied().collect();
        for id in ids {
            self.fail(id, CallError::NotRunning);
        }
        self.unacked.clear();
        self.unacked_to.clear();
        self.timers.clear();
        self.call_deadlines.clear();
        self.incoming.clear();
        self.holds.clear();
        self.parked_calls.clear();
        self.confirm_waits.clear();
        self.held.clear();
        self.deferred.clear();
    }

    fn defer(&mut self, id: MessageId, to: WorkerId, header: Header, deadline: Option<Instant>) {
        self.count_activity(None);
        if to != self.me {
            self.held
                .entry(to)
                .or_default()
                .push_back(Slot::Waiting(id));
        }
        self.deferred.insert(
            id,
            Deferred {
                to,
                header,
                deadline,
            },
        );
    }

    /// Sends a message now, or queues it behind messages to the same peer still waiting for
    /// their body.
    fn send_out(&mut self, t: Transmit<B>) {
        self.count_activity(Some(&t.header));
        match self.held.get_mut(&t.to) {
            Some(queue) => queue.push_back(Slot::Ready(t)),
            None => self.transmits.push_back(t),
        }
    }

    /// Moves the ready messages at the front of `to`'s held queue out.
    fn flush_held(&mut self, to: WorkerId) {
        let Some(queue) = self.held.get_mut(&to) else {
            return;
        };
        while let Some(Slot::Ready(_)) = queue.front() {
            if let Some(Slot::Ready(t)) = queue.pop_front() {
                self.transmits.push_back(t);
            }
        }
        if queue.is_empty() {
            self.held.remove(&to);
        }
    }
}

/// The deadline of something that started `now` with `timeout` (zero: none). A timeout past
/// what the clock can represent (a peer may send `Duration::MAX`) is none as well, not a panic.
fn deadline_after(now: Instant, timeout: Duration) -> Option<Instant> {
    if timeout.is_zero() {
        return None;
    }
    now.checked_add(timeout)
}

#[cfg(test)]
mod tests;
