//! The agent: drives the protocol state machine of `core::protocol` over a transport.
//!
//! One driver task owns the rhythm: it takes messages the endpoint wants sent and hands them to
//! per-peer writer tasks (one per connection, so messages to a peer keep their order), takes
//! events and dispatches them (run a function, complete a caller's future, drop a value), and
//! sleeps until the endpoint's next timer or until something changes. Received frames are fed
//! into the endpoint on the connection's reader task: in a static group the world process
//! group's (the agent shares its connections, see [`FrameSink`]), in a dynamic group the
//! agent's own.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::device::{Device, DeviceMaps};
use tensorwire_core::name::check_worker_name;
use tensorwire_core::ports::process_group::{ProcessGroup, ProcessGroupError};
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::{Connection, Transport};
use tensorwire_core::protocol::{
    CallError, ConfirmError, DebugInfo, Endpoint, EndpointConfig, Event, Header, LostCause,
    MessageId, Payload, ProtocolViolation, RRefForkData, RRefHandle, RRefId, RemoteError,
    RemoteErrorKind, RequestToken, ShutdownError, Transmit, WaitId, WorkerId,
};
use tensorwire_core::reverse::{device_list, reverse_device_maps};
use tensorwire_core::validate::{validate_device_maps, GroupKind, WorkerDeviceInfo};
use tensorwire_core::wire::{Frame, FrameKind};
use tensorwire_process_group::{
    rendezvous, CollectivesExt, FrameSink, Group, GroupOptions, Rendezvous, RendezvousOptions,
};
use tokio::sync::{mpsc, oneshot, Notify};
use tracing::{debug, info, warn};

use crate::codec::{self, Envelope};
use crate::error::RpcError;
use crate::functions::{Functions, HandlerError, Invocation, Value};
use crate::metrics::RpcMetrics;
use crate::options::RpcOptions;
use crate::rref::RRef;
use crate::runtime::Runtime;
use crate::tensors::{self, TensorTransferError, WireTensors};
use crate::typed::{Call, Function};
use tensorwire_core::placement::Direction;
use tensorwire_core::ports::device::DeviceBackend;

/// A worker's name and id (its rank in a static group).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The name.
    pub name: String,
    /// The id (rank).
    pub id: WorkerId,
}

impl fmt::Display for WorkerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (rank {})", self.name, self.id)
    }
}

/// The connection to one peer: [`Agent::connections`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerConnection {
    /// The peer.
    pub peer: WorkerInfo,
    /// The transport chosen for it: `"tcp"`, `"shm"` (shared memory, for a peer on this host),
    /// `"quic"` or `"memory"` (the in-memory transport of tests).
    pub transport: &'static str,
}

/// What an agent holds and waits for: [`Agent::debug_info`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AgentDebugInfo {
    /// This worker.
    pub worker: WorkerInfo,
    /// Values kept for references this worker owns.
    pub kept_values: usize,
    /// The protocol's view: owned references and their forks, forks held here (pending users
    /// are the unconfirmed ones), calls in flight and requests being served per peer.
    pub protocol: DebugInfo,
}

impl fmt::Display for AgentDebugInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.protocol;
        write!(
            f,
            "{}: {} values kept; owned references {}; forks held {}; calls in flight {:?}; requests being served {:?}",
            self.worker,
            self.kept_values,
            p.owned
                .iter()
                .map(|o| format!("{} ({} forks elsewhere, {} handles here{})", o.rref, o.forks, o.local_handles, if o.being_created { ", being created" } else { "" }))
                .collect::<Vec<_>>()
                .join(", "),
            p.forks
                .iter()
                .map(|u| format!("{} of {} on rank {} ({} handles{})", u.fork, u.rref, u.owner, u.handles, if u.confirmed { "" } else { ", pending user" }))
                .collect::<Vec<_>>()
                .join(", "),
            p.calls_in_flight,
            p.requests_being_served,
        )
    }
}

/// How to name a callee: by name, rank or [`WorkerInfo`].
#[derive(Debug, Clone)]
pub enum WorkerRef {
    /// By name.
    Name(String),
    /// By rank.
    Rank(WorkerId),
}

impl From<&str> for WorkerRef {
    fn from(s: &str) -> Self {
        WorkerRef::Name(s.to_owned())
    }
}
impl From<String> for WorkerRef {
    fn from(s: String) -> Self {
        WorkerRef::Name(s)
    }
}
impl From<WorkerId> for WorkerRef {
    fn from(r: WorkerId) -> Self {
        WorkerRef::Rank(r)
    }
}
impl From<&WorkerInfo> for WorkerRef {
    fn from(w: &WorkerInfo) -> Self {
        WorkerRef::Rank(w.id)
    }
}

/// What travels through the endpoint with a message: the encoded arguments or result, and for
/// methods the reference they are called on.
#[derive(Debug, Clone)]
pub(crate) struct Body {
    pub(crate) target: Option<RRefId>,
    pub(crate) data: Bytes,
    pub(crate) tensors: WireTensors,
    /// The forks made for the receiver of the references inside `data`: they also travel in a
    /// reply's header, so that the receiver's endpoint releases them if the reply is late.
    pub(crate) forks: Vec<RRefForkData>,
}

impl Payload for Body {
    fn forks(&self) -> Vec<RRefForkData> {
        self.forks.clone()
    }

    fn target(&self) -> Option<RRefId> {
        self.target
    }
}

type Waiter = oneshot::Sender<Result<Body, CallError>>;

/// What every worker publishes at init (the membership protocol's record).
pub(crate) type WorkerRecord = tensorwire_core::protocol::membership::MemberRecord;

/// The way to one peer: a writer task fed by a queue, and a lock that whoever writes holds —
/// the writer task, or a task of ours that writes directly when nothing is queued (one wake-up
/// less per message). Frames are taken from the endpoint under the state lock and either put in
/// the queue or written under the link lock taken at that moment, so they keep their order.
struct PeerLink {
    tx: mpsc::UnboundedSender<Frame>,
    conn: Arc<dyn Connection>,
    /// The connection's transport (`Connection::transport`), for [`Agent::connections`].
    transport: &'static str,
    write: Arc<tokio::sync::Mutex<()>>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
}

/// At most this many queued frames go out in one `send_many`.
const WRITE_BATCH: usize = 64;

/// Frames a task writes itself, holding its peer's write lock.
struct DirectWrite {
    peer: WorkerId,
    conn: Arc<dyn Connection>,
    frames: Vec<Frame>,
    _turn: tokio::sync::OwnedMutexGuard<()>,
}

pub(crate) struct State {
    pub(crate) ep: Endpoint<Body>,
    waiters: HashMap<MessageId, Waiter>,
    values: HashMap<RRefId, Arc<dyn Value>>,
    peers: HashMap<WorkerId, PeerLink>,
    /// When the driver task wakes up next for timers (`None`: only when woken).
    driver_wakes_at: Option<Instant>,
    /// Functions waiting until the owners confirm the references in their arguments (the
    /// endpoint decides when, and fails them by their deadline or a lost owner).
    confirm_waits: HashMap<WaitId, oneshot::Sender<Result<(), ConfirmError>>>,
    /// The graceful shutdown (or leave) in progress: told its outcome.
    shutdown_waiter: Option<oneshot::Sender<Result<(), ShutdownError>>>,
}

/// Who is in the group, and what this worker derives from it. Fixed after init in a static
/// group; in a dynamic group it changes as workers join and leave.
#[derive(Debug, Default)]
pub(crate) struct Membership {
    workers: std::collections::BTreeMap<WorkerId, WorkerInfo>,
    by_name: HashMap<String, WorkerId>,
    /// Every member's device plan, in rank order.
    infos: std::collections::BTreeMap<WorkerId, WorkerDeviceInfo>,
    reverse: DeviceMaps,
    devices: Vec<Device>,
}

impl Membership {
    fn new(records: &[WorkerRecord]) -> Self {
        let mut m = Membership::default();
        for r in records {
            m.workers.insert(
                r.rank,
                WorkerInfo {
                    name: r.devices.name.clone(),
                    id: r.rank,
                },
            );
            m.by_name.insert(r.devices.name.clone(), r.rank);
            m.infos.insert(r.rank, r.devices.clone());
        }
        m
    }

    /// Recomputes this worker's reverse maps and device list from the members' plans.
    fn derive(&mut self, me: &str, declared: &[Device], maps: &DeviceMaps) {
        let infos: Vec<WorkerDeviceInfo> = self.infos.values().cloned().collect();
        self.reverse = reverse_device_maps(me, &infos);
        self.devices = device_list(declared, maps, &self.reverse);
    }
}

pub(crate) struct Inner {
    me: WorkerInfo,
    members: std::sync::RwLock<Membership>,
    /// Whether workers join and leave (`world_size = None`).
    dynamic: bool,
    declared_devices: Vec<Device>,
    /// The default call timeout, in nanoseconds (changed by `set_rpc_timeout`).
    rpc_timeout_nanos: std::sync::atomic::AtomicU64,
    functions: Functions,
    backend: Arc<dyn DeviceBackend>,
    /// Same-host device memory sharing (CUDA IPC) with the peers.
    ipc: crate::ipc::IpcLink,
    state: Mutex<State>,
    wake: Notify,
    /// The group's store, until shutdown lets go of it.
    store: Mutex<Option<Arc<dyn Store>>>,
    device_maps: DeviceMaps,
    pub(crate) rendezvous: Mutex<Option<Rendezvous>>,
    /// A static group's world process group, whose connections the agent shares; shut down
    /// with the agent.
    group: Mutex<Option<Group>>,
    /// The dynamic-group gathers this worker leads (see [`crate::gather`]).
    gathers: crate::gather::Gathers,
    tasks: Mutex<Tasks>,
    /// The one runtime the agent reads time from, sleeps on and spawns with.
    pub(crate) runtime: Arc<dyn Runtime>,
    /// A dynamic group's membership (see [`crate::dynamic`]); its own lock, never held with
    /// the state's.
    pub(crate) membership: Mutex<crate::dynamic::DynState>,
    /// Wakes the membership's timer.
    pub(crate) membership_wake: Notify,
    pub(crate) metrics: crate::metrics::AgentMetrics,
    /// Who hears of lost and joined peers ([`Agent::peer_events`]).
    peer_events: crate::peer_events::PeerEventHub,
    /// Handlers running now (requests being served), so that one that finishes alone writes its
    /// reply at once instead of waiting for others to join it.
    serving: std::sync::atomic::AtomicUsize,
}

/// Every task the agent runs, so that shutdown can end them and wait until they have ended
/// (and so let go of the connections and values they hold).
#[derive(Default)]
pub(crate) struct Tasks {
    /// The connections' writers, which shutdown lets send what is queued and close first.
    writers: tokio::task::JoinSet<()>,
    /// Everything else: the driver, readers, accept loops, calls being served.
    others: tokio::task::JoinSet<()>,
    /// Set by shutdown: nothing new starts.
    closed: bool,
}

