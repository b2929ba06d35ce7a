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

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tensorwire_core::collective::varlen::{self, SLOT_BYTES};
use tensorwire_core::collective::{
    self, AllGatherAlgorithm, AllReduceAlgorithm, CollectiveError, ElementType, ReduceOp, Schedule,
    Signature,
};
use tensorwire_core::ports::process_group::{ProcessGroup, ProcessGroupError};
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::Transport;
use tokio::time::Instant;
use tracing::Instrument;

use crate::executor::{self, Held};
use crate::mesh::{Mesh, MeshSetup};

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
}

impl GroupOptions {
    /// Options for the group `name`, listening on `127.0.0.1`, with the default timeout.
    pub fn new(name: impl Into<String>) -> Self {
        GroupOptions {
            name: name.into(),
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            timeout: DEFAULT_COLLECTIVE_TIMEOUT,
        }
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
    mesh: Mesh,
    /// The barrier's schedule, the same every time.
    barrier: Schedule,
    /// The schedule of an all_gather's first round (one length slot per rank), likewise.
    lengths: Schedule,
    name: String,
    next_seq: AtomicU64,
    timeout: Duration,
    /// Kept so that an embedded store server (rank 0) lives as long as the group.
    _store: Arc<dyn Store>,
}

/// A process group over a mesh of [`Transport`] connections: the built-in backend.
///
/// Cheap to clone (one shared group). Collectives take `&self`; several may be in flight at
/// once as long as every rank *issues* them in the same order: a collective is issued when
/// its future is first polled, and then checks its arguments and numbers all its rounds
/// before it awaits anything (see the
/// [port's contract](tensorwire_core::ports::process_group)). Ranks that disagree about a
/// collective fail it with [`ProcessGroupError::Disagreement`] and the group is broken.
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
    /// Sets up `rank` of a group of `world` ranks: publishes this rank's address in `store`
    /// and connects to every other rank over `transport`.
    ///
    /// # Errors
    /// [`ProcessGroupError::Setup`] naming what failed (and, on timeout, the ranks that did
    /// not show up).
    pub async fn connect(
        store: Arc<dyn Store>,
        transport: Arc<dyn Transport>,
        rank: usize,
        world: usize,
        options: GroupOptions,
    ) -> Result<Group, ProcessGroupError> {
        let span = tracing::debug_span!("pg_connect", group = %options.name, rank, world);
        let mesh = Mesh::connect(MeshSetup {
            store: store.as_ref(),
            transport: transport.as_ref(),
            group: &options.name,
            rank,
            world,
            listen: options.listen,
            timeout: options.timeout,
        })
        .instrument(span)
        .await?;
        let setup = |e: CollectiveError| ProcessGroupError::Setup {
            rank,
            reason: e.to_string(),
        };
        let barrier = collective::barrier(rank, world).map_err(setup)?;
        let slots = vec![SLOT_BYTES; world];
        let lengths = collective::all_gather(rank, &slots, AllGatherAlgorithm::select(&slots))
            .map_err(setup)?;
        Ok(Group {
            inner: Arc::new(Inner {
                mesh,
                barrier,
                lengths,
                name: options.name,
                next_seq: AtomicU64::new(0),
                timeout: options.timeout,
                _store: store,
            }),
        })
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The bound on each collective.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Takes `rounds` consecutive sequence numbers and returns the first. Called when a
    /// collective is issued, after its arguments were checked and before its first await.
    fn reserve(&self, rounds: u64) -> u64 {
        self.inner.next_seq.fetch_add(rounds, Ordering::Relaxed)
    }

    async fn run(
        &self,
        seq: u64,
        signature: Signature,
        schedule: &Schedule,
        buffer: &mut [u8],
    ) -> Result<(), ProcessGroupError> {
        self.run_held(
            seq,
            signature,
            schedule,
            buffer,
            &mut Held::default(),
            false,
        )
        .await
    }

    async fn run_held(
        &self,
        seq: u64,
        signature: Signature,
        schedule: &Schedule,
        buffer: &mut [u8],
        held: &mut Held,
        defer: bool,
    ) -> Result<(), ProcessGroupError> {
        let deadline = Instant::now() + self.inner.timeout;
        let span = tracing::debug_span!("collective", %signature, seq, rank = self.rank());
        let op = executor::Op {
            seq,
            signature,
            deadline,
            timeout: self.inner.timeout,
        };
        let result = executor::run(&self.inner.mesh, op, schedule, buffer, held, defer)
            .instrument(span)
            .await;
        match &result {
            // The ranks no longer agree on where the collectives stand (some sent their
            // messages for this sequence number, others never will): break the group, as
            // PyTorch's watchdog aborts a communicator after a timeout.
            Err(e @ ProcessGroupError::Timeout { .. }) => self.inner.mesh.fail(e.clone()),
            // Another rank ran something else: break the group here and tell the others, so
            // that every rank fails, senders included.
            Err(e @ ProcessGroupError::Disagreement { here: true, .. }) => {
                self.inner.mesh.report_disagreement(e).await
            }
            _ => {}
        }
        result
    }

    /// All-gather of blocks whose lengths every rank already knows (`lens[i]` is rank i's);
    /// skips the exchange of lengths that [`all_gather`](ProcessGroup::all_gather) does first.
    /// Returns the blocks in rank order, sharing one buffer. Every rank must pass the same
    /// `lens` (ranks that do not fail with [`ProcessGroupError::Disagreement`]).
    ///
    /// # Errors
    /// [`ProcessGroupError::Arguments`] when `input` is not `lens[rank]` bytes or `lens` does
    /// not have one entry per rank (the call then takes no place in the group's sequence);
    /// the errors of every collective.
    pub async fn all_gather_with_lens(
        &self,
        input: &[u8],
        lens: &[usize],
    ) -> Result<Vec<Bytes>, ProcessGroupError> {
        let rank = self.rank();
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "all_gather",
            source,
        };
        if lens.len() != self.size() {
            return Err(arguments(CollectiveError::LengthsCount {
                lens: lens.len(),
                world: self.size(),
            }));
        }
        if lens[rank] != input.len() {
            return Err(arguments(CollectiveError::InputLength {
                rank,
                expected: lens[rank],
                actual: input.len(),
            }));
        }
        let schedule = collective::all_gather(rank, lens, AllGatherAlgorithm::select(lens))
            .map_err(arguments)?;
        let seq = self.reserve(1);
        self.gather_known(seq, schedule, input, lens).await
    }

