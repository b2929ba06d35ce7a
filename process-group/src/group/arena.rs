//! The arena path: a group whose ranks all share a host runs its collectives through one shared
//! segment ([`tensorwire_transport_shm::arena`]) with the plans of
//! [`tensorwire_core::collective::arena`], instead of through its links.
//!
//! The world group decides when it connects: every rank tells the others, over the links, its
//! host ([`host_key`]) and process id. When every rank is on rank 0's host (and
//! [`CollectivePath::Arena`] is chosen, the default), rank 0 makes the segment and publishes
//! the name of the socket it hands it out on in the store, and the others fetch it; otherwise
//! no segment is made and the group keeps its links. A subgroup whose members share a host
//! makes its own segment on its first collective (its lowest rank hands it out; the socket's
//! name goes through the store, under the subgroup's name).
//!
//! Collectives through the arena run one at a time, in the order they were issued (`turn`: a fair
//! lock taken in the issuing call). Collectives whose lengths only the sender knows (all_gather,
//! gather, scatter, all_to_all, the byte broadcast) first exchange the lengths through the arena
//! too, unless core says they are known ([`BlockLens::known`]: an all_gather of equal shapes, or of
//! given lengths). What the ranks of each phase compare is core's [`Signature::word`]: one coder
//! for both paths.

use tensorwire_core::collective::arena as plans;
use tensorwire_core::collective::arena::ArenaPlan;
use tensorwire_core::collective::arena_cache::{PlanCache, PlanKey, Planned};
use tensorwire_core::ports::process_group::DeathCause;
use tensorwire_transport_shm::arena::{
    host_key, Arena, ArenaError, ArenaFailure, ArenaHost, Bounds, Gone, Unfinished, UnfinishedFresh,
};

use super::*;

mod reduce;
pub(super) use reduce::ArenaReduce;

/// The environment variable that picks the collective path: `arena` (the default: through
/// shared memory when every rank of a group is on one host) or `links`.
pub const COLLECTIVES_ENV: &str = "TENSORWIRE_COLLECTIVES";
/// The environment variable that sets [`GroupOptions::arena_bytes`]'s default.
pub const ARENA_BYTES_ENV: &str = "TENSORWIRE_ARENA_BYTES";

/// Which path a group's collectives take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectivePath {
    /// Through the group's shared-memory arena when every rank is on one host; through the
    /// links otherwise.
    Arena,
    /// Always through the links (each message over the transport).
    Links,
}

/// What [`COLLECTIVES_ENV`] and the backend option `collectives` take.
pub(crate) const PATHS: &str = "arena or links";

impl CollectivePath {
    /// `arena` or `links`, in any case, blanks around it ignored; `None` for anything else.
    pub fn parse(value: &str) -> Option<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "arena" => Some(CollectivePath::Arena),
            "links" => Some(CollectivePath::Links),
            _ => None,
        }
    }

    /// From [`COLLECTIVES_ENV`]: [`Arena`](Self::Arena) when it is unset or empty.
    ///
    /// # Errors
    /// A [`BadVariable`] naming it when it is neither `arena` nor `links`.
    pub fn from_env() -> Result<Self, BadVariable> {
        match std::env::var(COLLECTIVES_ENV) {
            Ok(v) if !v.trim().is_empty() => {
                Self::parse(&v).ok_or_else(|| BadVariable::new(COLLECTIVES_ENV, v, PATHS))
            }
            Ok(_) | Err(std::env::VarError::NotPresent) => Ok(CollectivePath::Arena),
            Err(std::env::VarError::NotUnicode(v)) => Err(BadVariable::new(
                COLLECTIVES_ENV,
                v.to_string_lossy(),
                PATHS,
            )),
        }
    }
}

/// The arena's default size: [`ARENA_BYTES_ENV`] when it is set, else
/// [`DEFAULT_ARENA_BYTES`](tensorwire_transport_shm::arena::DEFAULT_ARENA_BYTES).
///
/// # Errors
/// A [`BadVariable`] naming it when it is set to anything but a whole number of bytes.
pub fn arena_bytes_from_env() -> Result<usize, BadVariable> {
    let bytes = tensorwire_core::env::whole_number(
        ARENA_BYTES_ENV,
        |n| std::env::var(n).ok(),
        "a size in bytes",
    )?;
    Ok(
        bytes.map_or(tensorwire_transport_shm::arena::DEFAULT_ARENA_BYTES, |b| {
            usize::try_from(b).unwrap_or(usize::MAX)
        }),
    )
}

/// The spin budget of the arena's waits: the shared-memory transport's
/// ([`SPIN_ENV`](tensorwire_transport_shm::SPIN_ENV)), 20 µs when it is unset.
///
/// # Errors
/// A [`BadVariable`] naming it when it is set to anything but a whole number of microseconds.
pub(crate) fn spin_from_env() -> Result<Duration, BadVariable> {
    let spin = tensorwire_core::spin::budget_from_env(tensorwire_transport_shm::SPIN_ENV, |n| {
        std::env::var(n).ok()
    })?;
    Ok(spin.unwrap_or(Duration::from_micros(20)))
}

/// The spin budget of the arena's waits, read when an arena is joined; a bad value failed the
/// group's setup already ([`GroupOptions::new`] reads it first).
fn spin() -> Duration {
    spin_from_env().unwrap_or(Duration::from_micros(20))
}

