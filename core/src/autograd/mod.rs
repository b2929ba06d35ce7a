//! Distributed autograd as a pure state machine: PyTorch's FAST mode.
//!
//! A forward pass that crosses workers leaves, on every worker it touched, an *autograd
//! context*: a [`ContextId`] (the creating worker's id in the high bits, a counter in the low
//! bits) with
//!
//! - a **send record** for every message that carried tracked tensors *out* of this worker
//!   (keyed by the [`AutogradMessageId`] the message carried, and naming its receiver),
//! - a **recv record** for every such message that came *in* (naming its sender),
//! - the set of **known workers**: every worker this one sent to or received from in the
//!   context.
//!
//! The backward pass follows PyTorch's FAST mode:
//!
//! - every send function has exactly one dependency, the gradient its receiver sends back: it
//!   runs as soon as that gradient arrives ([`DistAutograd::handle_gradient`]);
//! - a worker prepares its part of the context (its local dependencies) when the first
//!   gradient for that context arrives, or when it starts the backward itself
//!   ([`Output::Prepare`]);
//! - when the local engine reaches a recv function, its gradient goes back to the sender with
//!   (context, message id) ([`Output::SendGradient`]); the sender runs the matching send
//!   function.
//!
//! **Gradients in answers** (not in PyTorch): when the run a gradient request started reaches
//! only recv functions of messages that the requester itself sent here in a request (the usual
//! shape of a pipeline: the gradient of a call's result comes back to the callee, whose
//! gradient for the call's arguments goes back to the caller), those gradients ride in the
//! answer to the request ([`Output::ReplyWithGradients`]) instead of a request each: the
//! requester runs their send functions itself, as part of the work that sent the request
//! ([`DistAutograd::handle_gradient_reply_with`]). PyTorch sends a new request and its
//! answer back for each: two messages per hop that this saves, and on a chain the answers
//! that travel back hop by hop. Completion is unchanged: the requester's work is done once
//! the runs the answer started are.
//!
//! **Completion** is PyTorch's: a gradient request is answered once the local work it started
//! is done *and* every gradient request that work sent on has been answered, so
//! [`Output::BackwardDone`] on the root worker means every worker the backward reached has
//! finished, cycles (A→B→C→A) included.
//!
//! **Release** ([`DistAutograd::release`]) drops the context here and tells every known worker,
//! which drops it and tells *its* known workers (the fan-out stops at workers that no longer
//! have it). A **lost peer** ([`DistAutograd::handle_peer_lost`]) fails every backward that
//! involves it, naming it, and drops (with the same fan-out) every context that it made or
//! that knew it, whether or not a backward runs: no survivor keeps a context for a dead worker
//! (PyTorch leaks them, pytorch#26379). Nothing from a lost peer is recorded afterwards, and no
//! tracked tensor goes to it ([`RecvError::PeerLost`], [`AutogradError::PeerLost`]), until a
//! worker joins under its id ([`DistAutograd::handle_peer_joined`]). Every gradient request is
//! answered, even one from the worker that released the context or died.
//!
//! A backward that **fails** without a loss (an engine error on some worker, a gradient request
//! that timed out or was refused) leaves the context usable everywhere, as PyTorch does: the
//! failure travels back to the root, which reports it once every piece of work the pass started
//! has answered (so nothing of the failed pass still runs when the next one starts, unless a
//! request timed out: a timeout counts as an answer), and a later backward in the context may
//! succeed. Only a lost peer (or a release) drops a context.
//!
//! **Roots** are checked before anything runs ([`DistAutograd::backward`], [`Root`]): at least
//! one; each requires grad; each is a scalar or comes with a seed gradient of its shape. A
//! refused backward changes nothing (PyTorch's `dist_autograd.backward` raises at once too; it
//! takes no seeds, so its roots must all be scalars).
//!
//! A **late gradient** (one for a context this worker dropped, by a release or a loss, that
//! crossed the release on the wire) is dropped, as DESIGN says: nothing runs, the request is
//! answered with the reason the context went (so the sender's work ends) and it is counted
//! ([`DistAutograd::late_gradients`]) for the driver to log. It is not a violation.
//!
//! Input is checked against state: a gradient for a context this worker never had, from a
//! worker outside the context, for a message id this worker never sent to that worker, or a recv record with
//! a forged message id is a [`ProtocolViolation`]; the state is left unchanged.
//!
//! The state machine never touches a tensor: the driver keeps them under the ids given here
//! and runs its engine (see [`crate::ports::autograd`]) when told to ([`Output::RunLocal`]).
//! `sim` (tests and the `sim` feature) runs whole clusters of these state machines with a model engine and checks the
//! gradients, completion and release under seeded random schedules and worker deaths.

