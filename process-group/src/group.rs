//! [`Group`]: a process group whose collectives run over a [`Transport`] mesh.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tensorwire_core::collective::ReduceOp;
//! use tensorwire_core::ports::process_group::ProcessGroup;
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
mod ext;
mod running;
mod setup;

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
use tensorwire_core::collective::varlen::{self, SLOT_BYTES};
use tensorwire_core::collective::{
    self, AllGatherAlgorithm, AllReduceAlgorithm, CollectiveError, DebugLevel, ElementType,
    ReduceOp, Schedule, Signature, DEBUG_ENV,
};
use tensorwire_core::ports::process_group::{
    owned, Pending, ProcessGroup, ProcessGroupError, WorkHandle,
};
use tensorwire_core::ports::runtime::Runtime;
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::{Connection, Transport};
use tensorwire_core::tensor::Tensor;
use tracing::Instrument;

use crate::executor::{self, Held};
use crate::p2p::{self, Counters};
use crate::work::{self, Work};
use tensorwire_mesh::{GroupMesh, Mesh, MeshSetup, MAX_GROUP_ID};

/// Blocks up to this size travel with their lengths in [`ProcessGroup::all_gather`]'s first
/// round, so small all_gathers take one round instead of two (see
/// [`varlen`](tensorwire_core::collective::varlen)).
pub const INLINE_GATHER_BYTES: usize = varlen::INLINE_BYTES;

/// Largest block [`ProcessGroup::all_gather`] accepts from a rank: the transports' default
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
}

impl GroupOptions {
    /// Options for the group `name`, listening on `127.0.0.1`, with the default timeout.
    pub fn new(name: impl Into<String>) -> Self {
        GroupOptions {
            name: name.into(),
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            timeout: DEFAULT_COLLECTIVE_TIMEOUT,
            debug: None,
            inbox_limits: InboxLimits::default(),
            runtime: Arc::new(tensorwire_mesh::TokioRuntime),
            peer_budget: tensorwire_core::budget::DEFAULT_PEER_BUDGET,
            budget: None,
            collectives: CollectivePath::from_env(),
            arena_bytes: arena_bytes_from_env(),
        }
    }

    /// These options with another collective path (see [`collectives`](Self::collectives)).
    pub fn with_collectives(mut self, path: CollectivePath) -> Self {
        self.collectives = path;
        self
    }

