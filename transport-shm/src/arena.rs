//! The group arena: one shared segment per process group on a host, through which the group's
//! ranks on this host run their collectives (the plans of
//! [`tensorwire_core::collective::arena`]), as MPI's shared-memory collectives and NCCL's SHM
//! path do.
//!
//! # Layout
//! A memfd sealed against resizing, holding one 64-byte *phase line* per rank (its phase
//! counter and the signatures of its last two phases), then one 64-byte *control line* per rank
//! (what it said of its failures, and whether it sleeps), and then a slot per rank in two halves
//! of
//! [`Arena::slot_bytes`] bytes (`arena_bytes / (2 × world)`, rounded down to 64; see
//! [`DEFAULT_ARENA_BYTES`]). The memory is shared by every rank of the group on the host, so a
//! rank that writes outside its slot harms its group's results (never another group's, never
//! memory outside the segment): ranks on one host share memory, as over the shared-memory
//! transport. The control words have lines of their own because every rank reads every
//! other's on each publication (whom to wake) and at each collective's start (a reported
//! disagreement) while they seldom change: beside the phase counters, which change at every
//! phase, those reads would pull each line away from its writer mid-publication.
//!
//! # Setup
//! The *leader* (the lowest rank of the group on this host) makes the segment and listens on an
//! abstract Unix socket with an unguessable name ([`ArenaHost`]); the group tells every rank that
//! name, each rank's process id and host over its links (which are authenticated). Each other
//! rank connects, says its rank, and the leader checks with `SO_PEERCRED` that the process at
//! the other end runs as the same user with the process id that rank announced, then sends the
//! memfd with `SCM_RIGHTS` (as the shared-memory transport sends its rings); the rank checks the
//! leader's process id the same way, the memfd's size and seals, and maps it ([`Arena::join`]).
//! With the memfd come the group's wake-up descriptors: an eventfd per rank, made by the
//! leader, 16 to a packet (the most one packet of its socket carries); the rank checks that
//! each is an eventfd.
//!
//! # Waiting, and ranks that die or stop
//! What a wait decides (whom it still waits for, when to look again, which failure) is core's
//! [`ArenaWait`]; this module only looks and sleeps. A rank waiting for others' counters polls
//! them for the spin budget (the shared-memory transport's,
//! [`ShmConfig::spin`](crate::ShmConfig::spin); the budget is CPU time, measured on the system's
//! clock) — or, when the group's ranks outnumber the CPUs this process may run on, yields
//! between looks for that budget (core's [`SpinPolicy::for_host`]: polling would keep the
//! awaited ranks off the core) — then sleeps
//! until its eventfd is written (the runtime's reactor waits on it, so the waiting task's thread
//! goes on running other tasks and no thread of the arena's own is woken in between: a writer
//! wakes the ranks whose line says they sleep, after each publication), or until the time
//! [`WaitStep::Sleep`] names on the **group's clock** (the [`Runtime`] the collective is run
//! with: deadlines follow it, virtual time included), or until the process of a rank it still
//! waits for ends (its `pidfd`, readable once that process has exited, `SIGKILL` included, is
//! in the reactor too), or until the caller gives up. A dead rank is so named at once
//! ([`ArenaFailure::Died`]); one the group says is gone, within [`LIVENESS_PERIOD`] (the
//! longest sleep between two looks); ranks alive but stopped are named, all of
//! them, when the collective's deadline passes, or when the caller gives up first
//! ([`ArenaFailure::Timeout`]). Nobody spins or sleeps past the deadline. A failed collective
//! leaves the ranks out of step, so the arena refuses every later one with the same failure
//! ([`ArenaState::fail`]).

use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_core::collective::arena::{self, ArenaPhase, ArenaPlan, ArenaState, ARENA_ALIGN};
use tensorwire_core::collective::arena_wait::{
    all_reached, reported_disagreement, ArenaWait, Lost, WaitStep,
};
pub use tensorwire_core::collective::arena_wait::{ArenaFailure, Gone, LIVENESS_PERIOD};
use tensorwire_core::collective::{reduce_into, ElementType, ReduceOp};
use tensorwire_core::ports::runtime::Runtime;
use tensorwire_core::spin::{SpinPolicy, SpinStep};
use tokio::io::unix::AsyncFd;

use crate::mem::{self, Mapping, RING_SEALS};
use crate::sock;
use now::{At, Blocked, Look};
pub use now::{Unfinished, UnfinishedFresh};

/// The default size of a group's arena: 32 MiB per group and host (slots of 2 MiB a half at 8
/// ranks, 256 KiB at 64). Pages are touched only as messages use them.
pub const DEFAULT_ARENA_BYTES: usize = 32 << 20;

/// The largest arena a rank accepts.
pub const MAX_ARENA_BYTES: usize = 1 << 34;

/// Bytes of a rank's line.
const LINE: usize = 64;

/// Where in a rank's control line it says what it saw of its failures (a word: see
/// [`SAW_DISAGREEMENT`], [`FAILED`]).
const FAILURE_AT: usize = 0;

/// Where in a rank's control line it says that it sleeps (a word: 1 while it waits on its
/// eventfd).
const SLEEPING_AT: usize = 4;

/// A rank's failure word: it saw ranks run different collectives.
const SAW_DISAGREEMENT: u32 = 1;

/// A rank's failure word: a collective of its own failed otherwise (a rank died or is gone,
/// a timeout).
const FAILED: u32 = 2;

