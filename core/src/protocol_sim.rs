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
//! - only a holder reads or calls a value: an owner serves a fetch or runs a method only for a
//!   worker that created the reference or was given a fork of it (with forged traffic: or
//!   claimed one with a fork request the owner accepted);
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
    MessageId, MethodTarget, Payload, RRefForkData, RRefHandle, RRefId, RemoteError,
    RemoteErrorKind, RequestToken, ShutdownError, StaticJoin, Transmit, WorkerId,
};
use crate::sim::{Clock, Links, SimRng};

mod app;
mod groups;

/// A peer's loss as a transport reports it when the peer's process is killed: its
/// connection reset. For simulations, tests and fuzzing, which have no sockets.
pub fn lost_link() -> LostCause {
    LostCause::Transport(Box::new(crate::ports::transport::TransportError::Io {
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
        op: "receiving",
        kind: std::io::ErrorKind::ConnectionReset,
        message: "connection reset by peer".to_owned(),
    }))
}

/// What travels through the simulated endpoints: some bytes and the references passed along.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Body {
    /// The payload.
    pub data: Vec<u8>,
    /// References passed inside the message (forked for its receiver).
    pub forks: Vec<RRefForkData>,
    /// For a method call: the reference it runs on, and the caller's fork of it.
    pub target: Option<MethodTarget>,
}

impl Payload for Body {
    fn forks(&self) -> Vec<RRefForkData> {
        self.forks.clone()
    }

    fn target(&self) -> Option<MethodTarget> {
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
    confirming: Option<(crate::protocol::WaitId, String, Option<MethodTarget>)>,
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
    /// Every (worker, reference) where the worker came to hold the reference: it created it
    /// with `remote` or accepted a fork of it (a forged fork request makes nobody a holder:
    /// it cannot present the reference's capability). An owner serves fetches and method
    /// calls only to these.
    given: BTreeSet<(WorkerId, RRefId)>,
    /// (worker, peer) for each forger a worker found after its message (`Event::Misbehaved`).
    misbehaved: Vec<(WorkerId, WorkerId)>,
}

/// The capability key of worker `w` in the run of `seed` (the driver's entropy, seeded).
pub(crate) fn sim_key(seed: u64, w: WorkerId) -> [u8; 32] {
    let mut key = [0x5a; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..12].copy_from_slice(&w.to_le_bytes());
    key
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
                .map(|i| {
                    let mut ep = Endpoint::new(i, config.clone());
                    ep.set_secret_key(sim_key(seed, i));
                    ep
                })
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
            given: BTreeSet::new(),
            misbehaved: Vec::new(),
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

    fn step(&mut self, rng: &mut SimRng) {
        #[cfg(test)]
        for ep in &self.eps {
            assert!(
                ep.reference_counts_agree(),
                "worker {}: the references counted per peer disagree with its fork records",
                ep.id()
            );
            assert!(
                ep.pending_counts_agree(),
                "worker {}: the pending forks or parked fetches counted per peer disagree \
                 with its records",
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
                        target: Some(h.into()),
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
            self.given.insert((w, h.rref));
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
            self.given.insert((w, h.rref));
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
                        self.eps[w as usize].handle_peer_lost(t.to, lost_link(), self.clock.now());
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
                self.eps[w as usize].handle_peer_lost(victim, lost_link(), now);
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
        // A creation the owner accepts makes the sender a holder (see `given`); a fork
        // request does not: only a worker given the reference knows its capability.
        let claimed = match header {
            Header::Remote { rref, .. } => Some(rref),
            _ => None,
        };
        let violation = self.eps[to as usize]
            .handle_message(from, header, body, self.clock.now())
            .is_err();
        if let (false, Some(rref)) = (violation, claimed) {
            self.given.insert((from, rref));
        }
        // Whatever the endpoint made of it goes through the applications, which must cope.
        self.pump_lenient();
        violation
    }

    /// The owner `w` was asked to serve `what` on `rref` for `token`'s caller: only a holder
    /// may be served (see `given`).
    fn check_holder(&self, w: WorkerId, token: RequestToken, rref: RRefId, what: &str) {
        let from = token.from();
        if from != w && !self.given.contains(&(from, rref)) {
            self.fail(format!(
                "worker {w} served a {what} on {rref} to worker {from}, which never held it"
            ));
        }
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
                    Event::Call { token, body, .. } | Event::Remote { token, body, .. } => {
                        if let Some(t) = body.target {
                            self.check_holder(w, token, t.rref, "method call");
                        }
                        self.eps[w as usize].respond(token, Ok(Body::default()));
                    }
                    Event::Fetch { token, rref } => {
                        self.check_holder(w, token, rref, "fetch");
                        self.eps[w as usize].respond(token, Ok(Body::default()));
                    }
                    Event::Completed { .. }
                    | Event::ConfirmWaitDone { .. }
                    | Event::Confirmed { .. }
                    | Event::ReleaseValue { .. }
                    | Event::PeerLost { .. }
                    | Event::ShutdownComplete { .. } => {}
                    // The endpoint handled the forger as lost; its forged messages go on
                    // arriving, as from a peer whose connection the driver has not closed yet.
                    Event::Misbehaved { peer, .. } => self.misbehaved.push((w, peer)),
                }
            }
        }
    }
}
