//! A deterministic cluster simulation of the RPC protocol, for tests and fuzzing.
//!
//! [`Cluster`] runs N [`Endpoint`]s over per-pair FIFO links (what TCP gives) with a virtual
//! clock and a small model application on every worker. A seeded workload ([`Cluster::run`])
//! makes calls (some of them nested: the callee calls a third worker before it answers),
//! `remote`s (some of whose values hold references to other values), deferred bodies (device
//! copies still running) that are supplied or abandoned, fetches, forks across workers, drops,
//! timeouts and killed workers, delivering messages in a random order that keeps each link's
//! order. After every step it checks the protocol's promises:
//!
//! - every call resolves exactly once, and no later than its deadline (the clock is advanced
//!   and `handle_timeout` called in the same step);
//! - no value is released while a live worker holds a reference to it, directly or inside a
//!   value it keeps, or while a reference to it travels inside an undelivered message (until
//!   a worker dies: a worker that dies while a fork it passed on is still unconfirmed leaves
//!   the owner unaware of that fork, which PyTorch's protocol shares);
//! - no message of a normal flow is a [`ProtocolViolation`](crate::protocol::ProtocolViolation);
//! - at the end, once every reference is dropped: if no worker died, every value was released,
//!   and every live endpoint is idle;
//! - then the cluster shuts down gracefully (every member, or one worker leaving and the rest
//!   of a dynamic group after it, some calls still in flight, fire-and-forget chains of nested
//!   calls — each hop starts the next and answers without waiting for it, some passing a
//!   reference along — members starting at random moments, sometimes one member that never
//!   starts): every member's shutdown completes exactly once and no later than its deadline;
//!   it succeeds whenever every member takes part and none died, and otherwise fails naming
//!   only workers that were missing (dead or silent; a member that gave up passes on whom it
//!   waited for); and when it succeeds, it refused no work started before every member called
//!   shutdown: every hop of every chain ran and was answered.
//!
//! A failed check panics with a message naming the seed: `TW_SIM_SEED=<seed>` replays it (see
//! the crate's tests). [`Cluster::inject`] feeds an arbitrary message from one worker, for
//! fuzzing: it must never panic, and a violation is reported, not acted on.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use crate::protocol::membership::{
    Accepted, DynMessage, DynamicMembership, MemberRecord, MembershipError, MembershipEvent,
};
use crate::protocol::{
    CallError, Endpoint, EndpointConfig, Event, Header, JoinError, JoinMessage, LostCause,
    MessageId, Payload, RRefForkData, RRefHandle, RRefId, RemoteError, RemoteErrorKind,
    RequestToken, ShutdownError, StaticJoin, Transmit, WorkerId,
};
use crate::sim::{Clock, Links, SimRng};

/// What travels through the simulated endpoints: some bytes and the references passed along.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Body {
    /// The payload.
    pub data: Vec<u8>,
    /// References passed inside the message (forked for its receiver).
    pub forks: Vec<RRefForkData>,
    /// For a method call: the reference it runs on.
    pub target: Option<RRefId>,
}

impl Payload for Body {
    fn forks(&self) -> Vec<RRefForkData> {
        self.forks.clone()
    }

    fn target(&self) -> Option<RRefId> {
        self.target
    }
}

/// A request the model application is still working on.
#[derive(Debug)]
struct Serving {
    token: RequestToken,
    /// `Some`: a `remote`, whose value is kept under this reference.
    keep_as: Option<RRefId>,
    body: Body,
    /// A nested call this request waits for before it answers.
    waits_for: Option<MessageId>,
    /// References received in the arguments (handles held while serving).
    handles: Vec<RRefHandle>,
    /// Waiting until those are confirmed: the wait, the function to run, a method's target.
    confirming: Option<(crate::protocol::WaitId, String, Option<RRefId>)>,
}

/// One worker's model application.
#[derive(Debug, Default)]
struct App {
    /// Values kept for references this worker owns, with the references each value holds.
    values: HashMap<RRefId, Vec<RRefHandle>>,
    /// References the application holds (one entry per handle).
    held: Vec<RRefHandle>,
    /// Requests being served.
    serving: Vec<Serving>,
    /// Our calls: id -> deadline (`None`: none).
    calls: HashMap<MessageId, Option<Instant>>,
    /// Our calls that resolved.
    resolved: BTreeSet<MessageId>,
    /// Deferred messages whose body is not supplied yet, with their destination.
    deferred: Vec<(MessageId, WorkerId, Body)>,
    /// Outcomes of this worker's graceful shutdown, with the step they came in.
    shutdown: Vec<(usize, Result<(), ShutdownError>)>,
}

/// Counts of what a run did, to show a workload covers what it should.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SimStats {
    /// Calls made (nested ones included).
    pub calls: usize,
    /// `remote`s made.
    pub remotes: usize,
    /// References passed to another worker.
    pub forks: usize,
    /// Values released.
    pub released: usize,
    /// Calls that failed by their deadline.
    pub timeouts: usize,
    /// Workers killed.
    pub kills: usize,
    /// Deferred bodies abandoned.
    pub abandoned: usize,
    /// References that arrived inside a reply after its call had ended (the endpoint releases
    /// them: they travel beside the body).
    pub late_reply_forks: usize,
    /// Graceful shutdowns (or leaves) that completed.
    pub shutdowns_ok: usize,
    /// Graceful shutdowns that failed naming who was missing.
    pub shutdowns_failed: usize,
    /// Workers that left a dynamic group.
    pub leaves: usize,
    /// Method calls made on values through references.
    pub method_calls: usize,
    /// Runs of a dynamic group (the others join a static group first).
    pub dynamic_groups: usize,
    /// Static joins that completed on every worker.
    pub static_joins: usize,
    /// Static joins that failed on every worker, naming the rank that never started.
    pub static_joins_failed: usize,
    /// Joins of a dynamic group that completed.
    pub joins: usize,
    /// Joins that failed (their coordinator died) or were refused.
    pub joins_failed: usize,
    /// Workers that joined again under a rank that had left.
    pub rejoins: usize,
    /// Messages from a worker no longer a member, dropped by the receiver.
    pub from_non_members: usize,
    /// Functions that waited for the references in their arguments to be confirmed.
    pub confirm_waits: usize,
    /// Hops of fire-and-forget chains run during graceful shutdowns.
    pub chain_hops: usize,
    /// Of those, waits that failed (an owner lost, a creation failed, the deadline).
    pub confirm_waits_failed: usize,
}

/// A dynamic group: every worker's membership, the membership messages in flight, and what the
/// store says.
#[derive(Debug, Default)]
struct DynGroup {
    /// `None`: not started, or gone (left, killed, or its join failed).
    ms: Vec<Option<DynamicMembership>>,
    links: Links<(WorkerId, WorkerId), DynMessage>,
    /// The rank the store names as the coordinator.
    published: WorkerId,
    /// Workers that are not members: not joined yet, joining, or left.
    outside: BTreeSet<WorkerId>,
    joining: BTreeSet<WorkerId>,
    /// Leaving: `false` while the endpoint settles, `true` once the membership leave began;
    /// with the deadline.
    leaving: BTreeMap<WorkerId, (bool, Instant)>,
    /// Workers that left at least once.
    ever_left: BTreeSet<WorkerId>,
    /// Leaves that completed, and whether each said it was the last.
    left: Vec<(WorkerId, bool)>,
}

const OP_TIMEOUT: Duration = Duration::from_secs(30);

fn sim_record(w: WorkerId) -> MemberRecord {
    MemberRecord {
        rank: w,
        addr: std::net::SocketAddr::from(([10, 0, 0, 1], 1000 + w as u16)),
        devices: crate::validate::WorkerDeviceInfo {
            name: format!("w{w}"),
            ..Default::default()
        },
    }
}

