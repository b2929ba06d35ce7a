//! Distributed autograd (`torch.distributed.autograd`), shaped for Rust.
//!
//! [`DistAutograd`] sets it up on an agent with a local engine (an
//! [`AutogradEngine`], e.g. `tensorwire-autograd-candle`) on a [`tensorwire_rpc`] agent. A [`AutogradContext`] made from it
//! scopes one forward and backward pass: calls made through it
//! ([`rpc_sync`](AutogradContext::rpc_sync), [`rpc_async`](AutogradContext::rpc_async),
//! [`remote`](AutogradContext::remote), [`rref_rpc_sync`](AutogradContext::rref_rpc_sync)) carry their tracked tensors with the
//! context id and an autograd message id, so the callee records a recv function and the
//! caller a send function for them (and the other way round for the result's tensors).
//! [`backward`](AutogradContext::backward) runs PyTorch's FAST mode
//! ([`tensorwire_core::autograd`] decides; this module moves the messages and runs the engine),
//! and returns once every worker it reached is done. Each worker keeps the gradients it
//! computed in the context ([`gradients`](AutogradContext::gradients)).
//!
//! Tracked tensors travel beside the arguments, as a list: a function registered with
//! [`DistAutograd::register`] gets them as engine tensors, with recv functions attached, and
//! returns the tensors of its result the same way. Every call made in a context is recorded on
//! both sides, even one that carries no tensor (PyTorch records every Python call in a context
//! the same way), so the callee holds the context and may return tracked tensors, or send them
//! on, whatever its arguments: PyTorch's usual model, whose input needs no grad and whose
//! first stage returns a tensor that does, works from its first step.
//!
//! [`AutogradContext::to_here`] is `rref.to_here()` inside a context: the tensors of the value
//! come back tracked both ways (the fetch is recorded, and so is the reply), so their gradients
//! reach the owner: a [`Parameter`] fetched from a parameter server gets its gradient there,
//! where a [`DistributedOptimizer`] steps it; a [`TensorList`]
//! made by [`AutogradContext::remote`] carries gradients back through the graph it was computed
//! in. Other value types take part once they implement [`TrackedValue`] and are registered
//! ([`DistAutograd::register_tracked_value`]). A plain [`RRef::to_here`] only copies values.
//!
//! **Backward.** [`AutogradContext::backward`] checks its roots before anything runs (at least
//! one; each requires grad; each a scalar unless it comes with a seed of its shape) and refuses
//! bad ones with [`AutogradError::InvalidRoots`], changing nothing. A backward that fails on
//! some worker without losing it (its engine failed, a gradient request timed out) fails
//! naming that worker once all the work it started has answered (or timed out), and leaves
//! the context usable on every worker: a later backward in it may succeed (PyTorch's
//! `test_multiple_backward_with_errors`). Only a lost peer drops a context.
//!
//! **Where this differs from PyTorch on purpose**: `backward` takes seed gradients (PyTorch's
//! `dist_autograd.backward` takes scalar roots only); a failed backward is reported once all
//! the work it started has answered or timed out, not at its first error, so nothing of it
//! still runs when the next one starts (but on a worker that timed out); there is no ambient
//! "current context" (a thread-local in PyTorch): calls are tracked when made through an
//! [`AutogradContext`], and only those; a lost peer
//! drops every context it took part in on every survivor at once (PyTorch keeps them until
//! shutdown, pytorch#26379).
//!
//! Under the hood the calls are registered functions of the agent (`__tw_autograd/...`), like
//! PyTorch's autograd message types: forward calls wrap the user's arguments with
//! (context, message id, tensors); gradients go back with (context, message id) and are
//! answered once the receiver's work, and all work it started, is done; releases fan out.
//! When the work a gradient started reaches only recv functions of tensors the requester sent
//! it in a request, to the host, their gradients ride in the answer instead of requests of
//! their own, and the requester runs their send functions itself (the core's
//! `Output::ReplyWithGradients`): a chain of calls costs one message per hop backward, where
//! PyTorch's costs two and the answers that travel back hop by hop. A context's owner releases
//! it without waiting for the other workers ([`AutogradContext::release_in_background`], as
//! PyTorch does), or waiting ([`AutogradContext::release`]).
//! A gradient for an unknown context, or from a worker outside the context, a release from a
//! worker outside it, a message in a context forged under this worker's id or under a
//! message id that is not the sender's own is a protocol violation
//! ([`tensorwire_core::autograd::ProtocolViolation`], decided by the state machine): this
//! worker drops the sender as it drops one that breaks the RPC protocol
//! (`LostCause::Misbehaved` with `ProtocolViolation::Autograd`; its calls fail naming it,
//! every context it took part in is dropped here) and carries on with the others.
//!
//! **Bounds.** The contexts of other workers' that one peer's calls make this worker hold are
//! bounded ([`DistAutograd::set_contexts_per_peer`]): a call beyond the bound runs nothing
//! and fails naming it, and the caller stays.
//!
//! **Lost peers.** [`DistAutograd`] follows the agent's [`peer_events`](Agent::peer_events):
//! when a peer's connection breaks, every context that peer made or took part in is dropped
//! here at once (a backward running in it fails naming the peer), whether or not a backward
//! runs, so no survivor keeps a dead worker's contexts.
//!
//! **Devices.** The engine computes on the host: a tracked tensor that lands on a device (by a
//! device map) is copied to the host for it, and the device is kept. Its gradient is put back
//! on that device and travels by the reverse of the map the forward message took (a request's
//! tensors: this worker's reverse map for the sender; a response's: this worker's map for it),
//! so it arrives where the tensor came from; the receiver copies it to the host for its engine.
//!
//! **The distributed optimizer** (`optim`, re-exported at the crate root:
//! [`DistributedOptimizer`]) is part of it: it steps parameters
//! with the gradients a context left on their owners, and [`DistAutograd::new`] registers its
//! owner side on every worker.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tensorwire_core::autograd::inline::{InlineRuns, RunOn};
use tensorwire_core::autograd::{
    AutogradError, AutogradMessageId, BackwardError, ContextId, DistAutograd as State, Entry,
    GradientId, Output, RecvError, RequestToken, Root, TaskId,
};
use tensorwire_core::capability::Capability;
use tensorwire_core::device::Device;
use tensorwire_core::placement::Direction;
use tensorwire_core::ports::autograd::{AutogradEngine, EngineError, LeafGradients};
use tensorwire_core::ports::device::relocate;
use tensorwire_core::protocol::{CallError, WorkerId};
use tensorwire_core::tensor::Tensor;
use tokio::sync::oneshot;
use tracing::{debug, warn, Instrument};