/// A running RPC agent. Cheap to clone; every clone is the same agent.
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Agent")
            .field("me", &self.inner.me)
            .field("world", &self.members().workers.len())
            .finish()
    }
}

fn secret_bytes(options: &RpcOptions) -> Option<Vec<u8>> {
    options.secret.clone().or_else(|| {
        std::env::var_os(tensorwire_process_group::env_init::SECRET_ENV)
            .filter(|v| !v.is_empty())
            .map(|v| v.into_encoded_bytes())
    })
}

/// The address peers reach us at: the configured one, else `TENSORWIRE_IFNAME`'s, else the
/// local address that routes to `MASTER_ADDR`, else loopback; a loopback address in a group
/// that spans hosts is an error (see `tensorwire_process_group::address`).
pub(crate) fn advertise_ip(options: &RpcOptions) -> Result<IpAddr, RpcError> {
    Ok(tensorwire_process_group::advertise_ip(options.listen_ip)?)
}

/// Starts the agent of worker `name` with rank `rank` in a static group of `world_size`
/// workers, as PyTorch's `init_rpc`: rendezvous, then the backend named in `options.backend`
/// (see [`register_backend`](crate::register_backend); `TCP` by default) sets up the world
/// process group over its transport (one connection per pair of workers), gathers every
/// worker's record (name, devices, device maps) with its `all_gather_object`, validates them
/// (the same error on every worker: duplicate names, bad device maps), and starts the agent over
/// the group's connections, ending with a barrier. Calls and the group's collectives share
/// those connections; the store holds no worker record at any time.
///
/// In a static group, when `init_rpc` returns on any worker, every worker is connected to every
/// other, and no worker still needs the store for init: rank 0, which hosts the store, may
/// shut down and exit at once without failing anyone's init. An init that does not finish in
/// `init_timeout` fails with [`RpcError::Timeout`] naming the ranks it waited for.
///
/// With `world_size = None` the group is dynamic: the worker joins the members that are there
/// (rank 0 first: it hosts the store), validating everyone's device maps by the dynamic rules,
/// and `shutdown` makes it leave; see the `dynamic` module of this crate. A dynamic group has
/// no process group (nor has PyTorch's), but dials and greets with the same functions
/// (`tensorwire_process_group::link`). Static and dynamic workers never share a group.
pub async fn init_rpc(
    name: &str,
    rank: usize,
    world_size: Option<usize>,
    options: RpcOptions,
) -> Result<Agent, RpcError> {
    check_worker_name(name)?;
    if let Some(world_size) = world_size {
        if rank >= world_size {
            return Err(RpcError::Init(format!(
                "rank {rank} is not below world_size {world_size}"
            )));
        }
    }
    let backend = crate::backend::lookup(&options.backend)?;
    let secret = secret_bytes(&options);
    let rdv_options = RendezvousOptions {
        timeout: options.init_timeout,
        secret: secret.and_then(|s| ClusterSecret::new(s).ok()),
        // A dynamic group has no size to wait for: rank 0 hosts the store, the others join it.
        wait_for_all: world_size.is_some(),
        ..RendezvousOptions::default()
    };
    let url = match world_size {
        Some(n) => with_rank(&options.init_method, rank, n),
        None => dynamic_url(&options.init_method, rank),
    };
    let rdv = rendezvous(&url, rdv_options).await?;
    if rdv.rank != rank || world_size.is_some_and(|n| rdv.world_size != n) {
        return Err(RpcError::Init(format!(
            "rendezvous gave rank {} of {}, but init_rpc was called with rank {rank} of {world_size:?}",
            rdv.rank, rdv.world_size
        )));
    }
    backend
        .init_backend(rdv, name, rank, world_size, options)
        .await
}

/// The rendezvous URL of a dynamic group's member: its rank, and a nominal world size that
/// covers it (the rendezvous needs one; nobody waits for it).
fn dynamic_url(url: &str, rank: usize) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut pairs: Vec<String> = query
        .split('&')
        .filter(|p| !p.is_empty() && !p.starts_with("rank=") && !p.starts_with("world_size="))
        .map(str::to_owned)
        .collect();
    pairs.push(format!("rank={rank}"));
    pairs.push(format!("world_size={}", rank + 1));
    format!("{base}?{}", pairs.join("&"))
}

/// The store key that holds a group's kind (`static` or `dynamic`).
pub(crate) const GROUP_KIND: &str = "rpc/group_kind";

/// Records the group's kind in the store on first use; a worker of the other kind is refused.
async fn guard_group_kind(store: &dyn Store, dynamic: bool) -> Result<(), RpcError> {
    let kind: &[u8] = if dynamic { b"dynamic" } else { b"static" };
    let held = store.compare_set(GROUP_KIND, b"", kind).await?;
    if held != kind {
        return Err(RpcError::Init(format!(
            "this group is {}; a {} worker cannot join it (mixing static and dynamic members is refused)",
            String::from_utf8_lossy(&held),
            String::from_utf8_lossy(kind)
        )));
    }
    Ok(())
}

/// The cluster secret from the options, else from `TENSORWIRE_SECRET`.
#[cfg_attr(not(feature = "tcp"), allow(dead_code))] // the TCP backends use it
pub(crate) fn cluster_secret(options: &RpcOptions) -> Result<Option<ClusterSecret>, RpcError> {
    secret_bytes(options)
        .map(ClusterSecret::new)
        .transpose()
        .map_err(|e| RpcError::Init(e.to_string()))
}

/// The agent over `transport`, for a backend's `init_backend`: the world process group over
/// `transport` on the rendezvous store, an `all_gather_object` of the worker records, their
/// validation, then the agent over the group's connections (see [`init_rpc`] for what that
/// guarantees). With `world_size = None` it joins a dynamic group instead. A static init that
/// fails shuts the group and the rendezvous down (a store this worker hosts is closed) before
/// it returns the error.
pub async fn start_agent(
    transport: Arc<dyn Transport>,
    rdv: Rendezvous,
    name: &str,
    rank: usize,
    world_size: Option<usize>,
    options: RpcOptions,
) -> Result<Agent, RpcError> {
    let checked = match check_worker_name(name) {
        Ok(()) => guard_group_kind(&*rdv.store, world_size.is_none()).await,
        Err(e) => Err(e.into()),
    };
    if let Err(e) = checked {
        rdv.shutdown().await;
        return Err(e);
    }
    let Some(world_size) = world_size else {
        return crate::dynamic::join(transport, rdv, name, rank, options).await;
    };
    let runtime = Arc::clone(&options.runtime);
    let started = runtime.now();
    let (group, records) =
        match join_static(transport, &rdv, name, rank, world_size, &options).await {
            Ok(joined) => joined,
            Err(e) => {
                rdv.shutdown().await;
                return Err(e);
            }
        };
    let agent = Agent::new(name, rank as WorkerId, false, &records, &rdv, &options);
    *agent
        .inner
        .rendezvous
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(rdv);
    if let Err(e) = agent.attach_group(group, options.init_timeout).await {
        agent.stop_and_release(agent.now()).await;
        return Err(e);
    }
    agent.spawn(drive(agent.clone()));
    info!(worker = %agent.inner.me, world_size, took = ?runtime.now().saturating_duration_since(started), "RPC agent started");
    Ok(agent)
}

/// The name of the process group under a static RPC group (its store keys, its hello).
pub(crate) const RPC_GROUP: &str = "rpc";

/// Static groups, as DESIGN's init flow: the world process group over `transport` (one
/// connection per pair of workers, which the agent then shares), an `all_gather_object` of the
/// worker records, and their validation (names, device maps). The store holds no record.
async fn join_static(
    transport: Arc<dyn Transport>,
    rdv: &Rendezvous,
    name: &str,
    rank: usize,
    world_size: usize,
    options: &RpcOptions,
) -> Result<(Group, Vec<WorkerRecord>), RpcError> {
    let ip = advertise_ip(options)?;
    let group_options = GroupOptions::new(RPC_GROUP)
        .with_listen(SocketAddr::new(ip, 0))
        .with_timeout(options.init_timeout);
    let group = Group::connect(
        Arc::clone(&rdv.store),
        transport,
        rank,
        world_size,
        group_options,
    )
    .await
    .map_err(|e| init_error(e, "connecting to every worker", options.init_timeout))?;
    let record = WorkerRecord {
        rank: rank as WorkerId,
        // Nobody dials this: the group's connections are the agent's.
        addr: SocketAddr::new(ip, 0),
        devices: WorkerDeviceInfo {
            name: name.to_owned(),
            device_count: options.device_backend.device_count(),
            devices: options.devices.clone(),
            device_maps: options.device_maps.clone(),
        },
    };
    let records = match group.all_gather_object(&record).await {
        Ok(records) => records,
        Err(e) => {
            group.shutdown().await;
            return Err(init_error(
                e,
                "gathering every worker's record",
                options.init_timeout,
            ));
        }
    };
    if let Err(e) = validate_records(&records) {
        group.shutdown().await;
        return Err(e);
    }
    Ok((group, records))
}

/// Every worker's record is its own rank's, names are unique, and the device maps keep the
/// rules of a static group.
fn validate_records(records: &[WorkerRecord]) -> Result<(), RpcError> {
    let mut by_name = HashMap::new();
    for (r, rec) in records.iter().enumerate() {
        if rec.rank as usize != r {
            return Err(RpcError::Init(format!(
                "rank {r} sent the record of rank {}",
                rec.rank
            )));
        }
        if let Some(other) = by_name.insert(rec.devices.name.clone(), rec.rank) {
            return Err(RpcError::Init(format!(
                "worker name {:?} is used by ranks {other} and {}",
                rec.devices.name, rec.rank
            )));
        }
    }
    let infos: Vec<WorkerDeviceInfo> = records.iter().map(|r| r.devices.clone()).collect();
    validate_device_maps(&infos, GroupKind::Static).map_err(|e| RpcError::DeviceMaps(Box::new(e)))
}

/// A failure of the group under init: a timeout names the ranks it waited for.
fn init_error(e: ProcessGroupError, what: &str, after: Duration) -> RpcError {
    let waiting_on = match &e {
        ProcessGroupError::SetupTimeout { waiting_on, .. }
        | ProcessGroupError::Timeout { waiting_on, .. } => waiting_on.clone(),
        _ => return RpcError::ProcessGroup(e),
    };
    RpcError::Timeout {
        what: format!("init_rpc: {what}"),
        after,
        waiting_for: Some(
            waiting_on
                .iter()
                .map(|r| rank_only(*r))
                .collect::<Vec<_>>()
                .join(", "),
        ),
    }
}

/// The agent's side of its static group's connections: the frames that are not the group's
/// own, handled on the connection's reader task as the agent's own readers would. It holds
/// the agent as a reader task does; the agent's shutdown lets go of the group, whose readers
/// then end, and with them this.
struct AgentFrames(Agent);