/// N endpoints, their links, a virtual clock and a model application per worker.
// A run is drawn from one seed (the proptests pass `any::<u64>()`), so proptest cannot shrink a
// failing run to fewer steps; it reports the seed, which replays exactly (`TW_SIM_SEED`).
// Kept so for now: the cure, operations as proptest strategies driven through
// `proptest-state-machine`, is a rewrite of this simulator's driver, not yet done.
#[derive(Debug)]
pub struct Cluster {
    seed: u64,
    clock: Clock,
    eps: Vec<Endpoint<Body>>,
    apps: Vec<App>,
    links: Links<(WorkerId, WorkerId), Transmit<Body>>,
    dead: BTreeSet<WorkerId>,
    /// Released values, to catch a double release.
    released: BTreeSet<RRefId>,
    stats: SimStats,
    /// Counts shutdown steps, to order outcomes.
    shutdown_step: usize,
    /// A dynamic group's membership (`None`: a static group).
    group: Option<DynGroup>,
    /// Calls made by fire-and-forget chains (caller, id), and those that failed, with why.
    chain_calls: BTreeSet<(WorkerId, MessageId)>,
    chain_failures: Vec<(WorkerId, MessageId, CallError)>,
}

const FUNCTIONS: [&str; 4] = ["echo", "fail", "slow", "nested"];

impl Cluster {
    /// `n` workers (at least 1) for the run of `seed`.
    pub fn new(n: u32, seed: u64) -> Self {
        let config = EndpointConfig {
            control_retry: Duration::from_millis(100),
            ..EndpointConfig::default()
        };
        Self {
            seed,
            clock: Clock::new(),
            eps: (0..n.max(1))
                .map(|i| Endpoint::new(i, config.clone()))
                .collect(),
            apps: (0..n.max(1)).map(|_| App::default()).collect(),
            links: Links::new(),
            dead: BTreeSet::new(),
            released: BTreeSet::new(),
            stats: SimStats::default(),
            shutdown_step: 0,
            group: None,
            chain_calls: BTreeSet::new(),
            chain_failures: Vec::new(),
        }
    }

    /// What the run did so far.
    pub fn stats(&self) -> SimStats {
        self.stats
    }

    fn n(&self) -> u32 {
        self.eps.len() as u32
    }

    /// The workers that take part: not dead, and members (in a dynamic group).
    fn alive(&self) -> Vec<WorkerId> {
        let outside = self.group.as_ref().map(|g| &g.outside);
        (0..self.n())
            .filter(|w| !self.dead.contains(w) && !outside.is_some_and(|o| o.contains(w)))
            .collect()
    }

    fn fail(&self, what: impl std::fmt::Display) -> ! {
        panic!(
            "protocol simulation, seed {} (replay with TW_SIM_SEED={}): {what}",
            self.seed, self.seed
        )
    }

    /// Runs a random workload of `steps` steps, then drops every reference and lets the
    /// cluster settle, then shuts it down gracefully, checking the promises after every step.
    pub fn run(&mut self, steps: usize) {
        let mut rng = SimRng::new(self.seed);
        let dynamic = self.n() > 1 && rng.chance(40);
        if dynamic {
            self.found_group(&mut rng);
        } else {
            self.static_join(&mut rng);
        }
        for _ in 0..steps {
            self.step(&mut rng);
            self.check();
        }
        self.finish(&mut rng);
        if dynamic {
            self.leave_all(&mut rng);
        } else {
            self.shut_down(&mut rng);
        }
    }

    /// A static group's init ([`StaticJoin`]): connections made and handshake messages
    /// delivered in a seeded order. Sometimes one rank never starts: every other worker's join
    /// fails at its deadline naming it (and then the group starts again, whole). Else every
    /// join completes, and only after rank 0 heard every worker.
    fn static_join(&mut self, rng: &mut SimRng) {
        let n = self.n();
        let absent = (n > 1 && rng.chance(10)).then(|| rng.below(n as usize) as WorkerId);
        for attempt in [absent, None] {
            if attempt.is_none() && absent.is_some() {
                self.stats.static_joins_failed += 1;
            }
            let deadline = self.clock.now() + Duration::from_secs(60);
            let mut joins: Vec<StaticJoin> = (0..n)
                .map(|r| StaticJoin::new(r, n, Some(deadline)))
                .collect();
            let mut pairs: Vec<(WorkerId, WorkerId)> = (0..n)
                .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
                .filter(|(a, b)| Some(*a) != attempt && Some(*b) != attempt)
                .collect();
            let mut queues: Links<(WorkerId, WorkerId), JoinMessage> = Links::new();
            loop {
                // Collect handshake messages (a rank that never started sends nothing).
                for (from, j) in joins.iter_mut().enumerate() {
                    while let Some((to, m)) = j.poll_transmit() {
                        if Some(from as WorkerId) != attempt && Some(to) != attempt {
                            queues.send((from as WorkerId, to), m);
                        }
                    }
                }
                let busy = queues.ready();
                if pairs.is_empty() && busy.is_empty() {
                    break;
                }
                if !pairs.is_empty() && (busy.is_empty() || rng.chance(50)) {
                    let (a, b) = pairs.swap_remove(rng.below(pairs.len()));
                    for (w, peer, dialled) in [(a, b, true), (b, a, false)] {
                        if let Err(e) = joins[w as usize].handle_connected(peer, dialled) {
                            self.fail(format!("static join: rank {w} refused rank {peer}: {e}"));
                        }
                    }
                } else {
                    let (from, to) = busy[rng.below(busy.len())];
                    if let Some(m) = queues.pop((from, to)) {
                        if let Err(e) = joins[to as usize].handle_message(from, m) {
                            self.fail(format!("static join: rank {to} refused {m:?}: {e}"));
                        }
                    }
                }
            }
            for j in &mut joins {
                j.handle_timeout(deadline);
            }
            for (r, j) in joins.iter_mut().enumerate() {
                let r = r as WorkerId;
                if Some(r) == attempt {
                    continue;
                }
                match (j.poll_outcome(), attempt) {
                    (Some(Ok(())), None) => {}
                    (Some(Err(JoinError::Timeout { missing, .. })), Some(gone))
                        if missing.contains(&gone) || (missing == [0] && r != 0) => {}
                    (other, _) => self.fail(format!(
                        "static join of {n} workers, rank {attempt:?} absent: rank {r} ended with {other:?}"
                    )),
                }
            }
        }
        self.stats.static_joins += 1;
    }

    /// A dynamic group: worker 0 founds it, some others join at once (concurrently), the rest
    /// join during the workload.
    fn found_group(&mut self, rng: &mut SimRng) {
        self.stats.dynamic_groups += 1;
        let n = self.n();
        let mut g = DynGroup {
            ms: (0..n).map(|_| None).collect(),
            outside: (1..n).collect(),
            ..DynGroup::default()
        };
        g.ms[0] = Some(DynamicMembership::found(sim_record(0), OP_TIMEOUT));
        self.group = Some(g);
        for w in 1..n {
            if rng.chance(60) {
                self.start_join(w);
            }
        }
        let deadline = self.clock.now() + OP_TIMEOUT;
        while self.group.as_ref().is_some_and(|g| !g.joining.is_empty()) {
            if self.clock.now() > deadline {
                self.fail("the first joins did not complete by their deadline");
            }
            if !self.deliver_one(rng) {
                self.advance(Duration::from_millis(100));
            }
        }
    }

    /// Worker `w` (outside the group) asks the coordinator the store names to join. A new
    /// incarnation: a fresh endpoint and application.
    fn start_join(&mut self, w: WorkerId) {
        let now = self.clock.now();
        let Some(g) = self.group.as_mut() else {
            return;
        };
        let c = g.published;
        if self.dead.contains(&w) || g.joining.contains(&w) || !g.outside.contains(&w) {
            return;
        }
        if self.dead.contains(&c) || g.ms[c as usize].is_none() {
            // The store names a coordinator that is gone (a real joiner retries later).
            return;
        }
        let rec = sim_record(w);
        let accepted = g.ms[c as usize]
            .as_mut()
            .map(|m| m.handle_connected(w, Some(&rec)));
        match accepted {
            Some(Ok(Accepted::Applicant)) => {}
            Some(Err(MembershipError::Refused { .. })) => {
                self.stats.joins_failed += 1;
                return;
            }
            other => self.fail(format!(
                "coordinator {c} took joiner {w}'s connection as {other:?}"
            )),
        }
        let mut m = DynamicMembership::join(rec, c, OP_TIMEOUT, Some(now + OP_TIMEOUT));
        let _ = m.handle_connected(c, None);
        g.ms[w as usize] = Some(m);
        g.joining.insert(w);
        if g.ever_left.contains(&w) {
            self.stats.rejoins += 1;
        }
        let config = EndpointConfig {
            control_retry: Duration::from_millis(100),
            ..EndpointConfig::default()
        };
        self.eps[w as usize] = Endpoint::new(w, config);
        self.apps[w as usize] = App::default();
        self.links.retain(|(f, t)| f != w && t != w);
        self.pump();
    }