use tensorwire_core::tensor::Tensor as HostTensor;
use tensorwire_rpc::{Agent, CallContext, InitError, PeerEvent, RRef, RpcError};

mod engine;
mod inspect;
pub mod optim;
mod release;
mod responding;

pub use inspect::FunctionRecord;
pub use optim::{BuiltinState, DistributedOptimizer, LocalOptimizer, Parameter};
pub use responding::Responder;
pub use tensorwire_core::autograd::optim::{Adagrad, Adam, AdamW, Optimizer, RmsProp, Sgd};

const GRAD: &str = "__tw_autograd/grad";
const RELEASE: &str = "__tw_autograd/release";
const VOUCH: &str = "__tw_autograd/vouch";
const FN_PREFIX: &str = "__tw_autograd/fn/";
const METHOD_PREFIX: &str = "__tw_autograd/method/";
const REMOTE_PREFIX: &str = "__tw_autograd/remote/";
const FETCH_PREFIX: &str = "__tw_autograd/to_here/";

/// What can go wrong in distributed autograd.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistAutogradError {
    /// An RPC of the forward pass failed.
    #[error(transparent)]
    Rpc(#[from] RpcError),
    /// The local engine failed (a tensor it cannot hold, shapes that do not match, ...).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The call does not fit the context's state (unknown or released context, a backward
    /// already running, a freed graph).
    #[error(transparent)]
    State(#[from] AutogradError),
    /// The backward pass failed; the message names the worker at fault.
    #[error("distributed backward failed: {message}")]
    Backward {
        /// What happened, with worker names.
        message: String,
        /// The rank of the worker at fault.
        worker: WorkerId,
        /// The protocol's error.
        source: BackwardError,
    },
    /// A distributed optimizer's hyper-parameters are invalid.
    #[error("invalid {optimizer} optimizer: {message}")]
    Optimizer {
        /// The optimizer's [`LocalOptimizer::NAME`].
        optimizer: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A peer sent an autograd message it had no right to send.
    #[error("protocol violation by {from}: {message}")]
    Violation {
        /// The peer's name.
        from: String,
        /// What was wrong.
        message: String,
    },
}

/// The request of a forward call made in a context.
#[derive(Serialize, Deserialize)]
struct ForwardRequest<A> {
    context: ContextId,
    /// The context's capability: only the workers it was passed to know it, and the callee
    /// checks it (`tensorwire_core::autograd::DistAutograd::handle_recv`).
    capability: Capability,
    message: Option<AutogradMessageId>,
    tensors: Vec<Tensor>,
    /// One per tensor: whether it required grad on the sender. Only those get a recv
    /// function (PyTorch's `addRecvRpcBackward`): a gradient for the others would have
    /// nowhere to go on the sender, so none is sent back for them.
    requires_grad: Vec<bool>,
    args: A,
}

impl<A> ForwardRequest<A> {
    /// What the callee records of the request before running the function.
    fn received(&self) -> Received<'_> {
        Received {
            context: self.context,
            capability: self.capability,
            message: self.message,
            tensors: &self.tensors,
            requires_grad: &self.requires_grad,
        }
    }
}

/// The autograd part of a [`ForwardRequest`] (without its arguments, which need not be `Sync`).
#[derive(Clone, Copy)]
struct Received<'a> {
    context: ContextId,
    capability: Capability,
    message: Option<AutogradMessageId>,
    tensors: &'a [Tensor],
    requires_grad: &'a [bool],
}

/// Its response: the result and the tracked tensors of the result.
#[derive(Serialize, Deserialize)]
struct ForwardResponse<R> {
    message: Option<AutogradMessageId>,
    tensors: Vec<Tensor>,
    /// As [`ForwardRequest::requires_grad`].
    requires_grad: Vec<bool>,
    result: R,
}

#[derive(Serialize, Deserialize)]
struct GradientRequest {
    context: ContextId,
    message: AutogradMessageId,
    /// One per tensor of the message (`None`: no gradient reached it).
    grads: Vec<Option<Tensor>>,
}

/// A gradient that rides in the answer to a gradient request
/// (`tensorwire_core::autograd::Output::ReplyWithGradients`): for the send function of
/// `message`, which the requester sent to the answering worker in a request.
#[derive(Serialize, Deserialize)]
struct CarriedGradient {
    message: AutogradMessageId,
    /// One per tensor of the message (`None`: no gradient reached it).
    grads: Vec<Option<Tensor>>,
}

/// The answer to a gradient request: the gradients that ride in it (none for a plain
/// answer), or why the work failed.
type GradientAnswer = Result<Vec<CarriedGradient>, BackwardError>;

