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
//!   of a dynamic group after it, some calls still in flight, members starting at random
//!   moments, sometimes one member that never starts): every member's shutdown completes
//!   exactly once and no later than its deadline; it succeeds whenever every member takes part
//!   and none died, and otherwise fails naming only workers that were missing (dead or silent;
//!   a member that gave up passes on whom it waited for).
//!
//! A failed check panics with a message naming the seed: `TW_SIM_SEED=<seed>` replays it (see
//! the crate's tests). [`Cluster::inject`] feeds an arbitrary message from one worker, for
//! fuzzing: it must never panic, and a violation is reported, not acted on.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::protocol::{
    CallError, Endpoint, EndpointConfig, Event, Header, MessageId, Payload, RRefForkData,
    RRefHandle, RRefId, RemoteError, RemoteErrorKind, RequestToken, ShutdownError, Transmit,
    WorkerId,
};

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

/// A small, fast, seeded generator (SplitMix64): the same seed gives the same run.
#[derive(Debug, Clone)]
pub struct SimRng(u64);

impl SimRng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number below `n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
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
}

/// N endpoints, their links, a virtual clock and a model application per worker.
#[derive(Debug)]
pub struct Cluster {
    seed: u64,
    now: Instant,
    eps: Vec<Endpoint<Body>>,
    apps: Vec<App>,
    links: BTreeMap<(WorkerId, WorkerId), VecDeque<Transmit<Body>>>,
    dead: BTreeSet<WorkerId>,
    /// Released values, to catch a double release.
    released: BTreeSet<RRefId>,
    stats: SimStats,
    /// Counts shutdown steps, to order outcomes.
    shutdown_step: usize,
}

const FUNCTIONS: [&str; 4] = ["echo", "fail", "slow", "nested"];

impl Cluster {
    /// `n` workers (at least 1) for the run of `seed`.
    pub fn new(n: u32, seed: u64) -> Self {
        let config = EndpointConfig {
            control_retry: Duration::from_millis(100),
        };
        Self {
            seed,
            now: Instant::now(),
            eps: (0..n.max(1))
                .map(|i| Endpoint::new(i, config.clone()))
                .collect(),
            apps: (0..n.max(1)).map(|_| App::default()).collect(),
            links: BTreeMap::new(),
            dead: BTreeSet::new(),
            released: BTreeSet::new(),
            stats: SimStats::default(),
            shutdown_step: 0,
        }
    }

    /// What the run did so far.
    pub fn stats(&self) -> SimStats {
        self.stats
    }

    fn n(&self) -> u32 {
        self.eps.len() as u32
    }

    fn alive(&self) -> Vec<WorkerId> {
        (0..self.n()).filter(|w| !self.dead.contains(w)).collect()
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
        for _ in 0..steps {
            self.step(&mut rng);
            self.check();
        }
        self.finish(&mut rng);
        self.shut_down(&mut rng);
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
        let deadline = self.now + Duration::from_secs(20);
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
            if self.now >= deadline && !done(self) {
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
        let deadline = self.now + Duration::from_secs(10);
        self.eps[w as usize].begin_leave(Some(deadline));
        while self.apps[w as usize].shutdown.is_empty() {
            if self.now >= deadline {
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
            if self.links.values().all(VecDeque::is_empty) {
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
        self.links.retain(|(f, t), _| *f != w && *t != w);
        for other in self.alive() {
            self.eps[other as usize].handle_peer_lost(w, "left the group", self.now);
        }
        self.pump();
    }

    fn step(&mut self, rng: &mut SimRng) {
        let alive = self.alive();
        let w = alive[rng.below(alive.len())];
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
                if let Some(h) = self.pick_held(w, rng) {
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
                    if let Ok(id) = self.eps[w as usize].fetch(h, timeout, self.now) {
                        self.track_call(w, id, timeout);
                    }
                }
            }
            39..=50 => {
                let held = &mut self.apps[w as usize].held;
                if !held.is_empty() {
                    let h = held.swap_remove(rng.below(held.len()));
                    self.eps[w as usize].drop_handle(h, self.now);
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
                        ep.abandon(id, "copy failed", self.now);
                        // The references inside never leave: undo their forks.
                        for f in body.forks {
                            ep.cancel_fork(f, to, self.now);
                        }
                    } else {
                        self.eps[w as usize].supply_body(id, body);
                    }
                }
            }
            55..=59 => self.finish_slow_request(w, rng),
            60..=63 => self.advance(Duration::from_millis(30)),
            64 if self.dead.is_empty() && alive.len() > 2 && rng.chance(30) => self.kill(w),
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
        let deadline = (!timeout.is_zero()).then(|| self.now + timeout);
        if self.apps[w as usize].calls.insert(id, deadline).is_some() {
            self.fail(format!("worker {w} got message id {id} twice"));
        }
    }

    fn call(&mut self, w: WorkerId, to: WorkerId, function: &str, body: Body, timeout: Duration) {
        if let Ok(id) = self.eps[w as usize].call(to, function, body, timeout, self.now) {
            self.stats.calls += 1;
            self.track_call(w, id, timeout);
        }
    }

    fn remote(&mut self, w: WorkerId, to: WorkerId, function: &str, body: Body, timeout: Duration) {
        if let Ok((h, id)) = self.eps[w as usize].remote(to, function, body, timeout, self.now) {
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
        if let Ok((h, id)) = self.eps[w as usize].remote_deferred(to, function, timeout, self.now) {
            self.stats.remotes += 1;
            self.track_call(w, id, timeout);
            self.apps[w as usize].held.push(h);
            self.apps[w as usize].deferred.push((id, to, body));
        }
    }

    /// Moves transmits to links and runs the applications until nothing is left locally.
    fn pump(&mut self) {
        loop {
            let mut progress = false;
            for w in 0..self.n() {
                while let Some(t) = self.eps[w as usize].poll_transmit() {
                    progress = true;
                    if self.dead.contains(&w) {
                        continue;
                    }
                    if self.dead.contains(&t.to) {
                        // As the agent's driver does when a peer has no connection.
                        self.eps[w as usize].handle_peer_lost(t.to, "killed", self.now);
                        continue;
                    }
                    if t.to == w {
                        self.fail(format!("worker {w} sent a message to itself: {t:?}"));
                    }
                    self.links.entry((w, t.to)).or_default().push_back(t);
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
    }

    fn accept_all(&mut self, w: WorkerId, forks: &[RRefForkData]) -> Vec<RRefHandle> {
        forks
            .iter()
            .map(|f| self.eps[w as usize].accept_fork(*f, self.now))
            .collect()
    }

    fn app(&mut self, w: WorkerId, ev: Event<Body>) {
        let now = self.now;
        if std::env::var_os("TW_SIM_TRACE").is_some() {
            eprintln!("event at {w}: {ev:?}");
        }
        match ev {
            Event::Call {
                token,
                function,
                body,
                ..
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
                };
                match function.as_str() {
                    "method" => {
                        let target = body.target.unwrap_or_else(|| {
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
                            now,
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
                    "fail" => self.answer(w, serving, Err("refused".into())),
                    _ => self.answer(w, serving, Ok(())),
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
                // The driver stops the endpoint either way (pending calls fail).
                self.eps[w as usize].stop();
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
                        "worker {w} released {rref} while {holder} still refers to it"
                    ));
                }
                // The value's own references go with it.
                for h in inside {
                    self.eps[w as usize].drop_handle(h, now);
                }
            }
        }
    }

    /// Answers a request; a `remote` keeps the references it got inside the value.
    fn answer(&mut self, w: WorkerId, s: Serving, outcome: Result<(), String>) {
        let now = self.now;
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
            .filter(|i| serving[*i].waits_for.is_none())
            .collect();
        if !slow.is_empty() {
            let s = serving.remove(slow[rng.below(slow.len())]);
            self.answer(w, s, Ok(()));
        }
    }

    /// Who (alive) still refers to `rref`: a handle held by an application, a handle inside a
    /// kept value or a request being served, or fork data inside an undelivered message.
    fn holder_of(&self, rref: RRefId) -> Option<String> {
        for w in self.alive() {
            let app = &self.apps[w as usize];
            let direct = app.held.iter().any(|h| h.rref == rref);
            let inside = app.values.values().flatten().any(|h| h.rref == rref);
            let serving = app
                .serving
                .iter()
                .flat_map(|s| &s.handles)
                .any(|h| h.rref == rref);
            let deferred = app
                .deferred
                .iter()
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
        for ((from, to), queue) in &self.links {
            let carried = queue
                .iter()
                .filter_map(|t| t.body.as_ref())
                .flat_map(|b| &b.forks)
                .any(|f| f.rref == rref);
            if carried {
                return Some(format!("a message from {from} to {to}"));
            }
        }
        None
    }

    fn deliver_one(&mut self, rng: &mut SimRng) {
        let busy: Vec<(WorkerId, WorkerId)> = self
            .links
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(k, _)| *k)
            .collect();
        if busy.is_empty() {
            return;
        }
        let (from, to) = busy[rng.below(busy.len())];
        self.deliver(from, to);
    }

    fn deliver(&mut self, from: WorkerId, to: WorkerId) {
        let Some(t) = self
            .links
            .get_mut(&(from, to))
            .and_then(VecDeque::pop_front)
        else {
            return;
        };
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
        if let Err(v) = self.eps[to as usize].handle_message(from, t.header, t.body, self.now) {
            self.fail(format!(
                "worker {to} saw a protocol violation from {from} in a normal flow: {v}"
            ));
        }
        self.pump();
    }

    /// Moves the clock and lets every endpoint handle its timers.
    pub fn advance(&mut self, d: Duration) {
        self.now += d;
        for w in self.alive() {
            self.eps[w as usize].handle_timeout(self.now);
        }
        self.pump();
    }

    fn kill(&mut self, victim: WorkerId) {
        self.stats.kills += 1;
        self.dead.insert(victim);
        self.links.retain(|(f, t), _| *f != victim && *t != victim);
        for w in self.alive() {
            self.eps[w as usize].handle_peer_lost(victim, "killed", self.now);
        }
        self.pump();
    }

    /// The promises that hold after every step.
    fn check(&self) {
        for w in self.alive() {
            let app = &self.apps[w as usize];
            for (id, deadline) in &app.calls {
                if deadline.is_some_and(|d| self.now > d) && !app.resolved.contains(id) {
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
                    self.eps[w as usize].drop_handle(h, self.now);
                }
            }
            self.pump();
            while self.links.values().any(|q| !q.is_empty()) {
                self.deliver_one(rng);
            }
            self.advance(Duration::from_secs(6));
            self.check();
            let settled = self.alive().iter().all(|w| {
                let app = &self.apps[*w as usize];
                self.eps[*w as usize].is_idle()
                    && app.serving.is_empty()
                    && app.held.is_empty()
                    && app.deferred.is_empty()
            }) && self.links.values().all(VecDeque::is_empty);
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
                    let busy: Vec<(WorkerId, WorkerId)> = cluster
                        .links
                        .iter()
                        .filter(|(_, q)| !q.is_empty())
                        .map(|(k, _)| *k)
                        .collect();
                    if let Some(&(from, to)) = busy.get(usize::from(op >> 2) % busy.len().max(1)) {
                        if let Some(t) = cluster
                            .links
                            .get_mut(&(from, to))
                            .and_then(VecDeque::pop_front)
                        {
                            let now = cluster.now;
                            let _ = cluster.eps[to as usize]
                                .handle_message(from, t.header, t.body, now);
                            cluster.pump_lenient();
                        }
                    }
                }
                _ => {
                    cluster.now += Duration::from_millis(u64::from(op >> 2) * 10);
                    let now = cluster.now;
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
            .handle_message(from, header, body, self.now)
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
                    self.links.entry((w, t.to)).or_default().push_back(t);
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
                    | Event::Confirmed { .. }
                    | Event::ReleaseValue { .. }
                    | Event::ShutdownComplete { .. } => {}
                }
            }
        }
    }
}