    /// Worker `w` begins leaving: its endpoint settles, then the coordinator removes it.
    fn start_leave(&mut self, w: WorkerId) {
        let deadline = self.clock.now() + Duration::from_secs(60);
        let Some(g) = self.group.as_mut() else {
            return;
        };
        if g.leaving.contains_key(&w) || g.outside.contains(&w) || self.dead.contains(&w) {
            return;
        }
        g.leaving.insert(w, (false, deadline));
        if std::env::var_os("TW_SIM_TRACE").is_some() {
            eprintln!("worker {w} begins leaving at {:?}", self.clock.now());
        }
        self.eps[w as usize].begin_leave(Some(deadline));
        self.pump();
    }

    /// Moves leaves on: a leaver whose endpoint settled asks the coordinator.
    fn progress_leaves(&mut self) {
        let now = self.clock.now();
        let Some(g) = self.group.as_ref() else {
            return;
        };
        let settled: Vec<(WorkerId, Instant)> = g
            .leaving
            .iter()
            .filter(|(w, (asked, _))| !asked && !self.apps[**w as usize].shutdown.is_empty())
            .map(|(w, (_, d))| (*w, *d))
            .collect();
        for (w, _) in settled {
            // (A pump below may have moved this one on already.)
            let still = self
                .group
                .as_ref()
                .is_some_and(|g| matches!(g.leaving.get(&w), Some((false, _))));
            if !still || self.apps[w as usize].shutdown.is_empty() {
                continue;
            }
            let deadline = now + Duration::from_secs(60);
            if let Some((_, Err(e))) = self.apps[w as usize].shutdown.first() {
                self.fail(format!(
                    "worker {w}'s endpoint did not settle to leave: {e} {:?}; {:?}",
                    e.missing,
                    self.eps[w as usize].debug_info()
                ));
            }
            self.apps[w as usize].shutdown.clear();
            if let Some(g) = self.group.as_mut() {
                g.leaving.insert(w, (true, deadline));
                if let Some(m) = g.ms[w as usize].as_mut() {
                    m.begin_leave(now, Some(deadline));
                }
            }
            self.pump();
        }
        if let Some(g) = self.group.as_ref() {
            if let Some((w, _)) = g.leaving.iter().find(|(_, (_, d))| *d < now) {
                self.fail(format!(
                    "worker {w}'s leave is incomplete past its deadline"
                ));
            }
        }
    }

    /// The end of a dynamic group: every member leaves, at random moments; every leave
    /// completes, and exactly one says it was the last.
    fn leave_all(&mut self, rng: &mut SimRng) {
        let before = self.group.as_ref().map_or(0, |g| g.left.len());
        let mut to_leave = self.alive();
        let expected = to_leave.len();
        loop {
            self.shutdown_step += 1;
            match rng.below(10) {
                0..=2 if !to_leave.is_empty() => {
                    let w = to_leave.swap_remove(rng.below(to_leave.len()));
                    self.start_leave(w);
                }
                3 => self.advance(Duration::from_millis(200)),
                _ => {
                    if !self.deliver_one(rng) {
                        self.advance(Duration::from_millis(200));
                    }
                }
            }
            self.pump();
            self.check();
            let g = self.group.as_ref().unwrap_or_else(|| self.fail("no group"));
            if to_leave.is_empty() && g.leaving.is_empty() {
                break;
            }
        }
        let g = self.group.as_ref().unwrap_or_else(|| self.fail("no group"));
        let done = &g.left[before..];
        // The last member says so (so that its driver removes the group's store keys); one
        // removed just before may say so too (it deletes keys the last deletes anyway), and
        // nobody says so while a member stays (checked as each leave completes).
        if done.len() != expected || !done.iter().any(|(_, l)| *l) {
            self.fail(format!(
                "the group's end: {expected} members left as {done:?} (the last must say so)"
            ));
        }
        self.stats.shutdowns_ok += expected;
    }

    /// The graceful shutdown of the whole cluster (see the module docs).
    fn shut_down(&mut self, rng: &mut SimRng) {
        let alive = self.alive();
        // A dynamic group: one worker leaves first, and membership is whoever is alive.
        let dynamic = rng.chance(30);
        if dynamic && alive.len() > 1 {
            let leaver = alive[rng.below(alive.len())];
            self.leave(leaver, rng);
        }
        let alive = self.alive();
        let silent = (alive.len() > 1 && rng.chance(20)).then(|| alive[rng.below(alive.len())]);
        let members: Vec<WorkerId> = if dynamic {
            alive.clone()
        } else {
            (0..self.n()).collect()
        };
        let healthy = silent.is_none() && members.iter().all(|m| !self.dead.contains(m));
        // Some calls still in flight as the shutdown begins.
        for _ in 0..rng.below(4) {
            let (w, to) = (alive[rng.below(alive.len())], alive[rng.below(alive.len())]);
            let function = ["echo", "slow", "nested"][rng.below(3)];
            self.call(w, to, function, Body::default(), Duration::from_secs(5));
        }
        // Fire-and-forget chains, some passing a reference along hop after hop.
        self.chain_calls.clear();
        self.chain_failures.clear();
        for _ in 0..rng.below(4) {
            let (w, to) = (alive[rng.below(alive.len())], alive[rng.below(alive.len())]);
            let hops = rng.below(16) as u8;
            let mut handles = Vec::new();
            if rng.chance(50) {
                if let Ok(h) = self.eps[w as usize].local_rref() {
                    self.apps[w as usize].values.insert(h.rref, Vec::new());
                    handles.push(h);
                }
            }
            self.start_chain(w, to, hops, &handles);
            for h in handles {
                self.eps[w as usize].drop_handle(h, self.clock.now());
            }
        }
        // Room for every chain hop (the clock moves 200 ms in one step of ten).
        let deadline = self.clock.now() + Duration::from_secs(120);
        let mut to_start: Vec<WorkerId> = alive
            .iter()
            .copied()
            .filter(|w| Some(*w) != silent)
            .collect();
        let participants = to_start.clone();
        loop {
            self.shutdown_step += 1;
            match rng.below(10) {
                0..=2 if !to_start.is_empty() => {
                    let w = to_start.swap_remove(rng.below(to_start.len()));
                    self.eps[w as usize]
                        .begin_graceful_shutdown(members.iter().copied(), Some(deadline));
                }
                3 => {
                    let w = alive[rng.below(alive.len())];
                    self.finish_slow_request(w, rng);
                }
                4 => self.advance(Duration::from_millis(200)),
                _ => {
                    self.pump();
                    self.deliver_one(rng);
                }
            }
            self.pump();
            self.check();
            let done = |c: &Self| {
                participants
                    .iter()
                    .all(|w| !c.apps[*w as usize].shutdown.is_empty())
            };
            if self.clock.now() >= deadline && !done(self) {
                self.fail(format!(
                    "a shutdown is still incomplete at its deadline: {:?}",
                    participants
                        .iter()
                        .map(|w| (w, self.eps[*w as usize].shutdown_phase()))
                        .collect::<Vec<_>>()
                ));
            }
            if to_start.is_empty() && done(self) {
                break;
            }
        }
        // Every outcome: exactly one per participant; success when healthy; otherwise a
        // failure that names only workers that were missing (dead or silent: a member that
        // gave up passes on whom it waited for).
        let mut outcomes: Vec<(usize, WorkerId, Result<(), ShutdownError>)> = participants
            .iter()
            .map(|w| {
                let got = &self.apps[*w as usize].shutdown;
                if got.len() != 1 {
                    self.fail(format!(
                        "worker {w}'s shutdown completed {} times",
                        got.len()
                    ));
                }
                (got[0].0, *w, got[0].1.clone())
            })
            .collect();
        outcomes.sort_by_key(|(step, w, _)| (*step, *w));
        if healthy && !self.chain_failures.is_empty() {
            self.fail(format!(
                "the shutdown refused work started before every member called it: chain calls failed {:?}; outcomes {outcomes:?}",
                self.chain_failures
            ));
        }
        for (_, w, outcome) in &outcomes {
            match outcome {
                Ok(()) => self.stats.shutdowns_ok += 1,
                Err(e) => {
                    self.stats.shutdowns_failed += 1;
                    if healthy {
                        self.fail(format!(
                            "worker {w}'s shutdown failed though every member took part: {e} {:?}",
                            e.missing
                        ));
                    }
                    let allowed = |m: &WorkerId| self.dead.contains(m) || Some(*m) == silent;
                    if e.missing.is_empty() || !e.missing.iter().all(allowed) {
                        self.fail(format!(
                            "worker {w}'s shutdown failed naming {:?}; dead {:?}, silent {silent:?}",
                            e.missing, self.dead
                        ));
                    }
                }
            }
        }
    }