impl FrameSink for AgentFrames {
    fn on_frame(
        &self,
        peer: usize,
        conn: &Arc<dyn Connection>,
        frame: Frame,
    ) -> Result<(), String> {
        let agent = &self.0;
        let peer = peer as WorkerId;
        agent
            .on_frame(peer, frame, conn.cheap_sends())
            .map_err(|violation| {
                let reason = format!("broke the RPC protocol: {violation}");
                agent.peer_lost_on(peer, LostCause::Misbehaved(Box::new(violation)), conn);
                reason
            })
    }

    fn on_closed(&self, peer: usize, reason: &str) {
        let agent = &self.0;
        let peer = peer as WorkerId;
        let current = {
            let st = agent.lock();
            st.ep.state() == tensorwire_core::protocol::RunState::Running
                && st.peers.contains_key(&peer)
        };
        if current {
            agent.peer_lost(peer, LostCause::Transport(reason.to_owned()));
        }
    }
}

impl Agent {
    /// A new agent (not yet connected) for worker `name` among `records`.
    pub(crate) fn new(
        name: &str,
        me_id: WorkerId,
        dynamic: bool,
        records: &[WorkerRecord],
        rdv: &Rendezvous,
        options: &RpcOptions,
    ) -> Agent {
        let mut members = Membership::new(records);
        members.derive(name, &options.devices, &options.device_maps);
        let inner = Arc::new(Inner {
            me: WorkerInfo {
                name: name.to_owned(),
                id: me_id,
            },
            members: std::sync::RwLock::new(members),
            dynamic,
            declared_devices: options.devices.clone(),
            rpc_timeout_nanos: std::sync::atomic::AtomicU64::new(duration_nanos(
                options.rpc_timeout,
            )),
            functions: options.functions.clone(),
            backend: Arc::clone(&options.device_backend),
            ipc: crate::ipc::IpcLink::new(
                &*options.device_backend,
                options.share_device_memory,
                options.ipc_limits,
            ),
            state: Mutex::new(State {
                ep: Endpoint::new(me_id, EndpointConfig::default()),
                waiters: HashMap::new(),
                values: HashMap::new(),
                peers: HashMap::new(),
                driver_wakes_at: None,
                confirm_waits: HashMap::new(),
                shutdown_waiter: None,
            }),
            wake: Notify::new(),
            store: Mutex::new(Some(Arc::clone(&rdv.store))),
            device_maps: options.device_maps.clone(),
            metrics: crate::metrics::AgentMetrics::new(name),
            rendezvous: Mutex::new(None),
            group: Mutex::new(None),
            gathers: crate::gather::Gathers::default(),
            tasks: Mutex::new(Tasks::default()),
            runtime: Arc::clone(&options.runtime),
            peer_events: crate::peer_events::PeerEventHub::new(),
            membership: crate::dynamic::new_state(),
            membership_wake: Notify::new(),
            serving: std::sync::atomic::AtomicUsize::new(0),
        });
        Agent { inner }
    }
}

/// `url` with `rank` and `world_size` added to its query where it lacks them, for every scheme,
/// as PyTorch's `rendezvous(url, rank, world_size)` does: `tcp://host:port` and
/// `file:///path` work without repeating what `init_rpc` was given.
fn with_rank(url: &str, rank: usize, world_size: usize) -> String {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let has = |key: &str| query.split('&').any(|kv| kv.split('=').next() == Some(key));
    let mut out = url.to_owned();
    for (key, value) in [("rank", rank), ("world_size", world_size)] {
        if !has(key) {
            out.push(if out.contains('?') { '&' } else { '?' });
            out.push_str(&format!("{key}={value}"));
        }
    }
    out
}

/// A duration in nanoseconds, saturating (584 years).
fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn rank_only(rank: usize) -> String {
    format!("rank {rank}")
}

fn remote_error(
    worker: WorkerId,
    kind: RemoteErrorKind,
    message: impl Into<String>,
) -> RemoteError {
    RemoteError {
        worker,
        kind,
        message: message.into(),
    }
}

impl Agent {
    /// The current time, from the agent's one runtime (see [`crate::runtime`]).
    pub(crate) fn now(&self) -> Instant {
        self.inner.runtime.now()
    }

    /// The agent's runtime: its clock, timers and spawner.
    pub(crate) fn runtime(&self) -> &dyn Runtime {
        &*self.inner.runtime
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn tasks(&self) -> MutexGuard<'_, Tasks> {
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `task` as one of the agent's tasks: shutdown ends it and waits until it has ended.
    /// After shutdown nothing new starts (`task` is dropped, outside the lock: it may hold
    /// user values).
    pub(crate) fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.track(false, task);
    }

    fn track(&self, writer: bool, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let refused = {
            let mut tasks = self.tasks();
            if tasks.closed {
                Some(task)
            } else {
                let set = if writer {
                    &mut tasks.writers
                } else {
                    &mut tasks.others
                };
                // Forget the ones that ended, so the set holds the running ones only.
                while set.try_join_next().is_some() {}
                set.spawn(task);
                None
            }
        };
        drop(refused);
    }

    pub(crate) fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// Moves what the endpoint produced along, on the calling task: messages to the peers'
    /// writers (in order, under the lock) and events to their handlers. Wakes the driver only
    /// when a timer is now due earlier than the one it sleeps on. Must run inside the runtime
    /// (dispatching may spawn tasks); `Drop` impls use [`wake`](Self::wake) instead.
    pub(crate) fn pump(&self) {
        self.pump_with(None);
    }

    /// [`pump`](Self::pump), writing messages on this task where the peer's writer is idle
    /// (one wake-up less per message). Only for tasks of ours that nobody cancels mid-write.
    async fn pump_direct(&self) {
        let mut writes = Vec::new();
        self.pump_with(Some(&mut writes));
        for w in writes {
            if let Err(e) = w.conn.send_many(w.frames).await {
                self.peer_lost(w.peer, LostCause::Transport(e.to_string()));
            }
        }
    }

    /// [`pump`](Self::pump) for a task that cannot wait (a caller's `rpc_async`): messages to a
    /// peer whose writer is idle are written on this task as far as the connection takes them
    /// without waiting (one wake-up of the writer less per message); the rest of such a write
    /// goes on in a writer task, which shutdown lets finish, holding the peer's write turn (so
    /// order is kept).
    fn pump_now(&self) {
        let mut writes = Vec::new();
        self.pump_with(Some(&mut writes));
        for w in writes {
            let agent = self.clone();
            let mut write = Box::pin(async move {
                let DirectWrite {
                    peer,
                    conn,
                    frames,
                    _turn,
                } = w;
                if let Err(e) = conn.send_many(frames).await {
                    agent.peer_lost(peer, LostCause::Transport(e.to_string()));
                }
            });
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if std::future::Future::poll(write.as_mut(), &mut cx).is_pending() {
                self.track(true, write);
            }
        }
    }

    fn pump_with(&self, mut direct: Option<&mut Vec<DirectWrite>>) {
        loop {
            let (events, wake_driver) = {
                let mut st = self.lock();
                while let Some(t) = st.ep.poll_transmit() {
                    self.send(&mut st, t, direct.as_deref_mut());
                }
                let mut events = Vec::new();
                while let Some(e) = st.ep.poll_event() {
                    events.push(e);
                }
                let next = st.ep.poll_timeout();
                let wake_driver = match (next, st.driver_wakes_at) {
                    (Some(n), Some(at)) => n < at,
                    (Some(_), None) => true,
                    (None, _) => false,
                };
                (events, wake_driver)
            };
            if wake_driver {
                self.wake();
            }
            if events.is_empty() {
                return;
            }
            for e in events {
                self.dispatch(e);
            }
        }
    }

    /// This worker.
    pub fn worker_info(&self) -> &WorkerInfo {
        &self.inner.me
    }

    pub(crate) fn members(&self) -> std::sync::RwLockReadGuard<'_, Membership> {
        self.inner
            .members
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Every worker of the group now, in rank order.
    pub fn worker_infos(&self) -> Vec<WorkerInfo> {
        self.members().workers.values().cloned().collect()
    }

    /// The worker named `name`.
    pub fn get_worker_info(&self, name: &str) -> Result<WorkerInfo, RpcError> {
        let id = self.resolve(&WorkerRef::Name(name.to_owned()))?;
        Ok(WorkerInfo {
            name: name.to_owned(),
            id,
        })
    }

    /// Whether the group's membership can change (`world_size = None` at init).
    pub fn is_dynamic(&self) -> bool {
        self.inner.dynamic
    }

    /// The devices this agent handles (sorted, without the CPU).
    pub fn devices(&self) -> Vec<Device> {
        self.members().devices.clone()
    }

    /// This worker's device maps.
    pub fn device_maps(&self) -> &DeviceMaps {
        &self.inner.device_maps
    }

    /// This worker's reverse device maps (where its responses' tensors land).
    pub fn reverse_device_maps(&self) -> DeviceMaps {
        self.members().reverse.clone()
    }

    /// The functions this worker serves; functions registered later are served too.
    pub fn functions(&self) -> &Functions {
        &self.inner.functions
    }

    /// How many values this worker keeps for remote references it owns.
    pub fn owned_value_count(&self) -> usize {
        self.lock().values.len()
    }

    /// The group's store; [`RpcError::NotRunning`] once [`shutdown`](Self::shutdown) has let
    /// go of it.
    pub fn store(&self) -> Result<Arc<dyn Store>, RpcError> {
        self.inner
            .store
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or(RpcError::NotRunning)
    }

