//! [`Group`]: a process group whose collectives run over a [`Transport`] mesh.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tensorwire_core::collective::ReduceOp;
//! use tensorwire_core::ports::process_group::{Collectives, ProcessGroup};
//! use tensorwire_process_group::{CollectivesExt, Group, GroupOptions, InMemoryStore};
//! use tensorwire_transport_tcp::{TcpConfig, TcpTransport};
//!
//! // Every rank runs this with its own rank and the same store (here: one process, so an
//! // in-memory store would be shared by tasks; across processes, a TCP store).
//! let store = Arc::new(InMemoryStore::new());
//! let transport = Arc::new(TcpTransport::new(TcpConfig::from_env()?)?);
//! let group = Group::connect(store, transport, 0, 1, GroupOptions::new("demo")).await?;
//! group.barrier().await?;
//! let mut xs = [1.0f32, 2.0];
//! group.all_reduce_typed(&mut xs, ReduceOp::Sum).await?;
//! let names: Vec<String> = group.all_gather_object(&"rank zero".to_owned()).await?;
//! # Ok(()) }
//! ```

mod arena;
mod dispatch;
mod ext;
mod hier;
mod links;
mod now;
mod running;
mod setup;
mod turn;

#[cfg(feature = "tcp")]
pub(crate) use arena::PATHS;
pub use arena::{arena_bytes_from_env, CollectivePath, ARENA_BYTES_ENV, COLLECTIVES_ENV};

pub use ext::{CollectivesExt, Element};

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tensorwire_core::budget::Budget;
use tensorwire_core::collective::inbox::InboxLimits;
use tensorwire_core::collective::varlen::{self, BlockLens, SLOT_BYTES};
use tensorwire_core::collective::{
    self, AllGatherAlgorithm, AllReduceAlgorithm, CollectiveError, DebugLevel, ElementType,
    ReduceOp, Schedule, Signature, DEBUG_ENV,
};
use tensorwire_core::env::BadVariable;
use tensorwire_core::ports::process_group::{
    lazy, Collectives, Done, Op, Pending, ProcessGroup, ProcessGroupError, Started,
};
use tensorwire_core::ports::runtime::Runtime;
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::{Connection, Transport};
use tracing::Instrument;

use crate::executor::{self, Held};
use crate::p2p::{self, Counters};
use crate::work::{self, Work};
use tensorwire_mesh::{GroupMesh, Mesh, MeshSetup, MAX_GROUP_ID};

/// Blocks up to this size travel with their lengths in [`Collectives::all_gather`]'s first
/// round, so small all_gathers take one round instead of two (see
/// [`varlen`]).
pub const INLINE_GATHER_BYTES: usize = varlen::INLINE_BYTES;

/// Largest block [`Collectives::all_gather`] accepts from a rank: the transports' default
/// frame limit. A larger announced length is refused before anything is allocated for it.
pub const MAX_BLOCK_BYTES: usize = 1 << 30;