    /// Worker `w` leaves a dynamic group: its own calls are answered first, then it goes (the
    /// others see it as lost, as when its connections close).
    fn leave(&mut self, w: WorkerId, rng: &mut SimRng) {
        self.call(
            w,
            self.alive()[rng.below(self.alive().len())],
            "echo",
            Body::default(),
            Duration::from_secs(5),
        );
        let deadline = self.clock.now() + Duration::from_secs(10);
        self.eps[w as usize].begin_leave(Some(deadline));
        while self.apps[w as usize].shutdown.is_empty() {
            if self.clock.now() >= deadline {
                self.fail(format!("worker {w}'s leave is incomplete at its deadline"));
            }
            self.shutdown_step += 1;
            if rng.chance(20) {
                self.advance(Duration::from_millis(200));
            } else {
                self.pump();
                self.deliver_one(rng);
            }
            self.pump();
            if self.links.is_empty() {
                self.advance(Duration::from_millis(200));
            }
        }
        if let Some((_, Err(e))) = self.apps[w as usize].shutdown.first() {
            self.fail(format!("worker {w}'s leave failed: {e}"));
        }
        self.stats.leaves += 1;
        self.stats.shutdowns_ok += 1;
        self.apps[w as usize].shutdown.clear();
        // Gone: nothing it still holds counts any more, as for a killed worker, but the values
        // it kept for others were all released (the cluster had settled).
        self.dead.insert(w);
        self.links.retain(|(f, t)| f != w && t != w);
        for other in self.alive() {
            self.eps[other as usize].handle_peer_lost(w, LostCause::Left, self.clock.now());
        }
        self.pump();
    }

    fn step(&mut self, rng: &mut SimRng) {
        #[cfg(test)]
        for ep in &self.eps {
            assert!(
                ep.reference_counts_agree(),
                "worker {}: the references counted per peer disagree with its fork records",
                ep.id()
            );
        }
        let alive = self.alive();
        if alive.is_empty() {
            // (A dynamic group whose members all went: only messages and timers move.)
            if !self.deliver_one(rng) {
                self.advance(Duration::from_millis(30));
            }
            return;
        }
        let w = alive[rng.below(alive.len())];
        if self
            .group
            .as_ref()
            .is_some_and(|g| g.leaving.contains_key(&w))
        {
            // A worker that is leaving starts no new work; it only answers.
            match rng.below(4) {
                0 => self.finish_slow_request(w, rng),
                1 => self.advance(Duration::from_millis(30)),
                _ => {
                    self.deliver_one(rng);
                }
            }
            self.pump();
            return;
        }
        let to = alive[rng.below(alive.len())];
        let timeout = match rng.below(4) {
            0 => Duration::ZERO,
            1 => Duration::from_millis(50),
            _ => Duration::from_secs(5),
        };
        match rng.below(100) {
            0..=14 => self.call(w, to, FUNCTIONS[rng.below(4)], Body::default(), timeout),
            15..=24 => {
                // A remote, maybe holding forks of references this worker holds.
                let forks = self.forks_of_some(w, to, rng);
                let function = if rng.chance(10) { "broken" } else { "make" };
                let body = Body {
                    data: vec![1],
                    forks,
                    target: None,
                };
                if rng.chance(25) {
                    self.remote_deferred(w, to, function, body, timeout);
                } else {
                    self.remote(w, to, function, body, timeout);
                }
            }
            25..=32 => {
                // Pass references to another worker, which keeps them.
                let forks = self.forks_of_some(w, to, rng);
                if !forks.is_empty() {
                    let body = Body {
                        data: vec![],
                        forks,
                        target: None,
                    };
                    self.call(w, to, "keep", body, timeout);
                }
            }
            65..=69 => {
                // A method call on a value through a reference: the owner runs it only once
                // the value exists (the application checks), however early it arrives.
                // (Through a handle the endpoint still knows: one whose owner was lost is
                // forgotten, and the rank may have joined again since as another worker.)
                let known = |c: &Self, h: RRefHandle| c.eps[w as usize].is_confirmed(h).is_some();
                if let Some(h) = self.pick_held(w, rng).filter(|h| known(self, *h)) {
                    let body = Body {
                        target: Some(h.rref),
                        ..Body::default()
                    };
                    self.call(w, h.owner, "method", body, timeout);
                    self.stats.method_calls += 1;
                }
            }
            33..=38 => {
                if let Some(h) = self.pick_held(w, rng) {
                    if let Ok(id) = self.eps[w as usize].fetch(h, timeout, self.clock.now()) {
                        self.track_call(w, id, timeout);
                    }
                }
            }
            39..=50 => {
                let held = &mut self.apps[w as usize].held;
                if !held.is_empty() {
                    let h = held.swap_remove(rng.below(held.len()));
                    self.eps[w as usize].drop_handle(h, self.clock.now());
                }
            }
            51..=54 => {
                // A deferred body is ready, or its copy failed.
                let deferred = &mut self.apps[w as usize].deferred;
                if !deferred.is_empty() {
                    let (id, to, body) = deferred.swap_remove(rng.below(deferred.len()));
                    if rng.chance(20) {
                        self.stats.abandoned += 1;
                        let ep = &mut self.eps[w as usize];
                        ep.abandon(id, "copy failed", self.clock.now());
                        // The references inside never leave: undo their forks.
                        for f in body.forks {
                            ep.cancel_fork(f, to, self.clock.now());
                        }
                    } else {
                        self.eps[w as usize].supply_body(id, body);
                    }
                }
            }
            55..=59 => self.finish_slow_request(w, rng),
            60..=63 => self.advance(Duration::from_millis(30)),
            64 if self.dead.is_empty()
                && alive.len() > 2
                && (self.group.is_none() || self.staying() > 2)
                && rng.chance(30) =>
            {
                self.kill(w)
            }
            70..=72 if self.group.is_some() => {
                // A worker outside the group (never joined, or left) joins.
                let outside: Vec<WorkerId> = self
                    .group
                    .as_ref()
                    .map(|g| g.outside.iter().copied().collect())
                    .unwrap_or_default();
                if !outside.is_empty() {
                    self.start_join(outside[rng.below(outside.len())]);
                }
            }
            73..=74 if self.staying() > 1 => self.start_leave(w),
            _ => {
                self.pump();
                self.deliver_one(rng);
            }
        }
        self.pump();
    }

    /// Forks of up to two references `w` holds, for worker `to`.
    fn forks_of_some(&mut self, w: WorkerId, to: WorkerId, rng: &mut SimRng) -> Vec<RRefForkData> {
        let mut forks = Vec::new();
        for _ in 0..rng.below(3) {
            if let Some(h) = self.pick_held(w, rng) {
                if let Ok(f) = self.eps[w as usize].fork_for(h, to) {
                    forks.push(f);
                    self.stats.forks += 1;
                }
            }
        }
        forks
    }

    fn pick_held(&self, w: WorkerId, rng: &mut SimRng) -> Option<RRefHandle> {
        let held = &self.apps[w as usize].held;
        (!held.is_empty()).then(|| held[rng.below(held.len())])
    }

    fn track_call(&mut self, w: WorkerId, id: MessageId, timeout: Duration) {
        let deadline = (!timeout.is_zero()).then(|| self.clock.now() + timeout);
        if self.apps[w as usize].calls.insert(id, deadline).is_some() {
            self.fail(format!("worker {w} got message id {id} twice"));
        }
    }