mod errors;
mod incoming;
pub mod inline;
pub mod optim;
mod roots;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
#[cfg(test)]
mod tests;

pub use errors::{AutogradError, BackwardError, ProtocolViolation, RecvError};
pub use roots::{check_roots, Root, RootProblem};

/// What [`DistAutograd::handle_recv`] did with a message it took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recv {
    /// Recorded in its context (made here by this message if it is the first).
    Recorded,
    /// The context's creator presented a capability other than the one an earlier message from
    /// another worker made the context here with: that copy was a forgery's. It was discarded
    /// (its work failed, none of its members told) and the context made again from this
    /// message. The driver drops what it kept for the context before recording this message.
    ReplacedForgery,
    /// Nothing recorded yet: the message presented a capability other than that of the copy
    /// of the context held here, and neither can be trusted over the other (both came from
    /// workers other than the creator, and the creator has vouched for neither). One is a
    /// forgery's: a worker that guessed the id reached this worker first, or the sender is
    /// passing on a guessed context. The driver asks the context's creator whether the
    /// presented capability is its own ([`vouches`](DistAutograd::vouches) there) and hands
    /// the answer to [`handle_vouch`](DistAutograd::handle_vouch), which records the message
    /// or refuses it.
    AskCreator,
}

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::capability::{derive, same, Capability};
use crate::name::WorkerId;

/// Bits of a [`ContextId`] or [`AutogradMessageId`] below the worker id.
const COUNTER_BITS: u32 = 32;
const COUNTER_MASK: u64 = (1 << COUNTER_BITS) - 1;

/// What the capabilities of autograd contexts are derived under.
const CONTEXT_LABEL: &[u8] = b"tensorwire autograd context";

/// How many failure-dropped contexts of its own a worker remembers the cause of.
pub const DROPPED_KEPT: usize = 1024;

/// How many contexts dropped here (released, or dropped by a loss) a worker remembers, so that
/// a gradient arriving for one after it is gone is known as late (dropped, answered with the
/// reason) rather than taken for a forged message.
pub const GONE_KEPT: usize = 1024;

/// The default of [`DistAutograd::set_contexts_per_peer`]: how many contexts made by other
/// workers one peer's messages may make this worker hold at once.
pub const DEFAULT_CONTEXTS_PER_PEER: usize = 4096;

/// A distributed autograd context: the creating worker's id in the high 32 bits, that worker's
/// counter in the low 32 bits (PyTorch: 16 and 48; our worker ids are 32-bit).
///
/// ```
/// use tensorwire_core::autograd::ContextId;
/// let id = ContextId::new(7, 3);
/// assert_eq!((id.worker(), id.counter()), (7, 3));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ContextId(pub u64);

impl ContextId {
    /// The id of the `counter`th context made by `worker`.
    pub fn new(worker: WorkerId, counter: u64) -> Self {
        Self((u64::from(worker) << COUNTER_BITS) | (counter & COUNTER_MASK))
    }

    /// The worker that made the context.
    pub fn worker(self) -> WorkerId {
        (self.0 >> COUNTER_BITS) as WorkerId
    }

    /// The creator's counter.
    pub fn counter(self) -> u64 {
        self.0 & COUNTER_MASK
    }
}

impl fmt::Display for ContextId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "context {}:{}", self.worker(), self.counter())
    }
}

/// The id of a message that carried tracked tensors: the sending worker's id in the high 32
/// bits, its counter in the low 32 bits. The sender keeps a send record and the receiver a recv
/// record under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AutogradMessageId(pub u64);

impl AutogradMessageId {
    /// The id of the `counter`th message sent by `worker`.
    pub fn new(worker: WorkerId, counter: u64) -> Self {
        Self((u64::from(worker) << COUNTER_BITS) | (counter & COUNTER_MASK))
    }

    /// The worker that sent the message.
    pub fn worker(self) -> WorkerId {
        (self.0 >> COUNTER_BITS) as WorkerId
    }
}

impl fmt::Display for AutogradMessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "message {}:{}", self.worker(), self.0 & COUNTER_MASK)
    }
}

/// A piece of local backward work: the root's backward, or one send function run for a
/// gradient that arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId(pub u64);

/// A gradient request this worker sent (the driver matches its answer to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GradientId(pub u64);

/// The driver's handle for an incoming gradient request, given back in [`Output::Reply`].
pub type RequestToken = u64;

