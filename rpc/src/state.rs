//! What the agent holds, shared by its handle ([`Agent`]), its driver and its tasks: core's
//! [`Node`] (the endpoint, the gathers, the IPC state, the directory of members and a dynamic
//! group's membership), what waits on it and what the agent owns until shutdown (`State`,
//! under the agent's one lock), and the rest of the agent (`Inner`), which is not the
//! node's state: fixed at init, the user's table of functions, counters and wake-ups.

use std::any::Any;
use std::sync::{Arc, Mutex};
use tensorwire_core::hashing::HashMap;

use tensorwire_core::device::DeviceMaps;
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::{Connection, Transport};
use tensorwire_core::protocol::by_id::Waiters;
use tensorwire_core::protocol::envelope::FrameBody;
use tensorwire_core::protocol::gather::{GatherOutcome, GatherToken};
use tensorwire_core::protocol::membership::MembershipError;
use tensorwire_core::protocol::node::Node;
use tensorwire_core::protocol::{CallError, ConfirmError, RRefId, ShutdownError, WaitId, WorkerId};
use tensorwire_core::wire::Frame;
use tensorwire_process_group::{Group, Rendezvous};
use tokio::sync::{mpsc, oneshot, Notify};

use crate::functions::{Registry, Value};
use crate::runtime::Runtime;
use tensorwire_core::ports::device::DeviceBackend;
use tensorwire_core::protocol::membership::WorkerInfo;

pub(crate) use tensorwire_core::protocol::node::RPC_GROUP;

/// The functions a worker serves (a registry of functions run on an [`Agent`]). Cloning shares
/// the table.
pub type Functions = Registry<Agent>;

/// A running RPC agent. Cheap to clone; every clone is the same agent.
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<Inner>,
}

/// What travels through the endpoint with a message: the encoded arguments or result, their
/// tensors, the forks made for the receiver and for methods the reference they are called on
/// (core's frame body, which core encodes and decodes).
pub(crate) type Body = FrameBody;

/// What the agent keeps for a call (a fetch, a remote) under its id until its
/// [`Outcome`](crate::future::Outcome) reads it (core's [`Waiters`]).
pub(crate) type Waiter = tensorwire_core::protocol::by_id::Waiter<Result<Body, CallError>>;

/// What every worker publishes at init (the membership protocol's record).
pub(crate) type WorkerRecord = tensorwire_core::protocol::membership::MemberRecord;

/// The way to one peer: a writer task fed by a queue, and a lock that whoever writes holds —
/// the writer task, or a task of ours that writes directly when nothing is queued (one wake-up
/// less per message). Frames are taken from the endpoint under the state lock and either put in
/// the queue or written under the link lock taken at that moment, so they keep their order.
pub(crate) struct PeerLink {
    pub(crate) tx: mpsc::UnboundedSender<Frame>,
    pub(crate) conn: Arc<dyn Connection>,
    /// The connection's transport (`Connection::transport`), for [`Agent::connections`].
    pub(crate) transport: &'static str,
    /// The write turn. What it guards is the list a direct write gathers its frames in,
    /// kept between writes (no list allocated per message; see `links::DirectWrite`).
    pub(crate) write: Arc<tokio::sync::Mutex<Vec<Frame>>>,
    pub(crate) queued: Arc<crate::queue::OutQueue>,
    /// Where the message headers of the frames for this peer are encoded, one after another
    /// (`wire::bytes_in`): no allocation a header.
    pub(crate) room: bytes::BytesMut,
}

/// The agent's state, under its one lock. No guard is held across an `.await`, and nothing
/// that blocks or runs user code runs under it: a value, a task set, the store or the group
/// is taken out under the lock and dropped, ended or called after.
pub(crate) struct State {
    /// The endpoint, the gathers this worker leads, the IPC state, the directory of members
    /// and a dynamic group's membership, driven as one (core's sans-IO node).
    pub(crate) node: Node<Body, IpcHeld>,
    /// A dynamic group's driver state beside the node's membership.
    pub(crate) dyn_state: DynState,
    /// The calls of the gathers this worker leads (the node's), each waiting for its answer.
    pub(crate) gathers_waiting: HashMap<GatherToken, oneshot::Sender<GatherOutcome>>,
    /// Each call's (and fetch's) waiter, by its message id: no hashing (ids only grow).
    pub(crate) waiters: Waiters<Result<Body, CallError>>,
    /// Calls whose waiters are to be taken out: dropped unread while this lock was held.
    pub(crate) abandoned: mpsc::UnboundedReceiver<tensorwire_core::protocol::MessageId>,
    pub(crate) values: HashMap<RRefId, Arc<dyn Value>>,
    pub(crate) peers: HashMap<WorkerId, PeerLink>,
    /// Functions waiting until the owners confirm the references in their arguments (the
    /// endpoint decides when, and fails them by their deadline or a lost owner).
    pub(crate) confirm_waits: HashMap<WaitId, oneshot::Sender<Result<(), ConfirmError>>>,
    /// The graceful shutdown (or leave) in progress: told its outcome.
    pub(crate) shutdown_waiter: Option<oneshot::Sender<Result<(), ShutdownError>>>,
    /// What the agent holds until shutdown lets go of it, and the tasks it runs.
    pub(crate) owned: Owned,
}