/// "Is `capability` that of `context`, which you made?", asked of a context's creator by a
/// worker that holds a copy of it with another capability, which the creator has not vouched
/// for (`Recv::AskCreator`). Answered with a `bool`.
#[derive(Serialize, Deserialize)]
struct VouchRequest {
    context: ContextId,
    capability: Capability,
}

#[derive(Serialize, Deserialize)]
struct ReleaseRequest {
    context: ContextId,
    cause: Option<BackwardError>,
}

type Roots<E> = Vec<(
    <E as AutogradEngine>::Tensor,
    Option<<E as AutogradEngine>::Tensor>,
)>;

/// Where the tensors of one recv landed, and how their gradients travel back.
#[derive(Debug, Clone)]
struct RecvPlacement {
    /// The device each tensor landed on here (its gradient is put there before it is sent).
    devices: Vec<Device>,
    /// The reverse of the map the forward message took: a request's tensors (moved by the
    /// sender's map) send their gradients by this worker's reverse map for the sender, a
    /// response's (moved by the sender's reverse map) by this worker's map for it.
    gradients_go: Direction,
}

struct ContextData<E: AutogradEngine> {
    /// Tensors sent under each message (the send functions).
    sends: HashMap<AutogradMessageId, Vec<E::Tensor>>,
    /// Tensors received under each message, tracked (the recv functions).
    recvs: HashMap<AutogradMessageId, Vec<E::Tensor>>,
    /// Which recv tensor a leaf is.
    recv_leaves: HashMap<E::LeafId, (AutogradMessageId, usize)>,
    /// Where each recv's tensors landed, and by which map their gradients go back.
    recv_devices: HashMap<AutogradMessageId, RecvPlacement>,
    /// Seeds of the runs started by gradients.
    seeds: HashMap<TaskId, Vec<Option<E::Tensor>>>,
    /// Gradients a run produced for recv functions, until they are sent.
    produced: HashMap<(TaskId, AutogradMessageId), Vec<Option<E::Tensor>>>,
    /// The roots of a backward started here.
    roots: Roots<E>,
    /// Gradients of this worker's leaves.
    grads: HashMap<E::LeafId, E::Tensor>,
}

impl<E: AutogradEngine> ContextData<E> {
    fn new() -> Self {
        Self {
            sends: HashMap::new(),
            recvs: HashMap::new(),
            recv_leaves: HashMap::new(),
            recv_devices: HashMap::new(),
            seeds: HashMap::new(),
            produced: HashMap::new(),
            roots: Vec::new(),
            grads: HashMap::new(),
        }
    }
}

struct Shared<E: AutogradEngine> {
    state: State,
    data: HashMap<ContextId, ContextData<E>>,
    roots: HashMap<ContextId, oneshot::Sender<Result<(), BackwardError>>>,
    requests: HashMap<RequestToken, engine::Answerer>,
    next_token: RequestToken,
}

struct Inner<E: AutogradEngine> {
    agent: Agent,
    engine: E,
    shared: Mutex<Shared<E>>,
    violations: AtomicU64,
    /// The gradient and release requests' timeout.
    timeout: Mutex<Option<Duration>>,
    /// Serializes the distributed optimizer's steps on this owner.
    optimizer: tokio::sync::Mutex<()>,
    /// Where backward tasks run (inline while the engine's runs are short).
    runs: Mutex<InlineRuns>,
    /// Where the runs that are not inline go (a blocking thread each when `None`).
    executor: Mutex<Option<Executor>>,
}

/// Distributed autograd on one agent: contexts, the functions that take part in them, and the
/// backward pass. Cheap to clone.
pub struct DistAutograd<E: AutogradEngine> {
    inner: Arc<Inner<E>>,
}

impl<E: AutogradEngine> Clone for DistAutograd<E> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<E: AutogradEngine> fmt::Debug for DistAutograd<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistAutograd")
            .field("worker", &self.inner.agent.worker_info().name)
            .field("contexts", &self.context_count())
            .finish_non_exhaustive()
    }
}

/// A pinned, boxed future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A job that may block (a run of the local engine).
pub type BlockingJob = Box<dyn FnOnce() + Send>;

/// Runs a [`BlockingJob`] off the runtime's workers and resolves once it has run (see
/// [`DistAutograd::set_executor`]).
pub type Executor = Arc<dyn Fn(BlockingJob) -> BoxFuture<()> + Send + Sync>;

/// The result of a call in a context: the function's result and the tracked tensors of it.
pub type CallResult<R, E> = Result<(R, Vec<<E as AutogradEngine>::Tensor>), DistAutogradError>;

/// What a function registered with [`DistAutograd::register`] learns about its call: the RPC
/// context (caller, deadline) and the autograd context, for nested calls in it.
pub struct AutogradCall<E: AutogradEngine> {
    call: CallContext,
    context: AutogradContext<E>,
}

impl<E: AutogradEngine> AutogradCall<E> {
    /// The RPC's context: who called, the deadline.
    pub fn call(&self) -> &CallContext {
        &self.call
    }

    /// The autograd context the call belongs to (nested calls made through it are recorded
    /// too). It is not released when dropped: its creator releases it.
    pub fn context(&self) -> &AutogradContext<E> {
        &self.context
    }
}

/// A value kept in an [`RRef`] whose tensors [`AutogradContext::to_here`] copies into a
/// context *tracked*: the owner records a send function for them and the caller a recv
/// function, so the backward pass carries gradients back to the owner's tensors (PyTorch's
/// `rref.to_here()` inside a distributed autograd context). Register a type on the workers
/// that own such values with [`DistAutograd::register_tracked_value`]; [`Parameter`] and
/// [`TensorList`] are registered already.
pub trait TrackedValue<E: AutogradEngine>: Send + Sync + 'static {
    /// The name its fetch is registered under on the owners: unique per type, the same on
    /// every worker.
    const NAME: &'static str;
    /// The tensors a tracked fetch copies to the caller; their gradients come back here.
    fn tracked_tensors(&self) -> Vec<E::Tensor>;
}