    /// These options with another arena size (see [`arena_bytes`](Self::arena_bytes)).
    pub fn with_arena_bytes(mut self, bytes: usize) -> Self {
        self.arena_bytes = bytes;
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
    arena: tokio::sync::Mutex<arena::ArenaSlot>,
    arena_on: std::sync::atomic::AtomicBool,
    /// Every world rank's host and process (the world group, once connected).
    hosts: std::sync::OnceLock<Vec<arena::HostRecord>>,
    collectives: CollectivePath,
    arena_bytes: usize,
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
    /// use tensorwire_core::ports::process_group::ProcessGroup;
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

    /// [`barrier`](ProcessGroup::barrier) as a [`Work`], issued in this call.
    pub fn barrier_work(&self) -> Work<()> {
        self.issue("barrier", |g| async move { g.barrier().await })
    }

    /// [`all_reduce`](ProcessGroup::all_reduce) of owned bytes as a [`Work`], issued in this
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

    /// [`broadcast`](ProcessGroup::broadcast) of owned bytes as a [`Work`], issued in this
    /// call; gives `root`'s bytes back.
    pub fn broadcast_work(&self, mut data: Vec<u8>, root: usize) -> Work<Vec<u8>> {
        self.issue("broadcast", move |g| async move {
            g.broadcast(&mut data, root).await.map(|()| data)
        })
    }

    /// [`all_gather`](ProcessGroup::all_gather) as a [`Work`], issued in this call; gives
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
    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_barrier(&self) -> Box<dyn WorkHandle<'_, ()> + '_> {
        Box::new(self.barrier_work())
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_all_reduce_tensor(
        &self,
        tensor: Tensor,
        op: ReduceOp,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(self.issue("all_reduce", move |g| async move {
            g.all_reduce_tensor(&tensor, op).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_broadcast_tensor(
        &self,
        tensor: Tensor,
        root: usize,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(self.issue("broadcast", move |g| async move {
            g.broadcast_tensor(&tensor, root).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_all_gather_tensor(&self, tensor: Tensor) -> Box<dyn WorkHandle<'_, Vec<Tensor>> + '_> {
        Box::new(self.issue("all_gather", move |g| async move {
            g.all_gather_tensor(&tensor).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_reduce_tensor(
        &self,
        tensor: Tensor,
        op: ReduceOp,
        root: usize,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(self.issue("reduce", move |g| async move {
            owned::reduce_tensor(&g, tensor, op, root).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_gather_tensor(
        &self,
        input: Tensor,
        gather_list: Option<Vec<Tensor>>,
        root: usize,
    ) -> Box<dyn WorkHandle<'_, Option<Vec<Tensor>>> + '_> {
        Box::new(self.issue("gather", move |g| async move {
            owned::gather_tensor(&g, input, gather_list, root).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_scatter_tensor(
        &self,
        output: Tensor,
        scatter_list: Option<Vec<Tensor>>,
        root: usize,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(self.issue("scatter", move |g| async move {
            owned::scatter_tensor(&g, output, scatter_list, root).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_all_to_all_single_tensor(
        &self,
        output: Tensor,
        input: Tensor,
        output_split_sizes: Option<Vec<usize>>,
        input_split_sizes: Option<Vec<usize>>,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(self.issue("all_to_all_single", move |g| async move {
            owned::all_to_all_single_tensor(
                &g,
                output,
                input,
                output_split_sizes,
                input_split_sizes,
            )
            .await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_all_to_all_tensor(
        &self,
        outputs: Vec<Tensor>,
        inputs: Vec<Tensor>,
    ) -> Box<dyn WorkHandle<'_, Vec<Tensor>> + '_> {
        Box::new(self.issue("all_to_all", move |g| async move {
            owned::all_to_all_tensor(&g, outputs, inputs).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_all_gather_into_tensor(
        &self,
        output: Tensor,
        input: Tensor,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(self.issue("all_gather_into_tensor", move |g| async move {
            owned::all_gather_into_tensor(&g, output, input).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_reduce_scatter_tensor(
        &self,
        output: Tensor,
        input: Tensor,
        op: ReduceOp,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(self.issue("reduce_scatter_tensor", move |g| async move {
            owned::reduce_scatter_tensor(&g, output, input, op).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]); the message is numbered in the call.
    fn issue_send_tensor(
        &self,
        tensor: Tensor,
        dst: usize,
        tag: u32,
    ) -> Box<dyn WorkHandle<'_, ()> + '_> {
        Box::new(self.issue("send", move |g| async move {
            g.send_tensor(&tensor, dst, tag).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]); the receive is numbered in the call.
    fn issue_recv_tensor(
        &self,
        tensor: Tensor,
        src: usize,
        tag: u32,
    ) -> Box<dyn WorkHandle<'_, Tensor> + '_> {
        Box::new(self.issue("recv", move |g| async move {
            owned::recv_tensor(&g, tensor, src, tag).await
        }))
    }

    /// A [`Work`] on its own task (see [`Group::issue`]).
    fn issue_recv_any_tensor(
        &self,
        tensor: Tensor,
        tag: u32,
    ) -> Box<dyn WorkHandle<'_, (usize, Tensor)> + '_> {
        Box::new(self.issue("recv", move |g| async move {
            owned::recv_any_tensor(&g, tensor, tag).await
        }))
    }

    /// [`Group::new_group`] behind the port, for the group `new_group` returns.
    fn new_group(
        &self,
        ranks: &[usize],
    ) -> Result<Option<Arc<dyn ProcessGroup>>, ProcessGroupError> {
        Ok(Group::new_group(self, ranks)?.map(|g| Arc::new(g) as Arc<dyn ProcessGroup>))
    }

    fn rank(&self) -> usize {
        self.inner.mesh.rank()
    }

    fn size(&self) -> usize {
        self.inner.mesh.world()
    }

    async fn barrier(&self) -> Result<(), ProcessGroupError> {
        if let Some(mut turn) = self.arena_turn(1).await {
            return self.arena_barrier(&mut turn).await;
        }
        let seq = self.reserve(1);
        self.run(seq, Signature::Barrier, &self.inner.barrier, &mut [])
            .await
    }

    /// Two rounds, both numbered when the call is issued: one slot per rank with its block's
    /// length (and the block itself up to [`INLINE_GATHER_BYTES`]), then, unless every block
    /// fitted, the blocks.
    async fn all_gather(&self, input: &[u8]) -> Result<Vec<Bytes>, ProcessGroupError> {
        if let Some(mut turn) = self.arena_turn(varlen::ROUNDS).await {
            return self.arena_all_gather(&mut turn, input).await;
        }
        let world = self.size();
        let rank = self.rank();
        let mut first = vec![0u8; SLOT_BYTES * world];
        let mine: &mut [u8; SLOT_BYTES] = (&mut first[SLOT_BYTES * rank..SLOT_BYTES * (rank + 1)])
            .try_into()
            .expect("a slot is SLOT_BYTES long");
        varlen::write_slot(mine, input);
        let seq = self.reserve(varlen::ROUNDS);
        self.run(
            seq,
            Signature::AllGatherLengths,
            &self.inner.lengths,
            &mut first,
        )
        .await?;
        let lens: Vec<u64> = first
            .chunks_exact(SLOT_BYTES)
            .map(|c| varlen::slot_len(c.try_into().expect("slot-sized chunk")))
            .collect();
        if let Some((peer, len)) = lens
            .iter()
            .enumerate()
            .find(|(_, len)| **len > MAX_BLOCK_BYTES as u64)
        {
            return Err(ProcessGroupError::Mismatch {
                peer,
                collective: "all_gather",
                seq,
                reason: format!(
                    "it announced a block of {len} bytes, more than one frame carries \
                     ({MAX_BLOCK_BYTES} bytes)"
                ),
            });
        }
        let inline: Option<Vec<_>> = lens.iter().map(|len| varlen::inline_range(*len)).collect();
        if let Some(inline) = inline {
            let first = Bytes::from(first);
            return Ok(inline
                .into_iter()
                .enumerate()
                .map(|(r, range)| {
                    first.slice(SLOT_BYTES * r + range.start..SLOT_BYTES * r + range.end)
                })
                .collect());
        }
        let lens: Vec<usize> = lens.into_iter().map(|len| len as usize).collect();
        let schedule = collective::all_gather(rank, &lens, AllGatherAlgorithm::select(&lens))
            .map_err(|source| ProcessGroupError::Arguments {
                collective: "all_gather",
                source,
            })?;
        self.gather_known(seq + 1, schedule, input, &lens).await
    }

    async fn broadcast(&self, data: &mut [u8], root: usize) -> Result<(), ProcessGroupError> {
        if let Some(mut turn) = self.arena_turn(1).await {
            return self.arena_broadcast(&mut turn, data, root).await;
        }
        let schedule = collective::broadcast(self.rank(), self.size(), root, data.len()).map_err(
            |source| ProcessGroupError::Arguments {
                collective: "broadcast",
                source,
            },
        )?;
        let signature = Signature::Broadcast {
            root: root as u32,
            len: data.len() as u64,
        };
        let seq = self.reserve(1);
        self.run(seq, signature, &schedule, data).await
    }

    /// Two rounds, both numbered when the call is issued: the root's length slot (with the
    /// bytes, up to [`INLINE_GATHER_BYTES`]), then, unless they fitted, the bytes.
    async fn broadcast_bytes(&self, data: &[u8], root: usize) -> Result<Bytes, ProcessGroupError> {
        if let Some(mut turn) = self.arena_turn(varlen::ROUNDS).await {
            return self.arena_broadcast_bytes(&mut turn, data, root).await;
        }
        let (rank, world) = (self.rank(), self.size());
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "broadcast",
            source,
        };
        let first = collective::broadcast(rank, world, root, SLOT_BYTES).map_err(arguments)?;
        let mut slot = [0u8; SLOT_BYTES];
        if rank == root {
            varlen::write_slot(&mut slot, data);
        }
        let seq = self.reserve(varlen::ROUNDS);
        let signature = Signature::BroadcastLength { root: root as u32 };
        self.run(seq, signature, &first, &mut slot).await?;
        let len = varlen::slot_len(&slot);
        if let Some(range) = varlen::inline_range(len) {
            return Ok(Bytes::copy_from_slice(&slot[range]));
        }
        if len > MAX_BLOCK_BYTES as u64 {
            return Err(ProcessGroupError::Mismatch {
                peer: root,
                collective: "broadcast",
                seq,
                reason: format!("it announced {len} bytes, more than {MAX_BLOCK_BYTES}"),
            });
        }
        let len = len as usize;
        let schedule = collective::broadcast(rank, world, root, len).map_err(arguments)?;
        let mut out = if rank == root {
            data.to_vec()
        } else {
            vec![0u8; len]
        };
        let signature = Signature::Broadcast {
            root: root as u32,
            len: len as u64,
        };
        self.run(seq + 1, signature, &schedule, &mut out).await?;
        Ok(out.into())
    }

    async fn all_reduce(
        &self,
        data: &mut [u8],
        element: ElementType,
        op: ReduceOp,
    ) -> Result<(), ProcessGroupError> {
        if let Some(mut turn) = self.arena_turn(1).await {
            return self.arena_all_reduce(&mut turn, data, element, op).await;
        }
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "all_reduce",
            source,
        };
        let count = whole_elements("all_reduce", data.len(), element)?;
        let algorithm = AllReduceAlgorithm::select(self.size(), count, element);
        let schedule =
            collective::all_reduce(self.rank(), self.size(), count, element, op, algorithm)
                .map_err(arguments)?;
        let signature = Signature::AllReduce {
            op,
            element,
            count: count as u64,
        };
        let seq = self.reserve(1);
        self.run(seq, signature, &schedule, data).await?;
        op.finish(element, data, self.size());
        Ok(())
    }

    /// One round of slots to the root (each rank's length, and its block up to
    /// [`INLINE_GATHER_BYTES`]), then, for the ranks whose blocks did not fit, the blocks;
    /// both rounds numbered when the call is issued.
    async fn gather(
        &self,
        input: &[u8],
        root: usize,
    ) -> Result<Option<Vec<Bytes>>, ProcessGroupError> {
        if let Some(mut turn) = self.arena_turn(varlen::ROUNDS).await {
            return self.arena_gather(&mut turn, input, root).await;
        }
        let (rank, world) = (self.rank(), self.size());
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "gather",
            source,
        };
        let first = collective::gather(rank, root, &vec![SLOT_BYTES; world]).map_err(arguments)?;
        let mut slots = vec![0u8; first.buffer_len()];
        let mine: &mut [u8; SLOT_BYTES] = (&mut slots[first.input_range()])
            .try_into()
            .expect("a slot is SLOT_BYTES long");
        varlen::write_slot(mine, input);
        let seq = self.reserve(varlen::ROUNDS);
        let signature = Signature::GatherLengths { root: root as u32 };
        self.run(seq, signature, &first, &mut slots).await?;
        if rank != root {
            if input.len() > INLINE_GATHER_BYTES {
                let mut lens = vec![0; world];
                lens[rank] = input.len();
                let second = collective::gather(rank, root, &lens).map_err(arguments)?;
                let mut data = input.to_vec();
                let signature = Signature::Gather { root: root as u32 };
                self.run(seq + 1, signature, &second, &mut data).await?;
            }
            return Ok(None);
        }
        let lens: Vec<u64> = slots
            .chunks_exact(SLOT_BYTES)
            .map(|c| varlen::slot_len(c.try_into().expect("slot-sized chunk")))
            .collect();
        check_block_lens("gather", seq, &lens, |i| i)?;
        let large: Vec<usize> = lens
            .iter()
            .enumerate()
            .map(|(r, len)| match varlen::inline_range(*len) {
                Some(_) => 0,
                None if r == root => 0,
                None => *len as usize,
            })
            .collect();
        let data = if large.iter().any(|len| *len > 0) {
            self.gather_large(seq + 1, root, &large).await?
        } else {
            Vec::new()
        };
        let (slots, data) = (Bytes::from(slots), Bytes::from(data));
        let mut offset = 0;
        let mut blocks = Vec::with_capacity(world);
        for (r, len) in lens.iter().enumerate() {
            blocks.push(if r == root {
                Bytes::copy_from_slice(input)
            } else if let Some(inline) = varlen::inline_range(*len) {
                slots.slice(SLOT_BYTES * r + inline.start..SLOT_BYTES * r + inline.end)
            } else {
                offset += large[r];
                data.slice(offset - large[r]..offset)
            });
        }
        Ok(Some(blocks))
    }

    /// One round of slots from the root (each rank's length, and its block up to
    /// [`INLINE_GATHER_BYTES`]), then the blocks that did not fit; both rounds numbered when
    /// the call is issued.
    async fn scatter(&self, blocks: &[Bytes], root: usize) -> Result<Bytes, ProcessGroupError> {
        if let Some(mut turn) = self.arena_turn(varlen::ROUNDS).await {
            return self.arena_scatter(&mut turn, blocks, root).await;
        }
        let (rank, world) = (self.rank(), self.size());
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "scatter",
            source,
        };
        let first = collective::scatter(rank, root, &vec![SLOT_BYTES; world]).map_err(arguments)?;
        if rank == root && blocks.len() != world {
            return Err(arguments(CollectiveError::LengthsCount {
                lens: blocks.len(),
                world,
            }));
        }
        let mut slots = vec![0u8; first.buffer_len()];
        if rank == root {
            for (slot, block) in slots.chunks_exact_mut(SLOT_BYTES).zip(blocks) {
                varlen::write_slot(slot.try_into().expect("slot-sized chunk"), block);
            }
        }
        let seq = self.reserve(varlen::ROUNDS);
        let signature = Signature::ScatterLengths { root: root as u32 };
        self.run(seq, signature, &first, &mut slots).await?;
        let second_signature = Signature::Scatter { root: root as u32 };
        if rank == root {
            let large: Vec<usize> = blocks
                .iter()
                .enumerate()
                .map(|(r, b)| {
                    if r == root || b.len() <= INLINE_GATHER_BYTES {
                        0
                    } else {
                        b.len()
                    }
                })
                .collect();
            if large.iter().any(|len| *len > 0) {
                let second = collective::scatter(rank, root, &large).map_err(arguments)?;
                let mut data = Vec::with_capacity(second.buffer_len());
                for (b, len) in blocks.iter().zip(&large) {
                    if *len > 0 {
                        data.extend_from_slice(b);
                    }
                }
                self.run(seq + 1, second_signature, &second, &mut data)
                    .await?;
            }
            return Ok(blocks[root].clone());
        }
        let slot: &[u8; SLOT_BYTES] = slots[..].try_into().expect("one slot");
        let len = varlen::slot_len(slot);
        if let Some(inline) = varlen::inline_range(len) {
            return Ok(Bytes::copy_from_slice(&slot[inline]));
        }
        check_block_lens("scatter", seq, &[len], |_| root)?;
        let mut lens = vec![0; world];
        lens[rank] = len as usize;
        let second = collective::scatter(rank, root, &lens).map_err(arguments)?;
        let mut data = vec![0u8; second.buffer_len()];
        self.run(seq + 1, second_signature, &second, &mut data)
            .await?;
        Ok(data.into())
    }

    async fn reduce(
        &self,
        data: &mut [u8],
        element: ElementType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), ProcessGroupError> {
        if let Some(mut turn) = self.arena_turn(1).await {
            return self.arena_reduce(&mut turn, data, element, op, root).await;
        }
        let (rank, world) = (self.rank(), self.size());
        let count = whole_elements("reduce", data.len(), element)?;
        let schedule =
            collective::reduce(rank, world, root, count, element, op).map_err(|source| {
                ProcessGroupError::Arguments {
                    collective: "reduce",
                    source,
                }
            })?;
        let signature = Signature::Reduce {
            op,
            element,
            root: root as u32,
            count: count as u64,
        };
        let seq = self.reserve(1);
        if rank == root {
            self.run(seq, signature, &schedule, data).await?;
            op.finish(element, data, world);
            Ok(())
        } else {
            self.run(seq, signature, &schedule, &mut data.to_vec())
                .await
        }
    }

    async fn reduce_scatter(
        &self,
        input: &[u8],
        counts: &[usize],
        element: ElementType,
        op: ReduceOp,
    ) -> Result<Vec<u8>, ProcessGroupError> {
        if let Some(mut turn) = self.arena_turn(1).await {
            return self
                .arena_reduce_scatter(&mut turn, input, counts, element, op)
                .await;
        }
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "reduce_scatter",
            source,
        };
        if counts.len() != self.size() {
            return Err(arguments(CollectiveError::LengthsCount {
                lens: counts.len(),
                world: self.size(),
            }));
        }
        let schedule =
            collective::reduce_scatter(self.rank(), counts, element, op).map_err(arguments)?;
        if schedule.buffer_len() != input.len() {
            return Err(arguments(CollectiveError::SplitsSum {
                sum: schedule.buffer_len(),
                actual: input.len(),
            }));
        }
        let signature = Signature::reduce_scatter(op, element, counts);
        let seq = self.reserve(1);
        let mut buffer = input.to_vec();
        self.run(seq, signature, &schedule, &mut buffer).await?;
        let mut out = buffer[schedule.output_range()].to_vec();
        op.finish(element, &mut out, self.size());
        Ok(out)
    }

    async fn all_to_all(
        &self,
        inputs: &[Bytes],
        output_lens: &[usize],
    ) -> Result<Vec<Bytes>, ProcessGroupError> {
        if let Some(mut turn) = self.arena_turn(1).await {
            return self.arena_all_to_all(&mut turn, inputs, output_lens).await;
        }
        let splits: Vec<usize> = inputs.iter().map(Bytes::len).collect();
        let (schedule, seq) = self.issue_all_to_all(&splits, output_lens)?;
        self.all_to_all_blocks(seq, &schedule, inputs, output_lens)
            .await
    }

    async fn all_to_all_single(
        &self,
        input: &[u8],
        input_splits: &[usize],
        output_splits: &[usize],
    ) -> Result<Vec<u8>, ProcessGroupError> {
        let sum = input_splits
            .iter()
            .try_fold(0usize, |acc, s| acc.checked_add(*s));
        if sum != Some(input.len()) {
            return Err(ProcessGroupError::Arguments {
                collective: "all_to_all",
                source: CollectiveError::SplitsSum {
                    sum: sum.unwrap_or(usize::MAX),
                    actual: input.len(),
                },
            });
        }
        if let Some(mut turn) = self.arena_turn(1).await {
            let input = Bytes::copy_from_slice(input);
            let mut start = 0;
            let inputs: Vec<Bytes> = input_splits
                .iter()
                .map(|len| {
                    start += len;
                    input.slice(start - len..start)
                })
                .collect();
            let blocks = self
                .arena_all_to_all(&mut turn, &inputs, output_splits)
                .await?;
            return Ok(blocks.concat());
        }
        let (schedule, seq) = self.issue_all_to_all(input_splits, output_splits)?;
        // Two copies in all: the input into one shared message (its blocks are sent as slices
        // of it), and the blocks received into the output.
        let input = Bytes::copy_from_slice(input);
        let mut start = 0;
        let inputs: Vec<Bytes> = input_splits
            .iter()
            .map(|len| {
                start += len;
                input.slice(start - len..start)
            })
            .collect();
        let blocks = self
            .all_to_all_blocks(seq, &schedule, &inputs, output_splits)
            .await?;
        let mut out = Vec::with_capacity(output_splits.iter().sum());
        for block in &blocks {
            out.extend_from_slice(block);
        }
        Ok(out)
    }

    async fn send(&self, data: &[u8], dst: usize, tag: u32) -> Result<(), ProcessGroupError> {
        self.check_peer("send", dst)?;
        let n = self.inner.sent.take(self.world_rank(dst), tag);
        self.send_numbered(Bytes::copy_from_slice(data), dst, tag, n)
            .await
    }

    async fn recv(&self, src: usize, tag: u32) -> Result<Bytes, ProcessGroupError> {
        self.check_peer("recv", src)?;
        let n = self.inner.received.take(self.world_rank(src), tag);
        self.recv_numbered(src, tag, n).await
    }

    /// Waits until a message with `tag` from some peer is the next one that peer's receives
    /// expect, claims its number, then takes it as [`recv`](ProcessGroup::recv) would. A
    /// receive from a given source issued while this waits may take that number first; this
    /// then waits for the next message.
    async fn recv_any(&self, tag: u32) -> Result<(usize, Bytes), ProcessGroupError> {
        // A disagreement fails every point-to-point key alike; the number does not matter.
        if let Some(e) = self.inner.mesh.failure(p2p::key(tag, 0)) {
            return Err(e);
        }
        let (rank, world) = (self.rank(), self.size());
        if world == 1 {
            // The only rank that could send is this one: refuse instead of waiting.
            return Err(ProcessGroupError::Arguments {
                collective: "recv",
                source: CollectiveError::PeerIsSelf { rank },
            });
        }
        let peers: Vec<usize> = (0..world).filter(|p| *p != rank).collect();
        let mesh = &self.inner.mesh;
        let received = &self.inner.received;
        let claim = std::future::poll_fn(|cx| {
            let mut open = false;
            for &peer in &peers {
                let global = self.world_rank(peer);
                let n = received.peek(global, tag);
                match mesh.poll_arrived(peer, p2p::key(tag, n), cx) {
                    std::task::Poll::Ready(true) => {
                        if received.claim(global, tag, n) {
                            return std::task::Poll::Ready(Ok((peer, n)));
                        }
                        // A receive from that peer took the number: look again.
                        cx.waker().wake_by_ref();
                        return std::task::Poll::Pending;
                    }
                    std::task::Poll::Ready(false) => {}
                    std::task::Poll::Pending => open = true,
                }
            }
            if open {
                std::task::Poll::Pending
            } else {
                let last = peers.last().copied().unwrap_or(rank);
                std::task::Poll::Ready(Err(mesh
                    .failure(p2p::key(tag, 0))
                    .unwrap_or_else(|| mesh.closed_error(last, "recv", 0))))
            }
        });
        let span = tracing::debug_span!("recv_any", rank, tag);
        let (src, n) = work::bounded(&**self.inner.mesh.runtime(), self.inner.timeout, claim)
            .instrument(span)
            .await
            .map_err(|timeout| ProcessGroupError::Timeout {
                collective: "recv",
                seq: 0,
                rank,
                waiting_on: peers.clone(),
                timeout,
            })??;
        let bytes = self.recv_numbered(src, tag, n).await?;
        Ok((src, bytes))
    }

    /// Sends `data` to `dst` with `tag` without waiting: the message is numbered now (so it
    /// keeps its place among this rank's messages to `dst` with `tag`) and sent on a task;
    /// the returned future gives the result, and the send goes on if it is dropped.
    fn isend(&self, data: Bytes, dst: usize, tag: u32) -> Pending<'_, ()> {
        if let Err(e) = self.check_peer("send", dst) {
            return Box::pin(Work::failed(e));
        }
        let n = self.inner.sent.take(self.world_rank(dst), tag);
        let group = self.clone();
        let runtime = self.inner.mesh.runtime().clone();
        Box::pin(Work::issue(runtime, "send", dst, async move {
            group.send_numbered(data, dst, tag, n).await
        }))
    }

    /// Receives the next message `src` sends here with `tag` without waiting: the receive is
    /// numbered now (so it gets the message after those of the receives issued before it)
    /// and waits on a task; the returned future gives the bytes.
    fn irecv(&self, src: usize, tag: u32) -> Pending<'_, Bytes> {
        if let Err(e) = self.check_peer("recv", src) {
            return Box::pin(Work::failed(e));
        }
        let n = self.inner.received.take(self.world_rank(src), tag);
        let group = self.clone();
        let runtime = self.inner.mesh.runtime().clone();
        Box::pin(Work::issue(runtime, "recv", src, async move {
            group.recv_numbered(src, tag, n).await
        }))
    }

    /// Rank 0 receives an empty message from every other rank in one step (in rank order),
    /// then answers each; on timeout it knows which ranks had not arrived.
    async fn monitored_barrier(
        &self,
        timeout: Option<Duration>,
        wait_all_ranks: bool,
    ) -> Result<(), ProcessGroupError> {
        let rank = self.rank();
        let schedule = collective::monitored_barrier(rank, self.size()).map_err(|source| {
            ProcessGroupError::Arguments {
                collective: "monitored_barrier",
                source,
            }
        })?;
        let timeout = timeout.unwrap_or(self.inner.timeout);
        let seq = self.reserve(1);
        let result = self
            .run_within(
                seq,
                Signature::MonitoredBarrier,
                &schedule,
                &mut [],
                &mut Held::default(),
                false,
                timeout,
            )
            .await;
        match result {
            Err(ProcessGroupError::Timeout { waiting_on, .. }) if rank == 0 => {
                Err(ProcessGroupError::MonitoredBarrier {
                    rank,
                    missing: collective::monitored_barrier_missing(&waiting_on, wait_all_ranks),
                    timeout,
                })
            }
            other => other,
        }
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