/// Where a group stands with its arena.
pub(super) enum ArenaSlot {
    /// No arena: the links carry every collective.
    Off,
    /// A subgroup on one host, whose segment is fetched on its first collective.
    Pending {
        /// The world ranks' process ids, by group rank.
        pids: Vec<u32>,
    },
    /// Set up; with the plans of its small collectives, kept between them (core's
    /// [`PlanCache`] decides which).
    Ready(Box<Arena>, PlanCache),
    /// Setting it up failed: every collective fails with this.
    Failed(ProcessGroupError),
}

/// A collective's turn at the arena: the arena, held, and the sequence number the collective
/// took when it was issued (the link path's numbering, so errors read the same).
pub(super) struct Turn<'a> {
    slot: turn::TurnGuard<'a, ArenaSlot>,
    seq: u64,
    world: usize,
}

impl Turn<'_> {
    /// The slot size plans are made with. When the arena failed (or never came) it is the
    /// smallest a plan takes: such plans are never run ([`Group::arena_exec`] fails them with
    /// the arena's failure), but they must not fail as arguments first.
    fn slot_bytes(&self) -> usize {
        match &*self.slot {
            ArenaSlot::Ready(a, _) => a.slot_bytes(),
            _ => plans::ARENA_ALIGN * self.world,
        }
    }
}

/// What a world rank told the others when the world group connected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct HostRecord {
    pub(super) host: String,
    pub(super) pid: u32,
}

fn encode_record(host: &str, pid: u32, token: &str) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&pid.to_le_bytes());
    out.extend_from_slice(&(host.len() as u32).to_le_bytes());
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(token.as_bytes());
    out
}

fn decode_record(bytes: &[u8]) -> Option<(HostRecord, String)> {
    let pid = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?);
    let len = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?) as usize;
    let host = std::str::from_utf8(bytes.get(8..8usize.checked_add(len)?)?).ok()?;
    let token = std::str::from_utf8(bytes.get(8 + len..)?).ok()?;
    Some((
        HostRecord {
            host: host.to_owned(),
            pid,
        },
        token.to_owned(),
    ))
}

/// The group's error for a collective that failed through the arena (`pid`: a rank's process
/// id, for a death).
fn arena_error(
    collective: &'static str,
    seq: u64,
    rank: usize,
    e: ArenaError,
    pid: impl Fn(usize) -> Option<u32>,
) -> ProcessGroupError {
    let ArenaError::Failed(failure) = e else {
        return ProcessGroupError::Setup {
            rank,
            reason: e.to_string(),
        };
    };
    match failure {
        ArenaFailure::Died { rank: dead } => ProcessGroupError::PeerDied {
            rank: dead,
            reported_by: None,
            cause: DeathCause::ProcessEnded {
                pid: pid(dead),
                collective,
            },
        },
        ArenaFailure::Gone {
            rank: gone,
            why: Gone::Left,
        } => ProcessGroupError::PeerLeft {
            rank: gone,
            collective,
            seq,
        },
        // A broken group is reported as the group's own error by the caller; were it not
        // (it is kept once broken), the rank's link is what broke.
        ArenaFailure::Gone {
            rank: gone,
            why: Gone::ConnectionBroke | Gone::GroupBroken,
        } => ProcessGroupError::PeerDied {
            rank: gone,
            reported_by: None,
            cause: DeathCause::ConnectionBroke { collective },
        },
        ArenaFailure::Timeout {
            waiting_on,
            timeout,
        } => ProcessGroupError::Timeout {
            collective,
            seq,
            rank,
            waiting_on,
            timeout,
        },
        ArenaFailure::Disagreement { rank: peer } => ProcessGroupError::Mismatch {
            peer,
            collective,
            seq,
            reason: "it ran another collective, or the same with other arguments, \
                     through the group arena"
                .to_owned(),
        },
        // Its own account, attributed to it (as an abort over the links).
        ArenaFailure::DisagreementReported { rank: peer } => ProcessGroupError::PeerAborted {
            rank: peer,
            reason: "it saw ranks run different collectives, or the same with other \
                     arguments, through the group arena"
                .to_owned(),
        },
        other => ProcessGroupError::Setup {
            rank,
            reason: other.to_string(),
        },
    }
}