    /// The data round of an all_gather, as collective `seq`, once the lengths are known.
    async fn gather_known(
        &self,
        seq: u64,
        schedule: Schedule,
        input: &[u8],
        lens: &[usize],
    ) -> Result<Vec<Bytes>, ProcessGroupError> {
        // Blocks that arrive whole stay the messages they came in; the buffer (zeroed pages
        // the OS has not even mapped yet) is written only where a schedule needs contiguous
        // bytes, so a ring all_gather copies nothing but this rank's input.
        let mut buffer = vec![0u8; schedule.buffer_len()];
        let mut held = Held::default();
        held.insert(schedule.input_range(), Bytes::copy_from_slice(input), false);
        let signature = Signature::all_gather(lens);
        self.run_held(seq, signature, &schedule, &mut buffer, &mut held, true)
            .await?;
        let mut ranges = Vec::with_capacity(lens.len());
        let mut offset = 0;
        for len in lens {
            ranges.push(offset..offset + len);
            offset += len;
        }
        let missing: Vec<_> = ranges
            .iter()
            .filter(|r| held.get(r).is_none())
            .cloned()
            .collect();
        held.materialize(&missing, &mut buffer);
        let buffer = Bytes::from(buffer);
        Ok(ranges
            .into_iter()
            .map(|r| held.get(&r).unwrap_or_else(|| buffer.slice(r)))
            .collect())
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

    async fn barrier(&self) -> Result<(), ProcessGroupError> {
        let seq = self.reserve(1);
        self.run(seq, Signature::Barrier, &self.inner.barrier, &mut [])
            .await
    }

    /// Two rounds, both numbered when the call is issued: one slot per rank with its block's
    /// length (and the block itself up to [`INLINE_GATHER_BYTES`]), then, unless every block
    /// fitted, the blocks.
    async fn all_gather(&self, input: &[u8]) -> Result<Vec<Bytes>, ProcessGroupError> {
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
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "all_reduce",
            source,
        };
        if data.len() % element.size() != 0 {
            return Err(arguments(CollectiveError::ReduceLength {
                element,
                acc: data.len(),
                incoming: data.len(),
            }));
        }
        let count = data.len() / element.size();
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
        self.run(seq, signature, &schedule, data).await
    }

