//! The group arena: one shared segment per process group on a host, through which the group's
//! ranks on this host run their collectives (the plans of
//! [`tensorwire_core::collective::arena`]), as MPI's shared-memory collectives and NCCL's SHM
//! path do.
//!
//! # Layout
//! A memfd sealed against resizing, holding one 64-byte line per rank (its phase counter), one
//! line for the arena's generation (bumped after every publication; sleepers wait on it, and
//! count themselves there) and then a slot per rank in two halves of
//! [`Arena::slot_bytes`] bytes (`arena_bytes / (2 × world)`, rounded down to 64; see
//! [`DEFAULT_ARENA_BYTES`]). The memory is shared by every rank of the group on the host, so a
//! rank that writes outside its slot harms its group's results (never another group's, never
//! memory outside the segment): ranks on one host share memory, as over the shared-memory
//! transport.
//!
//! # Setup
//! The *leader* (the lowest rank of the group on this host) makes the segment and listens on an
//! abstract Unix socket with an unguessable name ([`ArenaHost`]); the group tells every rank that
//! name, each rank's process id and host over its links (which are authenticated). Each other
//! rank connects, says its rank, and the leader checks with `SO_PEERCRED` that the process at
//! the other end runs as the same user with the process id that rank announced, then sends the
//! memfd with `SCM_RIGHTS` (as the shared-memory transport sends its rings); the rank checks the
//! leader's process id the same way, the memfd's size and seals, and maps it ([`Arena::join`]).
//!
//! # Waiting, and ranks that die or stop
//! A rank waiting for another's counter polls it for the spin budget (the shared-memory
//! transport's, [`ShmConfig::spin`](crate::ShmConfig::spin); yielding instead of polling when
//! the process may run on one core only), then sleeps with a futex on the arena's generation (on a
//! blocking thread of the runtime, so that the waiting task's thread, and other ranks polled by
//! the same task, go on running) and
//! the writer wakes sleepers only when the line says there are some. Sleeps last at most
//! [`LIVENESS_PERIOD`]; between them the waiter checks the process of the rank it waits for
//! (a `pidfd`, readable once that process has exited, `SIGKILL` included), so a dead rank is
//! named within that period ([`ArenaError::Died`]); a rank that is alive but stopped is named
//! when the collective's deadline passes ([`ArenaError::Timeout`]). Nobody spins or sleeps past
//! the deadline. A failed collective leaves the ranks out of step, so the arena refuses every
//! later one with the same error.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tensorwire_core::collective::arena::{self, reached, ArenaPlan, ArenaState, ARENA_ALIGN};
use tensorwire_core::collective::reduce_into;
use tensorwire_core::spin::{SpinPolicy, SpinStep};

use crate::mem::{self, Mapping, RING_SEALS};
use crate::sock;

/// The default size of a group's arena: 32 MiB per group and host (slots of 2 MiB a half at 8
/// ranks, 256 KiB at 64). Pages are touched only as messages use them.
pub const DEFAULT_ARENA_BYTES: usize = 32 << 20;

/// The largest arena a rank accepts.
pub const MAX_ARENA_BYTES: usize = 1 << 34;

/// How long a waiting rank sleeps at most before it checks that the rank it waits for is alive.
pub const LIVENESS_PERIOD: Duration = Duration::from_millis(20);

/// Bytes of a rank's line (its counter), and of the generation's line.
const LINE: usize = 64;

/// Why an arena could not be set up, or a collective through it failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ArenaError {
    /// Setting the arena up failed.
    #[error("setting up the group arena: {0}")]
    Setup(String),
    /// The process of a rank ended while this rank waited for it.
    #[error("rank {rank} died (its process {pid} ended) during a collective through the arena")]
    Died {
        /// The group rank.
        rank: usize,
        /// Its process id.
        pid: u32,
    },
    /// The deadline passed while this rank waited for `waiting_on`.
    #[error("timed out after {timeout:?} waiting for rank {waiting_on} in the arena")]
    Timeout {
        /// The rank whose counter did not move.
        waiting_on: usize,
        /// The collective's timeout.
        timeout: Duration,
    },
    /// The group said the rank is gone (its links ended: it shut down, or its connection
    /// broke) while this rank waited for it.
    #[error("rank {rank} is gone: {reason}")]
    Gone {
        /// The group rank.
        rank: usize,
        /// What the group knows.
        reason: String,
    },
    /// A rank ran another collective (or the same with other arguments) in the same phase:
    /// its signature differs from this rank's.
    #[error("rank {rank} ran a different collective (or other arguments) through the arena")]
    Disagreement {
        /// The group rank.
        rank: usize,
    },
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
    /// A reduction failed (a plan for the wrong element size: a bug).
    #[error("{0}")]
    Reduce(String),
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