/// Why an arena could not be set up, or a collective through it failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ArenaError {
    /// Setting the arena up failed.
    #[error("setting up the group arena: {0}")]
    Setup(String),
    /// A collective failed (a rank died, is gone, did not come in time, or ran something
    /// else), as core's [`ArenaWait`] decided; this arena fails every later collective with
    /// the same. [`Arena::pid`] gives a dead rank's process id.
    #[error(transparent)]
    Failed(#[from] ArenaFailure),
    /// A plan that does not fit this arena (another slot size or world): a bug.
    #[error(
        "a plan for {plan_world} ranks and slots of {plan_slot} bytes does not fit this arena"
    )]
    PlanMismatch {
        /// The plan's world size.
        plan_world: usize,
        /// The plan's slot size.
        plan_slot: usize,
    },
    /// A plan's reduction does not fit its reads (a bug; refused before any phase).
    #[error("{0}")]
    Reduce(String),
}

/// How one collective through the arena is bounded, and what the group knows of its ranks.
pub struct Bounds<'a> {
    /// The group's clock: the deadline is on it, and so is every judgement of time.
    pub runtime: &'a dyn Runtime,
    /// When the collective fails ([`ArenaFailure::Timeout`]).
    pub deadline: Instant,
    /// What a timeout at the deadline reports.
    pub timeout: Duration,
    /// The collective's signature: ranks that ran others in the same phase are told.
    pub signature: u64,
    /// For a rank still awaited, whether the group knows it is gone (its links ended: it shut
    /// down, or its connection broke), and why; asked after every sleep, as the rank's process
    /// is checked.
    pub gone: &'a (dyn Fn(usize) -> Option<Gone> + Send + Sync),
}

impl std::fmt::Debug for Bounds<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounds")
            .field("deadline", &self.deadline)
            .field("timeout", &self.timeout)
            .field("signature", &self.signature)
            .finish_non_exhaustive()
    }
}

/// A caller's own bound on a collective: resolves, with the duration it waited, when the
/// caller gives up (a `Work::wait` with a shorter timeout). [`never()`] for none.
pub type GiveUp<'a> = Pin<&'a mut (dyn Future<Output = Duration> + Send)>;

/// A [`GiveUp`] that never resolves.
pub fn never() -> impl Future<Output = Duration> + Send {
    std::future::pending()
}

/// This host, as far as the arena is concerned: ranks with the same key can share one (same
/// boot, same network namespace, so the abstract socket is reachable; same process-id
/// namespace, so the process ids they announce are the ones `SO_PEERCRED` reports; same user).
pub fn host_key() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = |n: &str| {
        std::fs::read_link(format!("/proc/self/ns/{n}"))
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    };
    format!(
        "{}/{}/{}/{}",
        boot.trim(),
        ns("net"),
        ns("pid"),
        sock::my_uid()
    )
}