/// The default collective timeout: 30 minutes, as PyTorch's default process-group timeout.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// How a [`Group`] is set up.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct GroupOptions {
    /// The group's name: its store keys are `tensorwire/pg/<name>/...`, so groups with
    /// different names can share a store.
    pub name: String,
    /// Where this rank listens for its peers (port 0 for an ephemeral port). Its IP is what the
    /// peers are told, so it must be one they can reach (not `0.0.0.0`). Default `127.0.0.1:0`.
    pub listen: SocketAddr,
    /// Bound on each collective, and on setting up the mesh. A collective that times out
    /// leaves the ranks out of step, so it breaks the group: later collectives on this rank
    /// fail with the same error.
    pub timeout: Duration,
    /// Which collectives run the agreement check first
    /// ([`tensorwire_core::collective::check`]); `None` (the default) reads
    /// `TENSORWIRE_DEBUG` when the group connects. Every rank must use the same level.
    pub debug: Option<DebugLevel>,
    /// What one peer may make this rank hold in its collective inboxes (sequence window,
    /// messages not yet taken; see [`tensorwire_core::collective::inbox`]). A peer past a
    /// bound is dropped and the group fails with [`ProcessGroupError::Misbehaved`].
    pub inbox_limits: InboxLimits,
    /// The clock and timers of the group: its setup, every collective's deadline and every
    /// wait. Default [`TokioRuntime`](tensorwire_mesh::TokioRuntime) (virtual time under a
    /// paused tokio clock).
    pub runtime: Arc<dyn Runtime>,
    /// The memory budget of each peer, in bytes (default 256 MiB,
    /// [`tensorwire_core::budget::DEFAULT_PEER_BUDGET`]): its collective messages no
    /// collective has taken and the frame being received from it (TCP) draw from it. Past it
    /// the peer is dropped
    /// ([`MeshViolation::OverBudget`](tensorwire_core::ports::process_group::MeshViolation::OverBudget)).
    /// Each group made with these options has a budget of its own, unless
    /// [`with_budget`](Self::with_budget) shares one.
    pub peer_budget: usize,
    /// A budget shared with other holders (an RPC agent over the same connections), which
    /// [`peer_budget`](Self::peer_budget) then does not size.
    pub budget: Option<Budget>,
    /// Which path the collectives take: through the group arena when every rank is on one
    /// host ([`CollectivePath::Arena`], the default unless [`COLLECTIVES_ENV`] says `links`),
    /// or through the links. Every rank must choose the same. Under
    /// [`DebugLevel::Detail`] the links are used whatever this says: the agreement check is
    /// theirs (the arena compares a one-word signature per phase instead).
    pub collectives: CollectivePath,
    /// The size of the group's arena on a host, in bytes (default 32 MiB,
    /// [`DEFAULT_ARENA_BYTES`](tensorwire_transport_shm::arena::DEFAULT_ARENA_BYTES), or
    /// [`ARENA_BYTES_ENV`]): each rank's slot is two halves of `arena_bytes / (2 × world)`;
    /// a larger message streams through it in as many phases as it needs. Every rank must
    /// choose the same.
    pub arena_bytes: usize,
    /// What [`new`](Self::new) found wrong in the environment, by the setting it was read
    /// for: [`Group::connect`] fails with the first one still standing
    /// ([`ProcessGroupError::BadVariable`]); a `with_*` call that replaces a setting drops its
    /// variable's error.
    bad_env: BadEnv,
}

/// Environment variables [`GroupOptions::new`] read that held a value their setting does not
/// take, by setting.
#[derive(Debug, Clone, Default)]
struct BadEnv {
    collectives: Option<BadVariable>,
    arena_bytes: Option<BadVariable>,
    spin: Option<BadVariable>,
}

impl BadEnv {
    fn first(&self) -> Option<&BadVariable> {
        self.collectives
            .as_ref()
            .or(self.arena_bytes.as_ref())
            .or(self.spin.as_ref())
    }
}

impl GroupOptions {
    /// Options for the group `name`, listening on `127.0.0.1`, with the default timeout; the
    /// collective path and the arena's size from [`COLLECTIVES_ENV`] and [`ARENA_BYTES_ENV`]
    /// when they are set. A variable set to a value its setting does not take (and the
    /// shared-memory spin the arena's waits use) fails [`Group::connect`] naming it, unless
    /// the setting is replaced first ([`with_collectives`](Self::with_collectives),
    /// [`with_arena_bytes`](Self::with_arena_bytes)).
    pub fn new(name: impl Into<String>) -> Self {
        let mut bad_env = BadEnv::default();
        let collectives = CollectivePath::from_env().unwrap_or_else(|bad| {
            bad_env.collectives = Some(bad);
            CollectivePath::Arena
        });
        let arena_bytes = arena_bytes_from_env().unwrap_or_else(|bad| {
            bad_env.arena_bytes = Some(bad);
            tensorwire_transport_shm::arena::DEFAULT_ARENA_BYTES
        });
        bad_env.spin = arena::spin_from_env().err();
        GroupOptions {
            name: name.into(),
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            timeout: DEFAULT_COLLECTIVE_TIMEOUT,
            debug: None,
            inbox_limits: InboxLimits::default(),
            runtime: Arc::new(tensorwire_mesh::TokioRuntime),
            peer_budget: tensorwire_core::budget::DEFAULT_PEER_BUDGET,
            budget: None,
            collectives,
            arena_bytes,
            bad_env,
        }
    }