/// Where a local run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// The roots given to [`DistAutograd::backward`], with their seed gradients.
    Roots,
    /// The send function of this message, with the gradient its receiver sent back.
    Send(AutogradMessageId),
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// First backward work for this context here: compute the local dependencies of its graph.
    Prepare {
        /// The context.
        context: ContextId,
    },
    /// Run the local engine from `entry` and report with [`DistAutograd::local_done`] (the
    /// recv functions it reached) or [`DistAutograd::local_failed`]. Gradients of leaves go
    /// into the context's gradients.
    RunLocal {
        /// The task to report on.
        task: TaskId,
        /// The context.
        context: ContextId,
        /// Where the run starts.
        entry: Entry,
    },
    /// Send the gradient of the recv function of `message` to `to` (its sender) and report the
    /// answer with [`DistAutograd::handle_gradient_reply`].
    SendGradient {
        /// The request.
        gradient: GradientId,
        /// The local run that produced the gradient.
        task: TaskId,
        /// The worker that sent `message` in the forward pass.
        to: WorkerId,
        /// The context.
        context: ContextId,
        /// The message whose recv function produced the gradient.
        message: AutogradMessageId,
    },
    /// Answer the gradient request `request` from `to`.
    Reply {
        /// The requester.
        to: WorkerId,
        /// The driver's token for the request.
        request: RequestToken,
        /// Whether its work, and all work it started, succeeded.
        result: Result<(), BackwardError>,
    },
    /// Answer the gradient request `request` from `to` with the gradients that the local run
    /// `task` produced for the recv functions of `messages`: all of them messages `to` sent
    /// here in a request ([`DistAutograd::recv_came_in_request`]). The request is over here;
    /// `to` runs their send functions as part of its own work
    /// ([`DistAutograd::handle_gradient_reply_with`]).
    ReplyWithGradients {
        /// The requester, the sender of every message in `messages`.
        to: WorkerId,
        /// The driver's token for the request.
        request: RequestToken,
        /// The local run whose gradients the answer carries.
        task: TaskId,
        /// The context.
        context: ContextId,
        /// The messages whose recv functions the run reached, in the order found.
        messages: Vec<AutogradMessageId>,
    },
    /// The backward started here finished (every worker it reached is done) or failed.
    BackwardDone {
        /// The context.
        context: ContextId,
        /// The outcome.
        result: Result<(), BackwardError>,
    },
    /// Tell `to` that the context is released.
    Release {
        /// The worker to tell.
        to: WorkerId,
        /// The context.
        context: ContextId,
        /// Why, when a failure released it (the receiver fails its work with this error, so
        /// the root learns which worker was lost); `None` for a plain release.
        cause: Option<BackwardError>,
    },
    /// The context is gone here: free its tensors and gradients.
    Dropped {
        /// The context.
        context: ContextId,
    },
}

#[derive(Debug)]
struct Context {
    /// Message id -> the worker it was sent to, and how many tensors it carried (a gradient
    /// for it carries as many).
    sends: BTreeMap<AutogradMessageId, (WorkerId, usize)>,
    /// Message id -> the worker that sent it.
    recvs: BTreeMap<AutogradMessageId, WorkerId>,
    /// The recvs whose tensors came in a request, so that their gradients may ride in an
    /// answer to their sender ([`DistAutograd::recv_came_in_request`]).
    answerable: BTreeSet<AutogradMessageId>,
    known: BTreeSet<WorkerId>,
    tasks: BTreeSet<TaskId>,
    prepared: bool,
    root_running: bool,
    graph_freed: bool,
    /// The peer whose message made this context here (a context of another worker's, made
    /// by a recv): it counts toward that peer's bound until the context is dropped.
    made_by: Option<WorkerId>,
    /// Its capability: derived here for a context made here, else the one its first message
    /// here presented. Every forward message in it carries it ([`DistAutograd::capability`]).
    capability: Capability,
    /// Whether the creator stands behind `capability`: the context was made here, or by the
    /// creator's message, or a message with it came from the creator or was vouched for by it
    /// ([`DistAutograd::handle_vouch`]). A message presenting another one is then refused
    /// without asking.
    vouched: bool,
}