/// The CPUs this process may run on: its affinity mask (`sched_getaffinity`), fewer under a
/// cgroup's CPU quota (what `available_parallelism` reads); 1 when that cannot be read.
fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn setup(what: &str) -> impl FnOnce(std::fmt::Arguments<'_>) -> ArenaError + '_ {
    move |e| ArenaError::Setup(format!("{what}: {e}"))
}

fn segment_len(world: usize, arena_bytes: usize) -> (usize, usize) {
    let slot = arena::slot_bytes(arena_bytes, world);
    (slot, 2 * LINE * world + 2 * world * slot)
}

/// How many segments [`ArenaHost::create`] made in this process.
static MADE: AtomicU64 = AtomicU64::new(0);

/// How many arena segments this process has made ([`ArenaHost::create`] that succeeded), for
/// the tests and diagnostics that check which groups make an arena.
pub fn arenas_made() -> u64 {
    MADE.load(Ordering::Relaxed)
}

/// The leader's side of the setup: the segment, and the socket the other ranks fetch it from.
pub struct ArenaHost {
    listener: AsyncFd<OwnedFd>,
    name: String,
    fd: OwnedFd,
    /// Every rank's eventfd, by rank.
    wakes: Vec<OwnedFd>,
    world: usize,
    arena_bytes: usize,
}

impl std::fmt::Debug for ArenaHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaHost")
            .field("name", &self.name)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl ArenaHost {
    /// Makes the segment for `world` ranks and `arena_bytes` of slots, and listens for the
    /// other ranks. Must run inside a tokio runtime.
    ///
    /// # Errors
    /// [`ArenaError::Setup`] when the arena is too small for the world or too large, or the
    /// system refuses the memfd or the socket.
    pub fn create(world: usize, arena_bytes: usize) -> Result<Self, ArenaError> {
        let (slot, len) = segment_len(world, arena_bytes);
        if slot < ARENA_ALIGN * world || arena_bytes > MAX_ARENA_BYTES {
            return Err(ArenaError::Setup(format!(
                "an arena of {arena_bytes} bytes does not fit {world} ranks (at least {} bytes, at most {MAX_ARENA_BYTES})",
                2 * ARENA_ALIGN * world * world
            )));
        }
        let fd = mem::memfd("tensorwire-arena", len as u64)
            .map_err(|e| ArenaError::Setup(format!("memfd: {e}")))?;
        rustix::fs::fcntl_add_seals(&fd, RING_SEALS | rustix::fs::SealFlags::SEAL)
            .map_err(|e| setup("sealing the arena")(format_args!("{e}")))?;
        let wakes = (0..world)
            .map(|_| {
                rustix::event::eventfd(
                    0,
                    rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
                )
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| setup("the arena's eventfds")(format_args!("{e}")))?;
        let name = format!(
            "tensorwire-arena:{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        );
        let listener = (|| -> std::io::Result<_> {
            let fd = sock::socket()?;
            rustix::net::bind(
                &fd,
                &rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes())?,
            )?;
            rustix::net::listen(&fd, 128)?;
            sock::register(fd, tokio::io::Interest::READABLE)
        })()
        .map_err(|e| setup("the arena's socket")(format_args!("{e}")))?;
        MADE.fetch_add(1, Ordering::Relaxed);
        Ok(ArenaHost {
            listener,
            name,
            fd,
            wakes,
            world,
            arena_bytes,
        })
    }

    /// The socket's name, to tell the other ranks.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Hands the segment to every other rank (`pids[r]` is rank r's announced process id,
    /// `rank` this one's) and maps it: returns once each has fetched it, or fails at
    /// `deadline` on `runtime`'s clock. A connection from a process that is not the rank it claims is refused and
    /// logged.
    ///
    /// # Errors
    /// [`ArenaError::Setup`] naming the ranks that did not come.
    pub async fn accept(
        self,
        rank: usize,
        pids: &[u32],
        spin: Duration,
        runtime: &dyn Runtime,
        deadline: Instant,
    ) -> Result<Arena, ArenaError> {
        let mut missing: Vec<bool> = (0..self.world).map(|r| r != rank).collect();
        let me = sock::my_uid();
        let accepting = async {
            while missing.iter().any(|m| *m) {
                let conn = self
                    .listener
                    .async_io(tokio::io::Interest::READABLE, |fd| {
                        Ok(rustix::net::accept_with(
                            fd,
                            rustix::net::SocketFlags::NONBLOCK | rustix::net::SocketFlags::CLOEXEC,
                        )?)
                    })
                    .await
                    .map_err(|e| setup("accepting")(format_args!("{e}")))?;
                let Ok(conn) = sock::register(
                    conn,
                    tokio::io::Interest::READABLE | tokio::io::Interest::WRITABLE,
                ) else {
                    continue;
                };
                let mut buf = [0u8; 8];
                let Ok(packet) = sock::recv_packet(&conn, &mut buf).await else {
                    continue;
                };
                let claimed = u64::from_le_bytes(buf) as usize;
                let cred = sock::peer_cred(conn.get_ref());
                let ok = packet.len == 8
                    && claimed < self.world
                    && missing[claimed]
                    && matches!(cred, Ok((uid, pid)) if uid == me && pid == pids[claimed]);
                if !ok {
                    tracing::warn!(
                        ?cred,
                        claimed,
                        "a process that is not the rank it claims asked for the group arena: refused"
                    );
                    continue;
                }
                let header = [self.world as u64, self.arena_bytes as u64]
                    .map(u64::to_le_bytes)
                    .concat();
                let mut sent = sock::send_packet(&conn, &header, &[self.fd.as_fd()]).await;
                for wakes in self.wakes.chunks(sock::MAX_FDS) {
                    let fds: Vec<_> = wakes.iter().map(AsFd::as_fd).collect();
                    if sent.is_ok() {
                        sent = sock::send_packet(&conn, &[1], &fds).await;
                    }
                }
                if sent.is_ok() {
                    missing[claimed] = false;
                }
            }
            Ok::<(), ArenaError>(())
        };
        match runtime.timeout_at(deadline, accepting).await {
            Ok(result) => result?,
            Err(_) => {
                let missing: Vec<usize> = (0..self.world).filter(|r| missing[*r]).collect();
                return Err(ArenaError::Setup(format!(
                    "ranks {missing:?} did not fetch the arena in time"
                )));
            }
        }
        Arena::over(
            self.fd,
            self.wakes,
            rank,
            self.world,
            self.arena_bytes,
            pids,
            spin,
        )
    }
}

/// One rank's view of its group's arena: the mapping, the phase state, and the ranks'
/// processes (for liveness).
pub struct Arena {
    map: Arc<Mapping>,
    rank: usize,
    world: usize,
    slot: usize,
    state: ArenaState,
    pids: Vec<u32>,
    /// The ranks' processes (none for this one's), registered with the runtime's reactor:
    /// readable once the process has ended.
    pidfds: Vec<Option<AsyncFd<OwnedFd>>>,
    /// The ranks whose process this rank has seen end.
    ended: Vec<bool>,
    spin: SpinPolicy,
    /// Every rank's eventfd, by rank: a writer wakes a sleeping rank through it.
    wakes: Vec<OwnedFd>,
    /// This rank's eventfd (a duplicate), registered with the runtime's reactor: it sleeps on it.
    woken: AsyncFd<OwnedFd>,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

impl Arena {
    /// Fetches the segment from the leader listening on `name` (rank `leader`, whose process
    /// is `pids[leader]`), as `rank`, and maps it.
    ///
    /// # Errors
    /// [`ArenaError::Setup`] when the leader cannot be reached by `deadline` (on `runtime`'s
    /// clock), is not the process announced, or sends a segment of another size or without
    /// its seals.
    pub async fn join(
        name: &str,
        rank: usize,
        pids: &[u32],
        leader: usize,
        spin: Duration,
        runtime: &dyn Runtime,
        deadline: Instant,
    ) -> Result<Arena, ArenaError> {
        let fetch = async {
            let addr = rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes())
                .map_err(|e| setup("the arena's name")(format_args!("{e}")))?;
            let conn = sock::connect_name(&addr)
                .await
                .map_err(|e| setup("reaching the arena's leader")(format_args!("{e}")))?;
            match sock::peer_cred(conn.get_ref()) {
                Ok((uid, pid)) if uid == sock::my_uid() && pid == pids[leader] => {}
                other => {
                    return Err(ArenaError::Setup(format!(
                    "the arena's socket is held by {other:?}, not by rank {leader} (process {})",
                    pids[leader]
                )))
                }
            }
            sock::send_packet(&conn, &(rank as u64).to_le_bytes(), &[])
                .await
                .map_err(|e| setup("asking for the arena")(format_args!("{e}")))?;
            let mut buf = [0u8; 16];
            let mut packet = sock::recv_packet(&conn, &mut buf)
                .await
                .map_err(|e| setup("receiving the arena")(format_args!("{e}")))?;
            if packet.len != 16 || packet.fds.len() != 1 || packet.truncated {
                return Err(ArenaError::Setup(
                    "the leader sent no arena (or more than one)".into(),
                ));
            }
            let world = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes")) as usize;
            let bytes = u64::from_le_bytes(buf[8..].try_into().expect("8 bytes")) as usize;
            if world != pids.len() || bytes > MAX_ARENA_BYTES {
                return Err(ArenaError::Setup(format!(
                    "the leader's arena is for {world} ranks and {bytes} bytes"
                )));
            }
            let fd = packet.fds.pop().expect("one descriptor");
            let mut wakes = Vec::with_capacity(world);
            while wakes.len() < world {
                let expected = (world - wakes.len()).min(sock::MAX_FDS);
                let packet = sock::recv_packet(&conn, &mut [0])
                    .await
                    .map_err(|e| setup("receiving the arena's eventfds")(format_args!("{e}")))?;
                if packet.len != 1 || packet.fds.len() != expected || packet.truncated {
                    return Err(ArenaError::Setup(format!(
                        "the leader sent {} eventfds in a packet where {expected} were due",
                        packet.fds.len()
                    )));
                }
                wakes.extend(packet.fds);
            }
            if let Some(other) = wakes.iter().position(|fd| !is_eventfd(fd)) {
                return Err(ArenaError::Setup(format!(
                    "the leader's wake-up descriptor for rank {other} is not an eventfd"
                )));
            }
            Arena::over(fd, wakes, rank, world, bytes, pids, spin)
        };
        runtime.timeout_at(deadline, fetch).await.map_err(|_| {
            ArenaError::Setup(format!(
                "the arena's leader (rank {leader}) did not answer in time"
            ))
        })?
    }

    fn over(
        fd: OwnedFd,
        wakes: Vec<OwnedFd>,
        rank: usize,
        world: usize,
        arena_bytes: usize,
        pids: &[u32],
        spin: Duration,
    ) -> Result<Arena, ArenaError> {
        let (slot, len) = segment_len(world, arena_bytes);
        mem::check_memfd(&fd, len as u64, RING_SEALS)
            .map_err(|e| ArenaError::Setup(format!("the arena's memfd: {e}")))?;
        let map = Mapping::map(&fd, len, true, false)
            .map_err(|e| ArenaError::Setup(format!("mapping the arena: {e}")))?;
        let woken = (|| -> std::io::Result<_> {
            let mine = wakes.get(rank).ok_or(std::io::ErrorKind::NotFound)?;
            sock::register(mine.try_clone()?, tokio::io::Interest::READABLE)
        })()
        .map_err(|e| setup("this rank's eventfd")(format_args!("{e}")))?;
        let me = std::process::id();
        let pidfds = pids
            .iter()
            .map(|pid| {
                if *pid == me {
                    return None;
                }
                let pid = rustix::process::Pid::from_raw(*pid as i32)?;
                let fd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty());
                sock::register(fd.ok()?, tokio::io::Interest::READABLE).ok()
            })
            .collect();
        Ok(Arena {
            map: Arc::new(map),
            rank,
            world,
            slot,
            state: ArenaState::new(),
            pids: pids.to_vec(),
            pidfds,
            ended: vec![false; world],
            spin: SpinPolicy::for_host(world, cpus(), spin),
            woken,
            wakes,
        })
    }

    /// The bytes of one half of a slot: what plans for this arena are made with.
    pub fn slot_bytes(&self) -> usize {
        self.slot
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The process id rank `rank` announced (for messages about its death).
    pub fn pid(&self, rank: usize) -> Option<u32> {
        self.pids.get(rank).copied()
    }

    fn counter(&self, rank: usize) -> &AtomicU32 {
        // SAFETY: line `rank` lies in the mapping (rank < world, checked by callers), is 4-byte
        // aligned (page-aligned mapping, 64-byte lines) and lives as long as `self`.
        unsafe { &*(self.map.ptr().add(rank * LINE) as *const AtomicU32) }
    }

    /// Rank `rank`'s signature of the phase it last published in `half`: the phase's number,
    /// and the collective's signature (in the rest of its line).
    fn signature_words(&self, rank: usize, half: usize) -> (&AtomicU64, &AtomicU64) {
        // SAFETY: bytes 8 to 40 of line `rank`, 8-byte aligned, in the mapping.
        unsafe {
            let base = self.map.ptr().add(rank * LINE + 8 + 16 * half);
            (
                &*(base as *const AtomicU64),
                &*(base.add(8) as *const AtomicU64),
            )
        }
    }

    /// What rank `rank` said of its failures (a word at [`FAILURE_AT`] in its control line; a
    /// rank writes only its own): [`SAW_DISAGREEMENT`], [`FAILED`], or 0.
    fn disagreed(&self, rank: usize) -> &AtomicU32 {
        self.control(rank, FAILURE_AT)
    }

    /// The word at `at` of rank `rank`'s control line (see the layout in the module's docs).
    fn control(&self, rank: usize, at: usize) -> &AtomicU32 {
        debug_assert!(rank < self.world && at % 4 == 0 && at + 4 <= LINE);
        // SAFETY: bytes `at` to `at + 4` of control line `rank` (after the world's phase
        // lines), 4-byte aligned, in the mapping.
        unsafe { &*(self.map.ptr().add((self.world + rank) * LINE + at) as *const AtomicU32) }
    }

    /// Says in this rank's line how its collective failed, and wakes the sleepers. A
    /// disagreement ([`SAW_DISAGREEMENT`]) makes the ranks waiting for this one (and every
    /// rank's next collective) fail at once instead of waiting for the deadline: a broadcast's
    /// root, which waits for nobody, learns of it so. Any other failure ([`FAILED`]) only tells
    /// the others, once this process ends, that its end followed a failure of its own (so that
    /// they name the rank that caused it, not this one). A disagreement is never overwritten.
    fn report_failure(&self, word: u32) {
        let mine = self.disagreed(self.rank);
        if mine.load(Ordering::Relaxed) == SAW_DISAGREEMENT {
            return;
        }
        mine.store(word, Ordering::Release);
        self.announce();
    }

    /// Wakes, after a publication (a counter, a failure word), every other rank whose line
    /// says it sleeps. Paired with [`Arena::sleep_flag`]'s fence: either the sleeper sees the
    /// publication before it sleeps, or this sees its word and writes its eventfd.
    fn announce(&self) {
        fence(Ordering::SeqCst);
        for (q, wake) in self.wakes.iter().enumerate() {
            if q != self.rank && self.sleeping(q).load(Ordering::Relaxed) != 0 {
                // Only a full counter (2^64 - 2 unread wake-ups) refuses: it is readable then.
                let _ = rustix::io::write(wake, &1u64.to_ne_bytes());
            }
        }
    }

    /// Rank `rank`'s sleeping word (at [`SLEEPING_AT`] in its control line; a rank writes only
    /// its own).
    fn sleeping(&self, rank: usize) -> &AtomicU32 {
        self.control(rank, SLEEPING_AT)
    }

    /// Says in this rank's line whether it sleeps. Set before the look that precedes a sleep,
    /// with a fence between (see [`Arena::announce`]).
    fn sleep_flag(&self, on: bool) {
        self.sleeping(self.rank)
            .store(u32::from(on), Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Says in the arena that this rank's collectives failed elsewhere (its group broke: a
    /// rank died, say, seen on the links), before it stops taking part: the ranks waiting for
    /// it then name another lost rank before this one, once its process ends.
    pub fn report_failed(&self) {
        self.report_failure(FAILED);
    }

    fn slot_ptr(&self, rank: usize, half: usize) -> *mut u8 {
        // SAFETY: within the mapping: 2·LINE·world + (2·rank + half + 1)·slot ≤ its length.
        unsafe {
            self.map
                .ptr()
                .add(2 * LINE * self.world + (2 * rank + half) * self.slot)
        }
    }

    /// Runs `plan` over `buffer` (of the plan's length, input already in place) through the
    /// arena, within `bounds`, or until `give_up` resolves (then failing as at the deadline,
    /// with the duration it gives).
    ///
    /// # Errors
    /// [`ArenaError::Failed`] (and the same failure again for every later call);
    /// [`ArenaError::PlanMismatch`] or [`ArenaError::Reduce`] for a plan that does not fit,
    /// before anything is written.
    pub async fn run(
        &mut self,
        plan: &ArenaPlan,
        buffer: &mut [u8],
        bounds: &Bounds<'_>,
        give_up: GiveUp<'_>,
    ) -> Result<(), ArenaError> {
        self.check_plan(plan, buffer.len())?;
        let buffer = Buffer {
            ptr: buffer.as_mut_ptr(),
            len: buffer.len(),
        };
        // SAFETY: every byte of a slice is initialised, and the slice is ours (borrowed
        // mutably) for the whole call.
        unsafe { self.run_over(plan, buffer, bounds, give_up, At::START) }.await
    }

    /// Runs `plan` as [`Arena::run`] does, over a buffer of its own holding `input` in the
    /// plan's input range, and returns the buffer. When the plan fills its buffer
    /// ([`ArenaPlan::fills_buffer`], decided in core: an all_gather's, a gather's root's) the
    /// rest of the buffer is never cleared: every byte of it is written once, by the reads.
    ///
    /// # Errors
    /// As [`Arena::run`]; [`ArenaError::PlanMismatch`] also for an input of another length
    /// than the plan's input range.
    pub async fn run_fresh(
        &mut self,
        plan: &ArenaPlan,
        input: &[u8],
        bounds: &Bounds<'_>,
        give_up: GiveUp<'_>,
    ) -> Result<Vec<u8>, ArenaError> {
        let mut buffer = match Fresh::start(plan, input)? {
            Fresh::Zeroed(mut buffer) => {
                self.run(plan, &mut buffer, bounds, give_up).await?;
                return Ok(buffer);
            }
            Fresh::Filled(buffer) => buffer,
        };
        let len = plan.buffer_len();
        self.check_plan(plan, len)?;
        let raw = Fresh::with_input(&mut buffer, plan, input);
        // SAFETY: the plan fills its buffer (core's check above): it draws only on bytes the
        // input or its own reads have written. The allocation is not touched otherwise (nor
        // moved: only the vector's handle is, with the future) until the run has ended.
        unsafe { self.run_over(plan, raw, bounds, give_up, At::START) }.await?;
        // SAFETY: the plan ran to its end, and a plan that fills its buffer has then written
        // every byte of it.
        unsafe { buffer.set_len(len) };
        Ok(buffer)
    }

    /// Refuses a plan that does not fit this arena or a buffer of `len` bytes, or whose
    /// reductions do not fit its reads (core's [`ArenaPlan::check_reductions`], settled when
    /// it made the plan); fails at once when an earlier collective failed.
    #[inline(always)]
    fn check_plan(&self, plan: &ArenaPlan, len: usize) -> Result<(), ArenaError> {
        let fits = self.state.failure().is_none()
            && plan.world() == self.world
            && plan.slot_bytes() == self.slot
            && len == plan.buffer_len()
            && plan.check_reductions().is_ok();
        if fits {
            return Ok(());
        }
        self.refuse_plan(plan, len)
    }

    /// [`Arena::check_plan`]'s error for a plan it refuses.
    #[cold]
    fn refuse_plan(&self, plan: &ArenaPlan, len: usize) -> Result<(), ArenaError> {
        if let Some(failure) = self.state.failure() {
            return Err(failure.clone().into());
        }
        if plan.world() != self.world || plan.slot_bytes() != self.slot || len != plan.buffer_len()
        {
            return Err(ArenaError::PlanMismatch {
                plan_world: plan.world(),
                plan_slot: plan.slot_bytes(),
            });
        }
        plan.check_reductions().map_err(ArenaError::Reduce)
    }

    /// # Safety
    /// `buffer` is writable for its length, not touched by anything else until the returned
    /// future has finished or been dropped, and its bytes that the plan draws on (its writes,
    /// its reducing reads, its local copy's source) are initialised before it draws on them:
    /// all of them for a slice, or those [`ArenaPlan::fills_buffer`] promises. `at` is where
    /// a run of this plan over this buffer stopped ([`At::START`] for a new one).
    async unsafe fn run_over(
        &mut self,
        plan: &ArenaPlan,
        buffer: Buffer,
        bounds: &Bounds<'_>,
        mut give_up: GiveUp<'_>,
        at: At,
    ) -> Result<(), ArenaError> {
        let reported = if at.is_start() { self.reported() } else { None };
        let result = match reported {
            Some(failure) => Err(failure),
            None => {
                self.phases(plan, buffer, bounds, give_up.as_mut(), at)
                    .await
            }
        };
        result.map_err(|failure| self.failed(failure))
    }

    /// A disagreement another rank reported in the arena (checked before a collective's first
    /// phase).
    fn reported(&self) -> Option<ArenaFailure> {
        reported_disagreement(self.world, self.rank, |q| {
            self.disagreed(q).load(Ordering::Acquire) == SAW_DISAGREEMENT
        })
    }

    /// Says `failure` in this rank's line, and keeps it: every later collective fails with it.
    fn failed(&mut self, failure: ArenaFailure) -> ArenaError {
        self.report_failure(match failure {
            ArenaFailure::Disagreement { .. } => SAW_DISAGREEMENT,
            _ => FAILED,
        });
        self.state.fail(failure).into()
    }

    /// The phases of `plan` over `buffer` from `at` (see [`Arena::run_over`] for what it must
    /// be): [`Arena::advance`] looks once at each wait, and [`Arena::wait`] waits where it
    /// stopped. The first wait after a synchronous run's spin ([`At::spun`]) goes to sleep at
    /// once: its budget was spent.
    async fn phases(
        &mut self,
        plan: &ArenaPlan,
        buffer: Buffer,
        bounds: &Bounds<'_>,
        mut give_up: GiveUp<'_>,
        mut at: At,
    ) -> Result<(), ArenaFailure> {
        loop {
            let stopped = (at.phase, at.published.is_some());
            let blocked = self.advance(plan, buffer, &mut at, bounds.signature, Look::Once)?;
            // Only the wait the spin was spent on sleeps at once.
            let spun =
                std::mem::take(&mut at.spun) && stopped == (at.phase, at.published.is_some());
            match blocked {
                None => return Ok(()),
                Some(Blocked::Free) => {
                    let (readers, target) = self.state.free_wait();
                    let readers = readers.to_vec();
                    self.wait(&readers, target, bounds, give_up.as_mut(), spun)
                        .await?;
                }
                Some(Blocked::Phase) => {
                    let target = self.state.phase_target();
                    let ranks = &plan.phases()[at.phase].waits_on;
                    self.wait(ranks, target, bounds, give_up.as_mut(), spun)
                        .await?;
                }
            }
        }
    }

    /// Runs the phases of `plan` over `buffer` from `at` as far as the counters allow, looking
    /// at each wait as `look` says: `None` once the plan ran to its end, else what it waits
    /// for, with `at` where it stopped (see [`Arena::run_over`] for what `buffer` must be).
    fn advance(
        &mut self,
        plan: &ArenaPlan,
        buffer: Buffer,
        at: &mut At,
        signature: u64,
        look: Look,
    ) -> Result<Option<Blocked>, ArenaFailure> {
        if at.is_start() {
            if let Some((from, to)) = plan.local_copy() {
                assert!(from.end <= buffer.len && to.start + from.len() <= buffer.len);
                // SAFETY: both in the buffer (asserted); the source is initialised (the
                // caller's promise); `copy` allows them to overlap.
                unsafe {
                    std::ptr::copy(
                        buffer.ptr.add(from.start),
                        buffer.ptr.add(to.start),
                        from.len(),
                    )
                };
            }
            at.copied = true;
        }
        while let Some(phase) = plan.phases().get(at.phase) {
            let (half, phase_no) = match at.published {
                Some(published) => published,
                None => {
                    let half = self.state.half();
                    if !phase.writes.is_empty() {
                        let (readers, target) = self.state.free_wait();
                        if !self.reached(readers, target, look) {
                            return Ok(Some(Blocked::Free));
                        }
                        let slot = self.slot_ptr(self.rank, half);
                        for w in &phase.writes {
                            // SAFETY: the plan fits the slot (checked in core: `to + len <=
                            // slot`, asserted below) and the buffer, whose bytes it draws on are
                            // initialised (the caller's promise); the slot's half is ours to
                            // write: its readers have moved on (the waits above).
                            assert!(w.to + w.from.len() <= self.slot && w.from.end <= buffer.len);
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    buffer.ptr.add(w.from.start),
                                    slot.add(w.to),
                                    w.from.len(),
                                )
                            };
                        }
                    }
                    let published = self.publish(signature, !phase.writes.is_empty(), phase);
                    at.published = Some(published);
                    published
                }
            };
            if !self.reached(&phase.waits_on, self.state.phase_target(), look) {
                return Ok(Some(Blocked::Phase));
            }
            self.check_signatures(&phase.waits_on, (half, phase_no), signature)?;
            for read in &phase.reads {
                assert!(read.from + read.to.len() <= self.slot && read.to.end <= buffer.len);
                let src = self.slot_ptr(read.peer, half);
                // SAFETY: in the mapping (checked above); the writer published this half before
                // the counter we waited for and does not write it again before we publish the
                // next phase. A misbehaving rank of the group could still change the bytes: they
                // are plain bytes to us, whatever they hold. The destination is in the buffer
                // (asserted), which is not in the mapping.
                let (incoming, dst) = unsafe {
                    (
                        src.add(read.from) as *const u8,
                        buffer.ptr.add(read.to.start),
                    )
                };
                if read.reduce {
                    let (element, op) = plan.reduction().expect("checked before the phases");
                    // SAFETY: as above; a reducing read's destination is initialised (the
                    // caller's promise), and nothing else refers to it meanwhile.
                    let (incoming, dst) = unsafe {
                        (
                            std::slice::from_raw_parts(incoming, read.to.len()),
                            std::slice::from_raw_parts_mut(dst, read.to.len()),
                        )
                    };
                    reduce_into(op, element, dst, incoming, false)
                        .expect("reductions checked before the phases");
                } else {
                    // SAFETY: as above.
                    unsafe { std::ptr::copy_nonoverlapping(incoming, dst, read.to.len()) };
                }
            }
            for fold in &phase.folds {
                self.fold(fold, plan.reduction(), half, buffer);
            }
            at.phase += 1;
            at.published = None;
        }
        Ok(None)
    }

    /// Publishes the current phase (`phase` of a plan, whose writes, if `wrote`, are in this
    /// rank's half): its signature, then its counter, then wakes the sleepers. Returns the
    /// half and the number of the phase.
    #[inline]
    fn publish(&mut self, signature: u64, wrote: bool, phase: &ArenaPhase) -> (usize, u64) {
        let (half, phase_no) = (self.state.half(), self.state.phase());
        let (tag, sig) = self.signature_words(self.rank, half);
        tag.store(u64::MAX, Ordering::Relaxed);
        sig.store(signature, Ordering::Relaxed);
        tag.store(phase_no, Ordering::Release);
        let value = self.state.posted(wrote, &phase.readers);
        self.counter(self.rank).store(value, Ordering::Release);
        self.announce();
        (half, phase_no)
    }

    /// Fails on a rank of `waits_on` whose signature of the phase `published` (its half and
    /// number), read after its counter said it published it, is not `signature`. Best effort:
    /// a rank that has moved on two phases has overwritten its signature, and is not checked
    /// here (it was by the ranks that waited on it).
    #[inline]
    fn check_signatures(
        &self,
        waits_on: &[usize],
        (half, phase_no): (usize, u64),
        signature: u64,
    ) -> Result<(), ArenaFailure> {
        for q in waits_on {
            let (tag, sig) = self.signature_words(*q, half);
            if tag.load(Ordering::Acquire) == phase_no {
                let theirs = sig.load(Ordering::Relaxed);
                if tag.load(Ordering::Acquire) == phase_no && theirs != signature {
                    return Err(ArenaFailure::Disagreement { rank: *q });
                }
            }
        }
        Ok(())
    }

    fn counter_value(&self, rank: usize) -> u32 {
        self.counter(rank).load(Ordering::Acquire)
    }

    /// What this rank knows of rank `q`'s end: its process (seen to end through its pidfd
    /// while this rank slept), then the group.
    fn lost(&self, q: usize, bounds: &Bounds<'_>) -> Option<Lost> {
        let end = if self.ended[q] {
            Some(Lost::Died)
        } else {
            (bounds.gone)(q).map(Lost::Gone)
        };
        // Read after the look at its end: what it said before it ended is seen.
        let said = self.disagreed(q).load(Ordering::Acquire);
        if said == SAW_DISAGREEMENT {
            return Some(Lost::Disagreed);
        }
        let end = end?;
        Some(if said == FAILED {
            Lost::EndedAfterFailing
        } else {
            end
        })
    }

    /// Waits until each rank of `ranks` has published `target`: polls them all (or yields)
    /// for the spin budget, then sleeps until its eventfd is written, the time core's
    /// [`ArenaWait`] names on the group's clock, or the caller gives up; after each sleep, core
    /// decides on what the counters, the clock and the ranks' processes say. Nothing is
    /// allocated unless it comes to sleeping. `spun`: the budget was spent already (by
    /// [`Arena::try_run`]), so it sleeps at once.
    async fn wait(
        &mut self,
        ranks: &[usize],
        target: u32,
        bounds: &Bounds<'_>,
        give_up: GiveUp<'_>,
        spun: bool,
    ) -> Result<(), ArenaFailure> {
        let done = |this: &Self| all_reached(ranks, target, |q| this.counter_value(q));
        if done(self) {
            return Ok(());
        }
        if spun {
            return Box::pin(self.sleep(ranks, target, bounds, give_up)).await;
        }
        // The spin budget is CPU time spent looking, on the system's clock; no deadline is
        // judged here.
        let spin = self.spin.begin(true, Instant::now());
        let mut looks = 0u32;
        loop {
            match spin.step(Instant::now()) {
                SpinStep::Poll => {
                    for _ in 0..16 {
                        if done(self) {
                            return Ok(());
                        }
                        std::hint::spin_loop();
                    }
                    looks += 1;
                    if looks % 16 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                SpinStep::Yield => {
                    std::thread::yield_now();
                    if done(self) {
                        return Ok(());
                    }
                }
                SpinStep::Sleep => break,
            }
        }
        // Boxed: every collective's future holds its waits, and the port boxes that future at
        // every call; the sleeping half (a `select!` over the wake-up, the pidfds, the clock and
        // the caller) is a large part of a wait's state, so it goes to the heap only when needed.
        Box::pin(self.sleep(ranks, target, bounds, give_up)).await
    }

    /// The rest of [`Arena::wait`] once its spin budget is spent: sleep, look, decide.
    async fn sleep(
        &mut self,
        ranks: &[usize],
        target: u32,
        bounds: &Bounds<'_>,
        mut give_up: GiveUp<'_>,
    ) -> Result<(), ArenaFailure> {
        let wait = ArenaWait::new(
            ranks.iter().map(|q| (*q, target)).collect(),
            bounds.deadline,
            bounds.timeout,
        );
        self.sleep_flag(true);
        let result = loop {
            let step = wait.step(
                |q| self.counter_value(q),
                bounds.runtime.now(),
                |q| self.lost(q, bounds),
            );
            let until = match step {
                WaitStep::Done => break Ok(()),
                WaitStep::Failed(failure) => break Err(failure),
                WaitStep::Sleep { until } => until,
            };
            let watched: Vec<usize> = wait
                .missing(|q| self.counter_value(q))
                .into_iter()
                .filter(|q| !self.ended[*q])
                .collect();
            tokio::select! {
                biased;
                after = give_up.as_mut() => {
                    break match wait.expire(|q| self.counter_value(q), after) {
                        Some(failure) => Err(failure),
                        None => Ok(()),
                    };
                }
                ready = self.woken.readable() => {
                    // One read empties the counter: every wake-up so far. A write after it
                    // is a new readiness, which clearing this one keeps. A reactor error
                    // leaves the clock to wake us (the look below runs either way).
                    if let Ok(mut ready) = ready {
                        let _ = rustix::io::read(self.woken.get_ref(), &mut [0u8; 8]);
                        ready.clear_ready();
                    }
                }
                q = an_end(&self.pidfds, &watched) => self.ended[q] = true,
                () = bounds.runtime.sleep_until(until) => {}
            }
        };
        self.sleep_flag(false);
        result
    }
}

/// The buffer a plan runs over, as the executor sees it (see [`Arena::run_over`]).
#[derive(Clone, Copy)]
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

/// The start of a run over a buffer of its own (both paths: [`Arena::run_fresh`] and
/// [`Arena::try_run_fresh`]).
enum Fresh {
    /// A plan that does not fill its buffer: the buffer zeroed, with the input in place.
    Zeroed(Vec<u8>),
    /// A plan that fills its buffer: an empty vector with room for it (never cleared).
    Filled(Vec<u8>),
}

impl Fresh {
    /// Checks `input` against the plan's input range and makes the buffer.
    fn start(plan: &ArenaPlan, input: &[u8]) -> Result<Fresh, ArenaError> {
        let (len, at) = (plan.buffer_len(), plan.input_range());
        if input.len() != at.len() || at.end > len {
            return Err(ArenaError::PlanMismatch {
                plan_world: plan.world(),
                plan_slot: plan.slot_bytes(),
            });
        }
        Ok(if plan.fills_buffer() {
            Fresh::Filled(Vec::with_capacity(len))
        } else {
            let mut buffer = vec![0u8; len];
            buffer[at].copy_from_slice(input);
            Fresh::Zeroed(buffer)
        })
    }

    /// Copies `input` into the plan's input range of a [`Fresh::Filled`] vector (checked by
    /// [`Fresh::start`]) and gives the view of the whole allocation a run goes over.
    fn with_input(buffer: &mut Vec<u8>, plan: &ArenaPlan, input: &[u8]) -> Buffer {
        let (len, at) = (plan.buffer_len(), plan.input_range());
        assert!(buffer.capacity() >= len && at.end <= len && input.len() == at.len());
        let raw = Buffer {
            ptr: buffer.as_mut_ptr(),
            len,
        };
        // SAFETY: the input range lies in the allocation (asserted above); `input` is not in
        // it (the vector is the run's own).
        unsafe { std::ptr::copy_nonoverlapping(input.as_ptr(), raw.ptr.add(at.start), at.len()) };
        raw
    }
}

// SAFETY: a `Buffer` is only a view the executor's future keeps of memory it has for the
// whole run (a borrowed slice, or a vector of the future's own); it moves with the future.
unsafe impl Send for Buffer {}

/// Whether `fd` is an eventfd (what a leader must hand out as wake-up descriptors: writing
/// 8 bytes to anything else, a file say, would change it).
fn is_eventfd(fd: &OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|target| target.as_os_str() == "anon_inode:[eventfd]")
}

/// Resolves with the first of `ranks` whose process has ended (its pidfd became readable, and
/// a look confirms it): a rank dies, and the ranks waiting for it learn it at once, without
/// looking at every awaited process after every wake-up.
fn an_end<'a>(
    pidfds: &'a [Option<AsyncFd<OwnedFd>>],
    ranks: &'a [usize],
) -> impl Future<Output = usize> + 'a {
    std::future::poll_fn(move |cx| {
        for &q in ranks {
            let Some(fd) = &pidfds[q] else { continue };
            // Polled again after a readiness the look does not confirm, so that the waker is
            // registered before this returns pending.
            while let std::task::Poll::Ready(Ok(mut ready)) = fd.poll_read_ready(cx) {
                if exited(fd.get_ref()) {
                    return std::task::Poll::Ready(q);
                }
                ready.clear_ready();
            }
        }
        std::task::Poll::Pending
    })
}

/// Whether the process behind `pidfd` has ended (its pidfd is readable).
fn exited(pidfd: &OwnedFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        pidfd,
        rustix::event::PollFlags::IN,
    )];
    matches!(rustix::event::poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 })), Ok(n) if n > 0)
        && fds[0].revents().contains(rustix::event::PollFlags::IN)
}

mod fold;
mod now;
mod signal;
#[cfg(test)]
mod tests;