    fn call(&mut self, w: WorkerId, to: WorkerId, function: &str, body: Body, timeout: Duration) {
        if let Ok(id) = self.eps[w as usize].call(to, function, body, timeout, self.clock.now()) {
            self.stats.calls += 1;
            self.track_call(w, id, timeout);
        }
    }

    fn remote(&mut self, w: WorkerId, to: WorkerId, function: &str, body: Body, timeout: Duration) {
        if let Ok((h, id)) =
            self.eps[w as usize].remote(to, function, body, timeout, self.clock.now())
        {
            self.stats.remotes += 1;
            self.track_call(w, id, timeout);
            self.apps[w as usize].held.push(h);
        }
    }

    fn remote_deferred(
        &mut self,
        w: WorkerId,
        to: WorkerId,
        function: &str,
        body: Body,
        timeout: Duration,
    ) {
        if let Ok((h, id)) =
            self.eps[w as usize].remote_deferred(to, function, timeout, self.clock.now())
        {
            self.stats.remotes += 1;
            self.track_call(w, id, timeout);
            self.apps[w as usize].held.push(h);
            self.apps[w as usize].deferred.push((id, to, body));
        }
    }

    /// Moves transmits to links and runs the applications until nothing is left locally.
    fn pump(&mut self) {
        loop {
            let mut progress = self.pump_membership();
            for w in 0..self.n() {
                while let Some(t) = self.eps[w as usize].poll_transmit() {
                    progress = true;
                    if self.dead.contains(&w) || self.is_gone(w) {
                        continue;
                    }
                    if self.dead.contains(&t.to) || self.is_gone(t.to) {
                        // As the agent's driver does when a peer has no connection.
                        self.eps[w as usize].handle_peer_lost(
                            t.to,
                            LostCause::Transport("killed".into()),
                            self.clock.now(),
                        );
                        continue;
                    }
                    if t.to == w {
                        self.fail(format!("worker {w} sent a message to itself: {t:?}"));
                    }
                    self.links.send((w, t.to), t);
                }
                while let Some(ev) = self.eps[w as usize].poll_event() {
                    progress = true;
                    if !self.dead.contains(&w) {
                        self.app(w, ev);
                    }
                }
            }
            if !progress {
                break;
            }
        }
        self.progress_leaves();
    }

    /// Members of a dynamic group that are not leaving (0 for a static group): the workload
    /// always keeps one.
    fn staying(&self) -> usize {
        self.group.as_ref().map_or(0, |g| {
            self.alive()
                .iter()
                .filter(|w| !g.leaving.contains_key(w))
                .count()
        })
    }

    /// Whether `w` has no connections: outside a dynamic group and not joining.
    fn is_gone(&self, w: WorkerId) -> bool {
        self.group
            .as_ref()
            .is_some_and(|g| g.ms.get(w as usize).is_none_or(Option::is_none))
    }

    /// Moves membership messages to their links and acts on membership events as the driver
    /// does. Returns whether anything moved.
    fn pump_membership(&mut self) -> bool {
        let mut progress = false;
        for w in 0..self.n() {
            loop {
                let Some(g) = self.group.as_mut() else {
                    return false;
                };
                let Some(m) = g.ms[w as usize].as_mut() else {
                    break;
                };
                if let Some((to, msg)) = m.poll_transmit() {
                    progress = true;
                    if g.ms.get(to as usize).is_some_and(Option::is_some) {
                        g.links.send((w, to), msg);
                    }
                    continue;
                }
                let Some(ev) = m.poll_event() else {
                    break;
                };
                progress = true;
                self.membership_event(w, ev);
            }
        }
        progress
    }

    fn membership_event(&mut self, w: WorkerId, ev: MembershipEvent) {
        let now = self.clock.now();
        if std::env::var_os("TW_SIM_TRACE").is_some() {
            eprintln!("membership event at {w}: {ev:?}");
        }
        match ev {
            MembershipEvent::Admitted { seq } => {
                self.eps[w as usize].begin_incarnation(seq);
            }
            MembershipEvent::Connect(records) => {
                let me = sim_record(w);
                for r in records {
                    let accepted = self.group.as_mut().and_then(|g| {
                        g.ms[r.rank as usize]
                            .as_mut()
                            .map(|m| m.handle_connected(w, Some(&me)))
                    });
                    let Some(g) = self.group.as_mut() else {
                        return;
                    };
                    match accepted {
                        Some(Ok(Accepted::Member)) => {
                            if let Some(m) = g.ms[w as usize].as_mut() {
                                if let Err(e) = m.handle_connected(r.rank, None) {
                                    self.fail(format!(
                                        "joiner {w} refused its own dial to {}: {e}",
                                        r.rank
                                    ));
                                }
                            }
                        }
                        None => {
                            if let Some(m) = g.ms[w as usize].as_mut() {
                                m.handle_connect_failed(r.rank, now);
                            }
                        }
                        other => self.fail(format!(
                            "member {} took joiner {w}'s connection as {other:?}",
                            r.rank
                        )),
                    }
                }
            }
            MembershipEvent::MemberAdded(r) => self.eps[w as usize].handle_peer_joined(r.rank),
            MembershipEvent::MemberRemoved { rank, left } => {
                if left {
                    self.eps[w as usize].handle_peer_lost(rank, LostCause::Left, now);
                }
                // Sends to it still waiting for their bodies are dropped by the endpoint (their
                // references went with it): the driver drops them too.
                self.apps[w as usize]
                    .deferred
                    .retain(|(_, to, _)| *to != rank);
            }
            MembershipEvent::Joined => {
                if let Some(g) = self.group.as_mut() {
                    g.joining.remove(&w);
                    g.outside.remove(&w);
                }
                self.stats.joins += 1;
            }
            MembershipEvent::JoinFailed(e) => {
                if !e.is_retryable() {
                    self.fail(format!("worker {w}'s join failed: {e}"));
                }
                self.stats.joins_failed += 1;
                self.disconnect(w);
            }
            MembershipEvent::Left { last } => {
                let calls_open = {
                    let app = &self.apps[w as usize];
                    app.calls.keys().any(|id| !app.resolved.contains(id))
                };
                // (Control messages may still be unacknowledged: a value it kept was released
                // after it settled, dropping the references inside. The others handle its
                // departure as a lost peer, which covers them.)
                if calls_open || self.eps[w as usize].outstanding_calls() > 0 {
                    self.fail(format!(
                        "worker {w} left with work outstanding: {:?}",
                        self.eps[w as usize].debug_info()
                    ));
                }
                if let Some(g) = self.group.as_mut() {
                    g.leaving.remove(&w);
                    g.ever_left.insert(w);
                    g.left.push((w, last));
                }
                self.stats.leaves += 1;
                self.disconnect(w);
                // Saying "last" ends the group (its store keys go): nobody may stay in it.
                let staying = self.staying();
                if last && staying > 0 {
                    self.fail(format!(
                        "worker {w} left as the last member while {staying} stay"
                    ));
                }
            }
            MembershipEvent::LeaveFailed(e) => self.fail(format!("worker {w}'s leave failed: {e}")),
            MembershipEvent::Coordinate => {
                if let Some(g) = self.group.as_mut() {
                    g.published = w;
                }
            }
        }
    }

    /// `w`'s connections close (it left, or its join failed): it is outside the group, and
    /// every worker that knew it sees it lost, after what it sent before (a connection
    /// delivers what was sent before it closes).
    fn disconnect(&mut self, w: WorkerId) {
        let now = self.clock.now();
        let Some(g) = self.group.as_mut() else {
            return;
        };
        g.ms[w as usize] = None;
        g.joining.remove(&w);
        g.outside.insert(w);
        g.links.retain(|(_, t)| t != w);
        self.links.retain(|(_, t)| t != w);
        let from_w: Vec<WorkerId> = g
            .links
            .iter()
            .map(|(k, _)| k)
            .chain(self.links.iter().map(|(k, _)| k))
            .filter(|(f, _)| *f == w)
            .map(|(_, t)| t)
            .collect();
        for to in from_w {
            while self
                .group
                .as_ref()
                .is_some_and(|g| g.links.is_busy((w, to)))
            {
                self.deliver_membership(w, to);
            }
            while self.links.is_busy((w, to)) {
                self.deliver(w, to);
            }
        }
        if let Some(g) = self.group.as_mut() {
            g.links.retain(|(f, _)| f != w);
        }
        self.links.retain(|(f, _)| f != w);
        for app in &mut self.apps {
            app.deferred.retain(|(_, to, _)| *to != w);
        }
        for other in 0..self.n() {
            if other == w || self.dead.contains(&other) {
                continue;
            }
            if let Some(m) = self
                .group
                .as_mut()
                .and_then(|g| g.ms[other as usize].as_mut())
            {
                m.handle_lost(w, now);
                self.eps[other as usize].handle_peer_lost(
                    w,
                    LostCause::Transport("its connection closed".into()),
                    now,
                );
            }
        }
    }