    fn resolve(&self, to: &WorkerRef) -> Result<WorkerId, RpcError> {
        let m = self.members();
        let known = || {
            m.workers
                .values()
                .map(|w| w.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        match to {
            WorkerRef::Name(n) => m
                .by_name
                .get(n)
                .copied()
                .ok_or_else(|| RpcError::UnknownWorker(n.clone(), known())),
            WorkerRef::Rank(r) if m.workers.contains_key(r) => Ok(*r),
            WorkerRef::Rank(r) => Err(RpcError::UnknownWorker(format!("rank {r}"), known())),
        }
    }

    /// Adds a worker that joined (dynamic groups) and recomputes this worker's reverse maps and
    /// device list.
    pub(crate) fn add_member(&self, record: WorkerRecord) {
        let mut m = self
            .inner
            .members
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        m.workers.insert(
            record.rank,
            WorkerInfo {
                name: record.devices.name.clone(),
                id: record.rank,
            },
        );
        m.by_name.insert(record.devices.name.clone(), record.rank);
        m.infos.insert(record.rank, record.devices);
        m.derive(
            &self.inner.me.name,
            &self.inner.declared_devices,
            &self.inner.device_maps,
        );
        drop(m);
        let mut st = self.lock();
        st.ep.handle_peer_joined(record.rank);
        drop(st);
        self.inner
            .peer_events
            .emit(crate::peer_events::PeerEvent::Joined {
                worker: record.rank,
            });
    }

    /// Drops a worker that left or died (dynamic groups).
    pub(crate) fn remove_member(&self, rank: WorkerId) {
        let mut m = self
            .inner
            .members
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(w) = m.workers.remove(&rank) {
            m.by_name.remove(&w.name);
        }
        m.infos.remove(&rank);
        m.derive(
            &self.inner.me.name,
            &self.inner.declared_devices,
            &self.inner.device_maps,
        );
    }

    /// "rank 2 (w2)".
    fn describe(&self, rank: usize) -> String {
        format!("rank {rank} ({})", self.name_of(rank as WorkerId))
    }

    pub(crate) fn name_of(&self, id: WorkerId) -> String {
        self.members()
            .workers
            .get(&id)
            .map_or_else(|| format!("rank {id}"), |w| w.name.clone())
    }

    fn timeout_or_default(&self, timeout: Option<Duration>) -> Duration {
        timeout.unwrap_or_else(|| self.rpc_timeout())
    }

    /// The default timeout of calls made without one (PyTorch's `get_rpc_timeout`); zero
    /// means none.
    pub fn rpc_timeout(&self) -> Duration {
        Duration::from_nanos(
            self.inner
                .rpc_timeout_nanos
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Changes the default timeout of calls made from now on without one (PyTorch's
    /// `_set_rpc_timeout`); zero means none. Calls already sent keep theirs.
    pub fn set_rpc_timeout(&self, timeout: Duration) {
        self.inner.rpc_timeout_nanos.store(
            duration_nanos(timeout),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Calls `function(args)` on `to` and waits for its result. `timeout` overrides the default
    /// (zero: none). Tensors in `args` move by this worker's device map for `to`.
    pub async fn rpc_sync<A, R>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<R, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        self.rpc_async(to, function, args, timeout)?.await
    }

    /// Sends `function(args)` to `to` now and returns a future of its result, to await later.
    /// A tensor that cannot go to `to` (a CUDA tensor without a device map entry) fails here,
    /// before anything is sent.
    pub fn rpc_async<A, R>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<RpcFuture<R>, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        let to = self.resolve(&to.into())?;
        self.send_call(to, function, args, None, timeout)
    }

    fn transfer_error(&self, to: WorkerId, function: &str, e: TensorTransferError) -> RpcError {
        match e {
            TensorTransferError::Encode(e) => RpcError::Serialization {
                what: format!("the arguments of {function:?}"),
                message: codec::take_note().unwrap_or_else(|| e.to_string()),
            },
            other => RpcError::Tensors {
                to: self.name_of(to),
                function: function.to_owned(),
                message: other.to_string(),
            },
        }
    }

    pub(crate) fn send_call<A, R>(
        &self,
        to: WorkerId,
        function: &str,
        args: &A,
        target: Option<RRefHandle>,
        timeout: Option<Duration>,
    ) -> Result<RpcFuture<R>, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        self.send_call_placed(to, function, args, target, timeout, Direction::Request)
    }

    /// The backend that copies this agent's tensors between host and devices.
    /// This agent's IPC state (see [`crate::ipc`]).
    pub(crate) fn ipc(&self) -> &crate::ipc::IpcLink {
        &self.inner.ipc
    }

    /// Which way device tensors went to each peer, in rank order: by CUDA IPC handle (same
    /// host, same GPU, both sides able to share) or staged through host memory, with the
    /// reason for the last staged one and the buffers held for the peer awaiting its release.
    pub fn device_paths(&self) -> Vec<tensorwire_core::ipc::PeerPaths> {
        self.inner.ipc.report()
    }

    pub(crate) fn device_backend(&self) -> &Arc<dyn DeviceBackend> {
        &self.inner.backend
    }

    /// [`send_call`](Self::send_call), with the tensors of `args` placed as `placement` says:
    /// by this worker's map for `to` (a request) or by its reverse map for `to` (the way a
    /// response goes; distributed autograd sends a gradient back by the reverse of the map
    /// its forward message took).
    pub(crate) fn send_call_placed<A, R>(
        &self,
        to: WorkerId,
        function: &str,
        args: &A,
        target: Option<RRefHandle>,
        timeout: Option<Duration>,
        placement: Direction,
    ) -> Result<RpcFuture<R>, RpcError>
    where
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        let prepared = tensors::prepare(self, to, args, placement)
            .map_err(|e| self.transfer_error(to, function, e))?;
        let timeout = self.timeout_or_default(timeout);
        let (tx, rx) = oneshot::channel();
        let bytes = crate::metrics::message_bytes(
            prepared.data.len(),
            prepared.tensors.iter().map(|t| &t.0),
        );
        let mut alone = false;
        let id = if prepared.on_host() {
            let body = Body {
                target: target.map(|h| h.rref),
                data: prepared.data,
                tensors: tensors::host_to_wire(prepared.tensors),
                forks: prepared.forks.clone(),
            };
            let mut st = self.lock();
            self.check_target(&st, target)?;
            let id = st
                .ep
                .call(to, function, body, timeout, self.now())
                .map_err(|_| RpcError::NotRunning)?;
            st.waiters.insert(id, tx);
            // The only call waiting: nothing would join it in the writer's batch, so it is
            // written here and now. With others in flight, the writer batches them.
            alone = st.waiters.len() == 1;
            id
        } else {
            // Device tensors are copied to host memory first. The call takes its place now
            // (id, deadline, order among our messages to `to`) and goes out when they are.
            let id = {
                let mut st = self.lock();
                self.check_target(&st, target)?;
                let id = st
                    .ep
                    .call_deferred(to, function, timeout, self.now())
                    .map_err(|_| RpcError::NotRunning)?;
                st.waiters.insert(id, tx);
                id
            };
            self.supply_when_copied(id, to, target.map(|h| h.rref), prepared);
            id
        };
        if alone {
            self.pump_now();
        } else {
            self.pump();
        }
        let future = RpcFuture::new(self.clone(), rx, self.name_of(to), function.to_owned());
        Ok(self
            .inner
            .metrics
            .call(self, to, function, id, bytes, future))
    }

    /// Undoes the forks made for `to` by an encode whose bytes will not be sent.
    pub(crate) fn cancel_forks(
        &self,
        to: WorkerId,
        forks: &[tensorwire_core::protocol::RRefForkData],
    ) {
        if forks.is_empty() {
            return;
        }
        {
            let mut st = self.lock();
            for f in forks {
                st.ep.cancel_fork(*f, to, self.now());
            }
        }
        self.wake();
    }

    /// Copies the device tensors of a deferred call or remote to host memory, then hands its
    /// body to the endpoint (or abandons it, failing the call, if a copy fails).
    fn supply_when_copied(
        &self,
        id: MessageId,
        to: WorkerId,
        target: Option<RRefId>,
        prepared: tensors::Prepared,
    ) {
        let agent = self.clone();
        self.spawn(async move {
            let copied = crate::ipc::to_wire(&agent, to, prepared.tensors).await;
            {
                let mut st = agent.lock();
                match copied {
                    Ok(wire) => st.ep.supply_body(
                        id,
                        Body {
                            target,
                            data: prepared.data,
                            tensors: wire,
                            forks: prepared.forks.clone(),
                        },
                    ),
                    Err(e) => {
                        let now = agent.now();
                        st.ep.abandon(id, &e.to_string(), now);
                        for f in &prepared.forks {
                            st.ep.cancel_fork(*f, to, now);
                        }
                    }
                }
            }
            agent.pump();
        });
    }

    /// Creates a value on `to` by running `function(args)` there, and returns a reference to it
    /// at once. The value lives on `to` until every reference to it is dropped.
    ///
    /// Tensors in the arguments move by this worker's device map for `to`, CUDA ones too:
    /// their copies off the device run after `remote` returns, and the creation leaves once
    /// they are done, ahead of anything this worker sends `to` afterwards.
    pub fn remote<A, T>(
        &self,
        to: impl Into<WorkerRef>,
        function: &str,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<RRef<T>, RpcError>
    where
        A: Serialize + ?Sized,
        T: Send + Sync + 'static,
    {
        let to = self.resolve(&to.into())?;
        self.send_remote(to, function, args, None, timeout)
    }

    /// `remote`, also for methods: with `target`, `function` runs on the value of that
    /// reference (owned by `to`).
    pub(crate) fn send_remote<A, T>(
        &self,
        to: WorkerId,
        function: &str,
        args: &A,
        target: Option<RRefHandle>,
        timeout: Option<Duration>,
    ) -> Result<RRef<T>, RpcError>
    where
        A: Serialize + ?Sized,
        T: Send + Sync + 'static,
    {
        let prepared = tensors::prepare(self, to, args, Direction::Request)
            .map_err(|e| self.transfer_error(to, function, e))?;
        let timeout = self.timeout_or_default(timeout);
        let (tx, rx) = oneshot::channel();
        let bytes = crate::metrics::message_bytes(
            prepared.data.len(),
            prepared.tensors.iter().map(|t| &t.0),
        );
        self.inner.metrics.remote(self, to, function, bytes);
        let handle = if prepared.on_host() {
            let body = Body {
                target: target.map(|h| h.rref),
                data: prepared.data,
                tensors: tensors::host_to_wire(prepared.tensors),
                forks: prepared.forks.clone(),
            };
            let mut st = self.lock();
            self.check_target(&st, target)?;
            let (handle, id) = st
                .ep
                .remote(to, function, body, timeout, self.now())
                .map_err(|_| RpcError::NotRunning)?;
            st.waiters.insert(id, tx);
            handle
        } else {
            // As in `send_call`: the reference exists now; the creation leaves when the device
            // copies are done, and nothing we send the owner meanwhile overtakes it (so our
            // own `to_here` never finds the reference unknown).
            let (handle, id) = {
                let mut st = self.lock();
                self.check_target(&st, target)?;
                let (handle, id) = st
                    .ep
                    .remote_deferred(to, function, timeout, self.now())
                    .map_err(|_| RpcError::NotRunning)?;
                st.waiters.insert(id, tx);
                (handle, id)
            };
            self.supply_when_copied(id, to, target.map(|h| h.rref), prepared);
            handle
        };
        self.pump();
        Ok(RRef::from_handle(self.clone(), handle, Some(rx)))
    }

    /// A reference to `value`, owned by this worker (PyTorch's `RRef(value)`): it can be passed
    /// in arguments and results like any other, and the value lives until no worker refers to
    /// it. [`RRef::new`] is the same.
    pub fn local_rref<T>(&self, value: T) -> Result<RRef<T>, RpcError>
    where
        T: Serialize + Send + Sync + 'static,
    {
        let handle = {
            let mut st = self.lock();
            let handle = st.ep.local_rref().map_err(|_| RpcError::NotRunning)?;
            st.values
                .insert(handle.rref, Arc::new(value) as Arc<dyn Value>);
            handle
        };
        Ok(RRef::from_handle(self.clone(), handle, None))
    }

    /// What this agent holds and waits for (PyTorch's `_get_debug_info` and
    /// `_rref_context_get_debug_info`): values kept for references, the forks of references
    /// it owns held elsewhere, forks it holds (a *pending user* until the owner confirms),
    /// calls in flight per peer.
    pub fn debug_info(&self) -> AgentDebugInfo {
        let st = self.lock();
        AgentDebugInfo {
            worker: self.inner.me.clone(),
            kept_values: st.values.len(),
            protocol: st.ep.debug_info(),
        }
    }

    /// The connections to the peers this worker is connected to, in rank order, each with the
    /// transport chosen for it (shared memory for a peer on this host unless
    /// `TENSORWIRE_TRANSPORT=tcp`; TCP across hosts). A lost peer is not listed.
    pub fn connections(&self) -> Vec<PeerConnection> {
        let mut out: Vec<(WorkerId, &'static str)> = self
            .lock()
            .peers
            .iter()
            .map(|(id, link)| (*id, link.transport))
            .collect();
        out.sort_unstable_by_key(|(id, _)| *id);
        out.into_iter()
            .map(|(id, transport)| PeerConnection {
                peer: WorkerInfo {
                    name: self.name_of(id),
                    id,
                },
                transport,
            })
            .collect()
    }

    /// Calls `function(args)` on `to` (by name, rank or [`WorkerInfo`]): `.await` the returned
    /// [`Call`] for the result, or use its `timeout`, `send` and `remote`. The argument and
    /// result types come from the descriptor, so they cannot disagree with what
    /// [`Functions::serve`] registered in the same codebase; across binaries the callee checks
    /// them (see the [`typed`](crate::typed) module).
    pub fn call<'a, A, R>(
        &'a self,
        function: &Function<A, R>,
        to: impl Into<WorkerRef>,
        args: &'a A,
    ) -> Call<'a, A, R>
    where
        A: Serialize + 'static,
        R: 'static,
    {
        Call::new(self, function, to.into(), args)
    }

    /// This agent's counters: calls, bytes, errors and calls in flight, in total and per peer.
    /// The same numbers go to the [`metrics`] facade (see the [`metrics`](crate::metrics)
    /// module).
    pub fn metrics(&self) -> RpcMetrics {
        self.inner.metrics.read()
    }

    /// A reference handle of this worker's is gone (its last [`RRef`] clone dropped): the
    /// endpoint tells the owner when it may.
    pub(crate) fn drop_reference(&self, handle: RRefHandle) {
        let now = self.now();
        self.lock().ep.drop_handle(handle, now);
        self.wake();
    }

    /// Whether the owner has confirmed this worker's `handle`.
    pub(crate) fn reference_confirmed(&self, handle: RRefHandle) -> bool {
        self.lock().ep.is_confirmed(handle).unwrap_or(false)
    }

    /// Forks `handle` for worker `to` (a reference being sent to it).
    pub(crate) fn fork_reference(
        &self,
        handle: RRefHandle,
        to: WorkerId,
    ) -> Result<RRefForkData, CallError> {
        self.lock().ep.fork_for(handle, to)
    }

    /// Accepts a fork received from a peer, as a handle of this worker's.
    pub(crate) fn accept_reference(&self, data: RRefForkData) -> RRefHandle {
        let now = self.now();
        let handle = self.lock().ep.accept_fork(data, now);
        self.wake();
        handle
    }

    /// Whether `self` and `other` are the same agent (clones of one).
    pub(crate) fn same_as(&self, other: &Agent) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The value of a reference this worker owns.
    pub(crate) fn local_value(&self, rref: RRefId) -> Option<Arc<dyn Any + Send + Sync>> {
        self.lock()
            .values
            .get(&rref)
            .map(|v| Arc::clone(v).into_any())
    }

    pub(crate) fn fetch(
        &self,
        handle: RRefHandle,
        timeout: Option<Duration>,
    ) -> Result<oneshot::Receiver<Result<Body, CallError>>, RpcError> {
        let timeout = self.timeout_or_default(timeout);
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.lock();
            let id = st
                .ep
                .fetch(handle, timeout, self.now())
                .map_err(|e| self.rref_error(handle, e))?;
            st.waiters.insert(id, tx);
        }
        self.pump();
        Ok(rx)
    }

    /// The error of a reference that cannot be used: a failed or timed-out creation is
    /// [`RpcError::RRefCreation`], naming the reference and its owner.
    /// A method call (or remote method) on `target` may go: the endpoint still holds the
    /// reference. Checked under the same lock as the call is made, so a reference whose owner
    /// leaves (and whose rank a new worker takes) in between cannot slip through to the new
    /// worker, which never had the value.
    fn check_target(&self, st: &State, target: Option<RRefHandle>) -> Result<(), RpcError> {
        match target {
            Some(h) => st.ep.check_reference(h).map_err(|e| self.rref_error(h, e)),
            None => Ok(()),
        }
    }

    pub(crate) fn rref_error(&self, handle: RRefHandle, e: CallError) -> RpcError {
        match e {
            CallError::NotRunning => RpcError::NotRunning,
            e @ (CallError::RRefCreationTimedOut { .. } | CallError::Remote(_)) => {
                RpcError::RRefCreation {
                    rref: handle.rref.to_string(),
                    owner: self.name_of(handle.owner),
                    source: e,
                }
            }
            other => RpcError::RRef {
                rref: handle.rref.to_string(),
                reason: other.to_string(),
            },
        }
    }

    /// Gathers one value from every worker, in rank order.
    ///
    /// In a static group it runs as an `all_gather_object` of the world process group, over
    /// the agent's connections (no store key): every worker calls `all_gather`s and
    /// [`barrier`](Self::barrier)s in the same order, and `name` only labels errors. It is
    /// bounded by `timeout`; a timeout breaks the group, so later barriers and all_gathers fail
    /// with the same error (calls go on).
    ///
    /// In a dynamic group (which has no process group) it runs over RPC, as PyTorch's
    /// `rpc.api._all_gather`: every member sends its value to the leader (the lowest rank among
    /// the members), which answers them all once every member has sent; every member calls it
    /// with the same `name`, which may be used again once it has returned. Nothing goes
    /// through the store. A member that joins or leaves meanwhile makes it fail, saying so; on
    /// timeout the error names the members that did not send. (Values in rank order; a
    /// dynamic group's ranks need not be contiguous.)
    pub async fn all_gather<T: Serialize + DeserializeOwned>(
        &self,
        name: &str,
        value: &T,
        timeout: Duration,
    ) -> Result<Vec<T>, RpcError> {
        let what = format!("all_gather {name:?}");
        let bytes = postcard::to_allocvec(value).map_err(|e| RpcError::Serialization {
            what: format!("the {what} value"),
            message: e.to_string(),
        })?;
        let blocks = match self.group() {
            Some(group) => group
                .all_gather_work(bytes)
                .wait(timeout)
                .await
                .map_err(|e| self.group_error(e, &what, timeout))?,
            None => self
                .gather_dynamic(&what, name, bytes, timeout)
                .await?
                .into_iter()
                .map(Bytes::from)
                .collect(),
        };
        blocks
            .iter()
            .enumerate()
            .map(|(r, b)| {
                postcard::from_bytes(b).map_err(|e| RpcError::Serialization {
                    what: format!("the {what} value of member {r}"),
                    message: e.to_string(),
                })
            })
            .collect()
    }

    /// Waits until every worker reached the barrier `name`. On timeout the error names the
    /// workers that did not arrive.
    ///
    /// In a static group it is a monitored barrier of the world process group, over the
    /// agent's connections (no store key); workers call barriers and
    /// [`all_gather`](Self::all_gather)s in the same order, and `name` only labels errors. In
    /// a dynamic group it is an [`all_gather`](Self::all_gather) of nothing over RPC (through
    /// the leader; no store key).
    pub async fn barrier(&self, name: &str, timeout: Duration) -> Result<(), RpcError> {
        if let Some(group) = self.group() {
            return group
                .monitored_barrier(Some(timeout), true)
                .await
                .map_err(|e| self.group_error(e, &format!("barrier {name:?}"), timeout));
        }
        let what = format!("barrier {name:?}");
        self.gather_dynamic(&what, &format!("barrier/{name}"), Vec::new(), timeout)
            .await
            .map(drop)
    }

    /// A barrier among `workers` only (PyTorch's `rpc.api._barrier(worker_names)`): each of
    /// them calls it with the same list and name, and it returns once all of them have; the
    /// others take no part. It runs over RPC through the lowest-ranked of them (as the dynamic
    /// group's barrier does), in static and dynamic groups alike, and writes nothing to the
    /// store. This worker must be in the list; an unknown worker fails with
    /// [`RpcError::UnknownWorker`]. A timeout (zero: none) names the workers that did not come.
    pub async fn barrier_among<W: Into<WorkerRef>>(
        &self,
        name: &str,
        workers: impl IntoIterator<Item = W>,
        timeout: Duration,
    ) -> Result<(), RpcError> {
        let mut members = std::collections::BTreeSet::new();
        for w in workers {
            members.insert(self.resolve(&w.into())?);
        }
        if !members.contains(&self.inner.me.id) {
            return Err(RpcError::InvalidArgument(format!(
                "barrier_among {name:?}: this worker ({}) is not among the workers listed",
                self.inner.me.name
            )));
        }
        let what = format!("barrier {name:?} among {} workers", members.len());
        self.gather_among(
            &what,
            &format!("barrier-among/{name}"),
            Vec::new(),
            timeout,
            members,
        )
        .await
        .map(drop)
    }

    /// A static group's world process group: the group init ran over, whose connections the
    /// agent shares (`None` in a dynamic group, which has none, as in PyTorch). Its
    /// collectives (and subgroups) run beside the calls on the same connections; they are
    /// numbered with the agent's own [`barrier`](Self::barrier)s and
    /// [`all_gather`](Self::all_gather)s, so every worker issues all of them in the same
    /// order. The agent's shutdown shuts it down.
    pub fn process_group(&self) -> Option<Group> {
        self.group()
    }

    /// The dynamic-group gathers this worker leads.
    pub(crate) fn gathers(&self) -> &crate::gather::Gathers {
        &self.inner.gathers
    }

    /// A static group's world process group.
    fn group(&self) -> Option<Group> {
        self.inner
            .group
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A failed collective of the agent's group: a timeout names the workers it waited for.
    fn group_error(&self, e: ProcessGroupError, what: &str, after: Duration) -> RpcError {
        match e {
            ProcessGroupError::Timeout { waiting_on, .. }
            | ProcessGroupError::MonitoredBarrier {
                missing: waiting_on,
                ..
            } => RpcError::Timeout {
                what: what.to_owned(),
                after,
                waiting_for: Some(
                    waiting_on
                        .iter()
                        .map(|r| self.describe(*r))
                        .collect::<Vec<_>>()
                        .join(", "),
                ),
            },
            ProcessGroupError::ShutDown => RpcError::NotRunning,
            other => RpcError::ProcessGroup(other),
        }
    }

    /// Stops the agent, [`Shutdown::Graceful`](crate::Shutdown::Graceful) within its
    /// `timeout` in all.
    ///
    /// Graceful: a termination detection over the members' connections — every worker, once
    /// idle, reports how much it has sent and received, in rounds, until two rounds in a row
    /// agree everywhere — so that nothing in flight anywhere is refused, however far the calls
    /// that functions started without awaiting them spread; then it stops; rank 0, which
    /// hosts the store, then waits for the others to leave it. One deadline bounds all of it:
    /// a stage that cannot finish (a dead or frozen peer) fails by the deadline with an error
    /// that names the workers that did not arrive. [`Shutdown::Immediate`](crate::Shutdown::Immediate): pending calls
    /// fail at once.
    ///
    /// When it returns, whether it succeeded or not: every call of this agent has failed or
    /// completed ("RPC is no longer running" afterwards); every task of the agent has ended, so
    /// no connection of the agent is open any more (queued messages were sent and the
    /// connections closed where the deadline allowed it); and the agent has let go of the store
    /// — the store server this worker hosts is closed and its port free, and a `file://`
    /// store's handle is dropped (the last worker's removes the file), also while clones of the
    /// [`Agent`] live on. A store operation the user started and has not finished keeps its
    /// own handle until it ends.
    pub async fn shutdown(&self, how: crate::Shutdown) -> Result<(), RpcError> {
        let (graceful, timeout) = how.parts();
        let deadline = self.runtime().deadline_after(timeout);
        let stages = async {
            match (graceful, self.inner.dynamic) {
                (true, false) => self.graceful(deadline, timeout).await,
                (true, true) => crate::dynamic::leave(self, timeout).await,
                (false, _) => Ok(()),
            }
        };
        // Rank 0 of a static group removes the last key the agent put in the store (the group's
        // kind); a dynamic group's last member removes its keys when it leaves.
        let stages = async {
            let outcome = stages.await;
            if self.inner.me.id == 0 && !self.inner.dynamic {
                if let Ok(store) = self.store() {
                    if let Err(e) = store.delete_key(GROUP_KIND).await {
                        debug!("could not remove {GROUP_KIND} from the store: {e}");
                    }
                }
            }
            outcome
        };
        // Every wait of the stages ends by the deadline and says for whom; past it, the store
        // is what did not answer.
        let result = self
            .runtime()
            .timeout_at(deadline, stages)
            .await
            .unwrap_or_else(|_| {
                Err(RpcError::Timeout {
                    what: "shutdown".into(),
                    after: timeout,
                    waiting_for: Some("the store, which did not answer".into()),
                })
            });
        // On a task of its own: shutdown may be called from a task of the agent (a served
        // function), which ending the agent's tasks cancels; the agent still stops whole.
        let agent = self.clone();
        self.runtime()
            .spawn(Box::pin(async move {
                agent.stop_and_release(deadline).await;
            }))
            .await;
        result
    }

    /// Stops the endpoint (pending calls fail), ends every task of the agent and waits for
    /// them, then lets go of the store. Writers get until `deadline` to send what is queued and
    /// close their connections. (A graceful shutdown of a static group runs over the members'
    /// connections, not the store: rank 0, which hosts it, need not wait for anyone.)
    pub(crate) async fn stop_and_release(&self, deadline: Instant) {
        let (writers, mut others) = {
            let mut tasks = self.tasks();
            tasks.closed = true;
            (
                std::mem::take(&mut tasks.writers),
                std::mem::take(&mut tasks.others),
            )
        };
        self.lock().ep.stop();
        self.inner.peer_events.close();
        // Deliver the failures of pending calls now (the driver is about to stop).
        self.pump();
        // The values this worker kept for others go too, dropped once the guard is gone (they
        // may hold remote references, whose `Drop` takes the lock; kept, they would also keep
        // the agent alive through those references). Dropping the links lets the writers
        // finish; a waiter still left learns that the agent stopped.
        let (values, peers, waiters) = {
            let mut st = self.lock();
            (
                std::mem::take(&mut st.values),
                std::mem::take(&mut st.peers),
                std::mem::take(&mut st.waiters),
            )
        };
        drop((values, peers, waiters));
        others.abort_all();
        while others.join_next().await.is_some() {}
        let mut writers = writers;
        let flushed = self
            .runtime()
            .timeout_at(deadline, async {
                while writers.join_next().await.is_some() {}
            })
            .await;
        if flushed.is_err() {
            writers.abort_all();
            while writers.join_next().await.is_some() {}
        }
        // The group's goodbyes close the shared connections (its readers end with them).
        let group = self
            .inner
            .group
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(group) = group {
            if self
                .runtime()
                .timeout_at(deadline, group.shutdown())
                .await
                .is_err()
            {
                debug!("the group's goodbyes did not all go out before the deadline");
            }
        }
        let store = self
            .inner
            .store
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(store);
        let rdv = self
            .inner
            .rendezvous
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(rdv) = rdv {
            rdv.shutdown().await;
        }
    }

    /// A graceful shutdown of a static group, decided by the endpoint (see
    /// `tensorwire_core::protocol::shutdown`): our calls answered, every member's calls
    /// answered, nothing outstanding here, every member idle; over the members' connections.
    /// Fails naming the members that were lost, or at the deadline those it still waits for.
    async fn graceful(&self, deadline: Instant, timeout: Duration) -> Result<(), RpcError> {
        let info = self.debug_info();
        if info.protocol.holds_references() {
            warn!(
                "graceful shutdown while this worker still holds remote references (they stop working): {info}"
            );
        }
        let members: Vec<WorkerId> = self.members().workers.keys().copied().collect();
        // The endpoint's deadline comes a little before the caller's, so that its error, which
        // names who is missing, is the one returned.
        let ends = deadline - (timeout / 10).min(Duration::from_millis(500));
        self.run_shutdown(timeout, |ep| {
            ep.begin_graceful_shutdown(members, Some(ends));
        })
        .await
    }

    /// Starts a shutdown of the endpoint with `begin` and waits for its outcome (the driver
    /// delivers it as an event).
    pub(crate) async fn run_shutdown(
        &self,
        timeout: Duration,
        begin: impl FnOnce(&mut Endpoint<Body>),
    ) -> Result<(), RpcError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.lock();
            st.shutdown_waiter = Some(tx);
            begin(&mut st.ep);
        }
        self.pump();
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                let who: Vec<String> = e
                    .missing
                    .iter()
                    .map(|r| self.describe(*r as usize))
                    .collect();
                let who = if who.is_empty() {
                    "nobody in particular".to_owned()
                } else {
                    who.join(", ")
                };
                Err(if e.lost {
                    RpcError::ShutdownIncomplete {
                        reason: e.to_string(),
                        waiting_for: who,
                    }
                } else {
                    RpcError::Timeout {
                        what: format!("shutdown: {e}"),
                        after: timeout,
                        waiting_for: Some(who),
                    }
                })
            }
            Err(_) => Err(RpcError::NotRunning),
        }
    }