pub(crate) struct Inner {
    pub(crate) me: WorkerInfo,
    /// Whether workers join and leave (`world_size = None`).
    pub(crate) dynamic: bool,
    /// The default call timeout, in nanoseconds (changed by `set_rpc_timeout`).
    pub(crate) rpc_timeout_nanos: std::sync::atomic::AtomicU64,
    /// The user's registry (its own lock): read on every served call, written by the user's
    /// `register`, and shared with the [`Functions`] the user holds; not the node's state.
    pub(crate) functions: Functions,
    pub(crate) backend: Arc<dyn DeviceBackend>,
    /// The agent's one lock (see [`State`]).
    pub(crate) state: Mutex<State>,
    /// Wakes the driver: a wake-up, not state (the driver reads the state under the lock).
    pub(crate) wake: Notify,
    pub(crate) device_maps: DeviceMaps,
    /// The one runtime the agent reads time from, sleeps on and spawns with.
    pub(crate) runtime: Arc<dyn Runtime>,
    /// Counters (atomics, and a table of peers' counters behind its own lock, taken once per
    /// new peer): updated beside the state, never under its lock.
    pub(crate) metrics: crate::metrics::AgentMetrics,
    /// Who hears of lost and joined peers ([`Agent::peer_events`]): the subscribers' channels,
    /// sent to outside the state's lock (a subscriber's channel is the user's).
    pub(crate) peer_events: crate::peer_events::PeerEventHub,
    /// Handlers running now (requests being served), so that one that finishes alone writes its
    /// reply at once instead of waiting for others to join it.
    pub(crate) serving: std::sync::atomic::AtomicUsize,
    /// Bytes queued for every peer's writer ([`Agent::queued_bytes`]).
    pub(crate) queued_bytes: Arc<std::sync::atomic::AtomicUsize>,
    /// The ids of calls dropped unread while the state's lock was held, for the driver to
    /// take their waiters out ([`State::abandoned`]; see `future::Outcome`'s `Drop`).
    pub(crate) abandoned: mpsc::UnboundedSender<tensorwire_core::protocol::MessageId>,
}

/// What the agent holds until shutdown lets go of it — the group's store, the rendezvous, a
/// static group's world process group — and every task it runs, so that shutdown can end them
/// and wait until they have ended (and so let go of the connections and values they hold).
pub(crate) struct Owned {
    /// The group's store, until shutdown lets go of it.
    pub(crate) store: Option<Arc<dyn Store>>,
    /// The rendezvous the agent started from (shut down last).
    pub(crate) rendezvous: Option<Rendezvous>,
    /// A static group's world process group, whose connections the agent shares; shut down
    /// with the agent.
    pub(crate) group: Option<Group>,
    /// The connections' writers, which shutdown lets send what is queued and close first.
    pub(crate) writers: tokio::task::JoinSet<()>,
    /// Everything else: the driver, readers, accept loops, calls being served.
    pub(crate) others: tokio::task::JoinSet<()>,
    /// Set by shutdown: nothing new starts.
    pub(crate) closed: bool,
}

// The agent's parts that other modules drive: their types live here, with the agent that
// holds them, so that this module names none of the modules that use it.

/// What keeps one export valid (the backend's value), held until released.
pub(crate) type IpcHeld = Box<dyn Any + Send + Sync>;

/// The driver's side of a dynamic group's membership, beside the node's (in the agent's
/// state, under its lock).
#[derive(Default)]
pub(crate) struct DynState {
    /// The transport a joiner dials the members with.
    pub(crate) transport: Option<Arc<dyn Transport>>,
    pub(crate) join_waiter: Option<oneshot::Sender<Result<(), MembershipError>>>,
    pub(crate) leave_waiter: Option<oneshot::Sender<Result<bool, MembershipError>>>,
}