    fn accept_all(&mut self, w: WorkerId, forks: &[RRefForkData]) -> Vec<RRefHandle> {
        forks
            .iter()
            .map(|f| self.eps[w as usize].accept_fork(*f, self.clock.now()))
            .collect()
    }

    fn app(&mut self, w: WorkerId, ev: Event<Body>) {
        let now = self.clock.now();
        if std::env::var_os("TW_SIM_TRACE").is_some() {
            eprintln!("event at {w}: {ev:?}");
        }
        match ev {
            Event::Call {
                token,
                function,
                body,
                deadline,
            } => {
                let handles = self.accept_all(w, &body.forks);
                let mut serving = Serving {
                    token,
                    keep_as: None,
                    body: Body {
                        data: body.data,
                        forks: vec![],
                        target: None,
                    },
                    waits_for: None,
                    handles,
                    confirming: None,
                };
                // A function runs once the references in its arguments are confirmed (the
                // endpoint parks the wait, by the caller's deadline).
                if !serving.handles.is_empty() {
                    if let Some(wait) =
                        self.eps[w as usize].wait_confirmed(&serving.handles, deadline)
                    {
                        self.stats.confirm_waits += 1;
                        serving.confirming = Some((wait, function, body.target));
                        self.apps[w as usize].serving.push(serving);
                        return;
                    }
                }
                self.run_function(w, serving, &function, body.target);
            }
            Event::ConfirmWaitDone { wait, outcome } => {
                let serving = &mut self.apps[w as usize].serving;
                let Some(i) = serving
                    .iter()
                    .position(|s| s.confirming.as_ref().is_some_and(|c| c.0 == wait))
                else {
                    return; // answered already (the end of the run answers everything)
                };
                let mut s = serving.remove(i);
                let Some((_, function, target)) = s.confirming.take() else {
                    return;
                };
                match outcome {
                    Ok(()) => self.run_function(w, s, &function, target),
                    Err(e) => {
                        self.stats.confirm_waits_failed += 1;
                        self.answer(w, s, Err(e.to_string()));
                    }
                }
            }
            Event::Remote {
                token,
                function,
                body,
                rref,
                ..
            } => {
                let handles = self.accept_all(w, &body.forks);
                let serving = Serving {
                    token,
                    keep_as: Some(rref),
                    body: Body {
                        data: body.data,
                        forks: vec![],
                        target: None,
                    },
                    waits_for: None,
                    handles,
                    confirming: None,
                };
                // `make` values keep the references they were given; `broken` fails.
                let outcome = if function == "make" {
                    Ok(())
                } else {
                    Err("cannot make".to_owned())
                };
                self.answer(w, serving, outcome);
            }
            Event::Fetch { token, rref } => {
                let Some(inside) = self.apps[w as usize].values.get(&rref).cloned() else {
                    self.fail(format!(
                        "worker {w} was asked to serialize {rref}, which it does not keep"
                    ));
                };
                // The value's references travel with it, forked for the fetcher.
                let to = token.from();
                let forks = inside
                    .iter()
                    .filter_map(|h| self.eps[w as usize].fork_for(*h, to).ok())
                    .collect();
                self.eps[w as usize].respond(
                    token,
                    Ok(Body {
                        data: vec![2],
                        forks,
                        target: None,
                    }),
                );
            }
            Event::Completed { id, outcome } => {
                let app = &mut self.apps[w as usize];
                let Some(deadline) = app.calls.get(&id).copied() else {
                    self.fail(format!(
                        "worker {w}: call {id} completed but was never made"
                    ));
                };
                if !app.resolved.insert(id) {
                    self.fail(format!("worker {w}: call {id} resolved twice"));
                }
                let _ = deadline; // `check` holds every call to its deadline after each step.
                if let (true, Err(e)) = (self.chain_calls.contains(&(w, id)), &outcome) {
                    self.chain_failures.push((w, id, e.clone()));
                }
                match &outcome {
                    Err(CallError::Timeout { .. } | CallError::RRefCreationTimedOut { .. }) => {
                        self.stats.timeouts += 1;
                    }
                    Ok(body) if !body.forks.is_empty() => {
                        let got = self.accept_all(w, &body.forks);
                        self.apps[w as usize].held.extend(got);
                    }
                    _ => {}
                }
                // Requests waiting for this nested call can answer now.
                let serving = std::mem::take(&mut self.apps[w as usize].serving);
                let (ready, waiting): (Vec<_>, Vec<_>) =
                    serving.into_iter().partition(|s| s.waits_for == Some(id));
                self.apps[w as usize].serving = waiting;
                for s in ready {
                    self.answer(w, s, Ok(()));
                }
            }
            Event::Confirmed { .. } => {}
            Event::ShutdownComplete { outcome } => {
                let step = self.shutdown_step;
                self.apps[w as usize].shutdown.push((step, outcome));
                // The driver stops the endpoint either way (pending calls fail); a leaver's
                // once its membership leave is over.
                if !self
                    .group
                    .as_ref()
                    .is_some_and(|g| g.leaving.contains_key(&w))
                {
                    self.eps[w as usize].stop();
                }
            }
            Event::ReleaseValue { rref } => {
                let Some(inside) = self.apps[w as usize].values.remove(&rref) else {
                    self.fail(format!("worker {w} released {rref}, which it did not keep"));
                };
                if !self.released.insert(rref) {
                    self.fail(format!("{rref} released twice"));
                }
                self.stats.released += 1;
                // After a death the promise is weaker: a worker that dies while a fork it passed
                // on is unconfirmed leaves the owner unaware of that fork (as in PyTorch).
                if let Some(holder) = self.dead.is_empty().then(|| self.holder_of(rref)).flatten() {
                    self.fail(format!(
                        "worker {w} released {rref} while {holder} still refers to it; deferred {:?}",
                        self.apps.iter().map(|a| &a.deferred).collect::<Vec<_>>()
                    ));
                }
                // The value's own references go with it.
                for h in inside {
                    self.eps[w as usize].drop_handle(h, now);
                }
            }
        }
    }

    /// Runs the model function `function` for a request whose references are confirmed.
    fn run_function(
        &mut self,
        w: WorkerId,
        mut serving: Serving,
        function: &str,
        target: Option<RRefId>,
    ) {
        match function {
            "method" => {
                let target = target.unwrap_or_else(|| {
                    self.fail(format!("worker {w}: a method call without a target"))
                });
                if !self.apps[w as usize].values.contains_key(&target) {
                    self.fail(format!(
                        "worker {w} was asked to run a method on {target}, which it does not keep (yet)"
                    ));
                }
                self.answer(w, serving, Ok(()));
            }
            "slow" => self.apps[w as usize].serving.push(serving),
            "nested" => {
                // Call a third worker (or anyone) before answering.
                let alive = self.alive();
                let third = alive[(w as usize + 1) % alive.len()];
                if let Ok(id) = self.eps[w as usize].call(
                    third,
                    "echo",
                    Body::default(),
                    Duration::from_secs(1),
                    self.clock.now(),
                ) {
                    self.stats.calls += 1;
                    self.track_call(w, id, Duration::from_secs(1));
                    serving.waits_for = Some(id);
                    self.apps[w as usize].serving.push(serving);
                } else {
                    self.answer(w, serving, Ok(()));
                }
            }
            "keep" => {
                let kept = std::mem::take(&mut serving.handles);
                self.apps[w as usize].held.extend(kept);
                self.answer(w, serving, Ok(()));
            }
            "chain" => {
                // A hop of a fire-and-forget chain: start the next hop (passing on the
                // references it got) and answer at once, without waiting for it.
                self.stats.chain_hops += 1;
                let left = serving.body.data.first().copied().unwrap_or(0);
                if left > 0 {
                    let alive = self.alive();
                    let next = alive[(w as usize + 1) % alive.len()];
                    let handles = serving.handles.clone();
                    self.start_chain(w, next, left - 1, &handles);
                }
                self.answer(w, serving, Ok(()));
            }
            "fail" => self.answer(w, serving, Err("refused".into())),
            _ => self.answer(w, serving, Ok(())),
        }
    }