    /// These options with another collective path (see [`collectives`](Self::collectives)).
    pub fn with_collectives(mut self, path: CollectivePath) -> Self {
        self.collectives = path;
        self.bad_env.collectives = None;
        self
    }

    /// These options with another arena size (see [`arena_bytes`](Self::arena_bytes)).
    pub fn with_arena_bytes(mut self, bytes: usize) -> Self {
        self.arena_bytes = bytes;
        self.bad_env.arena_bytes = None;
        self
    }

    /// These options with a memory budget of `bytes` per peer (see
    /// [`peer_budget`](Self::peer_budget)).
    pub fn with_peer_budget(mut self, bytes: usize) -> Self {
        self.peer_budget = bytes;
        self
    }

    /// These options drawing from `budget`, shared with its other holders (an RPC agent's).
    pub fn with_budget(mut self, budget: Budget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// These options with another runtime (clock, timers, spawning).
    pub fn with_runtime(mut self, runtime: Arc<dyn Runtime>) -> Self {
        self.runtime = runtime;
        self
    }

    /// These options with other inbox bounds.
    pub fn with_inbox_limits(mut self, limits: InboxLimits) -> Self {
        self.inbox_limits = limits;
        self
    }

    /// These options with a debug level, instead of the one `TENSORWIRE_DEBUG` sets.
    pub fn with_debug(mut self, debug: DebugLevel) -> Self {
        self.debug = Some(debug);
        self
    }

    /// These options with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with another listening address.
    pub fn with_listen(mut self, listen: SocketAddr) -> Self {
        self.listen = listen;
        self
    }
}

struct Inner {
    mesh: GroupMesh,
    /// The barrier's schedule, the same every time.
    barrier: Schedule,
    /// The schedule of an all_gather's first round (one length slot per rank), likewise.
    lengths: Schedule,
    /// The agreement check's schedule, likewise, and which collectives run it.
    check: Schedule,
    debug: DebugLevel,
    name: String,
    next_seq: AtomicU64,
    /// Point-to-point messages issued to each (world rank, tag), and receives from each:
    /// shared by the world group and its subgroups, whose point-to-point messages share
    /// keys (see [`Group::new_group`]).
    sent: Arc<Counters>,
    received: Arc<Counters>,
    timeout: Duration,
    /// The next subgroup id, counted on the world group by every rank alike (every rank
    /// calls [`Group::new_group`] and [`Group::split_group`] in the same order).
    next_group: AtomicU64,
    /// Kept so that an embedded store server (rank 0) lives as long as the group.
    _store: Arc<dyn Store>,
    /// The group arena (see [`arena`]), and whether collectives go through it.
    arena: turn::TurnLock<arena::ArenaSlot>,
    arena_on: std::sync::atomic::AtomicBool,
    /// Every world rank's host and process (the world group, once connected).
    hosts: std::sync::OnceLock<Vec<arena::HostRecord>>,
    collectives: CollectivePath,
    arena_bytes: usize,
    /// The hierarchy of a group across hosts (see [`hier`]): set once, when it is made.
    hierarchy: std::sync::OnceLock<hier::Hierarchy>,
}

/// A process group over a mesh of [`Transport`] connections: the built-in backend.
///
/// Cheap to clone (one shared group). Collectives take `&self`; several may be in flight at
/// once as long as every rank *issues* them in the same order: a collective is issued when
/// its future is first polled, and then checks its arguments and numbers all its rounds
/// before it awaits anything (see the
/// [port's contract](tensorwire_core::ports::process_group)). Ranks that disagree about a
/// collective fail it and every later collective with [`ProcessGroupError::Disagreement`];
/// the collectives issued before it still complete.
#[derive(Clone)]
pub struct Group {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("name", &self.inner.name)
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish_non_exhaustive()
    }
}