/// A parameter fetched into a context is its tensor, tracked: gradients reach the parameter on
/// its owner, where a [`DistributedOptimizer`] steps it.
impl<E: AutogradEngine> TrackedValue<E> for Parameter<E> {
    const NAME: &'static str = "parameter";
    fn tracked_tensors(&self) -> Vec<E::Tensor> {
        vec![self.tensor().clone()]
    }
}

/// Engine tensors kept on their owner in an [`RRef`] (say, made by
/// [`AutogradContext::remote`] from the caller's tracked tensors): PyTorch's
/// `rpc.remote(owner, torch.add, ...)`. [`AutogradContext::to_here`] fetches them tracked; a
/// plain [`RRef::to_here`] gets detached copies (`Vec<Tensor>` of host tensors).
pub struct TensorList<E: AutogradEngine> {
    tensors: Vec<E::Tensor>,
    engine: E,
}

impl<E: AutogradEngine + Clone> TensorList<E> {
    /// `tensors`, to keep in an [`RRef`].
    pub fn new(engine: &E, tensors: Vec<E::Tensor>) -> Self {
        Self {
            tensors,
            engine: engine.clone(),
        }
    }
}

impl<E: AutogradEngine> TensorList<E> {
    /// The tensors (on their owner).
    pub fn tensors(&self) -> &[E::Tensor] {
        &self.tensors
    }
}

impl<E: AutogradEngine> TrackedValue<E> for TensorList<E> {
    const NAME: &'static str = "tensor-list";
    fn tracked_tensors(&self) -> Vec<E::Tensor> {
        self.tensors.clone()
    }
}

/// Travels as detached host copies of the tensors' values (`Vec<Tensor>`).
impl<E: AutogradEngine> Serialize for TensorList<E> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.tensors
            .iter()
            .map(|t| self.engine.export(t))
            .collect::<Result<Vec<HostTensor>, _>>()
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