/// Whether the process may run on one core only (then waiting sides yield, never poll).
fn one_core() -> bool {
    std::thread::available_parallelism().map_or(true, |n| n.get() == 1)
}

fn setup(what: &str) -> impl FnOnce(std::fmt::Arguments<'_>) -> ArenaError + '_ {
    move |e| ArenaError::Setup(format!("{what}: {e}"))
}

fn segment_len(world: usize, arena_bytes: usize) -> (usize, usize) {
    let slot = arena::slot_bytes(arena_bytes, world);
    (slot, LINE * (world + 1) + 2 * world * slot)
}

/// The leader's side of the setup: the segment, and the socket the other ranks fetch it from.
pub struct ArenaHost {
    listener: tokio::io::unix::AsyncFd<OwnedFd>,
    name: String,
    fd: OwnedFd,
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
        Ok(ArenaHost {
            listener,
            name,
            fd,
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
    /// `deadline`. A connection from a process that is not the rank it claims is refused and
    /// logged.
    ///
    /// # Errors
    /// [`ArenaError::Setup`] naming the ranks that did not come.
    pub async fn accept(
        self,
        rank: usize,
        pids: &[u32],
        spin: Duration,
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
                if sock::send_packet(&conn, &header, &[self.fd.as_fd()])
                    .await
                    .is_ok()
                {
                    missing[claimed] = false;
                }
            }
            Ok::<(), ArenaError>(())
        };
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, accepting).await {
            Ok(result) => result?,
            Err(_) => {
                let missing: Vec<usize> = (0..self.world).filter(|r| missing[*r]).collect();
                return Err(ArenaError::Setup(format!(
                    "ranks {missing:?} did not fetch the arena in time"
                )));
            }
        }
        Arena::over(self.fd, rank, self.world, self.arena_bytes, pids, spin)
    }
}