    /// Registers the connection to `peer` and starts its reader and writer tasks.
    pub(crate) fn attach(&self, peer: WorkerId, conn: Box<dyn Connection>) {
        self.attach_conn(peer, Arc::from(conn), true);
    }

    /// Shares the connections of the static group's world process group: its reader tasks
    /// hand the agent's frames to the agent (see [`AgentFrames`]), the agent writes its own
    /// beside the group's, and a barrier makes sure that every worker has attached before any
    /// sends the others a call. The agent's shutdown shuts the group down.
    async fn attach_group(&self, group: Group, timeout: Duration) -> Result<(), RpcError> {
        let sink: Arc<dyn FrameSink> = Arc::new(AgentFrames(self.clone()));
        let routed = group.route_frames(sink);
        for (peer, conn) in group.connections() {
            self.attach_conn(peer as WorkerId, conn, false);
        }
        *self
            .inner
            .group
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(group.clone());
        routed.map_err(RpcError::ProcessGroup)?;
        group
            .barrier()
            .await
            .map_err(|e| init_error(e, "waiting for every worker to start", timeout))
    }

    /// Registers the connection to `peer` and starts its writer task, and its reader task if
    /// `read` (else the connection's owner, the static group, reads it and keeps it open).
    fn attach_conn(&self, peer: WorkerId, conn: Arc<dyn Connection>, read: bool) {
        if self.tasks().closed {
            // Shut down already: the connection closes here.
            return;
        }
        let (tx, mut rx) = mpsc::unbounded_channel::<Frame>();
        let write = Arc::new(tokio::sync::Mutex::new(()));
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        self.lock().peers.insert(
            peer,
            PeerLink {
                tx,
                transport: conn.transport(),
                conn: Arc::clone(&conn),
                write: Arc::clone(&write),
                queued: Arc::clone(&queued),
            },
        );
        let writer_conn = Arc::clone(&conn);
        let agent = self.clone();
        let writer = async move {
            while let Some(frame) = rx.recv().await {
                // Everything queued meanwhile goes out with it, in as few writes as possible.
                let mut batch = vec![frame];
                while batch.len() < WRITE_BATCH {
                    match rx.try_recv() {
                        Ok(f) => batch.push(f),
                        Err(_) => break,
                    }
                }
                let n = batch.len();
                let turn = write.lock().await;
                let sent = writer_conn.send_many(batch).await;
                drop(turn);
                queued.fetch_sub(n, std::sync::atomic::Ordering::AcqRel);
                if let Err(e) = sent {
                    agent.peer_lost_on(peer, LostCause::Transport(e.to_string()), &writer_conn);
                    return;
                }
            }
            if read {
                let _ = writer_conn.close().await;
            }
        };
        let agent = self.clone();
        let cheap_sends = conn.cheap_sends();
        let reader = async move {
            loop {
                match conn.recv().await {
                    Ok(frame) => {
                        if let Err(violation) = agent.on_frame(peer, frame, cheap_sends) {
                            agent.peer_lost_on(
                                peer,
                                LostCause::Misbehaved(Box::new(violation)),
                                &conn,
                            );
                            return;
                        }
                    }
                    Err(e) => {
                        if agent.lock().ep.state() == tensorwire_core::protocol::RunState::Running {
                            agent.peer_lost_on(peer, LostCause::Transport(e.to_string()), &conn);
                        }
                        return;
                    }
                }
            }
        };
        self.track(true, writer);
        if read {
            self.spawn(reader);
        }
    }