impl<E: AutogradEngine> DistAutograd<E> {
    /// Sets up distributed autograd on `agent` with `engine`. Registers the internal functions
    /// it needs on every worker; every worker taking part must call it (before the others
    /// send it anything in a context). The gradient requests use the agent's RPC timeout.
    /// Setting it up twice on one agent is an error (its functions are registered already).
    ///
    /// It listens to the agent's [`peer_events`](Agent::peer_events): when a peer is lost,
    /// every context it made or took part in is dropped here (a backward running in it fails
    /// naming the peer), whether or not a backward was running. Must be called inside the
    /// agent's tokio runtime.
    pub fn new(agent: &Agent, engine: E) -> Result<Self, RpcError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(InitError::NoRuntime {
                what: "DistAutograd::new",
                why: "it starts a task that follows lost peers",
            }
            .into());
        }
        // Subscribed before anything can be recorded: no loss goes unheard.
        let mut events = agent.peer_events();
        let inner = Arc::new(Inner {
            agent: agent.clone(),
            engine,
            shared: Mutex::new(Shared {
                state: {
                    // The key of the capabilities of the contexts made here: real entropy,
                    // so that no peer can compute them.
                    let mut state = State::new(agent.worker_info().id);
                    let mut key = [0u8; 32];
                    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut key);
                    state.set_secret_key(key);
                    state
                },
                data: HashMap::new(),
                roots: HashMap::new(),
                requests: HashMap::new(),
                next_token: 0,
            }),
            violations: AtomicU64::new(0),
            timeout: Mutex::new(None),
            optimizer: tokio::sync::Mutex::new(()),
            runs: Mutex::new(InlineRuns::default()),
            executor: Mutex::new(None),
        });
        let functions = agent.functions();
        let weak = Arc::downgrade(&inner);
        functions.register_with_context(GRAD, move |cx: CallContext, req: GradientRequest| {
            let weak = weak.clone();
            async move {
                let inner = upgrade(&weak)?;
                inner.on_gradient(cx, req).await
            }
        })?;
        let weak = Arc::downgrade(&inner);
        functions.register_with_context(RELEASE, move |cx: CallContext, req: ReleaseRequest| {
            let weak = weak.clone();
            async move {
                let inner = upgrade(&weak)?;
                inner.on_release(cx, req).await
            }
        })?;
        let weak = Arc::downgrade(&inner);
        functions.register(VOUCH, move |req: VouchRequest| {
            let weak = weak.clone();
            async move {
                let inner = upgrade(&weak)?;
                let vouched = inner.lock().state.vouches(req.context, req.capability);
                Ok::<_, String>(vouched)
            }
        })?;
        // One of the agent's tasks: its shutdown ends it.
        let weak = Arc::downgrade(&inner);
        agent.spawn(async move {
            while let Some(event) = events.recv().await {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                match event {
                    PeerEvent::Lost { worker, cause } => {
                        debug!(
                            "autograd: worker {worker} was lost ({cause}); dropping its contexts"
                        );
                        inner.peer_lost(worker);
                    }
                    PeerEvent::Joined { worker } => inner.lock().state.handle_peer_joined(worker),
                    // Events added later (the enum is non-exhaustive) change no context.
                    _ => {}
                }
            }
        });
        let dist = Self { inner };
        dist.register_optimizer::<Optimizer>()?;
        dist.register_tracked_value::<Parameter<E>>()?;
        dist.register_tracked_value::<TensorList<E>>()?;
        Ok(dist)
    }

    /// Registers the local optimizer `O` on this worker, so that a
    /// [`DistributedOptimizer`] of `O` can step the parameters it
    /// owns. `torch.optim`'s ([`Optimizer`]) is registered by [`new`](Self::new); register
    /// your own on every worker that owns parameters. Registering one name twice is an error.
    pub fn register_optimizer<O: LocalOptimizer>(&self) -> Result<(), RpcError> {
        let weak = Arc::downgrade(&self.inner);
        self.inner.agent.functions().register(
            &format!("{}{}", optim::STEP, O::NAME),
            move |(context, optimizer, params): (ContextId, O, Vec<RRef<Parameter<E>>>)| {
                let weak = weak.clone();
                async move {
                    let inner = upgrade(&weak)?;
                    optim::owner_step(&DistAutograd { inner }, context, optimizer, params).await
                }
            },
        )
    }

    /// Registers `T` as a value whose tensors [`AutogradContext::to_here`] fetches tracked
    /// from this worker. [`Parameter`] and [`TensorList`] are registered by
    /// [`new`](Self::new); register your own types on every worker that owns them.
    pub fn register_tracked_value<T: TrackedValue<E>>(&self) -> Result<(), RpcError> {
        let weak = Arc::downgrade(&self.inner);
        self.inner.agent.functions().register_method_with_context(
            &format!("{FETCH_PREFIX}{}", T::NAME),
            move |cx: CallContext, value: Arc<T>, req: ForwardRequest<()>| {
                let weak = weak.clone();
                async move {
                    let inner = upgrade(&weak)?;
                    let caller = cx.caller().id;
                    inner.receive(caller, req.received()).await?;
                    inner.respond(req.context, caller, value.tracked_tensors(), ())
                }
            },
        )
    }

    /// Held while this owner runs a distributed optimizer step.
    pub(crate) async fn optimizer_lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.inner.optimizer.lock().await
    }

    /// Sets the timeout of gradient and release requests (default: the agent's RPC timeout).
    /// A backward whose next worker does not answer in time fails naming it.
    pub fn set_timeout(&self, timeout: Duration) {
        *self.inner.timeout.lock().unwrap_or_else(|e| e.into_inner()) = Some(timeout);
    }

    /// A new context made by this worker. Release it with [`AutogradContext::release`]; one
    /// dropped without it is released in the background.
    pub fn context(&self) -> Result<AutogradContext<E>, DistAutogradError> {
        let id = {
            let mut sh = self.inner.lock();
            let id = sh.state.new_context()?;
            sh.data.insert(id, ContextData::new());
            id
        };
        Ok(AutogradContext {
            span: context_span(&self.inner.agent, id),
            inner: self.inner.clone(),
            id,
            owned: true,
        })
    }

    /// A handle on `context`, held here (made here, or brought in by a call): PyTorch's
    /// `dist_autograd._retrieve_context`. Calls made through it are recorded in the context;
    /// dropping it releases nothing (release it with [`AutogradContext::release`]). A
    /// context this worker does not hold is [`AutogradError::UnknownContext`], or
    /// [`AutogradError::Dropped`] with the cause when a failure dropped one made here.
    pub fn retrieve(&self, context: ContextId) -> Result<AutogradContext<E>, DistAutogradError> {
        let sh = self.inner.lock();
        if !sh.state.has_context(context) {
            return Err(match sh.state.dropped_cause(context) {
                Some(cause) => AutogradError::Dropped {
                    context,
                    cause: cause.clone(),
                },
                None => AutogradError::UnknownContext(context),
            }
            .into());
        }
        drop(sh);
        Ok(AutogradContext {
            span: context_span(&self.inner.agent, context),
            inner: self.inner.clone(),
            id: context,
            owned: false,
        })
    }

    /// How many contexts this worker holds (its own and the ones calls brought in).
    pub fn context_count(&self) -> usize {
        self.inner.lock().state.context_count()
    }

    /// Sets how many contexts of other workers' one peer's calls may make this worker hold
    /// at once (default [`DEFAULT_CONTEXTS_PER_PEER`](tensorwire_core::autograd::DEFAULT_CONTEXTS_PER_PEER)).
    /// A call in a context beyond it runs nothing and fails with an error naming the bound
    /// (`contexts_per_peer`); the caller stays connected and may call again once some of its
    /// contexts are released here. Contexts this worker made do not count.
    pub fn set_contexts_per_peer(&self, limit: usize) {
        self.inner.lock().state.set_contexts_per_peer(limit);
    }

    /// How many autograd messages from peers were protocol violations (each dropped its
    /// sender, see the module's docs).
    pub fn violations(&self) -> u64 {
        self.inner.violations.load(Ordering::Relaxed)
    }

    /// Backward tasks (the root's backward, or a send function run for a gradient that
    /// arrived) may run inline, on the thread that serves this worker's RPCs, while the
    /// engine's recent runs each took at most `bound` (default 50 µs,
    /// [`DEFAULT_INLINE_BOUND`](tensorwire_core::autograd::inline::DEFAULT_INLINE_BOUND)):
    /// a hand-off to a blocking thread and back costs more than such a run. Longer ones run on
    /// a blocking thread; `Duration::ZERO` sends every run there. The run history is kept.
    pub fn set_inline_bound(&self, bound: Duration) {
        self.inner
            .runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_bound(bound);
    }

    /// Runs the engine's runs that are not inline with `executor` instead of a blocking thread
    /// each: an engine whose every call needs a resource (an interpreter lock, a device) runs
    /// them where that resource is already held, one hand-over less per run. A job reports
    /// its run and sends what the run produced (gradients, further runs) itself, inside the
    /// runtime it came from, so it must not hold what the driver's lock is taken before (the
    /// executor of an engine behind an interpreter lock releases it around the job).
    pub fn set_executor(&self, executor: Executor) {
        *self
            .inner
            .executor
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(executor);
    }

    /// How many backward tasks ran inline and how many on a blocking thread, in that order
    /// (see [`set_inline_bound`](Self::set_inline_bound)). Runs on a thread that may run the
    /// engine itself (the first pass of [`AutogradContext::backward_here`], and those an
    /// executor's job starts) are not decided by the bound and not counted.
    pub fn engine_runs(&self) -> (u64, u64) {
        self.inner
            .runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .counts()
    }

    /// The local engine.
    pub fn engine(&self) -> &E {
        &self.inner.engine
    }

    /// The agent.
    pub fn agent(&self) -> &Agent {
        &self.inner.agent
    }

    /// Registers `name` as a function that takes part in autograd contexts: it gets its
    /// arguments, the caller's tracked tensors (with recv functions attached) and an
    /// [`AutogradCall`], and returns its result and the tracked tensors of the result.
    /// Registering a name twice is an error.
    pub fn register<A, R, F, Fut>(&self, name: &str, f: F) -> Result<(), RpcError>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        F: Fn(AutogradCall<E>, A, Vec<E::Tensor>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(R, Vec<E::Tensor>), String>> + Send + 'static,
    {
        let f = Arc::new(f);
        let weak = Arc::downgrade(&self.inner);
        self.inner.agent.functions().register_with_context(
            &format!("{FN_PREFIX}{name}"),
            move |cx: CallContext, req: ForwardRequest<A>| {
                let (f, weak) = (f.clone(), weak.clone());
                async move {
                    let inner = upgrade(&weak)?;
                    let caller = cx.caller().id;
                    let (context, tracked) = inner.receive(caller, req.received()).await?;
                    let call = AutogradCall { call: cx, context };
                    let (result, out) = f(call, req.args, tracked).await?;
                    inner.respond(req.context, caller, out, result)
                }
            },
        )
    }

    /// Registers `name` as a method on values of type `T` (held in [`RRef`]s) that takes part
    /// in autograd contexts; see [`register`](Self::register) and
    /// [`AutogradContext::rref_rpc_sync`].
    pub fn register_method<T, A, R, F, Fut>(&self, name: &str, f: F) -> Result<(), RpcError>
    where
        T: Send + Sync + 'static,
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + Sync + 'static,
        F: Fn(AutogradCall<E>, Arc<T>, A, Vec<E::Tensor>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(R, Vec<E::Tensor>), String>> + Send + 'static,
    {
        let f = Arc::new(f);
        let weak = Arc::downgrade(&self.inner);
        self.inner.agent.functions().register_method_with_context(
            &format!("{METHOD_PREFIX}{name}"),
            move |cx: CallContext, value: Arc<T>, req: ForwardRequest<A>| {
                let (f, weak) = (f.clone(), weak.clone());
                async move {
                    let inner = upgrade(&weak)?;
                    let caller = cx.caller().id;
                    let (context, tracked) = inner.receive(caller, req.received()).await?;
                    let call = AutogradCall { call: cx, context };
                    let (result, out) = f(call, value, req.args, tracked).await?;
                    inner.respond(req.context, caller, out, result)
                }
            },
        )
    }

    /// Registers `name` as a constructor of values kept on this worker for
    /// [`AutogradContext::remote`]: it gets the caller's tracked tensors (with recv functions
    /// attached) and returns the value, which may hold tensors computed from them; a method
    /// called on the value later in the same context carries the graph through it.
    pub fn register_remote<A, T, F, Fut>(&self, name: &str, f: F) -> Result<(), RpcError>
    where
        A: DeserializeOwned + Send + 'static,
        T: Serialize + Send + Sync + 'static,
        F: Fn(AutogradCall<E>, A, Vec<E::Tensor>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, String>> + Send + 'static,
    {
        let f = Arc::new(f);
        let weak = Arc::downgrade(&self.inner);
        self.inner.agent.functions().register_with_context(
            &format!("{REMOTE_PREFIX}{name}"),
            move |cx: CallContext, req: ForwardRequest<A>| {
                let (f, weak) = (f.clone(), weak.clone());
                async move {
                    let inner = upgrade(&weak)?;
                    let (context, tracked) = inner.receive(cx.caller().id, req.received()).await?;
                    f(AutogradCall { call: cx, context }, req.args, tracked).await
                }
            },
        )
    }

    /// The gradients this worker holds in `context` (see [`AutogradContext::gradients`]), for a
    /// context made elsewhere (a parameter server's view of a trainer's context).
    pub fn gradients(&self, context: ContextId) -> Option<HashMap<E::LeafId, E::Tensor>> {
        self.inner
            .lock()
            .data
            .get(&context)
            .map(|d| d.grads.clone())
    }
}

/// The `tracing` span of one autograd context on this worker (debug level): the worker and the
/// context id. The calls made in the context, its backward pass and its release run in it, and
/// so do this worker's parts of other workers' backward passes and releases.
fn context_span(agent: &Agent, context: ContextId) -> tracing::Span {
    tracing::debug_span!(
        "autograd_context",
        worker = %agent.worker_info().name,
        context = %context,
    )
}

fn upgrade<E: AutogradEngine>(weak: &Weak<Inner<E>>) -> Result<Arc<Inner<E>>, String> {
    weak.upgrade()
        .ok_or_else(|| "distributed autograd is no longer set up on this worker".to_owned())
}

/// One distributed autograd context, on this worker.
pub struct AutogradContext<E: AutogradEngine> {
    inner: Arc<Inner<E>>,
    id: ContextId,
    /// Made here by the user: released when dropped.
    owned: bool,
    /// The `autograd_context` span: calls, backward and release in this context run in it.
    span: tracing::Span,
}

impl<E: AutogradEngine> fmt::Debug for AutogradContext<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AutogradContext")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl<E: AutogradEngine> AutogradContext<E> {
    /// The context's id.
    pub fn id(&self) -> ContextId {
        self.id
    }

    /// Calls the autograd function `function` on `to` with `args` and the tracked `tensors`,
    /// and waits for its result and the tracked tensors of its result.
    pub async fn rpc_sync<A, R>(
        &self,
        to: &str,
        function: &str,
        args: &A,
        tensors: &[E::Tensor],
        timeout: Option<Duration>,
    ) -> Result<(R, Vec<E::Tensor>), DistAutogradError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        self.rpc_async(to, function, args, tensors, timeout)?.await
    }

    /// [`rpc_sync`](Self::rpc_sync), sent now; the future gives the result.
    pub fn rpc_async<A, R>(
        &self,
        to: &str,
        function: &str,
        args: &A,
        tensors: &[E::Tensor],
        timeout: Option<Duration>,
    ) -> Result<BoxFuture<CallResult<R, E>>, DistAutogradError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        let callee = self.inner.agent.get_worker_info(to)?.id;
        let req = self.inner.send(self.id, callee, tensors, args, true)?;
        let fut = self.inner.agent.rpc_async::<_, ForwardResponse<R>>(
            callee,
            &format!("{FN_PREFIX}{function}"),
            &req,
            timeout,
        )?;
        Ok(self.finish_call(callee, fut))
    }

    /// Calls the autograd method `method` (see [`DistAutograd::register_method`]) on the value
    /// `rref` refers to, on its owner, in this context.
    pub async fn rref_rpc_sync<T, A, R>(
        &self,
        rref: &RRef<T>,
        method: &str,
        args: &A,
        tensors: &[E::Tensor],
        timeout: Option<Duration>,
    ) -> Result<(R, Vec<E::Tensor>), DistAutogradError>
    where
        T: Send + Sync + 'static,
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        let owner = rref.owner().id;
        let req = self.inner.send(self.id, owner, tensors, args, true)?;
        let fut = rref.rpc_async::<_, ForwardResponse<R>>(
            &format!("{METHOD_PREFIX}{method}"),
            &req,
            timeout,
        )?;
        self.finish_call(owner, fut).await
    }

    /// Creates a value on `to` with the constructor `function` (see
    /// [`DistAutograd::register_remote`]) from `args` and the tracked `tensors`, in this
    /// context, and returns a reference to it at once (`rpc.remote` within a context).
    pub fn remote<A, T>(
        &self,
        to: &str,
        function: &str,
        args: &A,
        tensors: &[E::Tensor],
        timeout: Option<Duration>,
    ) -> Result<RRef<T>, DistAutogradError>
    where
        A: Serialize + ?Sized,
        T: Send + Sync + 'static,
    {
        let owner = self.inner.agent.get_worker_info(to)?.id;
        let req = self.inner.send(self.id, owner, tensors, args, true)?;
        Ok(self
            .inner
            .agent
            .remote(owner, &format!("{REMOTE_PREFIX}{function}"), &req, timeout)?)
    }

    /// Copies the tensors of the value `rref` refers to into this context, **tracked** (PyTorch's
    /// `rref.to_here()` inside a context): the owner records a send function for them and this
    /// worker a recv function, so the backward pass carries their gradients back to the owner
    /// (to a [`Parameter`]'s leaf, or through the graph a [`TensorList`] was computed in).
    /// On the owner itself the value's tensors are returned as they are (the local graph
    /// carries their gradients). A plain [`RRef::to_here`] is never tracked: it copies values.
    pub async fn to_here<T: TrackedValue<E>>(
        &self,
        rref: &RRef<T>,
        timeout: Option<Duration>,
    ) -> Result<Vec<E::Tensor>, DistAutogradError> {
        if rref.is_owner() {
            return Ok(rref.local_value().await?.tracked_tensors());
        }
        let owner = rref.owner().id;
        let req = self.inner.send(self.id, owner, &[], &(), true)?;
        let fut = rref.rpc_async::<_, ForwardResponse<()>>(
            &format!("{FETCH_PREFIX}{}", T::NAME),
            &req,
            timeout,
        )?;
        let ((), tensors) = self.finish_call(owner, fut).await?;
        Ok(tensors)
    }

    fn finish_call<R: Send + 'static>(
        &self,
        callee: WorkerId,
        fut: impl Future<Output = Result<ForwardResponse<R>, RpcError>> + Send + 'static,
    ) -> BoxFuture<CallResult<R, E>> {
        let inner = self.inner.clone();
        let id = self.id;
        let span = self.span.clone();
        Box::pin(async move {
            let resp = fut.instrument(span).await?;
            // The answer to our own call presents the capability we hold.
            let capability = inner.lock().state.capability(id).unwrap_or_default();
            let tracked = match resp.message {
                Some(m) => inner
                    .track(
                        callee,
                        (id, capability),
                        m,
                        &resp.tensors,
                        &resp.requires_grad,
                        Direction::Response,
                    )
                    .await
                    .map_err(|message| DistAutogradError::Violation {
                        from: inner.agent.name_of(callee),
                        message,
                    })?,
                None => Vec::new(),
            };
            Ok((resp.result, tracked))
        })
    }

    /// Runs the backward pass from `roots` (each with its seed gradient; `None`: ones, for a
    /// scalar loss), and returns once every worker it reached is done. Gradients of leaves
    /// accumulate in the context on the worker that holds them. Without `retain_graph` a
    /// second backward in this context is refused.
    ///
    /// The roots are checked first, as PyTorch does: at least one, each requiring grad, each a
    /// scalar unless it has a seed (of its shape), each computed by an operation or received
    /// in the context (a leaf, such as a parameter, has no gradient function to start from);
    /// otherwise [`AutogradError::InvalidRoots`] and nothing changes. (PyTorch's `dist_autograd.backward` takes no seeds: its roots are
    /// all scalars.)
    ///
    /// A pass that fails on some worker (its engine failed, a request timed out) fails naming
    /// that worker, once all the work it started has answered or timed out, and leaves the
    /// context usable: a later backward in it may succeed (gradients the failed pass
    /// accumulated stay). A lost worker fails it at once, naming the worker, and the context is
    /// dropped everywhere.
    pub async fn backward(
        &self,
        roots: &[(E::Tensor, Option<E::Tensor>)],
        retain_graph: bool,
    ) -> Result<(), DistAutogradError> {
        let rx = self.begin_backward(roots, retain_graph)?;
        self.inner.pump();
        self.finish_backward(rx).await
    }

    /// [`backward`](Self::backward) from a thread that may run the engine itself (not a
    /// runtime worker; inside the runtime, entered): checks the roots and runs this worker's
    /// first local pass here and now, sending the gradients it makes, then returns the future
    /// of the rest (the other workers' passes, and the local ones their gradients start,
    /// which run as every other). The same pass as `backward`'s, without a hand-off to
    /// another thread and back before it starts.
    pub fn backward_here(
        &self,
        roots: &[(E::Tensor, Option<E::Tensor>)],
        retain_graph: bool,
    ) -> Result<BoxFuture<Result<(), DistAutogradError>>, DistAutogradError> {
        let rx = self.begin_backward(roots, retain_graph)?;
        self.inner.pump_here();
        let this = AutogradContext {
            inner: self.inner.clone(),
            id: self.id,
            owned: false,
            span: self.span.clone(),
        };
        Ok(Box::pin(async move { this.finish_backward(rx).await }))
    }

    /// Checks the roots and starts the pass in the state machine: the receiver of its end.
    fn begin_backward(
        &self,
        roots: &[(E::Tensor, Option<E::Tensor>)],
        retain_graph: bool,
    ) -> Result<oneshot::Receiver<Result<(), BackwardError>>, DistAutogradError> {
        Ok({
            let mut sh = self.inner.lock();
            if !sh.data.contains_key(&self.id) {
                // Gone: dropped by a failure (say so, naming the cause) or released.
                let e = match sh.state.dropped_cause(self.id) {
                    Some(cause) => AutogradError::Dropped {
                        context: self.id,
                        cause: cause.clone(),
                    },
                    None => AutogradError::UnknownContext(self.id),
                };
                return Err(e.into());
            }
            let engine = &self.inner.engine;
            let received = &sh.data.get(&self.id).expect("checked above").recv_leaves;
            let checked: Vec<Root> = roots
                .iter()
                .map(|(t, seed)| Root {
                    shape: engine.shape(t),
                    requires_grad: engine.requires_grad(t),
                    // A tensor received in the context is a leaf to the engine, but its recv
                    // function sends its gradient back, as PyTorch's does.
                    has_grad_fn: engine.has_grad_fn(t) || received.contains_key(&engine.leaf_id(t)),
                    seed: seed.as_ref().map(|s| engine.shape(s)),
                })
                .collect();
            sh.state.backward(self.id, retain_graph, &checked)?;
            let data = sh.data.get_mut(&self.id).expect("checked above");
            data.roots = roots.to_vec();
            let (tx, rx) = oneshot::channel();
            sh.roots.insert(self.id, tx);
            rx
        })
    }

    /// Waits for the end of the pass [`begin_backward`](Self::begin_backward) started.
    async fn finish_backward(
        &self,
        rx: oneshot::Receiver<Result<(), BackwardError>>,
    ) -> Result<(), DistAutogradError> {
        // The answer's sender goes away unanswered only with this worker's autograd state.
        let result = rx.instrument(self.span.clone()).await.unwrap_or_else(|_| {
            Err(BackwardError::Stopped {
                worker: self.inner.agent.worker_info().id,
                context: self.id,
            })
        });
        result.map_err(|e| self.inner.named(e))
    }

    /// The gradients this worker holds in the context, by leaf.
    pub fn gradients(&self) -> HashMap<E::LeafId, E::Tensor> {
        self.inner
            .lock()
            .data
            .get(&self.id)
            .map(|d| d.grads.clone())
            .unwrap_or_default()
    }

    /// The gradient of `leaf` in the context, if the backward reached it here.
    pub fn gradient(&self, leaf: &E::Tensor) -> Option<E::Tensor> {
        let id = self.inner.engine.leaf_id(leaf);
        self.inner
            .lock()
            .data
            .get(&self.id)
            .and_then(|d| d.grads.get(&id).cloned())
    }

    /// Releases the context here and on every worker it reached, and waits until they have
    /// dropped it (or are unreachable). Releasing a context already released (a failed
    /// backward releases it) is not an error.
    pub async fn release(mut self) -> Result<(), DistAutogradError> {
        let started = self.release_here()?;
        if started {
            self.inner
                .pump_and_wait_releases()
                .instrument(self.span.clone())
                .await;
        }
        Ok(())
    }
}