impl Context {
    fn new(capability: Capability) -> Self {
        Self {
            capability,
            vouched: true,
            made_by: None,
            sends: BTreeMap::new(),
            recvs: BTreeMap::new(),
            answerable: BTreeSet::new(),
            known: BTreeSet::new(),
            tasks: BTreeSet::new(),
            prepared: false,
            root_running: false,
            graph_freed: false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Origin {
    Root {
        retain_graph: bool,
    },
    Gradient {
        from: WorkerId,
        request: RequestToken,
    },
    /// A send function run here for a gradient that came in the answer to a request of the
    /// task `parent` ([`DistAutograd::handle_gradient_reply_with`]): part of its work.
    Continuation {
        parent: TaskId,
    },
}

#[derive(Debug)]
struct Task {
    context: ContextId,
    origin: Origin,
    local_done: bool,
    outstanding: BTreeSet<GradientId>,
    /// The continuation runs started by answers to this task's requests, not yet over.
    children: BTreeSet<TaskId>,
    /// The first failure that leaves the context usable: the task reports it once its local
    /// run and every request it sent are over.
    error: Option<BackwardError>,
}

#[derive(Debug)]
struct Outgoing {
    task: TaskId,
    /// Where the request went.
    to: WorkerId,
}

/// One worker's distributed autograd state: its contexts, its running backward work and the
/// gradient requests it waits for.
///
/// Commands: [`new_context`](Self::new_context), [`record_send`](Self::record_send),
/// [`backward`](Self::backward), [`release`](Self::release). Input: `handle_*`,
/// [`local_done`](Self::local_done) and [`local_failed`](Self::local_failed). Output:
/// [`poll`](Self::poll).
#[derive(Debug)]
pub struct DistAutograd {
    me: WorkerId,
    next_context: u64,
    next_message: u64,
    next_task: u64,
    next_gradient: u64,
    contexts: BTreeMap<ContextId, Context>,
    tasks: BTreeMap<TaskId, Task>,
    outgoing: BTreeMap<GradientId, Outgoing>,
    /// Workers declared lost (and not back since): no context is made with them again.
    lost: BTreeSet<WorkerId>,
    /// Why contexts made here were dropped by a failure, until the user lets go of them
    /// ([`forget`](Self::forget)); at most [`DROPPED_KEPT`], the oldest forgotten first.
    dropped: BTreeMap<ContextId, BackwardError>,
    /// Contexts dropped here and the error they went with, at most [`GONE_KEPT`]; `gone_order`
    /// holds them oldest first.
    gone: BTreeMap<ContextId, BackwardError>,
    gone_order: VecDeque<ContextId>,
    /// Gradients dropped because their context was gone here.
    late_gradients: u64,
    /// How many contexts of other workers' each peer's messages made here (and are held).
    made_by_peer: BTreeMap<WorkerId, usize>,
    /// The bound on them, per peer.
    contexts_per_peer: usize,
    /// The key of the capabilities of the contexts made here ([`set_secret_key`](Self::set_secret_key)).
    secret_key: [u8; 32],
    /// Whether gradients may ride in answers ([`set_gradients_in_replies`](Self::set_gradients_in_replies)).
    gradients_in_replies: bool,
    out: VecDeque<Output>,
}

impl DistAutograd {
    /// The state of worker `me`.
    pub fn new(me: WorkerId) -> Self {
        Self {
            me,
            next_context: 0,
            next_message: 0,
            next_task: 0,
            next_gradient: 0,
            contexts: BTreeMap::new(),
            tasks: BTreeMap::new(),
            outgoing: BTreeMap::new(),
            lost: BTreeSet::new(),
            dropped: BTreeMap::new(),
            gone: BTreeMap::new(),
            gone_order: VecDeque::new(),
            late_gradients: 0,
            made_by_peer: BTreeMap::new(),
            contexts_per_peer: DEFAULT_CONTEXTS_PER_PEER,
            secret_key: crate::capability::default_key(me),
            gradients_in_replies: true,
            out: VecDeque::new(),
        }
    }

    /// Sets how many contexts of other workers' one peer's messages may make this worker hold
    /// at once (default [`DEFAULT_CONTEXTS_PER_PEER`]). A message that would make one more is
    /// refused with [`RecvError::TooManyContexts`] and records nothing; contexts already held
    /// stay. A context counts toward the peer whose message made it here until it is dropped
    /// (released, or dropped by a loss); messages in a context already held are not counted.
    pub fn set_contexts_per_peer(&mut self, limit: usize) {
        self.contexts_per_peer = limit;
    }

    /// Whether a gradient request's answer may carry the gradients its run produced for its
    /// requester ([`Output::ReplyWithGradients`]; default on). Off, every gradient goes in a
    /// request of its own, as in PyTorch.
    pub fn set_gradients_in_replies(&mut self, on: bool) {
        self.gradients_in_replies = on;
    }

    /// The bound set by [`set_contexts_per_peer`](Self::set_contexts_per_peer).
    pub fn contexts_per_peer(&self) -> usize {
        self.contexts_per_peer
    }

    /// How many contexts of other workers' `peer`'s messages made this worker hold (see
    /// [`set_contexts_per_peer`](Self::set_contexts_per_peer)).
    pub fn contexts_made_by(&self, peer: WorkerId) -> usize {
        self.made_by_peer.get(&peer).copied().unwrap_or(0)
    }

    // --- getters ---

    /// This worker's id.
    pub fn worker(&self) -> WorkerId {
        self.me
    }

    /// How many contexts this worker holds.
    pub fn context_count(&self) -> usize {
        self.contexts.len()
    }

    /// Whether this worker holds `context`.
    pub fn has_context(&self, context: ContextId) -> bool {
        self.contexts.contains_key(&context)
    }

    /// The contexts this worker holds.
    pub fn contexts(&self) -> impl Iterator<Item = ContextId> + '_ {
        self.contexts.keys().copied()
    }

    /// The workers this worker exchanged tracked tensors with in `context`.
    pub fn known_workers(&self, context: ContextId) -> Option<Vec<WorkerId>> {
        self.contexts
            .get(&context)
            .map(|c| c.known.iter().copied().collect())
    }

    /// The send records of `context`: message id and receiver.
    pub fn send_records(&self, context: ContextId) -> Vec<(AutogradMessageId, WorkerId)> {
        self.contexts
            .get(&context)
            .map(|c| c.sends.iter().map(|(m, (w, _))| (*m, *w)).collect())
            .unwrap_or_default()
    }

    /// The worker `message` was sent to in `context`, and how many tensors it carried; `None`
    /// when this worker holds no such send record.
    pub fn sent(
        &self,
        context: ContextId,
        message: AutogradMessageId,
    ) -> Option<(WorkerId, usize)> {
        self.contexts.get(&context)?.sends.get(&message).copied()
    }

    /// The recv records of `context`: message id and sender.
    pub fn recv_records(&self, context: ContextId) -> Vec<(AutogradMessageId, WorkerId)> {
        self.contexts
            .get(&context)
            .map(|c| c.recvs.iter().map(|(m, w)| (*m, *w)).collect())
            .unwrap_or_default()
    }

    /// How many pieces of backward work are running (local runs or waiting for answers).
    pub fn running_tasks(&self) -> usize {
        self.tasks.len()
    }

    /// Whether backward work of `context` is running here.
    pub fn is_busy(&self, context: ContextId) -> bool {
        self.contexts
            .get(&context)
            .is_some_and(|c| !c.tasks.is_empty())
    }

    /// How many gradients arrived for a context already dropped here (late: dropped and
    /// answered with the reason the context went, see [`handle_gradient`](Self::handle_gradient)).
    pub fn late_gradients(&self) -> u64 {
        self.late_gradients
    }

    /// Whether nothing is running and no answer is awaited.
    pub fn is_idle(&self) -> bool {
        self.tasks.is_empty() && self.outgoing.is_empty() && self.out.is_empty()
    }

    // --- commands ---

    /// A new context made by this worker.
    pub fn new_context(&mut self) -> Result<ContextId, AutogradError> {
        if self.next_context > COUNTER_MASK {
            return Err(AutogradError::IdsExhausted(self.me));
        }
        let id = ContextId::new(self.me, self.next_context);
        self.next_context += 1;
        let capability = derive(&self.secret_key, CONTEXT_LABEL, &[id.0]);
        self.contexts.insert(id, Context::new(capability));
        Ok(id)
    }

    /// Whether `capability` is that of `context`, a context this worker made (held still or
    /// not): the creator's answer to a worker whose [`handle_recv`](Self::handle_recv) said
    /// [`Recv::AskCreator`]. A context of another worker's, or one never made here, is vouched
    /// for by nobody here. It tells the asker one bit about a 128-bit value it presented.
    pub fn vouches(&self, context: ContextId, capability: Capability) -> bool {
        context.worker() == self.me
            && context.counter() < self.next_context
            && same(
                derive(&self.secret_key, CONTEXT_LABEL, &[context.0]),
                capability,
            )
    }

    /// Sets the key the capabilities of the contexts made here are derived from. The driver
    /// passes 32 bytes of real entropy (simulations: a seeded generator) before making any
    /// context; with the default key a peer could compute them.
    pub fn set_secret_key(&mut self, key: [u8; 32]) {
        self.secret_key = key;
    }

    /// The capability of `context`, held here: what every forward message in it carries
    /// ([`handle_recv`](Self::handle_recv) checks it).
    pub fn capability(&self, context: ContextId) -> Option<Capability> {
        self.contexts.get(&context).map(|c| c.capability)
    }

    /// Records that a message carrying `tensors` tracked tensors leaves for `to` in `context`;
    /// the message carries the returned id. The driver keeps the tensors sent under it (the
    /// send function). A gradient for it must carry as many
    /// ([`handle_gradient`](Self::handle_gradient)).
    pub fn record_send(
        &mut self,
        context: ContextId,
        to: WorkerId,
        tensors: usize,
    ) -> Result<AutogradMessageId, AutogradError> {
        if self.next_message > COUNTER_MASK {
            return Err(AutogradError::IdsExhausted(self.me));
        }
        if self.lost.contains(&to) {
            return Err(AutogradError::PeerLost {
                worker: to,
                context,
            });
        }
        let ctx = self
            .contexts
            .get_mut(&context)
            .ok_or_else(|| missing(&self.dropped, context))?;
        let id = AutogradMessageId::new(self.me, self.next_message);
        self.next_message += 1;
        ctx.sends.insert(id, (to, tensors));
        ctx.known.insert(to);
        Ok(id)
    }

    /// Starts a backward pass in `context` from `roots` held here. The roots are checked
    /// first ([`check_roots`]); a refused backward changes nothing. The driver gets
    /// [`Output::Prepare`] (first time) and [`Output::RunLocal`] with [`Entry::Roots`], and in
    /// the end [`Output::BackwardDone`]. A pass that fails without a loss leaves the graph and
    /// the context as they were; one that succeeds without `retain_graph` frees the graph.
    pub fn backward(
        &mut self,
        context: ContextId,
        retain_graph: bool,
        roots: &[Root],
    ) -> Result<TaskId, AutogradError> {
        let ctx = self
            .contexts
            .get_mut(&context)
            .ok_or_else(|| missing(&self.dropped, context))?;
        if ctx.root_running {
            return Err(AutogradError::BackwardRunning(context));
        }
        if ctx.graph_freed {
            return Err(AutogradError::GraphFreed(context));
        }
        check_roots(roots).map_err(|problem| AutogradError::InvalidRoots { context, problem })?;
        ctx.root_running = true;
        Ok(self.start_task(context, Origin::Root { retain_graph }, Entry::Roots))
    }

    /// Why `context` (made here) was dropped by a failure, if it was and the user has not let
    /// go of it yet.
    pub fn dropped_cause(&self, context: ContextId) -> Option<&BackwardError> {
        self.dropped.get(&context)
    }

    /// The user let go of `context` (released or dropped its handle): a cause kept for it is
    /// forgotten.
    pub fn forget(&mut self, context: ContextId) {
        self.dropped.remove(&context);
    }

    /// Releases `context`: drops it here (failing any backward work in it) and tells every
    /// known worker. Releasing a context this worker does not hold is an error.
    pub fn release(&mut self, context: ContextId) -> Result<(), AutogradError> {
        if !self.contexts.contains_key(&context) {
            return Err(AutogradError::UnknownContext(context));
        }
        let error = BackwardError::Released {
            worker: self.me,
            context,
        };
        self.drop_context(context, None, &error, false);
        Ok(())
    }

    // --- input ---

    /// `peer` is gone: every context that it made or that knew it fails its backward work
    /// (naming `peer`) and is dropped here, with a release to the other known workers. This
    /// holds whether or not a backward is running: a context whose forward pass reached a
    /// worker that then died is dropped too (PyTorch keeps it until shutdown, pytorch#26379).
    /// From now on no message from `peer` is recorded and no tracked tensor goes to it, until
    /// [`handle_peer_joined`](Self::handle_peer_joined). Telling it twice is harmless.
    pub fn handle_peer_lost(&mut self, peer: WorkerId) {
        self.lost.insert(peer);
        let hit: Vec<ContextId> = self
            .contexts
            .iter()
            .filter(|(id, c)| id.worker() == peer || c.known.contains(&peer))
            .map(|(id, _)| *id)
            .collect();
        for context in hit {
            let error = BackwardError::PeerLost {
                worker: peer,
                context,
            };
            self.drop_context(context, Some(peer), &error, true);
        }
    }

    /// A worker joined the group under `peer`'s id (a dynamic group reuses the id of a worker
    /// that left or died): contexts with it may be made again.
    pub fn handle_peer_joined(&mut self, peer: WorkerId) {
        self.lost.remove(&peer);
        // The newcomer counts its contexts from zero again: the old worker's dropped contexts
        // are no longer its.
        self.gone.retain(|c, _| c.worker() != peer);
        self.gone_order.retain(|c| c.worker() != peer);
    }

    /// Whether `peer` was declared lost (and has not joined again since).
    pub fn is_lost(&self, peer: WorkerId) -> bool {
        self.lost.contains(&peer)
    }

    /// The local run of `task` finished; it reached the recv functions of `reached` (their
    /// gradients go to their senders). A task no longer running (its context was dropped) is
    /// ignored. A message id that is not a recv record of the context fails the task.
    pub fn local_done(&mut self, task: TaskId, reached: &[AutogradMessageId]) {
        let Some(t) = self.tasks.get(&task) else {
            return;
        };
        let context = t.context;
        let Some(ctx) = self.contexts.get(&context) else {
            return;
        };
        let origin = t.origin;
        let mut targets = Vec::with_capacity(reached.len());
        for m in reached {
            match ctx.recvs.get(m) {
                Some(from) => targets.push((*m, *from)),
                None => {
                    let e = BackwardError::Engine {
                        worker: self.me,
                        context,
                        reason: format!("the engine reached {m}, which has no recv record"),
                    };
                    if let Some(t) = self.tasks.get_mut(&task) {
                        t.local_done = true;
                    }
                    self.fail_task(task, e);
                    return;
                }
            }
        }
        // Every gradient goes back to the requester, for messages it sent here in a request:
        // they ride in the answer, and the requester runs their send functions itself.
        if let Origin::Gradient { from, request } = origin {
            let carried = self.gradients_in_replies
                && !targets.is_empty()
                && targets
                    .iter()
                    .all(|(m, to)| *to == from && ctx.answerable.contains(m));
            let clean = self.tasks.get(&task).is_some_and(|t| {
                t.outstanding.is_empty() && t.children.is_empty() && t.error.is_none()
            });
            if carried && clean {
                // The request is over here: the requester's work goes on with the gradients.
                self.tasks.remove(&task);
                if let Some(ctx) = self.contexts.get_mut(&context) {
                    ctx.tasks.remove(&task);
                }
                self.out.push_back(Output::ReplyWithGradients {
                    to: from,
                    request,
                    task,
                    context,
                    messages: targets.into_iter().map(|(m, _)| m).collect(),
                });
                return;
            }
        }
        for (message, to) in targets {
            let gradient = GradientId(self.next_gradient);
            self.next_gradient += 1;
            self.outgoing.insert(gradient, Outgoing { task, to });
            if let Some(t) = self.tasks.get_mut(&task) {
                t.outstanding.insert(gradient);
            }
            self.out.push_back(Output::SendGradient {
                gradient,
                task,
                to,
                context,
                message,
            });
        }
        if let Some(t) = self.tasks.get_mut(&task) {
            t.local_done = true;
        }
        self.maybe_complete(task);
    }

    /// The local run of `task` failed.
    pub fn local_failed(&mut self, task: TaskId, reason: impl Into<String>) {
        let Some(t) = self.tasks.get(&task) else {
            return;
        };
        let e = BackwardError::Engine {
            worker: self.me,
            context: t.context,
            reason: reason.into(),
        };
        // The run is over (it sent nothing).
        if let Some(t) = self.tasks.get_mut(&task) {
            t.local_done = true;
        }
        self.fail_task(task, e);
    }

    // --- output ---

    /// The next thing the driver must do.
    pub fn poll(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    // --- internals ---

    fn start_task(&mut self, context: ContextId, origin: Origin, entry: Entry) -> TaskId {
        let task = TaskId(self.next_task);
        self.next_task += 1;
        let ctx = self
            .contexts
            .get_mut(&context)
            .expect("callers check the context");
        if !ctx.prepared {
            ctx.prepared = true;
            self.out.push_back(Output::Prepare { context });
        }
        ctx.tasks.insert(task);
        self.tasks.insert(
            task,
            Task {
                context,
                origin,
                local_done: false,
                outstanding: BTreeSet::new(),
                children: BTreeSet::new(),
                error: None,
            },
        );
        self.out.push_back(Output::RunLocal {
            task,
            context,
            entry,
        });
        task
    }

    fn maybe_complete(&mut self, task: TaskId) {
        let done = self
            .tasks
            .get(&task)
            .is_some_and(|t| t.local_done && t.outstanding.is_empty() && t.children.is_empty());
        if !done {
            return;
        }
        let mut t = self.tasks.remove(&task).expect("checked above");
        let result = t.error.take().map_or(Ok(()), Err);
        let ctx = self.contexts.get_mut(&t.context);
        if let Some(ctx) = ctx {
            ctx.tasks.remove(&task);
            if let Origin::Root { retain_graph } = t.origin {
                ctx.root_running = false;
                ctx.graph_freed |= result.is_ok() && !retain_graph;
            }
        }
        self.finish(task, t, result);
    }

    fn finish(&mut self, id: TaskId, t: Task, result: Result<(), BackwardError>) {
        match t.origin {
            Origin::Continuation { parent } => {
                if let Some(p) = self.tasks.get_mut(&parent) {
                    p.children.remove(&id);
                }
                match result {
                    Ok(()) => self.maybe_complete(parent),
                    Err(e) => self.fail_task(parent, e),
                }
            }
            Origin::Root { .. } => self.out.push_back(Output::BackwardDone {
                context: t.context,
                result,
            }),
            Origin::Gradient { from, request } => self.out.push_back(Output::Reply {
                to: from,
                request,
                result,
            }),
        }
    }

    /// Fails `task`. An error that leaves the context usable is kept, and the task reports it
    /// once its local run and its requests are over ([`maybe_complete`](Self::maybe_complete)).
    /// An error that means the context is gone ([`BackwardError::drops_context`]) fails the
    /// task at once, and a root releases its context everywhere. Either way a failed gradient
    /// request is answered with the error (its requester fails in turn).
    fn fail_task(&mut self, task: TaskId, error: BackwardError) {
        if !error.drops_context() {
            if let Some(t) = self.tasks.get_mut(&task) {
                t.error.get_or_insert(error);
            }
            self.maybe_complete(task);
            return;
        }
        let Some(t) = self.tasks.remove(&task) else {
            return;
        };
        self.outgoing.retain(|_, o| o.task != task);
        let context = t.context;
        let is_root = matches!(t.origin, Origin::Root { .. });
        if let Some(ctx) = self.contexts.get_mut(&context) {
            ctx.tasks.remove(&task);
            if is_root {
                ctx.root_running = false;
            }
        }
        if is_root && self.contexts.contains_key(&context) {
            self.drop_context(context, None, &error, true);
        }
        self.finish(task, t, Err(error));
    }

    /// Drops `context`: its running work fails with `error`, every known worker but `except`
    /// is told (with `error` as the cause when `failure`), and the driver frees it.
    /// Takes `context` out: it no longer counts toward the bound of the peer whose message
    /// made it, and its running work fails with `error`. Nothing is told or freed (see
    /// [`drop_context`](Self::drop_context) and [`discard_forged`](Self::discard_forged)).
    fn remove_context(&mut self, context: ContextId, error: &BackwardError) -> Option<Context> {
        let ctx = self.contexts.remove(&context)?;
        if let Some(peer) = ctx.made_by {
            if let Some(made) = self.made_by_peer.get_mut(&peer) {
                *made -= 1;
                if *made == 0 {
                    self.made_by_peer.remove(&peer);
                }
            }
        }
        for task in &ctx.tasks {
            if let Some(t) = self.tasks.remove(task) {
                self.outgoing.retain(|_, o| o.task != *task);
                // Every request is answered, even one from the lost (or releasing) worker:
                // nobody may read that answer, but the driver learns that the request is over
                // (and stops serving it) instead of waiting for an answer that never comes.
                self.finish(*task, t, Err(error.clone()));
            }
        }
        Some(ctx)
    }

    fn drop_context(
        &mut self,
        context: ContextId,
        except: Option<WorkerId>,
        error: &BackwardError,
        failure: bool,
    ) {
        let Some(ctx) = self.remove_context(context, error) else {
            return;
        };
        if self.gone.insert(context, error.clone()).is_none() {
            self.gone_order.push_back(context);
        }
        while self.gone_order.len() > GONE_KEPT {
            if let Some(old) = self.gone_order.pop_front() {
                self.gone.remove(&old);
            }
        }
        if failure && context.worker() == self.me {
            self.dropped.insert(context, error.clone());
            while self.dropped.len() > DROPPED_KEPT {
                self.dropped.pop_first();
            }
        }
        for to in ctx.known {
            if Some(to) != except && to != self.me {
                self.out.push_back(Output::Release {
                    to,
                    context,
                    cause: failure.then(|| error.clone()),
                });
            }
        }
        self.out.push_back(Output::Dropped { context });
    }
}

/// The error for a context this worker does not hold: why it was dropped, if known.
fn missing(dropped: &BTreeMap<ContextId, BackwardError>, context: ContextId) -> AutogradError {
    match dropped.get(&context) {
        Some(cause) => AutogradError::Dropped {
            context,
            cause: cause.clone(),
        },
        None => AutogradError::UnknownContext(context),
    }
}