    /// Subscribes to what happens to peers: a peer lost (its connection broke; told once per
    /// loss, whether or not a call to it was pending) or a worker joined. Each subscription
    /// sees every event after it was made, in order; it ends when the agent shuts down.
    pub fn peer_events(&self) -> crate::peer_events::PeerEvents {
        self.inner.peer_events.subscribe()
    }

    /// [`peer_lost`](Self::peer_lost), if `conn` is still the connection to `peer` (a worker
    /// that left and joined again has a new one, which the old one's end must not touch).
    fn peer_lost_on(&self, peer: WorkerId, cause: LostCause, conn: &Arc<dyn Connection>) {
        let current = self
            .lock()
            .peers
            .get(&peer)
            .is_some_and(|l| Arc::ptr_eq(&l.conn, conn));
        if current {
            self.peer_lost(peer, cause);
        } else {
            debug!("an old connection to rank {peer} ended: {cause}");
        }
    }

    /// Member `peer` left a dynamic group (the membership decided it): the endpoint treats it
    /// as a lost peer (its calls fail naming it, its forks stop keeping our values alive, the
    /// forks of its values are forgotten), and its connection closes once what is queued for
    /// it is sent.
    pub(crate) fn member_left(&self, peer: WorkerId) {
        crate::ipc::peer_lost(self, peer);
        let (link, first) = {
            let mut st = self.lock();
            let link = st.peers.remove(&peer);
            let first = st.ep.lost_cause(peer).is_none();
            st.ep.handle_peer_lost(peer, LostCause::Left, self.now());
            (link, first)
        };
        drop(link);
        // For subscribers a member that left is gone as a lost one is (autograd drops the
        // contexts it made or knew).
        if first {
            self.inner
                .peer_events
                .emit(crate::peer_events::PeerEvent::Lost {
                    worker: peer,
                    cause: LostCause::Left,
                });
        }
    }