impl Group {
    /// Issues an operation on this group as a [`Work`]: `operation` gets a clone of the group
    /// and is polled once now, so the collectives it starts before its first await take their
    /// places in the sequence **in this call** (the ordering point: every rank must issue in
    /// the same order); the rest runs on a task of its own, whether or not anyone waits.
    ///
    /// ```no_run
    /// # async fn demo(group: tensorwire_process_group::Group) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tensorwire_core::ports::process_group::{Collectives, ProcessGroup};
    /// let gathered = group.issue("all_gather", |g| async move { g.all_gather(b"mine").await });
    /// let blocks = gathered.wait(Duration::from_secs(60)).await?;
    /// # Ok(()) }
    /// ```
    pub fn issue<T, F, Fut>(&self, what: &'static str, operation: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(Group) -> Fut,
        Fut: std::future::Future<Output = Result<T, ProcessGroupError>> + Send + 'static,
    {
        let span = tracing::debug_span!("work", what, group = %self.name(), rank = self.rank());
        Work::issue(
            self.inner.mesh.runtime().clone(),
            what,
            self.rank(),
            operation(self.clone()).instrument(span),
        )
    }

    /// [`barrier`](Collectives::barrier) as a [`Work`], issued in this call.
    pub fn barrier_work(&self) -> Work<()> {
        self.issue("barrier", |g| async move { g.barrier().await })
    }

    /// [`all_reduce`](Collectives::all_reduce) of owned bytes as a [`Work`], issued in this
    /// call; gives the reduced bytes back.
    pub fn all_reduce_work(
        &self,
        mut data: Vec<u8>,
        element: ElementType,
        op: ReduceOp,
    ) -> Work<Vec<u8>> {
        self.issue("all_reduce", move |g| async move {
            g.all_reduce(&mut data, element, op).await.map(|()| data)
        })
    }

    /// [`all_reduce_typed`](CollectivesExt::all_reduce_typed) of owned elements as a
    /// [`Work`], issued in this call; gives the reduced elements back.
    pub fn all_reduce_typed_work<T: Element>(
        &self,
        mut data: Vec<T>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        self.issue("all_reduce", move |g| async move {
            g.all_reduce_typed(&mut data, op).await.map(|()| data)
        })
    }

    /// [`broadcast`](Collectives::broadcast) of owned bytes as a [`Work`], issued in this
    /// call; gives `root`'s bytes back.
    pub fn broadcast_work(&self, mut data: Vec<u8>, root: usize) -> Work<Vec<u8>> {
        self.issue("broadcast", move |g| async move {
            g.broadcast(&mut data, root).await.map(|()| data)
        })
    }

    /// [`all_gather`](Collectives::all_gather) as a [`Work`], issued in this call; gives
    /// every rank's block, in rank order.
    pub fn all_gather_work(&self, input: Vec<u8>) -> Work<Vec<Bytes>> {
        self.issue(
            "all_gather",
            move |g| async move { g.all_gather(&input).await },
        )
    }

    /// The world rank of a checked group rank.
    fn world_rank(&self, peer: usize) -> usize {
        self.global_rank(peer).unwrap_or(usize::MAX)
    }

    /// The group rank of world rank `global` (PyTorch's `get_group_rank`), or `None` when
    /// that rank is not in this group.
    pub fn group_rank(&self, global: usize) -> Option<usize> {
        self.inner.mesh.members().iter().position(|r| *r == global)
    }

    /// The world rank of `group_rank` (PyTorch's `get_global_rank`), or `None` when the group
    /// has no such rank.
    pub fn global_rank(&self, group_rank: usize) -> Option<usize> {
        self.inner.mesh.members().get(group_rank).copied()
    }

    /// The world ranks of the group's members, by group rank (PyTorch's
    /// `get_process_group_ranks`).
    pub fn global_ranks(&self) -> &[usize] {
        self.inner.mesh.members()
    }

    /// Whether this group's collectives go through its group arena (every rank on one host,
    /// [`CollectivePath::Arena`] chosen) rather than its links.
    pub fn uses_arena(&self) -> bool {
        self.inner.arena_on.load(Ordering::Acquire)
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The bound on each collective.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }
}

#[async_trait]
impl ProcessGroup for Group {
    fn rank(&self) -> usize {
        self.inner.mesh.rank()
    }