impl Group {
    /// The world group's arena setup, when it connects: one exchange of host and process id
    /// over the links, then, only if every rank shares rank 0's host, the segment (rank 0
    /// makes it and publishes its socket's name in the store, as a subgroup's lowest rank
    /// does). A world across hosts makes no whole-world segment.
    pub(super) async fn set_up_arena(
        &self,
        path: CollectivePath,
        arena_bytes: usize,
    ) -> Result<(), ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        if path == CollectivePath::Links || world == 1 {
            return Ok(());
        }
        let setup = |reason: String| ProcessGroupError::Setup { rank, reason };
        // Rank 0's token names this connect's key in the store, so that a key an earlier
        // world of the same name left there is never taken for this one's.
        let token = if rank == 0 {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            format!("{:x}-{:016x}", std::process::id(), h.finish())
        } else {
            String::new()
        };
        let blocks = self
            .all_gather(&encode_record(&host_key(), std::process::id(), &token))
            .await?;
        let mut records = Vec::with_capacity(world);
        let mut token = String::new();
        for (r, block) in blocks.iter().enumerate() {
            let (record, theirs) = decode_record(block)
                .ok_or_else(|| setup(format!("rank {r} sent a malformed host record")))?;
            if r == 0 {
                token = theirs;
            }
            records.push(record);
        }
        let _ = self.inner.hosts.set(records.clone());
        let one_host = records.iter().all(|r| r.host == records[0].host);
        if path != CollectivePath::Arena || !one_host {
            return Ok(());
        }
        let pids: Vec<u32> = records.iter().map(|r| r.pid).collect();
        let key = format!("tensorwire/pg/{}/world-arena/{token}", self.name());
        let Some(arena) = self.fetch_arena(&key, &pids, arena_bytes, true).await? else {
            return Ok(());
        };
        let cache = PlanCache::new(rank, world, arena.slot_bytes());
        *self
            .inner
            .arena
            .try_lock()
            .expect("nobody holds a new group's arena") = ArenaSlot::Ready(Box::new(arena), cache);
        self.inner.arena_on.store(true, Ordering::Release);
        Ok(())
    }

    /// A subgroup's arena slot, from the world's host records: pending when every member
    /// shares a host.
    pub(super) fn subgroup_arena(
        hosts: Option<&Vec<HostRecord>>,
        members: &[usize],
        path: CollectivePath,
    ) -> ArenaSlot {
        let Some(hosts) = hosts else {
            return ArenaSlot::Off;
        };
        let records: Option<Vec<&HostRecord>> = members.iter().map(|m| hosts.get(*m)).collect();
        match records {
            Some(records)
                if path == CollectivePath::Arena
                    && records.len() > 1
                    && records.iter().all(|r| r.host == records[0].host) =>
            {
                ArenaSlot::Pending {
                    pids: records.iter().map(|r| r.pid).collect(),
                }
            }
            _ => ArenaSlot::Off,
        }
    }

    /// This collective's turn at the arena, taken in the issuing call (the lock is fair, so
    /// turns come in issue order): `None` when the group runs on its links.
    /// `rounds` sequence numbers are taken now, as the link path takes them.
    pub(super) async fn arena_turn(&self, rounds: u64) -> Option<Turn<'_>> {
        if !self.inner.arena_on.load(Ordering::Acquire) {
            return None;
        }
        let seq = self.reserve(rounds);
        // Through the lock's future even when it is free (not `try_lock`): it spends the task's
        // budget of the runtime's cooperative scheduling, which is what gives the runtime (the
        // links' tasks) a turn in a loop of collectives that each complete within the spin.
        let mut slot = self.inner.arena.lock().await;
        if let ArenaSlot::Pending { pids } = &*slot {
            let pids = pids.clone();
            // Boxed: once per subgroup, and its state (a socket, a handshake) would otherwise
            // be part of every collective's future, which the port boxes at every call.
            *slot = match Box::pin(self.fetch_subgroup_arena(&pids)).await {
                Ok(arena) => {
                    let cache = PlanCache::new(self.rank(), self.size(), arena.slot_bytes());
                    ArenaSlot::Ready(Box::new(arena), cache)
                }
                Err(e) => ArenaSlot::Failed(e),
            };
        }
        Some(Turn {
            slot,
            seq,
            world: self.size(),
        })
    }

    /// A one-round collective's turn taken in the issuing call, without waiting: `None` when
    /// the arena is not set up, or held (an earlier collective's, or waited for: turns come in
    /// issue order), and then nothing is taken. Its sequence number is taken here.
    pub(super) fn try_turn(&self) -> Option<Turn<'_>> {
        let slot = self.inner.arena.try_lock()?;
        if !matches!(*slot, ArenaSlot::Ready(..)) {
            return None;
        }
        Some(Turn {
            slot,
            seq: self.reserve(1),
            world: self.size(),
        })
    }

    async fn fetch_subgroup_arena(&self, pids: &[u32]) -> Result<Arena, ProcessGroupError> {
        let key = format!("tensorwire/pg/{}/arena", self.name());
        self.fetch_arena(&key, pids, self.inner.arena_bytes, false)
            .await?
            .ok_or_else(|| ProcessGroupError::Setup {
                rank: self.rank(),
                reason: "the group's lowest rank published no arena".to_owned(),
            })
    }

    /// The group's arena, through the store under `key`: rank 0 makes the segment and
    /// publishes its socket's name, the others wait for the name and join. With `fallback`
    /// (the world group), a segment rank 0 cannot make is published as an empty name and
    /// every rank goes on without an arena (`None`), on its links, after a barrier over them
    /// (then rank 0 removes the name). Rank 0 removes the name once every rank has joined, or
    /// once the accepting failed.
    async fn fetch_arena(
        &self,
        key: &str,
        pids: &[u32],
        arena_bytes: usize,
        fallback: bool,
    ) -> Result<Option<Arena>, ProcessGroupError> {
        let rank = self.rank();
        let setup = |reason: String| ProcessGroupError::Setup { rank, reason };
        let setup_store = |doing, source| ProcessGroupError::SetupStore {
            rank,
            doing,
            source,
        };
        let removing = |source| setup_store("removing the arena's name", source);
        let store = &self.inner._store;
        let runtime = &**self.inner.mesh.runtime();
        let deadline = runtime.deadline_after(self.inner.timeout);
        if rank == 0 {
            let host = match ArenaHost::create(self.size(), arena_bytes) {
                Ok(host) => host,
                Err(e) if fallback => {
                    tracing::warn!(error = %e, "no group arena: the collectives run on the links");
                    store
                        .set(key, b"")
                        .await
                        .map_err(|e| setup_store("publishing the arena", e))?;
                    // Every rank reads the empty name before it enters this barrier (over the
                    // links: no rank has an arena), so once it is passed the key can go.
                    self.links_barrier().await?;
                    delete_name(store.as_ref(), key).await.map_err(removing)?;
                    return Ok(None);
                }
                Err(e) => return Err(setup(e.to_string())),
            };
            store
                .set(key, host.name().as_bytes())
                .await
                .map_err(|e| setup_store("publishing the arena", e))?;
            let accepted = host.accept(rank, pids, spin(), runtime, deadline).await;
            // Every rank has joined, so every rank has read the name: the key goes, and the
            // store holds nothing of the arena once it is set up. It goes too when a rank did
            // not join in time: the listener behind the name is closed, so a rank reading it
            // later could not join anyway (it fails waiting for the name instead).
            let deleted = delete_name(store.as_ref(), key).await;
            let arena = accepted.map_err(|e| setup(e.to_string()))?;
            deleted.map_err(removing)?;
            Ok(Some(arena))
        } else {
            store
                .wait(&[key], self.inner.timeout)
                .await
                .map_err(|e| setup_store("waiting for the arena", e))?;
            let name = store
                .get(key)
                .await
                .map_err(|e| setup_store("reading the arena's name", e))?;
            let name =
                String::from_utf8(name).map_err(|_| setup("a malformed arena name".into()))?;
            if name.is_empty() {
                // Rank 0 removes the name once every rank has read it (this barrier).
                if fallback {
                    self.links_barrier().await?;
                }
                return Ok(None);
            }
            Arena::join(&name, rank, pids, 0, spin(), runtime, deadline)
                .await
                .map(Some)
                .map_err(|e| setup(e.to_string()))
        }
    }

    /// Runs the plan under `key` (lent by the arena's [`PlanCache`], which makes it with `make`
    /// from the slot size the first time and keeps it if it may) over `buffer` through the
    /// arena: see [`Group::arena_exec`].
    async fn arena_run_kept(
        &self,
        turn: &mut Turn<'_>,
        collective: &'static str,
        key: Option<PlanKey>,
        make: impl FnOnce(usize) -> Result<ArenaPlan, CollectiveError>,
        buffer: Exec<'_>,
        signature: u64,
    ) -> Result<Option<Vec<u8>>, ProcessGroupError> {
        self.arena_exec(turn, collective, key, make, buffer, signature, None)
            .await
    }

    /// Runs `plan` over `buffer` through the arena in `slot`: see [`Group::arena_exec`].
    pub(super) async fn arena_run(
        &self,
        turn: &mut Turn<'_>,
        collective: &'static str,
        plan: Result<ArenaPlan, CollectiveError>,
        buffer: &mut [u8],
        signature: u64,
    ) -> Result<(), ProcessGroupError> {
        self.arena_exec(
            turn,
            collective,
            None,
            |_| plan,
            Exec::InPlace(buffer),
            signature,
            None,
        )
        .await
        .map(|_| ())
    }

    /// Runs `plan` through the arena in `slot` over a buffer of its own that starts with
    /// `input` in the plan's input range (never cleared when the plan fills it, see
    /// [`Arena::run_fresh`]): the buffer.
    async fn arena_run_fresh(
        &self,
        turn: &mut Turn<'_>,
        collective: &'static str,
        plan: Result<ArenaPlan, CollectiveError>,
        input: &[u8],
        signature: u64,
    ) -> Result<Vec<u8>, ProcessGroupError> {
        let out = self
            .arena_exec(
                turn,
                collective,
                None,
                |_| plan,
                Exec::Fresh(input),
                signature,
                None,
            )
            .await?;
        Ok(out.unwrap_or_default())
    }

    /// Runs the plan under `key` (see [`PlanCache::plan`]: lent by the cache, or made by `make`
    /// from the slot size) over `buffer` through the arena in `slot` as the collective whose
    /// [`Signature::word`] is `signature` (the arena compares it between the ranks of each
    /// phase: core's coder, as the links compare [`Signature`]s), bounded by the group's timeout
    /// on its runtime's clock and by the wait of the [`Work`] running it, if any.
    /// A failure fails every later collective through the arena with the same error; a timeout
    /// also breaks the group (as on the links: the ranks no longer agree where the collectives
    /// stand). `from`: the rest of a run [`Group::arena_now`] began (over the same buffer).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn arena_exec(
        &self,
        turn: &mut Turn<'_>,
        collective: &'static str,
        key: Option<PlanKey>,
        make: impl FnOnce(usize) -> Result<ArenaPlan, CollectiveError>,
        buffer: Exec<'_>,
        signature: u64,
        from: Option<Unfinished>,
    ) -> Result<Option<Vec<u8>>, ProcessGroupError> {
        let mesh = &self.inner.mesh;
        let (arena, cache) = match &mut *turn.slot {
            ArenaSlot::Ready(arena, cache) => (arena, cache),
            ArenaSlot::Failed(e) => return Err(e.clone()),
            ArenaSlot::Off | ArenaSlot::Pending { .. } => {
                unreachable!("a turn is handed out only for a set-up arena")
            }
        };
        let begun = matches!(buffer, Exec::FreshRest(_))
            || from.is_some_and(|f| f != Unfinished::NOT_BEGUN);
        if let (false, Some(e)) = (begun, mesh.broken()) {
            // Said in the arena before this rank stops taking part, so that the ranks still
            // waiting for it, once its process ends, name the rank that broke the group rather
            // than this one.
            arena.report_failed();
            return Err(e);
        }
        let slot = arena.slot_bytes();
        let plan = cache
            .plan(key, || make(slot))
            .map_err(|source| ProcessGroupError::Arguments { collective, source })?;
        let timeout = self.op_timeout();
        let runtime = &**mesh.runtime();
        // Subscribed now, in the collective's first poll (see `work::expired`).
        let give_up = crate::work::expired();
        tokio::pin!(give_up);
        let span = tracing::debug_span!("arena", collective, seq = turn.seq);
        let gone = |peer: usize| -> Option<Gone> {
            if mesh.broken().is_some() {
                return Some(Gone::GroupBroken);
            }
            mesh.peer_gone(peer).map(|kind| match kind {
                tensorwire_mesh::PeerStatusKind::Left => Gone::Left,
                tensorwire_mesh::PeerStatusKind::Dead => Gone::ConnectionBroke,
            })
        };
        let bounds = Bounds {
            runtime,
            deadline: runtime.deadline_after(timeout),
            timeout,
            signature,
            gone: &gone,
        };
        let result = match (buffer, from) {
            (Exec::InPlace(buffer), Some(from)) => arena
                .resume(&plan, buffer, &bounds, give_up, from)
                .instrument(span)
                .await
                .map(|()| None),
            (Exec::InPlace(buffer), None) => arena
                .run(&plan, buffer, &bounds, give_up)
                .instrument(span)
                .await
                .map(|()| None),
            (Exec::Fresh(input), _) => arena
                .run_fresh(&plan, input, &bounds, give_up)
                .instrument(span)
                .await
                .map(Some),
            (Exec::FreshRest(rest), _) => arena
                .resume_fresh(&plan, rest, &bounds, give_up)
                .instrument(span)
                .await
                .map(Some),
        };
        let e = match result {
            Ok(out) => return Ok(out),
            Err(e) => e,
        };
        // The plan is the cache's, in the slot `arena_failed` may replace.
        drop(plan);
        Err(self.arena_failed(turn, collective, e))
    }

    /// Runs the plan under `key` (as [`Group::arena_exec`] does) over `buffer` in this call,
    /// when core says it runs so ([`Planned::runs_now`](tensorwire_core::collective::arena_cache::Planned::runs_now))
    /// and for as long as the arena's waits end within their spin ([`Arena::try_run`]): `None`
    /// when it ran to its end, else what [`Group::arena_exec`] is to finish (the whole of it
    /// when it was not begun). No clock is read, nothing subscribed, no deadline made here:
    /// that is the rest's.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn arena_now(
        &self,
        turn: &mut Turn<'_>,
        collective: &'static str,
        key: Option<PlanKey>,
        make: impl FnOnce(usize) -> Result<ArenaPlan, CollectiveError>,
        buffer: &mut [u8],
        signature: u64,
    ) -> Result<Option<Unfinished>, ProcessGroupError> {
        let run = |arena: &mut Arena, plan: &ArenaPlan| arena.try_run(plan, buffer, signature);
        Ok(self
            .arena_now_with(
                turn,
                collective,
                |cache, slot| cache.plan(key, || make(slot)),
                run,
            )?
            .unwrap_or(Some(Unfinished::NOT_BEGUN)))
    }

    /// [`Group::arena_now`]'s choice and failures, with `plan` the plan's look-up in the
    /// arena's [`PlanCache`] (given the slot size) and `run` the arena's synchronous run of it:
    /// `None` when it is not run in this call (not kept, no arena, a broken group: the rest
    /// runs all of it), else what `run` gave.
    pub(super) fn arena_now_with<R>(
        &self,
        turn: &mut Turn<'_>,
        collective: &'static str,
        plan: impl FnOnce(&mut PlanCache, usize) -> Result<Planned<'_>, CollectiveError>,
        run: impl FnOnce(&mut Arena, &ArenaPlan) -> Result<R, ArenaError>,
    ) -> Result<Option<R>, ProcessGroupError> {
        let (arena, cache) = match &mut *turn.slot {
            ArenaSlot::Ready(arena, cache) => (arena, cache),
            _ => return Ok(None),
        };
        if self.inner.mesh.is_broken() {
            // The rest says so in the arena, as every collective does.
            return Ok(None);
        }
        let slot = arena.slot_bytes();
        let plan = plan(cache, slot)
            .map_err(|source| ProcessGroupError::Arguments { collective, source })?;
        if !plan.runs_now() {
            return Ok(None);
        }
        let e = match run(arena, &plan) {
            Ok(ran) => return Ok(Some(ran)),
            Err(e) => e,
        };
        drop(plan);
        Err(self.arena_failed(turn, collective, e))
    }

    /// The error of a collective through the arena that failed with `e`: a failure of the
    /// arena's fails every later collective through it with the same error, and a timeout also
    /// breaks the group.
    fn arena_failed(
        &self,
        turn: &mut Turn<'_>,
        collective: &'static str,
        e: ArenaError,
    ) -> ProcessGroupError {
        let (seq, mesh) = (turn.seq, &self.inner.mesh);
        let ArenaSlot::Ready(arena, _) = &*turn.slot else {
            unreachable!("a run failed on a set-up arena")
        };
        let failed = matches!(e, ArenaError::Failed(_));
        let error = match (e, mesh.broken()) {
            (ArenaError::Failed(ArenaFailure::Gone { .. }), Some(broken)) => broken,
            // A rank that died, left or aborted is named by its world rank, as the links name
            // it (the arena numbers its ranks as the group does, which in a subgroup or a
            // hierarchy's internal group is not the world's).
            (e, _) => match arena_error(collective, seq, self.rank(), e, |r| arena.pid(r)) {
                ProcessGroupError::PeerDied {
                    rank,
                    reported_by,
                    cause,
                } => ProcessGroupError::PeerDied {
                    rank: self.world_rank(rank),
                    reported_by,
                    cause,
                },
                ProcessGroupError::PeerLeft {
                    rank,
                    collective,
                    seq,
                } => ProcessGroupError::PeerLeft {
                    rank: self.world_rank(rank),
                    collective,
                    seq,
                },
                ProcessGroupError::PeerAborted { rank, reason } => ProcessGroupError::PeerAborted {
                    rank: self.world_rank(rank),
                    reason,
                },
                other => other,
            },
        };
        if failed {
            if matches!(error, ProcessGroupError::Timeout { .. }) {
                mesh.fail(error.clone());
            }
            *turn.slot = ArenaSlot::Failed(error.clone());
        }
        error
    }

    /// Every rank's value of `mine.len()` bytes (the same on every rank), through the arena,
    /// as the round of `signature`.
    async fn arena_lengths(
        &self,
        turn: &mut Turn<'_>,
        collective: &'static str,
        signature: Signature,
        mine: &[u8],
    ) -> Result<Vec<u8>, ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        let lens = vec![mine.len(); world];
        let mut buffer = vec![0u8; mine.len() * world];
        buffer[rank * mine.len()..(rank + 1) * mine.len()].copy_from_slice(mine);
        self.arena_run_kept(
            turn,
            collective,
            PlanKey::all_gather(&lens),
            |s| plans::all_gather(rank, &lens, s),
            Exec::InPlace(&mut buffer),
            signature.word(&[mine.len()]),
        )
        .await?;
        Ok(buffer)
    }

    pub(super) async fn arena_barrier(&self, turn: &mut Turn<'_>) -> Result<(), ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        self.arena_run_kept(
            turn,
            "barrier",
            PlanKey::barrier(),
            |s| plans::barrier(rank, world, s),
            Exec::InPlace(&mut []),
            barrier_word(),
        )
        .await
        .map(|_| ())
    }

    pub(super) async fn arena_all_reduce(
        &self,
        turn: &mut Turn<'_>,
        data: &mut [u8],
        element: ElementType,
        op: ReduceOp,
    ) -> Result<(), ProcessGroupError> {
        let count = whole_elements("all_reduce", data.len(), element)?;
        let (rank, world) = (self.rank(), self.size());
        self.arena_run_kept(
            turn,
            "all_reduce",
            PlanKey::all_reduce(count, element, op),
            |s| plans::all_reduce(rank, world, count, element, op, s),
            Exec::InPlace(data),
            Signature::AllReduce {
                op,
                element,
                count: count as u64,
            }
            .word(&[]),
        )
        .await?;
        op.finish(element, data, self.size());
        Ok(())
    }

    pub(super) async fn arena_reduce(
        &self,
        turn: &mut Turn<'_>,
        data: &mut [u8],
        element: ElementType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), ProcessGroupError> {
        let r = ArenaReduce::new(self, data.len(), element, op, root)?;
        if r.at_root() {
            self.arena_run_kept(
                turn,
                "reduce",
                r.key,
                r.make(),
                Exec::InPlace(data),
                r.signature,
            )
            .await?;
            op.finish(element, data, self.size());
            Ok(())
        } else {
            let mut scratch = ArenaReduce::scratch(data);
            let exec = Exec::InPlace(&mut scratch);
            self.arena_run_kept(turn, "reduce", r.key, r.make(), exec, r.signature)
                .await
                .map(|_| ())
        }
    }

    pub(super) async fn arena_broadcast(
        &self,
        turn: &mut Turn<'_>,
        data: &mut [u8],
        root: usize,
    ) -> Result<(), ProcessGroupError> {
        let signature = Signature::Broadcast {
            root: root as u32,
            len: data.len() as u64,
        };
        self.arena_broadcast_as(turn, data, root, signature).await
    }

    /// A broadcast of `data` from `root` as the round of `signature` (a broadcast's own, or
    /// the lengths round of another collective: ranks that run different ones are told).
    async fn arena_broadcast_as(
        &self,
        turn: &mut Turn<'_>,
        data: &mut [u8],
        root: usize,
        signature: Signature,
    ) -> Result<(), ProcessGroupError> {
        let (rank, world, len) = (self.rank(), self.size(), data.len());
        self.arena_run_kept(
            turn,
            signature.name(),
            PlanKey::broadcast(root, len),
            |s| plans::broadcast(rank, world, root, len, s),
            Exec::InPlace(data),
            signature.word(&[]),
        )
        .await
        .map(|_| ())
    }

    pub(super) async fn arena_broadcast_bytes(
        &self,
        turn: &mut Turn<'_>,
        data: &[u8],
        root: usize,
    ) -> Result<Bytes, ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        if root >= world {
            return Err(ProcessGroupError::Arguments {
                collective: "broadcast",
                source: CollectiveError::RootOutOfRange { root, world },
            });
        }
        let mut len = (data.len() as u64).to_le_bytes();
        let announce = Signature::BroadcastLength { root: root as u32 };
        self.arena_broadcast_as(turn, &mut len, root, announce)
            .await?;
        let len = u64::from_le_bytes(len);
        if len > MAX_BLOCK_BYTES as u64 {
            return Err(ProcessGroupError::Mismatch {
                peer: root,
                collective: "broadcast",
                seq: turn.seq,
                reason: format!("it announced {len} bytes, more than {MAX_BLOCK_BYTES}"),
            });
        }
        let mut out = if rank == root {
            data.to_vec()
        } else {
            vec![0u8; len as usize]
        };
        self.arena_broadcast(turn, &mut out, root).await?;
        Ok(out.into())
    }

    /// Every rank's announced block length, as the lengths round of `signature`, refused
    /// past [`MAX_BLOCK_BYTES`].
    async fn arena_block_lens(
        &self,
        turn: &mut Turn<'_>,
        signature: Signature,
        mine: usize,
    ) -> Result<Vec<usize>, ProcessGroupError> {
        let collective = signature.name();
        let all = self
            .arena_lengths(turn, collective, signature, &(mine as u64).to_le_bytes())
            .await?;
        let lens: Vec<u64> = all
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        check_block_lens(collective, 0, &lens, |i| i)?;
        Ok(lens.into_iter().map(|l| l as usize).collect())
    }

    /// An all_gather through the arena: with its lengths known ([`BlockLens::known`]: equal
    /// shapes, or given), its data phases alone; otherwise the lengths first. Either way each
    /// rank reads from every other as many bytes as its own lengths say, and the data phases'
    /// signature holds those lengths, so a rank of another size is told apart.
    pub(super) async fn arena_all_gather(
        &self,
        turn: &mut Turn<'_>,
        input: &[u8],
        lens: &BlockLens,
    ) -> Result<Vec<Bytes>, ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        let known = lens.known(rank, world, input.len()).map_err(|source| {
            ProcessGroupError::Arguments {
                collective: "all_gather",
                source,
            }
        })?;
        let lens = match known {
            Some(lens) => lens,
            None => {
                self.arena_block_lens(turn, Signature::AllGatherLengths, input.len())
                    .await?
            }
        };
        // The receiving buffer is never cleared: the plan writes every byte of it.
        let buffer = self
            .arena_run_kept(
                turn,
                "all_gather",
                PlanKey::all_gather(&lens),
                |s| plans::all_gather(rank, &lens, s),
                Exec::Fresh(input),
                Signature::all_gather(&lens).word(&[]),
            )
            .await?
            .unwrap_or_default();
        Ok(split(buffer.into(), &lens))
    }

    pub(super) async fn arena_gather(
        &self,
        turn: &mut Turn<'_>,
        input: &[u8],
        root: usize,
    ) -> Result<Option<Vec<Bytes>>, ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        if root >= world {
            return Err(ProcessGroupError::Arguments {
                collective: "gather",
                source: CollectiveError::RootOutOfRange { root, world },
            });
        }
        let root32 = root as u32;
        let lens = self
            .arena_block_lens(turn, Signature::GatherLengths { root: root32 }, input.len())
            .await?;
        let plan = plans::gather(rank, root, &lens, turn.slot_bytes());
        let signature = Signature::Gather { root: root32 }.word(&lens);
        if rank != root {
            self.arena_run(turn, "gather", plan, &mut input.to_vec(), signature)
                .await?;
            return Ok(None);
        }
        let buffer = self
            .arena_run_fresh(turn, "gather", plan, input, signature)
            .await?;
        Ok(Some(split(buffer.into(), &lens)))
    }

    pub(super) async fn arena_scatter(
        &self,
        turn: &mut Turn<'_>,
        blocks: &[Bytes],
        root: usize,
    ) -> Result<Bytes, ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "scatter",
            source,
        };
        if root >= world {
            return Err(arguments(CollectiveError::RootOutOfRange { root, world }));
        }
        if rank == root && blocks.len() != world {
            return Err(arguments(CollectiveError::LengthsCount {
                lens: blocks.len(),
                world,
            }));
        }
        let mut lens_bytes = vec![0u8; 8 * world];
        if rank == root {
            for (c, b) in lens_bytes.chunks_exact_mut(8).zip(blocks) {
                c.copy_from_slice(&(b.len() as u64).to_le_bytes());
            }
        }
        let announce = Signature::ScatterLengths { root: root as u32 };
        self.arena_broadcast_as(turn, &mut lens_bytes, root, announce)
            .await?;
        let lens: Vec<u64> = lens_bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        check_block_lens("scatter", 0, &lens, |_| root)?;
        let lens: Vec<usize> = lens.into_iter().map(|l| l as usize).collect();
        let plan = plans::scatter(rank, root, &lens, turn.slot_bytes());
        let signature = Signature::Scatter { root: root as u32 }.word(&lens);
        if rank == root {
            let mut buffer: Vec<u8> = blocks.iter().flat_map(|b| b.iter().copied()).collect();
            self.arena_run(turn, "scatter", plan, &mut buffer, signature)
                .await?;
            return Ok(blocks[root].clone());
        }
        let mut buffer = vec![0u8; lens[rank]];
        self.arena_run(turn, "scatter", plan, &mut buffer, signature)
            .await?;
        Ok(buffer.into())
    }

    pub(super) async fn arena_reduce_scatter(
        &self,
        turn: &mut Turn<'_>,
        input: &[u8],
        counts: &[usize],
        element: ElementType,
        op: ReduceOp,
    ) -> Result<Vec<u8>, ProcessGroupError> {
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
        let plan = plans::reduce_scatter(self.rank(), counts, element, op, turn.slot_bytes())
            .map_err(arguments)?;
        if plan.buffer_len() != input.len() {
            return Err(arguments(CollectiveError::SplitsSum {
                sum: plan.buffer_len(),
                actual: input.len(),
            }));
        }
        let output = plan.output_range();
        let signature = Signature::reduce_scatter(op, element, counts).word(counts);
        let mut buffer = input.to_vec();
        self.arena_run(turn, "reduce_scatter", Ok(plan), &mut buffer, signature)
            .await?;
        let mut out = buffer[output].to_vec();
        op.finish(element, &mut out, self.size());
        Ok(out)
    }

    pub(super) async fn arena_all_to_all(
        &self,
        turn: &mut Turn<'_>,
        inputs: &[Bytes],
        output_lens: &[usize],
    ) -> Result<Vec<Bytes>, ProcessGroupError> {
        let (rank, world) = (self.rank(), self.size());
        let arguments = |source| ProcessGroupError::Arguments {
            collective: "all_to_all",
            source,
        };
        for lens in [inputs.len(), output_lens.len()] {
            if lens != world {
                return Err(arguments(CollectiveError::LengthsCount { lens, world }));
            }
        }
        let row: Vec<u8> = inputs
            .iter()
            .flat_map(|b| (b.len() as u64).to_le_bytes())
            .collect();
        let all = self
            .arena_lengths(turn, "all_to_all", Signature::AllToAll, &row)
            .await?;
        let matrix: Vec<Vec<usize>> = all
            .chunks_exact(8 * world)
            .map(|row| {
                row.chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
                    .collect()
            })
            .collect();
        for (peer, row) in matrix.iter().enumerate() {
            if row[rank] != output_lens[peer] {
                return Err(ProcessGroupError::Mismatch {
                    peer,
                    collective: "all_to_all",
                    seq: turn.seq,
                    reason: format!(
                        "it sends {} bytes here, this rank expects {}",
                        row[rank], output_lens[peer]
                    ),
                });
            }
        }
        let plan = plans::all_to_all(rank, &matrix, turn.slot_bytes()).map_err(arguments)?;
        let cells: Vec<usize> = matrix.iter().flatten().copied().collect();
        let signature = Signature::AllToAll.word(&cells);
        let mut buffer = vec![0u8; plan.buffer_len()];
        let mut at = 0;
        for b in inputs {
            buffer[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        let output = plan.output_range();
        self.arena_run(turn, "all_to_all", Ok(plan), &mut buffer, signature)
            .await?;
        let out = Bytes::from(buffer).slice(output);
        Ok(split(out, output_lens))
    }
}

/// What a collective runs over through the arena.
pub(super) enum Exec<'b> {
    /// The caller's buffer, input in place.
    InPlace(&'b mut [u8]),
    /// A buffer of the run's own, starting with this input (see [`Arena::run_fresh`]).
    Fresh(&'b [u8]),
    /// The rest of a run over a buffer of its own that [`Arena::try_run_fresh`] began.
    FreshRest(UnfinishedFresh),
}

/// A barrier's signature word: it never changes, so it is coded once per process, not at
/// every barrier.
pub(super) fn barrier_word() -> u64 {
    static BARRIER_WORD: std::sync::LazyLock<u64> =
        std::sync::LazyLock::new(|| Signature::Barrier.word(&[]));
    *BARRIER_WORD
}

/// Removes an arena's name from the store.
async fn delete_name(store: &dyn Store, key: &str) -> Result<(), crate::StoreError> {
    store.delete_key(key).await.map(|_| ())
}

/// `bytes` cut into consecutive blocks of `lens`.
pub(super) fn split(bytes: Bytes, lens: &[usize]) -> Vec<Bytes> {
    let mut at = 0;
    lens.iter()
        .map(|len| {
            at += len;
            bytes.slice(at - len..at)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_records_round_trip_and_refuse_garbage() {
        let bytes = encode_record("boot/net/pid/1000", 42, "tensorwire-arena:ab");
        let (record, socket) = decode_record(&bytes).unwrap();
        assert_eq!(record.pid, 42);
        assert_eq!(record.host, "boot/net/pid/1000");
        assert_eq!(socket, "tensorwire-arena:ab");
        assert!(decode_record(&bytes[..6]).is_none());
        let mut long = bytes.clone();
        long[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_record(&long).is_none());
    }
}