    /// Worker `w` calls hop `left` of a fire-and-forget chain on `to`, passing on `handles`.
    fn start_chain(&mut self, w: WorkerId, to: WorkerId, left: u8, handles: &[RRefHandle]) {
        let forks = handles
            .iter()
            .filter_map(|h| self.eps[w as usize].fork_for(*h, to).ok())
            .collect();
        let body = Body {
            data: vec![left],
            forks,
            target: None,
        };
        match self.eps[w as usize].call(to, "chain", body, Duration::ZERO, self.clock.now()) {
            Ok(id) => {
                self.stats.calls += 1;
                self.track_call(w, id, Duration::ZERO);
                self.chain_calls.insert((w, id));
            }
            Err(e) => self.chain_failures.push((w, 0, e)),
        }
    }

    /// Answers a request; a `remote` keeps the references it got inside the value.
    fn answer(&mut self, w: WorkerId, s: Serving, outcome: Result<(), String>) {
        let now = self.clock.now();
        match outcome {
            Ok(()) => {
                if let Some(rref) = s.keep_as {
                    if self.apps[w as usize]
                        .values
                        .insert(rref, s.handles)
                        .is_some()
                    {
                        self.fail(format!("worker {w} created {rref} twice"));
                    }
                    if !self.eps[w as usize].respond(s.token, Ok(s.body)) {
                        // The creator was lost meanwhile: nobody will ever refer to it.
                        let inside = self.apps[w as usize].values.remove(&rref);
                        for h in inside.into_iter().flatten() {
                            self.eps[w as usize].drop_handle(h, now);
                        }
                    }
                    return;
                }
                for h in s.handles {
                    self.eps[w as usize].drop_handle(h, now);
                }
                self.eps[w as usize].respond(s.token, Ok(s.body));
            }
            Err(message) => {
                for h in s.handles {
                    self.eps[w as usize].drop_handle(h, now);
                }
                let e = RemoteError {
                    worker: w,
                    kind: RemoteErrorKind::Failed,
                    message,
                };
                self.eps[w as usize].respond(s.token, Err(e));
            }
        }
    }

    fn finish_slow_request(&mut self, w: WorkerId, rng: &mut SimRng) {
        let serving = &mut self.apps[w as usize].serving;
        let slow: Vec<usize> = (0..serving.len())
            .filter(|i| serving[*i].waits_for.is_none() && serving[*i].confirming.is_none())
            .collect();
        if !slow.is_empty() {
            let s = serving.remove(slow[rng.below(slow.len())]);
            self.answer(w, s, Ok(()));
        }
    }

    /// Who (alive) still refers to `rref`: a handle held by an application, a handle inside a
    /// kept value or a request being served, or fork data inside an undelivered message.
    fn holder_of(&self, rref: RRefId) -> Option<String> {
        // Settled and asked to leave: what it holds, and what travels to or from it, goes
        // with it.
        let departing = |w: &WorkerId| {
            self.group
                .as_ref()
                .is_some_and(|g| matches!(g.leaving.get(w), Some((true, _))))
        };
        for w in self.alive() {
            if departing(&w) {
                continue;
            }
            let app = &self.apps[w as usize];
            let direct = app.held.iter().any(|h| h.rref == rref);
            let inside = app.values.values().flatten().any(|h| h.rref == rref);
            let serving = app
                .serving
                .iter()
                .flat_map(|s| &s.handles)
                .any(|h| h.rref == rref);
            // (A message for a worker that left never goes: its forks went with that worker.)
            let deferred = app
                .deferred
                .iter()
                .filter(|(_, to, _)| !self.is_gone(*to) && !departing(to))
                .flat_map(|(_, _, b)| &b.forks)
                .any(|f| f.rref == rref);
            if direct || inside || serving || deferred {
                let how = [
                    (direct, "a handle"),
                    (inside, "a value's reference"),
                    (serving, "a request's argument"),
                    (deferred, "an unsent message"),
                ]
                .iter()
                .filter(|(b, _)| *b)
                .map(|(_, s)| *s)
                .collect::<Vec<_>>()
                .join(", ");
                return Some(format!("worker {w} ({how})"));
            }
        }
        for ((from, to), mut queue) in self.links.iter() {
            if departing(&from) || departing(&to) || self.is_gone(from) || self.is_gone(to) {
                continue;
            }
            let carried = queue
                .by_ref()
                .filter_map(|t| t.body.as_ref())
                .flat_map(|b| &b.forks)
                .any(|f| f.rref == rref);
            if carried {
                return Some(format!("a message from {from} to {to}"));
            }
        }
        None
    }

    /// Delivers one message (of the protocol or of the membership); returns whether there
    /// was one.
    fn deliver_one(&mut self, rng: &mut SimRng) -> bool {
        let mut busy: Vec<(bool, WorkerId, WorkerId)> = self
            .links
            .ready()
            .into_iter()
            .map(|(f, t)| (false, f, t))
            .collect();
        if let Some(g) = &self.group {
            busy.extend(g.links.ready().into_iter().map(|(f, t)| (true, f, t)));
        }
        if busy.is_empty() {
            return false;
        }
        match busy[rng.below(busy.len())] {
            (false, from, to) => self.deliver(from, to),
            (true, from, to) => self.deliver_membership(from, to),
        }
        true
    }

    fn deliver_membership(&mut self, from: WorkerId, to: WorkerId) {
        let now = self.clock.now();
        let Some(g) = self.group.as_mut() else {
            return;
        };
        let Some(msg) = g.links.pop((from, to)) else {
            return;
        };
        if std::env::var_os("TW_SIM_TRACE").is_some() {
            eprintln!("deliver membership {from} -> {to}: {msg:?}");
        }
        if let Some(m) = g.ms[to as usize].as_mut() {
            if let Err(e) = m.handle_message(from, msg.clone(), now) {
                self.fail(format!(
                    "worker {to} saw a membership violation from {from} in a normal flow: {e} ({msg:?})"
                ));
            }
        }
        self.pump();
    }

    fn deliver(&mut self, from: WorkerId, to: WorkerId) {
        let Some(t) = self.links.pop((from, to)) else {
            return;
        };
        // The driver refuses calls and replies from a worker that is not a member (one that
        // left: its last messages may arrive after the coordinator said so).
        let refused = self.group.as_ref().is_some_and(|g| {
            g.ms[to as usize]
                .as_ref()
                .is_some_and(|m| !m.may_call(from))
        });
        if refused {
            self.stats.from_non_members += 1;
            return;
        }
        if let (Header::Reply { id, .. }, Some(body)) = (&t.header, &t.body) {
            let app = &self.apps[to as usize];
            if app.resolved.contains(id) && !body.forks.is_empty() {
                // A late reply: its body never reaches the application; the endpoint releases
                // the references inside (the checks at the end hold it to that).
                self.stats.late_reply_forks += body.forks.len();
            }
        }
        if std::env::var_os("TW_SIM_TRACE").is_some() {
            eprintln!("deliver {from} -> {to}: {:?} {:?}", t.header, t.body);
        }
        if let Err(v) =
            self.eps[to as usize].handle_message(from, t.header, t.body, self.clock.now())
        {
            self.fail(format!(
                "worker {to} saw a protocol violation from {from} in a normal flow: {v}"
            ));
        }
        self.pump();
    }

    /// Moves the clock and lets every endpoint handle its timers.
    pub fn advance(&mut self, d: Duration) {
        self.clock.advance(d);
        let now = self.clock.now();
        for w in 0..self.n() {
            if self.dead.contains(&w) || self.is_gone(w) {
                continue;
            }
            self.eps[w as usize].handle_timeout(now);
            if let Some(m) = self.group.as_mut().and_then(|g| g.ms[w as usize].as_mut()) {
                m.handle_timeout(now);
            }
        }
        self.pump();
    }