    fn size(&self) -> usize {
        self.inner.mesh.world()
    }

    /// Runs `op` (through the group arena or the links, from one dispatch) on the caller's
    /// task, as the handle is asked or waited on.
    fn start<'a>(&'a self, op: Op<'a>) -> Started<'a> {
        lazy(self.run_op(op))
    }

    /// The future [`start`](ProcessGroup::start)'s handle polls, without the handle: the
    /// awaited collectives issue it in their first poll, as `start` does in the call.
    fn run_op<'a>(&'a self, op: Op<'a>) -> Pending<'a, Done> {
        if self.alone_on_arena(&op) {
            return Box::pin(self.arena_alone(op));
        }
        Box::pin(self.execute(op))
    }

    /// [`run_op`](ProcessGroup::run_op), or a small barrier, broadcast, all_reduce, reduce or
    /// all_gather of known lengths on the group's arena run to its end in this call when its
    /// turn is free and its waits end within the spin (see `group::now`).
    fn run_now<'a>(
        &'a self,
        op: Op<'a>,
        cx: &mut std::task::Context<'_>,
    ) -> tensorwire_core::ports::process_group::Now<'a> {
        if matches!(op, Op::Barrier) {
            // A barrier holds nothing: forgotten here rather than dropped through the op's
            // glue at the end (15 instructions per barrier, counted).
            std::mem::forget(op);
            return self.barrier_now(cx);
        }
        self.now(op, cx)
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn spawn(&self, op: Op<'static>) -> Started<'_> {
        Box::new(self.issue(op.name(), move |g| async move { g.execute(op).await }))
    }

    /// [`Group::new_group`] behind the port, for the group `new_group` returns.
    fn new_group(
        &self,
        ranks: &[usize],
    ) -> Result<Option<Arc<dyn ProcessGroup>>, ProcessGroupError> {
        Ok(Group::new_group(self, ranks)?.map(|g| Arc::new(g) as Arc<dyn ProcessGroup>))
    }

    /// Says goodbye to the peers and closes the connections. Peers still waiting for this
    /// rank's messages get [`ProcessGroupError::PeerLeft`]; later collectives here fail with
    /// [`ProcessGroupError::ShutDown`]. A group dropped without it looks dead to its peers.
    async fn shutdown(&self) {
        self.inner.mesh.shutdown(Duration::from_secs(5)).await;
    }
}

/// The element count of `len` bytes of `element`, or the error for bytes that are not whole
/// elements.
fn whole_elements(
    collective: &'static str,
    len: usize,
    element: ElementType,
) -> Result<usize, ProcessGroupError> {
    if len % element.size() != 0 {
        return Err(ProcessGroupError::Arguments {
            collective,
            source: CollectiveError::ReduceLength {
                element,
                acc: len,
                incoming: len,
            },
        });
    }
    Ok(len / element.size())
}

/// Refuses block lengths announced in slots that are larger than a frame carries, naming the
/// rank that announced one (`peers[i]` announced `lens[i]`).
fn check_block_lens(
    collective: &'static str,
    seq: u64,
    lens: &[u64],
    peers: impl Fn(usize) -> usize,
) -> Result<(), ProcessGroupError> {
    match lens
        .iter()
        .enumerate()
        .find(|(_, len)| **len > MAX_BLOCK_BYTES as u64)
    {
        Some((i, len)) => Err(ProcessGroupError::Mismatch {
            peer: peers(i),
            collective,
            seq,
            reason: format!(
                "it announced a block of {len} bytes, more than one frame carries \
                 ({MAX_BLOCK_BYTES} bytes)"
            ),
        }),
        None => Ok(()),
    }
}