    /// Drops every connection (a join that failed, before it is tried again).
    pub(crate) fn close_links(&self) {
        let links = std::mem::take(&mut self.lock().peers);
        drop(links);
    }

    /// Queues a control frame (the membership protocol's) for `to`'s writer.
    pub(crate) fn send_control(&self, to: WorkerId, frame: Frame) {
        let st = self.lock();
        match st.peers.get(&to) {
            Some(link) => {
                link.queued
                    .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                if link.tx.send(frame).is_err() {
                    link.queued
                        .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                }
            }
            None => debug!("no connection to rank {to} for a membership message"),
        }
    }

    /// The connection to `peer` is gone for `cause`: recorded once, in the endpoint (the first
    /// cause stays), and told to subscribers once.
    fn peer_lost(&self, peer: WorkerId, cause: LostCause) {
        let name = self.name_of(peer);
        warn!("lost the connection to {name} (rank {peer}): {cause}");
        crate::ipc::peer_lost(self, peer);
        let first = {
            let mut st = self.lock();
            st.peers.remove(&peer);
            let first = st.ep.lost_cause(peer).is_none();
            st.ep.handle_peer_lost(peer, cause, self.now());
            first.then(|| st.ep.lost_cause(peer).cloned()).flatten()
        };
        if self.inner.dynamic {
            // The membership drops it (and hands coordination on, if it coordinated).
            let now = self.now();
            self.with_membership(|m| m.handle_lost(peer, now));
        }
        self.pump();
        // The reader and the writer of a link may both report its end: subscribers hear once.
        if let Some(cause) = first {
            self.inner
                .peer_events
                .emit(crate::peer_events::PeerEvent::Lost {
                    worker: peer,
                    cause,
                });
        }
    }

    /// Hands a received frame to the endpoint. A frame that breaks the protocol is an error:
    /// the connection to that peer is dropped (its calls fail naming it), never a silent loss.
    ///
    /// With `direct` (a connection whose sends are cheap, see `Connection::cheap_sends`), what
    /// handling it produced is written on the reader's task, before it waits for the next
    /// frame (see [`pump_now`](Self::pump_now)); else it goes through the writers, which batch
    /// it with the replies to the other frames of the same read.
    fn on_frame(
        &self,
        from: WorkerId,
        frame: Frame,
        direct: bool,
    ) -> Result<(), ProtocolViolation> {
        if frame.kind == FrameKind::Control {
            if let Some(handled) = crate::ipc::on_control(self, from, &frame) {
                return handled;
            }
            return self.on_membership_frame(from, &frame);
        }
        if self.inner.dynamic && !self.may_call(from) {
            return Err(ProtocolViolation::NotAMember);
        }
        let envelope: Envelope =
            postcard::from_bytes(&frame.header).map_err(|e| ProtocolViolation::Malformed {
                what: format!("a message header that does not parse ({e})"),
            })?;
        self.inner
            .ipc
            .check_received(from, &envelope.tensors)
            .map_err(ProtocolViolation::Ipc)?;
        let mut payloads = frame.payloads.into_iter();
        let body = match payloads.next() {
            Some(data) => {
                let bytes: Vec<Bytes> = payloads.collect();
                if bytes.len() != envelope.tensors.len() {
                    return Err(ProtocolViolation::Malformed {
                        what: format!(
                            "a message that announces {} tensors and carries {}",
                            envelope.tensors.len(),
                            bytes.len()
                        ),
                    });
                }
                let tensors = envelope.tensors.into_iter().zip(bytes).collect();
                Some(Body {
                    target: envelope.target,
                    data,
                    tensors,
                    forks: Vec::new(),
                })
            }
            None => None,
        };
        let handled = self
            .lock()
            .ep
            .handle_message(from, envelope.header, body, self.now());
        if direct {
            self.pump_now();
        } else {
            self.pump();
        }
        handled
    }

    fn send(&self, st: &mut State, t: Transmit<Body>, direct: Option<&mut Vec<DirectWrite>>) {
        // A shutdown's last words go through the writers, which shutdown lets finish; a task
        // writing directly may be one that stopping the agent cancels.
        let direct = direct.filter(|_| {
            !matches!(
                t.header,
                Header::Shutdown { .. } | Header::ShutdownFailed { .. }
            )
        });
        let (target, payloads, metas) = match t.body {
            Some(b) => {
                let (metas, bytes): (Vec<_>, Vec<_>) = b.tensors.into_iter().unzip();
                let mut payloads = Vec::with_capacity(1 + bytes.len());
                payloads.push(b.data);
                payloads.extend(bytes);
                (b.target, payloads, metas)
            }
            None => (None, vec![], vec![]),
        };
        let header = match postcard::to_allocvec(&Envelope {
            header: t.header,
            target,
            tensors: metas,
        }) {
            Ok(h) => h,
            Err(e) => {
                warn!("cannot encode a message header: {e}");
                return;
            }
        };
        let frame = Frame {
            kind: FrameKind::Message,
            header: header.into(),
            payloads,
        };
        if let (Some(out), Some(link)) = (direct, st.peers.get(&t.to)) {
            // Already writing to this peer: the frame joins that write.
            if let Some(w) = out.iter_mut().find(|w| w.peer == t.to) {
                w.frames.push(frame);
                return;
            }
            if link.queued.load(std::sync::atomic::Ordering::Acquire) == 0 {
                if let Ok(turn) = Arc::clone(&link.write).try_lock_owned() {
                    out.push(DirectWrite {
                        peer: t.to,
                        conn: Arc::clone(&link.conn),
                        frames: vec![frame],
                        _turn: turn,
                    });
                    return;
                }
            }
        }
        let queued = st.peers.get(&t.to).map(|link| {
            link.queued
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            let ok = link.tx.send(frame).is_ok();
            if !ok {
                link.queued
                    .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            }
            ok
        });
        match queued {
            Some(true) => {}
            _ => {
                // Lost earlier: the endpoint keeps that first cause. Never connected: this is
                // its loss, and subscribers hear of it as of any other (once).
                let first = st.ep.lost_cause(t.to).is_none();
                let cause =
                    LostCause::Transport(format!("no connection to {}", self.name_of(t.to)));
                st.ep.handle_peer_lost(t.to, cause.clone(), self.now());
                if first {
                    self.inner
                        .peer_events
                        .emit(crate::peer_events::PeerEvent::Lost {
                            worker: t.to,
                            cause,
                        });
                }
            }
        }
    }

    fn dispatch(&self, ev: Event<Body>) {
        match ev {
            Event::Call {
                token,
                function,
                body,
                deadline,
            } => self.serve(token, function, body, None, deadline),
            Event::Remote {
                token,
                function,
                body,
                rref,
                deadline,
            } => self.serve(token, function, body, Some(rref), deadline),
            Event::ConfirmWaitDone { wait, outcome } => {
                if let Some(tx) = self.lock().confirm_waits.remove(&wait) {
                    let _ = tx.send(outcome);
                }
            }
            Event::Fetch { token, rref } => {
                let value = self.lock().values.get(&rref).cloned();
                let from_peer = token.from() != self.inner.me.id;
                let agent = self.clone();
                let answer = async move {
                    let me = agent.inner.me.id;
                    let outcome = match value {
                        Some(v) => agent.reply_body(&*v, token.from()).await,
                        None => Err(remote_error(
                            me,
                            RemoteErrorKind::RRef,
                            format!("no value is kept for {rref}"),
                        )),
                    };
                    agent.lock().ep.respond(token, outcome);
                };
                // A value in host memory is answered here and now (the pump that dispatched
                // this sends the reply, in the same write as what it sends already: after a
                // `remote`, its acknowledgement); one with device tensors waits for the copies
                // in a task of its own, as does a fetch by this worker itself (dispatched from
                // inside its `to_here`).
                let mut answer = Box::pin(answer);
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                if !from_peer || std::future::Future::poll(answer.as_mut(), &mut cx).is_pending() {
                    let agent = self.clone();
                    self.spawn(async move {
                        answer.await;
                        agent.pump_direct().await;
                    });
                }
            }
            Event::Completed { id, outcome } => {
                let waiter = self.lock().waiters.remove(&id);
                if let Some(tx) = waiter {
                    let _ = tx.send(outcome);
                }
            }
            Event::ReleaseValue { rref } => {
                // The value leaves the map under the lock and is dropped after the guard is gone:
                // a user value may hold remote references, whose `Drop` takes the lock again.
                let value = self.lock().values.remove(&rref);
                drop(value);
            }
            Event::ShutdownComplete { outcome } => {
                if let Some(tx) = self.lock().shutdown_waiter.take() {
                    let _ = tx.send(outcome);
                }
            }
            _ => {}
        }
    }

    /// Encodes a result for `to`, with its tensors placed by the reverse map and copied to host.
    async fn reply_body(&self, value: &dyn Value, to: WorkerId) -> Result<Body, RemoteError> {
        let me = self.inner.me.id;
        let prepared = value.prepare(self, to).map_err(|e| match e {
            TensorTransferError::Encode(e) => remote_error(
                me,
                RemoteErrorKind::Serialization,
                format!("cannot encode: {e}"),
            ),
            other => remote_error(me, RemoteErrorKind::DeviceMap, other.to_string()),
        })?;
        let wire = crate::ipc::to_wire(self, to, prepared.tensors)
            .await
            .map_err(|e| remote_error(me, RemoteErrorKind::DeviceMap, e.to_string()))?;
        Ok(Body {
            target: None,
            data: prepared.data,
            tensors: wire,
            forks: prepared.forks,
        })
    }