    fn kill(&mut self, victim: WorkerId) {
        self.stats.kills += 1;
        self.dead.insert(victim);
        self.links.retain(|(f, t)| f != victim && t != victim);
        let now = self.clock.now();
        if let Some(g) = self.group.as_mut() {
            g.ms[victim as usize] = None;
            g.leaving.remove(&victim);
            g.links.retain(|(f, t)| f != victim && t != victim);
            for m in g.ms.iter_mut().flatten() {
                m.handle_lost(victim, now);
            }
        }
        for w in 0..self.n() {
            if !self.dead.contains(&w) && !self.is_gone(w) {
                self.eps[w as usize].handle_peer_lost(
                    victim,
                    LostCause::Transport("killed".into()),
                    now,
                );
            }
        }
        self.pump();
    }

    /// The promises that hold after every step.
    fn check(&self) {
        for w in self.alive() {
            let app = &self.apps[w as usize];
            for (id, deadline) in &app.calls {
                if deadline.is_some_and(|d| self.clock.now() > d) && !app.resolved.contains(id) {
                    self.fail(format!(
                        "worker {w}: call {id} is still unresolved past its deadline"
                    ));
                }
            }
        }
    }

    /// Answers everything, supplies every deferred body, drops every reference, delivers
    /// everything and lets all timers run out; then checks that nothing was leaked.
    fn finish(&mut self, rng: &mut SimRng) {
        for round in 0..64 {
            for w in self.alive() {
                let serving = std::mem::take(&mut self.apps[w as usize].serving);
                for s in serving {
                    self.answer(w, s, Ok(()));
                }
                for (id, _, body) in std::mem::take(&mut self.apps[w as usize].deferred) {
                    self.eps[w as usize].supply_body(id, body);
                }
                for h in std::mem::take(&mut self.apps[w as usize].held) {
                    self.eps[w as usize].drop_handle(h, self.clock.now());
                }
            }
            self.pump();
            while self.deliver_one(rng) {}
            self.advance(Duration::from_secs(6));
            self.check();
            let settled = self.alive().iter().all(|w| {
                let app = &self.apps[*w as usize];
                self.eps[*w as usize].is_idle()
                    && app.serving.is_empty()
                    && app.held.is_empty()
                    && app.deferred.is_empty()
            }) && self.links.is_empty()
                && self
                    .group
                    .as_ref()
                    .is_none_or(|g| g.joining.is_empty() && g.links.is_empty());
            if settled {
                break;
            }
            if round == 63 {
                let state: Vec<String> = self
                    .alive()
                    .iter()
                    .map(|w| {
                        let app = &self.apps[*w as usize];
                        format!(
                            "worker {w}: idle {}, serving {}, held {}, deferred {}, {:?}",
                            self.eps[*w as usize].is_idle(),
                            app.serving.len(),
                            app.held.len(),
                            app.deferred.len(),
                            self.eps[*w as usize].debug_info()
                        )
                    })
                    .collect();
                self.fail(format!("the cluster did not settle: {state:#?}"));
            }
        }
        if let Some(g) = &self.group {
            // Every member's view of the group is the same: who is alive.
            for w in self.alive() {
                let view: BTreeSet<WorkerId> = g.ms[w as usize]
                    .as_ref()
                    .map(|m| m.members().iter().map(|r| r.rank).collect())
                    .unwrap_or_default();
                if view != self.alive().into_iter().collect() {
                    self.fail(format!(
                        "worker {w} sees members {view:?}; alive {:?}",
                        self.alive()
                    ));
                }
            }
        }
        for w in self.alive() {
            let app = &self.apps[w as usize];
            if let Some(id) = app.calls.keys().find(|id| !app.resolved.contains(id)) {
                self.fail(format!("worker {w}: call {id} never resolved"));
            }
            let leaked: Vec<&RRefId> = app.values.keys().collect();
            if self.dead.is_empty() && !leaked.is_empty() {
                self.fail(format!(
                    "worker {w} still keeps {:?} after every reference was dropped; values hold {:?}; endpoints: {:#?}",
                    app.values.keys().map(ToString::to_string).collect::<Vec<_>>(),
                    app.values,
                    self.alive().iter().map(|w| self.eps[*w as usize].debug_info()).collect::<Vec<_>>()
                ));
            }
        }
    }

    /// Fuzzing: a short normal workload, then `input` read as a script of forged messages
    /// (postcard-encoded [`Header`]s, each injected from worker 0 into worker 1 or 2) mixed
    /// with deliveries and timers. Nothing may panic; returns how many forged messages the
    /// endpoints reported as violations.
    pub fn fuzz(seed: u64, input: &[u8]) -> usize {
        let mut cluster = Cluster::new(3, seed);
        let mut rng = SimRng::new(seed);
        for _ in 0..40 {
            cluster.step(&mut rng);
        }
        let mut violations = 0;
        let mut rest = input;
        while let Some((&op, tail)) = rest.split_first() {
            rest = tail;
            match op % 4 {
                0 | 1 => {
                    let len = usize::from(rest.first().copied().unwrap_or(0) % 64);
                    let take = len.min(rest.len().saturating_sub(1));
                    let chunk = rest.get(1..1 + take).unwrap_or(&[]);
                    rest = rest.get(1 + take..).unwrap_or(&[]);
                    if let Ok(header) = postcard::from_bytes::<Header>(chunk) {
                        let body = (op & 0x10 != 0).then(Body::default);
                        let to = 1 + u32::from(op & 0x20 != 0);
                        if cluster.inject(0, to, header, body) {
                            violations += 1;
                        }
                    }
                }
                2 => {
                    // Deliver something, leniently (forged traffic may have confused anyone).
                    let busy = cluster.links.ready();
                    if let Some(&(from, to)) = busy.get(usize::from(op >> 2) % busy.len().max(1)) {
                        if let Some(t) = cluster.links.pop((from, to)) {
                            let now = cluster.clock.now();
                            let _ = cluster.eps[to as usize]
                                .handle_message(from, t.header, t.body, now);
                            cluster.pump_lenient();
                        }
                    }
                }
                _ => {
                    cluster
                        .clock
                        .advance(Duration::from_millis(u64::from(op >> 2) * 10));
                    let now = cluster.clock.now();
                    for ep in &mut cluster.eps {
                        ep.handle_timeout(now);
                    }
                    cluster.pump_lenient();
                }
            }
        }
        violations
    }

    /// Feeds `header` (with `body`) to worker `to` as if worker `from` had sent it, for
    /// fuzzing: returns whether the endpoint judged it a violation. Never panics on its own.
    pub fn inject(
        &mut self,
        from: WorkerId,
        to: WorkerId,
        header: Header,
        body: Option<Body>,
    ) -> bool {
        let n = self.n();
        if from >= n || to >= n || from == to || self.dead.contains(&to) {
            return false;
        }
        let violation = self.eps[to as usize]
            .handle_message(from, header, body, self.clock.now())
            .is_err();
        // Whatever the endpoint made of it goes through the applications, which must cope.
        self.pump_lenient();
        violation
    }

    /// Like [`pump`](Self::pump), for fuzzing: applications answer what they can and drop
    /// what they cannot (an injected request may name values nobody keeps).
    fn pump_lenient(&mut self) {
        for w in 0..self.n() {
            while let Some(t) = self.eps[w as usize].poll_transmit() {
                if t.to < self.n() && t.to != w && !self.dead.contains(&t.to) {
                    self.links.send((w, t.to), t);
                }
            }
            while let Some(ev) = self.eps[w as usize].poll_event() {
                match ev {
                    Event::Call { token, .. } | Event::Remote { token, .. } => {
                        self.eps[w as usize].respond(token, Ok(Body::default()));
                    }
                    Event::Fetch { token, .. } => {
                        self.eps[w as usize].respond(token, Ok(Body::default()));
                    }
                    Event::Completed { .. }
                    | Event::ConfirmWaitDone { .. }
                    | Event::Confirmed { .. }
                    | Event::ReleaseValue { .. }
                    | Event::ShutdownComplete { .. } => {}
                }
            }
        }
    }
}