/// One rank's view of its group's arena: the mapping, the phase state, and the ranks'
/// processes (for liveness).
pub struct Arena {
    map: std::sync::Arc<Mapping>,
    rank: usize,
    world: usize,
    slot: usize,
    state: ArenaState,
    pids: Vec<u32>,
    pidfds: Vec<Option<OwnedFd>>,
    spin: SpinPolicy,
    broken: Option<ArenaError>,
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
    /// Fetches the segment from the leader listening on `name` (its process `leader_pid`),
    /// as `rank`, and maps it.
    ///
    /// # Errors
    /// [`ArenaError::Setup`] when the leader cannot be reached by `deadline`, is not the
    /// process announced, or sends a segment of another size or without its seals.
    pub async fn join(
        name: &str,
        rank: usize,
        pids: &[u32],
        leader: usize,
        spin: Duration,
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
            Arena::over(fd, rank, world, bytes, pids, spin)
        };
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::timeout(left, fetch).await.map_err(|_| {
            ArenaError::Setup(format!(
                "the arena's leader (rank {leader}) did not answer in time"
            ))
        })?
    }

    fn over(
        fd: OwnedFd,
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
        let me = std::process::id();
        let pidfds = pids
            .iter()
            .map(|pid| {
                if *pid == me {
                    return None;
                }
                let pid = rustix::process::Pid::from_raw(*pid as i32)?;
                rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
            })
            .collect();
        Ok(Arena {
            map: std::sync::Arc::new(map),
            rank,
            world,
            slot,
            state: ArenaState::new(),
            pids: pids.to_vec(),
            pidfds,
            spin: SpinPolicy::new(spin, one_core()),
            broken: None,
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

    /// The arena's generation (the line after the ranks'): every rank bumps it after each
    /// publication, and sleepers wait on it, so one sleep covers a wait on several ranks.
    fn generation(&self) -> &AtomicU32 {
        // SAFETY: line `world` lies in the mapping (the segment has world + 1 lines), aligned.
        unsafe { &*(self.map.ptr().add(self.world * LINE) as *const AtomicU32) }
    }

    /// How many ranks sleep on the generation (4 bytes further into its line).
    fn sleepers(&self) -> &AtomicU32 {
        // SAFETY: as in `generation`.
        unsafe { &*(self.map.ptr().add(self.world * LINE + 4) as *const AtomicU32) }
    }

    fn slot_ptr(&self, rank: usize, half: usize) -> *mut u8 {
        // SAFETY: within the mapping: LINE·world + (2·rank + half + 1)·slot ≤ its length.
        unsafe {
            self.map
                .ptr()
                .add(LINE * (self.world + 1) + (2 * rank + half) * self.slot)
        }
    }

    /// Runs `plan` over `buffer` (of the plan's length, input already in place) through the
    /// arena, failing at `deadline` (reported as `timeout`).
    ///
    /// # Errors
    /// [`ArenaError::Died`], [`ArenaError::Timeout`]; and the first error again for every
    /// later call.
    ///
    /// `gone` tells, for a rank this one waits for, whether the group knows it is gone (its
    /// links ended); it is asked between sleeps, as the rank's process is checked.
    pub async fn run(
        &mut self,
        plan: &ArenaPlan,
        buffer: &mut [u8],
        deadline: Instant,
        timeout: Duration,
        signature: u64,
        gone: &(dyn Fn(usize) -> Option<String> + Send + Sync),
    ) -> Result<(), ArenaError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        if plan.world() != self.world
            || plan.slot_bytes() != self.slot
            || buffer.len() != plan.buffer_len()
        {
            return Err(ArenaError::PlanMismatch {
                plan_world: plan.world(),
                plan_slot: plan.slot_bytes(),
            });
        }
        let result = self
            .phases(plan, buffer, deadline, timeout, signature, gone)
            .await;
        if let Err(e) = &result {
            self.broken = Some(e.clone());
        }
        result
    }

    async fn phases(
        &mut self,
        plan: &ArenaPlan,
        buffer: &mut [u8],
        deadline: Instant,
        timeout: Duration,
        signature: u64,
        gone: &(dyn Fn(usize) -> Option<String> + Send + Sync),
    ) -> Result<(), ArenaError> {
        if let Some((from, to)) = plan.local_copy() {
            buffer.copy_within(from, to.start);
        }
        for phase in plan.phases() {
            let half = self.state.half();
            if !phase.writes.is_empty() {
                let waits: Vec<(usize, u32)> = self.state.free_waits().collect();
                self.wait(&waits, deadline, timeout, gone).await?;
                let slot = self.slot_ptr(self.rank, half);
                for w in &phase.writes {
                    // SAFETY: the plan fits the slot (checked in core: `to + len <= slot`,
                    // asserted below) and the buffer; the slot's half is ours to write: its
                    // readers have moved on (the waits above).
                    assert!(w.to + w.from.len() <= self.slot && w.from.end <= buffer.len());
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            buffer[w.from.clone()].as_ptr(),
                            slot.add(w.to),
                            w.from.len(),
                        )
                    };
                }
            }
            let phase_no = self.state.phase();
            let (tag, sig) = self.signature_words(self.rank, half);
            tag.store(u64::MAX, Ordering::Relaxed);
            sig.store(signature, Ordering::Relaxed);
            tag.store(phase_no, Ordering::Release);
            let value = self.state.posted(!phase.writes.is_empty(), &phase.readers);
            self.counter(self.rank).store(value, Ordering::Release);
            self.generation().fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if self.sleepers().load(Ordering::Relaxed) > 0 {
                let _ = rustix::thread::futex::wake(
                    self.generation(),
                    rustix::thread::futex::Flags::empty(),
                    u32::MAX,
                );
            }
            let targets: Vec<(usize, u32)> = phase.waits_on.iter().map(|q| (*q, value)).collect();
            self.wait(&targets, deadline, timeout, gone).await?;
            for q in &phase.waits_on {
                // Best effort: a rank that has moved on two phases has overwritten its
                // signature, and is not checked here (it was by the ranks that waited on it).
                let (tag, sig) = self.signature_words(*q, half);
                if tag.load(Ordering::Acquire) == phase_no {
                    let theirs = sig.load(Ordering::Relaxed);
                    if tag.load(Ordering::Acquire) == phase_no && theirs != signature {
                        return Err(ArenaError::Disagreement { rank: *q });
                    }
                }
            }
            for read in &phase.reads {
                assert!(read.from + read.to.len() <= self.slot && read.to.end <= buffer.len());
                let src = self.slot_ptr(read.peer, half);
                // SAFETY: in the mapping (checked above); the writer published this half before
                // the counter we waited for and does not write it again before we publish the
                // next phase. A misbehaving rank of the group could still change the bytes: they
                // are plain bytes to us, whatever they hold.
                let incoming =
                    unsafe { std::slice::from_raw_parts(src.add(read.from), read.to.len()) };
                let dst = &mut buffer[read.to.clone()];
                if read.reduce {
                    let (element, op) = plan.reduction().ok_or_else(|| {
                        ArenaError::Reduce("a reducing read without a reduction".into())
                    })?;
                    reduce_into(op, element, dst, incoming, false)
                        .map_err(|e| ArenaError::Reduce(e.to_string()))?;
                } else {
                    dst.copy_from_slice(incoming);
                }
            }
        }
        Ok(())
    }

    /// The first of `targets` (rank, counter) not reached yet, if any.
    fn pending(&self, targets: &[(usize, u32)]) -> Option<(usize, u32)> {
        targets
            .iter()
            .copied()
            .find(|(q, target)| !reached(self.counter(*q).load(Ordering::Acquire), *target))
    }

    /// Waits until each rank of `targets` has published its counter value: polls them all (or
    /// yields) for the spin budget, then sleeps on the arena's generation in slices of
    /// [`LIVENESS_PERIOD`], checking, between them, the process of the first rank still
    /// awaited and what the group knows of it.
    async fn wait(
        &self,
        targets: &[(usize, u32)],
        deadline: Instant,
        timeout: Duration,
        gone: &(dyn Fn(usize) -> Option<String> + Send + Sync),
    ) -> Result<(), ArenaError> {
        if self.pending(targets).is_none() {
            return Ok(());
        }
        let spin = self.spin.begin(true, Instant::now());
        let mut looks = 0u32;
        loop {
            let now = Instant::now();
            match spin.step(now) {
                SpinStep::Poll => {
                    for _ in 0..16 {
                        if self.pending(targets).is_none() {
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
                    if self.pending(targets).is_none() {
                        return Ok(());
                    }
                }
                SpinStep::Sleep => break,
            }
        }
        let generation = self.generation();
        loop {
            let seen = generation.load(Ordering::SeqCst);
            let Some((q, _)) = self.pending(targets) else {
                return Ok(());
            };
            if let Some(pidfd) = &self.pidfds[q] {
                if exited(pidfd) {
                    return Err(ArenaError::Died {
                        rank: q,
                        pid: self.pids[q],
                    });
                }
            }
            if let Some(reason) = gone(q) {
                return Err(ArenaError::Gone { rank: q, reason });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ArenaError::Timeout {
                    waiting_on: q,
                    timeout,
                });
            }
            let slice = LIVENESS_PERIOD.min(deadline - now);
            let sleepers = self.sleepers();
            sleepers.fetch_add(1, Ordering::SeqCst);
            if generation.load(Ordering::SeqCst) == seen {
                // The futex sleep runs on a blocking thread, so that this task's thread (and
                // any other rank polled by the same task) goes on running.
                let map = self.map.clone();
                let at = self.world * LINE;
                let ts = rustix::thread::futex::Timespec {
                    tv_sec: slice.as_secs() as i64,
                    tv_nsec: slice.subsec_nanos() as i64,
                };
                let _ = tokio::task::spawn_blocking(move || {
                    // SAFETY: as in `generation`; the mapping lives as long as `map`.
                    let word = unsafe { &*(map.ptr().add(at) as *const AtomicU32) };
                    let _ = rustix::thread::futex::wait(
                        word,
                        rustix::thread::futex::Flags::empty(),
                        seen,
                        Some(&ts),
                    );
                })
                .await;
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire_core::collective::{ElementType, ReduceOp};

    async fn arenas(world: usize, bytes: usize) -> Vec<Arena> {
        let pids = vec![std::process::id(); world];
        let deadline = Instant::now() + Duration::from_secs(10);
        let host = ArenaHost::create(world, bytes).unwrap();
        let name = host.name().to_owned();
        let spin = Duration::from_micros(20);
        let mut joins = Vec::new();
        for r in 1..world {
            let (name, pids) = (name.clone(), pids.clone());
            joins.push(tokio::spawn(async move {
                Arena::join(&name, r, &pids, 0, spin, deadline).await
            }));
        }
        let mut out = vec![host.accept(0, &pids, spin, deadline).await.unwrap()];
        for j in joins {
            out.push(j.await.unwrap().unwrap());
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ranks_of_one_process_all_reduce_and_all_gather_through_an_arena() {
        let world = 4;
        // A small arena: every collective is chunked.
        let arenas = arenas(world, 2 * 64 * world * world).await;
        let slot = arenas[0].slot_bytes();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut tasks = Vec::new();
        for (r, mut arena) in arenas.into_iter().enumerate() {
            tasks.push(tokio::spawn(async move {
                let count = 5000;
                let mut data: Vec<u8> = (0..count)
                    .flat_map(|i| ((i * (r + 1)) as i32).to_le_bytes())
                    .collect();
                let plan =
                    arena::all_reduce(r, world, count, ElementType::I32, ReduceOp::Sum, slot)
                        .unwrap();
                arena
                    .run(
                        &plan,
                        &mut data,
                        deadline,
                        Duration::from_secs(20),
                        7,
                        &|_| None,
                    )
                    .await
                    .unwrap();
                let lens = vec![3000; world];
                let plan = arena::all_gather(r, &lens, slot).unwrap();
                let mut gathered = vec![0u8; plan.buffer_len()];
                gathered[plan.input_range()].fill(r as u8 + 1);
                arena
                    .run(
                        &plan,
                        &mut gathered,
                        deadline,
                        Duration::from_secs(20),
                        7,
                        &|_| None,
                    )
                    .await
                    .unwrap();
                let barrier = arena::barrier(r, world, slot).unwrap();
                for _ in 0..100 {
                    arena
                        .run(
                            &barrier,
                            &mut [],
                            deadline,
                            Duration::from_secs(20),
                            7,
                            &|_| None,
                        )
                        .await
                        .unwrap();
                }
                (data, gathered)
            }));
        }
        for t in tasks {
            let (data, gathered) = t.await.unwrap();
            for (i, c) in data.chunks(4).enumerate() {
                assert_eq!(i32::from_le_bytes(c.try_into().unwrap()), (i * 10) as i32);
            }
            for (q, block) in gathered.chunks(3000).enumerate() {
                assert!(block.iter().all(|b| *b == q as u8 + 1));
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rank_that_never_comes_is_named_at_the_deadline() {
        let world = 2;
        let mut arenas = arenas(world, DEFAULT_ARENA_BYTES).await;
        let slot = arenas[0].slot_bytes();
        let plan = arena::barrier(0, world, slot).unwrap();
        let timeout = Duration::from_millis(100);
        let started = Instant::now();
        let err = arenas[0]
            .run(
                &plan,
                &mut [],
                Instant::now() + timeout,
                timeout,
                0,
                &|_| None,
            )
            .await
            .unwrap_err();
        assert_eq!(
            err,
            ArenaError::Timeout {
                waiting_on: 1,
                timeout
            }
        );
        assert!(started.elapsed() < Duration::from_secs(2));
        // The arena is broken for good.
        assert_eq!(
            arenas[0]
                .run(
                    &plan,
                    &mut [],
                    Instant::now() + timeout,
                    timeout,
                    0,
                    &|_| None
                )
                .await,
            Err(err)
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_process_that_is_not_the_rank_it_claims_gets_no_arena() {
        // Rank 1 is announced with another process id than ours.
        let pids = vec![std::process::id(), 1];
        let deadline = Instant::now() + Duration::from_millis(300);
        let host = ArenaHost::create(2, DEFAULT_ARENA_BYTES).unwrap();
        let name = host.name().to_owned();
        let pids2 = pids.clone();
        let join = tokio::spawn(async move {
            Arena::join(&name, 1, &pids2, 0, Duration::ZERO, deadline).await
        });
        let err = host
            .accept(0, &pids, Duration::ZERO, deadline)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("ranks [1] did not fetch"), "{err}");
        assert!(join.await.unwrap().is_err());
    }
}