    /// Runs a registered function for a request, catching errors and panics.
    fn serve(
        &self,
        token: RequestToken,
        function: String,
        body: Body,
        keep_as: Option<RRefId>,
        deadline: Option<Instant>,
    ) {
        let me = self.inner.me.id;
        let agent = self.clone();
        let handler = if function == crate::gather::GATHER {
            Some(crate::gather::handler())
        } else {
            self.inner.functions.get(&function)
        };
        let Some(handler) = handler else {
            let names = self.inner.functions.names().join(", ");
            let err = remote_error(
                me,
                RemoteErrorKind::UnknownFunction,
                format!(
                    "no function {function:?} is registered on {} (registered: {names})",
                    self.inner.me.name
                ),
            );
            warn!(
                function = %function,
                caller = %self.name_of(token.from()),
                "a call asked for a function that is not registered here"
            );
            self.lock().ep.respond(token, Err(err));
            self.pump();
            return;
        };
        let serving = Serving::enter(self);
        let from_peer = token.from() != me;
        let task = async move {
            // A method call reaches this point only once its value exists (the endpoint parks
            // it until then, by its caller's deadline).
            let target = match body.target {
                Some(rref) => match agent.owned_value(rref) {
                    Ok(v) => Some(v),
                    Err(reason) => {
                        let err = remote_error(me, RemoteErrorKind::RRef, reason);
                        agent.lock().ep.respond(token, Err(err));
                        agent.pump();
                        return serving;
                    }
                },
                None => None,
            };
            let tensors = match crate::ipc::from_wire(&agent, token.from(), body.tensors).await {
                Ok(t) => t,
                Err(e) => {
                    let err = remote_error(
                        me,
                        RemoteErrorKind::DeviceMap,
                        format!("cannot place the tensors of {function:?}: {e}"),
                    );
                    agent.lock().ep.respond(token, Err(err));
                    agent.pump();
                    return serving;
                }
            };
            let inv = Invocation {
                agent: agent.clone(),
                caller: token.from(),
                deadline,
                args: body.data,
                tensors,
                target,
            };
            let outcome = match (CatchPanic {
                inner: handler(inv),
            })
            .await
            {
                Ok(Ok(value)) => match keep_as {
                    Some(rref) => {
                        let replaced = agent.lock().values.insert(rref, value);
                        drop(replaced);
                        Ok(Body {
                            target: None,
                            data: Bytes::new(),
                            tensors: Vec::new(),
                            forks: Vec::new(),
                        })
                    }
                    None => agent
                        .reply_body(&*value, token.from())
                        .await
                        .map_err(|mut e| {
                            e.message = format!("the result of {function:?}: {}", e.message);
                            e
                        }),
                },
                Ok(Err(HandlerError::BadArguments(m))) => Err(remote_error(
                    me,
                    RemoteErrorKind::Serialization,
                    format!("bad arguments for {function:?}: {m}"),
                )),
                Ok(Err(HandlerError::Failed(m))) => {
                    Err(remote_error(me, RemoteErrorKind::Failed, m))
                }
                Ok(Err(HandlerError::Target(m))) => Err(remote_error(me, RemoteErrorKind::RRef, m)),
                Err(panic) => {
                    let msg = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".into());
                    Err(remote_error(
                        me,
                        RemoteErrorKind::Panicked,
                        format!("{function:?} panicked: {msg}"),
                    ))
                }
            };
            if let Err(e) = &outcome {
                // The caller gets the error; the callee's operator should see it too.
                warn!(
                    function = %function,
                    caller = %agent.name_of(token.from()),
                    kind = %e.kind,
                    "a call failed on this worker: {}",
                    e.message
                );
            }
            let orphan = {
                let mut st = agent.lock();
                let created = keep_as.filter(|_| outcome.is_ok());
                let expected = st.ep.respond(token, outcome);
                // A value made for a creator lost meanwhile: nobody will ever refer to it.
                created
                    .filter(|_| !expected)
                    .and_then(|rref| st.values.remove(&rref))
            };
            drop(orphan);
            serving
        };
        // On a current-thread runtime every task runs on this thread anyway: the handler starts
        // here, on the task that received the request, instead of in a task of its own (no
        // spawn, no turn of the scheduler). One that finishes at once has answered: the pump
        // that dispatched this request sends the reply, with whatever else it sends (replies
        // to the other requests of the same read, in one write). One that waits goes on in a
        // task. On a multi-thread runtime handlers always get a task, so that they run in
        // parallel; so does a call to this worker itself (it is dispatched from inside the
        // caller's `rpc_async`, where the caller may hold locks its handler takes).
        let inline = from_peer
            && tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
        let mut task = Box::pin(task);
        if inline {
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if let std::task::Poll::Ready(serving) =
                std::future::Future::poll(task.as_mut(), &mut cx)
            {
                drop(serving);
                return;
            }
        }
        let agent = self.clone();
        self.spawn(async move {
            let serving = task.await;
            // Let the other handlers that are ready answer too, so that their replies leave in
            // the same write (one scheduler turn). Alone, the reply leaves at once: a yield
            // would cost a turn of the runtime's I/O driver (a system call) for nothing.
            if serving.leave() > 0 {
                tokio::task::yield_now().await;
            }
            agent.pump_direct().await;
        });
    }

    /// The value of `rref`, owned here. (A method call on a value still being created waits
    /// in the endpoint, by its caller's deadline, and is only handed over once the value is
    /// kept: see `Payload::target` in core.)
    fn owned_value(&self, rref: RRefId) -> Result<Arc<dyn Any + Send + Sync>, String> {
        self.local_value(rref)
            .ok_or_else(|| format!("no value is kept for {rref} on {}", self.inner.me.name))
    }

    /// Waits until the owners confirm every reference of `handles` (PyTorch runs a function
    /// only then): the endpoint parks the wait, with `deadline` among its deadlines, and
    /// decides when it ends.
    pub(crate) async fn wait_confirmed(
        &self,
        handles: &[RRefHandle],
        deadline: Option<Instant>,
    ) -> Result<(), String> {
        let rx = {
            let mut st = self.lock();
            let Some(wait) = st.ep.wait_confirmed(handles, deadline) else {
                return Ok(());
            };
            let (tx, rx) = oneshot::channel();
            st.confirm_waits.insert(wait, tx);
            rx
        };
        // The driver's timer may have to wake earlier now.
        self.pump();
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(ConfirmError::OwnerLost { rref, owner })) => Err(format!(
                "remote reference {rref} in the arguments: its owner {} was lost before confirming it",
                self.name_of(owner)
            )),
            Ok(Err(ConfirmError::Deadline { rref, owner })) => Err(format!(
                "remote reference {rref} in the arguments: its owner {} did not confirm it before the call's deadline",
                self.name_of(owner)
            )),
            Ok(Err(other)) => Err(other.to_string()),
            Err(_) => Err("RPC is no longer running on this worker".into()),
        }
    }
}

/// A request being served, counted in `Inner::serving` until it leaves (or is dropped: a
/// cancelled handler).
struct Serving(Option<Agent>);

impl Serving {
    fn enter(agent: &Agent) -> Self {
        agent
            .inner
            .serving
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Serving(Some(agent.clone()))
    }

    /// Stops counting this one; returns how many others are still being served.
    fn leave(mut self) -> usize {
        match self.0.take() {
            Some(agent) => {
                agent
                    .inner
                    .serving
                    .fetch_sub(1, std::sync::atomic::Ordering::AcqRel)
                    - 1
            }
            None => 0,
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(agent) = self.0.take() {
            agent
                .inner
                .serving
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
    }
}

/// Polls a handler's future, turning a panic into an error (the handler is user code; one that
/// panics must not take the agent down, and need not cost a task of its own).
struct CatchPanic<F> {
    inner: F,
}

impl<F: std::future::Future + Unpin> std::future::Future for CatchPanic<F> {
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let inner = &mut self.inner;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            std::pin::Pin::new(&mut *inner).poll(cx)
        })) {
            Ok(std::task::Poll::Ready(v)) => std::task::Poll::Ready(Ok(v)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    }
}

/// The driver: moves the endpoint's output to peers and the application, and its timers.
pub(crate) async fn drive(agent: Agent) {
    loop {
        agent.pump();
        let next = {
            let mut st = agent.lock();
            let next = st.ep.poll_timeout();
            st.driver_wakes_at = next;
            next
        };
        match next {
            Some(at) => {
                tokio::select! {
                    () = agent.inner.wake.notified() => {}
                    () = agent.inner.runtime.sleep_until(at) => {
                        let now = agent.now();
                        agent.lock().ep.handle_timeout(now);
                    }
                }
            }
            None => agent.inner.wake.notified().await,
        }
    }
}

/// The result of [`Agent::rpc_async`]: await it for the callee's result.
pub struct RpcFuture<R> {
    pub(crate) inner:
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<R, RpcError>> + Send>>,
}

impl<R: DeserializeOwned + Send + 'static> RpcFuture<R> {
    fn new(
        agent: Agent,
        rx: oneshot::Receiver<Result<Body, CallError>>,
        to: String,
        function: String,
    ) -> Self {
        Self {
            inner: Box::pin(async move {
                match rx.await {
                    Ok(Ok(body)) => agent.decode_body(body, &to, &function).await,
                    Ok(Err(source)) => Err(RpcError::Call {
                        to,
                        function,
                        source,
                    }),
                    Err(_) => Err(RpcError::NotRunning),
                }
            }),
        }
    }
}

impl Agent {
    /// Places a received body's tensors and decodes its value.
    pub(crate) async fn decode_body<R: DeserializeOwned>(
        &self,
        body: Body,
        from: &str,
        what: &str,
    ) -> Result<R, RpcError> {
        let from_id = self
            .resolve(&WorkerRef::Name(from.to_owned()))
            .unwrap_or(WorkerId::MAX);
        let tensors = crate::ipc::from_wire(self, from_id, body.tensors)
            .await
            .map_err(|e| RpcError::Tensors {
                to: from.to_owned(),
                function: what.to_owned(),
                message: e.to_string(),
            })?;
        codec::decode(self, &body.data, tensors).map_err(|e| RpcError::Serialization {
            what: format!("the result of {what:?} from {from}"),
            message: e.to_string(),
        })
    }
}

impl<R> std::future::Future for RpcFuture<R> {
    type Output = Result<R, RpcError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::with_rank;

    #[test]
    fn init_urls_get_the_missing_rank_and_world_size() {
        assert_eq!(with_rank("env://", 1, 4), "env://?rank=1&world_size=4");
        assert_eq!(
            with_rank("tcp://10.0.0.1:29500", 0, 2),
            "tcp://10.0.0.1:29500?rank=0&world_size=2"
        );
        assert_eq!(
            with_rank("file:///tmp/x?world_size=2", 1, 2),
            "file:///tmp/x?world_size=2&rank=1"
        );
        assert_eq!(
            with_rank("tcp://h:1?rank=3&world_size=5", 3, 5),
            "tcp://h:1?rank=3&world_size=5"
        );
    }
}