    /// Says goodbye to the peers and closes the connections. Peers still waiting for this
    /// rank's messages get [`ProcessGroupError::PeerLeft`]; later collectives here fail with
    /// [`ProcessGroupError::ShutDown`]. A group dropped without it looks dead to its peers.
    async fn shutdown(&self) {
        self.inner.mesh.shutdown(Duration::from_secs(5)).await;
    }
}

/// An element type [`CollectivesExt::all_reduce_typed`] can reduce: `f32`, `f64`, `i32`, `i64`.
pub trait Element: Copy + Send + Sync + sealed::Sealed + 'static {
    /// The element type on the wire.
    const TYPE: ElementType;
    /// Writes the value's little-endian bytes into `out` (exactly `TYPE.size()` bytes).
    fn write_le(self, out: &mut [u8]);
    /// Reads a value from `TYPE.size()` little-endian bytes.
    fn read_le(bytes: &[u8]) -> Self;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
}

macro_rules! element {
    ($t:ty, $e:expr) => {
        impl Element for $t {
            const TYPE: ElementType = $e;
            fn write_le(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn read_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element-sized chunk"))
            }
        }
    };
}

element!(f32, ElementType::F32);
element!(f64, ElementType::F64);
element!(i32, ElementType::I32);
element!(i64, ElementType::I64);

/// Typed collectives on top of any [`ProcessGroup`]'s byte collectives.
#[async_trait]
pub trait CollectivesExt: ProcessGroup {
    /// [`all_reduce`](ProcessGroup::all_reduce) on a slice of `f32`, `f64`, `i32` or `i64`.
    async fn all_reduce_typed<T: Element>(
        &self,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<(), ProcessGroupError> {
        let size = T::TYPE.size();
        let mut bytes = vec![0u8; data.len() * size];
        for (x, out) in data.iter().zip(bytes.chunks_exact_mut(size)) {
            x.write_le(out);
        }
        self.all_reduce(&mut bytes, T::TYPE, op).await?;
        for (x, chunk) in data.iter_mut().zip(bytes.chunks_exact(size)) {
            *x = T::read_le(chunk);
        }
        Ok(())
    }

    /// Gathers one serde value from every rank (postcard-encoded; the lengths travel first),
    /// in rank order.
    async fn all_gather_object<T>(&self, value: &T) -> Result<Vec<T>, ProcessGroupError>
    where
        T: Serialize + DeserializeOwned + Sync,
    {
        let rank = self.rank();
        let bytes = postcard::to_allocvec(value).map_err(|e| ProcessGroupError::Object {
            rank,
            op: "encoded",
            reason: e.to_string(),
        })?;
        let blocks = self.all_gather(&bytes).await?;
        blocks
            .iter()
            .enumerate()
            .map(|(peer, block)| {
                postcard::from_bytes(block).map_err(|e| ProcessGroupError::Object {
                    rank: peer,
                    op: "decoded",
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    /// Sends `root`'s serde value to every rank: `value` must be `Some` on the root (other
    /// ranks' values are ignored). Runs [`broadcast_bytes`](ProcessGroup::broadcast_bytes).
    async fn broadcast_object<T>(
        &self,
        value: Option<&T>,
        root: usize,
    ) -> Result<T, ProcessGroupError>
    where
        T: Serialize + DeserializeOwned + Sync,
    {
        let rank = self.rank();
        let bytes = if rank == root {
            let value = value.ok_or_else(|| ProcessGroupError::Object {
                rank,
                op: "encoded",
                reason: "the root passed no value to broadcast".to_owned(),
            })?;
            postcard::to_allocvec(value).map_err(|e| ProcessGroupError::Object {
                rank,
                op: "encoded",
                reason: e.to_string(),
            })?
        } else {
            Vec::new()
        };
        let bytes = self.broadcast_bytes(&bytes, root).await?;
        postcard::from_bytes(&bytes).map_err(|e| ProcessGroupError::Object {
            rank: root,
            op: "decoded",
            reason: e.to_string(),
        })
    }
}

impl<P: ProcessGroup + ?Sized> CollectivesExt for P {}
