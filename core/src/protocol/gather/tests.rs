use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::*;
use crate::sim::SimRng;

fn set(ranks: &[WorkerId]) -> BTreeSet<WorkerId> {
    ranks.iter().copied().collect()
}

fn contribution(name: &str, expected: &[WorkerId], wait_ms: u64, value: &[u8]) -> Contribution {
    Contribution {
        name: name.into(),
        expected: expected.to_vec(),
        wait: Duration::from_millis(wait_ms),
        value: value.to_vec(),
    }
}

fn answers(leader: &mut GatherLeader) -> Vec<(GatherToken, GatherOutcome)> {
    std::iter::from_fn(|| leader.poll_answer()).collect()
}

/// What a leader holds, to check that a refused contribution changed nothing.
fn held(leader: &GatherLeader) -> (usize, usize, usize, Option<Instant>) {
    (
        leader.rounds(),
        leader.held_bytes(),
        leader.waiting(),
        leader.poll_timeout(),
    )
}

#[test]
fn every_caller_gets_every_value_in_rank_order_once_all_sent() {
    let t0 = Instant::now();
    let mut l = GatherLeader::new(1, GatherConfig::default());
    let a = l.handle_contribution(t0, 5, contribution("x", &[1, 2, 5], 100, b"five"));
    let b = l.handle_contribution(t0, 1, contribution("x", &[1, 2, 5], 100, b"one"));
    assert!(answers(&mut l).is_empty());
    assert_eq!(l.held_bytes(), 7);
    let c = l.handle_contribution(t0, 2, contribution("x", &[1, 2, 5], 100, b"two"));
    let done = GatherOutcome::Done(vec![
        (1, b"one".to_vec()),
        (2, b"two".to_vec()),
        (5, b"five".to_vec()),
    ]);
    let mut got = answers(&mut l);
    got.sort_by_key(|(t, _)| *t);
    assert_eq!(
        got,
        vec![(a, done.clone()), (b, done.clone()), (c, done.clone())]
    );
    assert!(l.is_idle());
    assert_eq!(l.poll_timeout(), None);
    assert_eq!(
        resolve(&set(&[1, 2, 5]), done).unwrap(),
        vec![b"one".to_vec(), b"two".to_vec(), b"five".to_vec()]
    );
    // The name may be used again at once: a new round.
    l.handle_contribution(t0, 2, contribution("x", &[1, 2], 100, b""));
    assert_eq!(l.rounds(), 1);
}

#[test]
fn a_wait_that_ends_ends_the_round_for_every_caller_naming_who_did_not_send() {
    let t0 = Instant::now();
    let mut l = GatherLeader::new(0, GatherConfig::default());
    let a = l.handle_contribution(t0, 0, contribution("x", &[0, 1, 2], 100, b"a"));
    let b = l.handle_contribution(
        t0 + Duration::from_millis(50),
        2,
        contribution("x", &[0, 1, 2], 500, b"b"),
    );
    assert_eq!(l.poll_timeout(), Some(t0 + Duration::from_millis(100)));
    l.handle_timeout(t0 + Duration::from_millis(99));
    assert!(answers(&mut l).is_empty());
    l.handle_timeout(t0 + Duration::from_millis(100));
    let mut got = answers(&mut l);
    got.sort_by_key(|(t, _)| *t);
    let missing = GatherOutcome::Missing(vec![1]);
    assert_eq!(got, vec![(a, missing.clone()), (b, missing.clone())]);
    assert!(l.is_idle());
    assert_eq!(l.poll_timeout(), None);
    assert_eq!(
        resolve(&set(&[0, 1, 2]), missing),
        Err(GatherFailure::Missing(vec![1]))
    );
    // The late member starts a new round rather than completing the old one.
    l.handle_contribution(t0, 1, contribution("x", &[0, 1, 2], 100, b"late"));
    assert!(answers(&mut l).is_empty());
    assert_eq!(l.rounds(), 1);
}

#[test]
fn no_limit_means_no_deadline() {
    let t0 = Instant::now();
    let mut l = GatherLeader::new(0, GatherConfig::default());
    let r = request("x", &set(&[0, 1]), vec![], Duration::ZERO).unwrap();
    assert_eq!(r.call_timeout, Duration::ZERO);
    l.handle_contribution(t0, 0, r.contribution);
    assert_eq!(l.poll_timeout(), None);
    let r = request("y", &set(&[0, 1]), vec![], Duration::from_secs(3)).unwrap();
    assert_eq!(r.leader, 0);
    assert_eq!(r.call_timeout, Duration::from_secs(3) + REPLY_MARGIN);
    assert_eq!(request("z", &set(&[]), vec![], Duration::ZERO), None);
}

#[test]
fn refused_contributions_are_answered_at_once_and_change_nothing() {
    let t0 = Instant::now();
    let cfg = GatherConfig::default()
        .with_max_name_len(8)
        .with_max_members(4)
        .with_max_rounds(2)
        .with_max_bytes(10);
    let mut l = GatherLeader::new(1, cfg);
    l.handle_contribution(t0, 2, contribution("x", &[1, 2, 3], 100, b"abcd"));
    l.handle_contribution(t0, 1, contribution("y", &[1, 2], 100, b"ef"));
    let before = held(&l);
    let cases: Vec<(WorkerId, Contribution, GatherError)> = vec![
        (
            2,
            contribution("y", &[1, 2, 3], 100, b""),
            GatherError::Disagreement {
                name: "y".into(),
                ours: vec![1, 2],
                theirs: vec![1, 2, 3],
            },
        ),
        (
            2,
            contribution("x", &[1, 2, 3], 100, b""),
            GatherError::Duplicate {
                from: 2,
                name: "x".into(),
            },
        ),
        (
            4,
            contribution("x", &[1, 2, 3], 100, b""),
            GatherError::NotAMember {
                from: 4,
                name: "x".into(),
            },
        ),
        (
            2,
            contribution("z", &[0, 2], 100, b""),
            GatherError::NotLeader {
                name: "z".into(),
                leader: 0,
                me: 1,
            },
        ),
        (
            2,
            contribution("z", &[2, 1], 100, b""),
            GatherError::UnsortedMembers {
                name: "z".into(),
                members: vec![2, 1],
            },
        ),
        (
            2,
            contribution("z", &[1, 2, 2], 100, b""),
            GatherError::UnsortedMembers {
                name: "z".into(),
                members: vec![1, 2, 2],
            },
        ),
        (
            2,
            contribution("z", &[], 100, b""),
            GatherError::NoMembers { name: "z".into() },
        ),
        (
            2,
            contribution("a-long-name", &[1, 2], 100, b""),
            GatherError::NameTooLong { len: 11, limit: 8 },
        ),
        (
            2,
            contribution("z", &[1, 2, 3, 4, 5], 100, b""),
            GatherError::TooManyMembers {
                name: "z".into(),
                count: 5,
                limit: 4,
            },
        ),
        (
            2,
            contribution("z", &[1, 2], 100, b""),
            GatherError::TooManyRounds {
                name: "z".into(),
                limit: 2,
            },
        ),
        (
            3,
            contribution("x", &[1, 2, 3], 100, b"12345"),
            GatherError::TooManyBytes {
                name: "x".into(),
                len: 5,
                held: 6,
                limit: 10,
            },
        ),
    ];
    for (from, c, error) in cases {
        let token = l.handle_contribution(t0, from, c);
        assert_eq!(
            answers(&mut l),
            vec![(token, GatherOutcome::Failed(error.clone()))]
        );
        assert_eq!(held(&l), before, "{error}");
    }
    // A value that fits still joins.
    l.handle_contribution(t0, 3, contribution("x", &[1, 2, 3], 100, b"1234"));
    assert_eq!(l.held_bytes(), 10);
}

#[test]
fn a_member_lost_before_it_sent_fails_the_round_and_after_it_sent_does_not() {
    let t0 = Instant::now();
    let mut l = GatherLeader::new(0, GatherConfig::default());
    let a = l.handle_contribution(t0, 0, contribution("x", &[0, 1, 2], 100, b"a"));
    let b = l.handle_contribution(t0, 1, contribution("y", &[0, 1, 2], 100, b"b"));
    l.handle_contribution(t0, 2, contribution("y", &[0, 1, 2], 100, b"c"));
    l.handle_peer_lost(2);
    // "x" expects 2's value, which never comes; "y" has it and no caller left but 1.
    assert_eq!(
        answers(&mut l),
        vec![(
            a,
            GatherOutcome::Failed(GatherError::MemberLost {
                name: "x".into(),
                member: 2
            })
        )]
    );
    assert_eq!(l.rounds(), 1);
    let c = l.handle_contribution(t0, 0, contribution("y", &[0, 1, 2], 100, b"d"));
    let done = GatherOutcome::Done(vec![
        (0, b"d".to_vec()),
        (1, b"b".to_vec()),
        (2, b"c".to_vec()),
    ]);
    let mut got = answers(&mut l);
    got.sort_by_key(|(t, _)| *t);
    // The lost member gets no answer: only 1 and 0 do.
    assert_eq!(got, vec![(b, done.clone()), (c, done)]);
    assert!(l.is_idle());
}

#[test]
fn a_round_nobody_waits_for_is_forgotten() {
    let t0 = Instant::now();
    let mut l = GatherLeader::new(0, GatherConfig::default());
    let a = l.handle_contribution(t0, 1, contribution("x", &[0, 1, 2], 100, b"a"));
    let b = l.handle_contribution(t0, 2, contribution("x", &[0, 1, 2], 100, b"b"));
    l.handle_abandoned(a);
    assert_eq!(l.rounds(), 1);
    assert_eq!(l.held_bytes(), 2);
    l.handle_peer_lost(2);
    assert!(answers(&mut l).is_empty());
    assert!(l.is_idle(), "{l:?}");
    // Tokens that are gone are ignored.
    l.handle_abandoned(b);
    l.handle_abandoned(999);
    assert!(l.is_idle());
}

#[test]
fn a_wrong_done_is_refused_by_the_member() {
    let members = set(&[0, 1]);
    for got in [
        vec![(0, vec![])],
        vec![(1, vec![]), (0, vec![])],
        vec![(0, vec![]), (2, vec![])],
        vec![(0, vec![]), (1, vec![]), (1, vec![])],
    ] {
        assert!(matches!(
            resolve(&members, GatherOutcome::Done(got)),
            Err(GatherFailure::WrongMembers { .. })
        ));
    }
}

// ---- the seeded simulation ----

/// A message in flight.
#[derive(Debug)]
enum Msg {
    Contribute { call: usize, c: Contribution },
    Answer { call: usize, outcome: GatherOutcome },
}

/// How a call ended: the values or an error's words.
type CallResult = Result<Vec<Vec<u8>>, String>;

/// One member's gather call.
#[derive(Debug)]
struct Call {
    caller: WorkerId,
    leader: WorkerId,
    /// Which gather of the workload (`None`: a hostile worker's).
    index: Option<usize>,
    members: BTreeSet<WorkerId>,
    deadline: Option<Instant>,
    /// How it ended: `Ok` values or an error's words, and when.
    result: Option<(Instant, CallResult)>,
}

struct Sim {
    rng: SimRng,
    now: Instant,
    n: WorkerId,
    hostile: Option<WorkerId>,
    alive: BTreeSet<WorkerId>,
    leaders: Vec<GatherLeader>,
    config: GatherConfig,
    /// (delivery time, sequence) → (from, to, message).
    net: BTreeMap<(Instant, u64), (WorkerId, WorkerId, Msg)>,
    sent: u64,
    calls: Vec<Call>,
    /// (leader, token) → call.
    tokens: BTreeMap<(WorkerId, GatherToken), usize>,
    /// Per honest worker: its next gather, and when it starts it (`None`: a call is under way).
    next: Vec<(usize, Option<Instant>)>,
    gathers: usize,
    timeout: Duration,
    /// Every value each worker sent, by name.
    sent_values: BTreeMap<(WorkerId, String), BTreeSet<Vec<u8>>>,
    /// Whether something happened that may make a gather fail (a kill, a forgery, a timeout).
    faults: bool,
}

const NAMES: [&str; 3] = ["a", "b", "c"];

fn value_of(worker: WorkerId, index: usize) -> Vec<u8> {
    format!("{worker}/{index}").into_bytes()
}

impl Sim {
    fn new(seed: u64) -> Self {
        let mut rng = SimRng::new(seed);
        let n = 2 + rng.below(5) as WorkerId;
        let hostile = rng
            .chance(30)
            .then(|| rng.below(n as usize + 1) as WorkerId);
        let config = GatherConfig::default()
            .with_max_rounds(4)
            .with_max_bytes(64);
        let now = Instant::now();
        let timeout = if rng.chance(50) {
            Duration::from_secs(10)
        } else {
            Duration::from_millis(20 + rng.below(200) as u64)
        };
        let gathers = 1 + rng.below(6);
        let next = (0..=n)
            .map(|_| (0, Some(now + Duration::from_millis(rng.below(30) as u64))))
            .collect();
        Sim {
            rng,
            now,
            n,
            hostile,
            alive: (0..=n).collect(),
            leaders: (0..=n).map(|w| GatherLeader::new(w, config)).collect(),
            config,
            net: BTreeMap::new(),
            sent: 0,
            calls: Vec::new(),
            tokens: BTreeMap::new(),
            next,
            gathers,
            timeout,
            sent_values: BTreeMap::new(),
            faults: hostile.is_some(),
        }
    }

    /// Honest workers: every rank up to `n` but the hostile one.
    fn honest(&self) -> impl Iterator<Item = WorkerId> + '_ {
        (0..=self.n).filter(move |w| Some(*w) != self.hostile)
    }

    fn send(&mut self, from: WorkerId, to: WorkerId, msg: Msg) {
        if !self.alive.contains(&from) || !self.alive.contains(&to) {
            return;
        }
        let delay = Duration::from_millis(self.rng.below(20) as u64);
        self.sent += 1;
        self.net
            .insert((self.now + delay, self.sent), (from, to, msg));
    }

    fn start_call(
        &mut self,
        caller: WorkerId,
        index: Option<usize>,
        members: BTreeSet<WorkerId>,
        c: Contribution,
        call_timeout: Duration,
    ) {
        let leader = *members.first().unwrap_or(&caller);
        let call = self.calls.len();
        self.sent_values
            .entry((caller, c.name.clone()))
            .or_default()
            .insert(c.value.clone());
        self.calls.push(Call {
            caller,
            leader,
            index,
            members,
            deadline: (!call_timeout.is_zero()).then(|| self.now + call_timeout),
            result: None,
        });
        self.send(caller, leader, Msg::Contribute { call, c });
    }

    fn finish(&mut self, call: usize, result: CallResult) {
        let now = self.now;
        let c = &mut self.calls[call];
        assert!(c.result.is_none(), "call {call} resolved twice: {c:?}");
        if let Some(d) = c.deadline {
            assert!(now <= d, "call {call} resolved after its deadline: {c:?}");
        }
        if result.is_err() {
            self.faults = true;
        }
        c.result = Some((now, result));
        if c.index.is_some() {
            let caller = c.caller as usize;
            let start = now + Duration::from_millis(self.rng.below(10) as u64);
            self.next[caller].0 += 1;
            self.next[caller].1 = Some(start);
        }
    }

    fn pump_leader(&mut self, leader: WorkerId) {
        while let Some((token, outcome)) = self.leaders[leader as usize].poll_answer() {
            let call = self
                .tokens
                .remove(&(leader, token))
                .expect("a token given out");
            let caller = self.calls[call].caller;
            self.send(leader, caller, Msg::Answer { call, outcome });
        }
        assert!(self.leaders[leader as usize].rounds() <= self.config.max_rounds);
        assert!(self.leaders[leader as usize].held_bytes() <= self.config.max_bytes);
    }

    fn kill(&mut self, w: WorkerId) {
        if !self.alive.remove(&w) {
            return;
        }
        self.faults = true;
        self.net.retain(|_, (from, to, _)| *from != w && *to != w);
        // Calls to it fail at once (the endpoint's lost peer); calls of it are gone.
        let pending: Vec<usize> = (0..self.calls.len())
            .filter(|&i| self.calls[i].result.is_none() && self.calls[i].leader == w)
            .collect();
        for call in pending {
            if self.alive.contains(&self.calls[call].caller) {
                self.finish(call, Err(format!("leader {w} lost")));
            }
        }
        let survivors: Vec<WorkerId> = self.alive.iter().copied().collect();
        for l in survivors {
            self.leaders[l as usize].handle_peer_lost(w);
            self.pump_leader(l);
        }
    }

    /// A hostile worker's contribution: forged names, member lists, duplicates, sizes.
    fn forge(&mut self, h: WorkerId) {
        let name = if self.rng.chance(70) {
            NAMES[self.rng.below(NAMES.len())].to_owned()
        } else {
            format!("forged/{}", self.rng.below(10))
        };
        let mut expected: Vec<WorkerId> = (0..=self.n).filter(|_| self.rng.chance(60)).collect();
        match self.rng.below(4) {
            0 => expected.reverse(),
            1 => expected.push(self.rng.below(4) as WorkerId),
            _ => {}
        }
        let to = if self.rng.chance(70) {
            expected.first().copied().unwrap_or(0)
        } else {
            self.rng.below(self.n as usize + 1) as WorkerId
        };
        let c = Contribution {
            name,
            expected: expected.clone(),
            wait: Duration::from_millis(self.rng.below(300) as u64),
            value: vec![0xee; self.rng.below(40)],
        };
        let call = self.calls.len();
        self.calls.push(Call {
            caller: h,
            leader: to,
            index: None,
            members: expected.into_iter().collect(),
            deadline: None,
            result: None,
        });
        self.send(h, to, Msg::Contribute { call, c: c.clone() });
        if self.rng.chance(30) {
            self.send(h, to, Msg::Contribute { call, c });
        }
    }

    /// The earliest thing that happens next, if anything does.
    fn next_time(&self) -> Option<Instant> {
        let msg = self.net.keys().next().map(|(at, _)| *at);
        let start = self
            .honest()
            .filter(|w| self.alive.contains(w) && self.next[*w as usize].0 < self.gathers)
            .filter_map(|w| self.next[w as usize].1)
            .min();
        let timer = self
            .alive
            .iter()
            .filter_map(|l| self.leaders[*l as usize].poll_timeout())
            .min();
        let deadline = self
            .calls
            .iter()
            .filter(|c| c.result.is_none() && c.index.is_some() && self.alive.contains(&c.caller))
            .filter_map(|c| c.deadline)
            .min();
        [msg, start, timer, deadline].into_iter().flatten().min()
    }

    fn step(&mut self) -> bool {
        let Some(at) = self.next_time() else {
            return false;
        };
        self.now = self.now.max(at);
        let now = self.now;
        // Faults, at random moments.
        if self.rng.chance(2) && self.alive.len() > 1 {
            let w = self.rng.below(self.n as usize + 1) as WorkerId;
            self.kill(w);
        }
        if let Some(h) = self.hostile.filter(|h| self.alive.contains(h)) {
            if self.rng.chance(20) {
                self.forge(h);
            }
        }
        // Timers of the leaders.
        let live: Vec<WorkerId> = self.alive.iter().copied().collect();
        for l in &live {
            if self.leaders[*l as usize]
                .poll_timeout()
                .is_some_and(|t| t <= now)
            {
                self.leaders[*l as usize].handle_timeout(now);
                self.pump_leader(*l);
            }
        }
        // Members whose next gather is due.
        for w in self.honest().collect::<Vec<_>>() {
            let (index, start) = self.next[w as usize];
            if !self.alive.contains(&w) || index >= self.gathers || start.is_none_or(|s| s > now) {
                continue;
            }
            self.next[w as usize].1 = None;
            let members: BTreeSet<WorkerId> =
                self.honest().filter(|m| self.alive.contains(m)).collect();
            let r = request(NAMES[index % 3], &members, value_of(w, index), self.timeout)
                .expect("members");
            self.start_call(w, Some(index), members, r.contribution, r.call_timeout);
        }
        // Messages due.
        while let Some(entry) = self.net.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (from, to, msg) = entry.remove();
            match msg {
                Msg::Contribute { call, c } => {
                    let token = self.leaders[to as usize].handle_contribution(now, from, c);
                    self.tokens.insert((to, token), call);
                    self.pump_leader(to);
                }
                Msg::Answer { call, outcome } => {
                    if self.calls[call].index.is_none() {
                        continue;
                    }
                    if self.calls[call].result.is_some() {
                        panic!("an answer to call {call}, which already ended: {outcome:?}");
                    }
                    let members = self.calls[call].members.clone();
                    let result = resolve(&members, outcome).map_err(|e| e.to_string());
                    self.check_values(call, &result);
                    self.finish(call, result);
                }
            }
        }
        // Calls whose own deadline passed without an answer.
        let overdue: Vec<usize> = (0..self.calls.len())
            .filter(|&i| {
                let c = &self.calls[i];
                c.result.is_none()
                    && c.index.is_some()
                    && self.alive.contains(&c.caller)
                    && c.deadline.is_some_and(|d| d <= now)
            })
            .collect();
        for call in overdue {
            self.finish(call, Err("the call timed out".into()));
        }
        true
    }

    /// A gather that completed carries, for every honest member, a value that member sent
    /// under that name (its own exactly); without faults, the values of this very gather.
    fn check_values(&self, call: usize, result: &CallResult) {
        let Ok(values) = result else { return };
        let c = &self.calls[call];
        let index = c.index.expect("an honest call");
        let name = NAMES[index % 3].to_owned();
        for (member, value) in c.members.iter().zip(values) {
            if Some(*member) == self.hostile {
                continue;
            }
            if *member == c.caller {
                assert_eq!(*value, value_of(*member, index), "its own value: {c:?}");
            }
            let sent = self.sent_values.get(&(*member, name.clone()));
            assert!(
                sent.is_some_and(|s| s.contains(value)),
                "call {call} got {value:?} for member {member}, which it never sent under {name:?}"
            );
        }
    }

    fn run(&mut self) {
        let mut steps = 0;
        while self.step() {
            steps += 1;
            assert!(steps < 100_000, "the simulation does not settle");
        }
        // Every live honest worker finished its workload, each call resolved once.
        for w in self.honest().filter(|w| self.alive.contains(w)) {
            assert_eq!(self.next[w as usize].0, self.gathers, "worker {w}");
        }
        for (i, c) in self.calls.iter().enumerate() {
            if c.index.is_some() && self.alive.contains(&c.caller) {
                assert!(c.result.is_some(), "call {i} never resolved: {c:?}");
            }
        }
        // Nothing is left held anywhere.
        for l in &self.alive {
            let leader = &self.leaders[*l as usize];
            assert!(leader.is_idle(), "leader {l} still holds {leader:?}");
        }
        if !self.faults {
            // Without faults, every gather completed with exactly its own values.
            for c in &self.calls {
                let Some((_, Ok(values))) = &c.result else {
                    panic!("a gather failed without faults: {c:?}");
                };
                let index = c.index.expect("honest");
                let want: Vec<Vec<u8>> = c.members.iter().map(|m| value_of(*m, index)).collect();
                assert_eq!(*values, want);
            }
        }
    }
}

fn run_seed(seed: u64) -> Sim {
    let mut sim = Sim::new(seed);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sim.run()));
    if let Err(e) = outcome {
        eprintln!("gather simulation failed for seed {seed}: replay with TW_SIM_SEED={seed}");
        std::panic::resume_unwind(e);
    }
    sim
}

/// Leaders and members over a network with delays, workers lost at random moments (leaders
/// among them), a hostile member sending forged and duplicated contributions: every call
/// resolves once and by its deadline, completed gathers carry only values their members
/// sent, leaders stay within their bounds and end holding nothing, and without faults every
/// gather completes with its own values.
#[test]
fn seeded_gather_simulation() {
    if let Some(seed) = std::env::var("TW_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        run_seed(seed);
        return;
    }
    let (mut clean, mut completed, mut failed) = (0, 0, 0);
    for seed in 0..500 {
        let sim = run_seed(seed);
        clean += usize::from(!sim.faults);
        for c in sim.calls.iter().filter(|c| c.index.is_some()) {
            match &c.result {
                Some((_, Ok(_))) => completed += 1,
                Some((_, Err(_))) => failed += 1,
                None => {}
            }
        }
    }
    // The workload exercises both sides: clean runs, completed and failed gathers.
    assert!(clean > 50, "{clean} clean runs");
    assert!(completed > 500, "{completed} completed gathers");
    assert!(failed > 50, "{failed} failed gathers");
}

/// One input to a leader in [`forged_traffic_stays_within_bounds_and_leaves_nothing`].
#[derive(Debug, Clone)]
enum Op {
    Contribute {
        from: WorkerId,
        name: u8,
        expected: Vec<WorkerId>,
        wait_ms: u64,
        len: usize,
    },
    Advance(u64),
    Lost(WorkerId),
    Abandon(GatherToken),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (
            0u32..5,
            0u8..6,
            proptest::collection::vec(0u32..5, 0..5),
            0u64..200,
            0usize..24,
        )
            .prop_map(|(from, name, expected, wait_ms, len)| Op::Contribute {
                from,
                name,
                expected,
                wait_ms,
                len,
            }),
        1 => (0u64..150).prop_map(Op::Advance),
        1 => (0u32..5).prop_map(Op::Lost),
        1 => (0u64..40).prop_map(Op::Abandon),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Any traffic (member lists unsorted, foreign, for another leader; names reused; values
    /// large; losses and abandoned calls): no panic, every contribution answered at most once,
    /// a refusal answered at once and changing nothing, the bounds never passed, and once the
    /// waits have ended the leader holds nothing and has answered every caller still there.
    #[test]
    fn forged_traffic_stays_within_bounds_and_leaves_nothing(
        ops in proptest::collection::vec(op(), 0..80)
    ) {
        let cfg = GatherConfig::default().with_max_rounds(3).with_max_bytes(40).with_max_name_len(8);
        let mut l = GatherLeader::new(0, cfg);
        let t0 = Instant::now();
        let mut now = t0;
        let mut answered = BTreeSet::new();
        let mut gone = BTreeSet::new();
        let mut callers = BTreeMap::new();
        let collect = |l: &mut GatherLeader, answered: &mut BTreeSet<GatherToken>| {
            let got = answers(l);
            for (token, _) in &got {
                assert!(answered.insert(*token), "token {token} answered twice");
            }
            got
        };
        for op in ops {
            match op {
                Op::Contribute { from, name, expected, wait_ms, len } => {
                    let before = held(&l);
                    let c = Contribution {
                        name: if name == 5 { "x".repeat(9) } else { format!("g{name}") },
                        expected,
                        wait: Duration::from_millis(wait_ms),
                        value: vec![from as u8; len],
                    };
                    let token = l.handle_contribution(now, from, c);
                    callers.insert(token, from);
                    for (t, outcome) in collect(&mut l, &mut answered) {
                        if let GatherOutcome::Failed(e) = &outcome {
                            if t == token && !matches!(e, GatherError::MemberLost { .. }) {
                                assert_eq!(held(&l), before, "{e}");
                            }
                        }
                    }
                }
                Op::Advance(ms) => {
                    now += Duration::from_millis(ms);
                    l.handle_timeout(now);
                    collect(&mut l, &mut answered);
                }
                Op::Lost(w) => {
                    l.handle_peer_lost(w);
                    for (t, c) in &callers {
                        if *c == w {
                            gone.insert(*t);
                        }
                    }
                    collect(&mut l, &mut answered);
                }
                Op::Abandon(t) => {
                    l.handle_abandoned(t);
                    gone.insert(t);
                    collect(&mut l, &mut answered);
                }
            }
            assert!(l.rounds() <= 3);
            assert!(l.held_bytes() <= 40);
        }
        now += Duration::from_secs(1);
        l.handle_timeout(now);
        collect(&mut l, &mut answered);
        assert!(l.is_idle(), "{l:?}");
        for t in callers.keys() {
            assert!(answered.contains(t) || gone.contains(t), "token {t} never answered");
        }
    }
}

#[test]
fn the_leaders_view_of_the_members_wins_over_one_sent_before_it() {
    let t0 = Instant::now();
    let mut l = GatherLeader::new(0, GatherConfig::default());
    // Worker 1 sends first with a member list of its choosing (a forger, or a member whose
    // view of the group is stale); worker 2, who agrees with the leader, is not refused for
    // it: until the leader's own value comes, each list is a round of its own.
    let early = l.handle_contribution(t0, 1, contribution("x", &[0, 1], 100, b"one"));
    let two = l.handle_contribution(t0, 2, contribution("x", &[0, 1, 2], 100, b"two"));
    assert!(answers(&mut l).is_empty());
    assert_eq!(l.rounds(), 2);
    // The leader's own contribution picks its list: the other round's caller is told, and it
    // ends.
    let leader = l.handle_contribution(t0, 0, contribution("x", &[0, 1, 2], 100, b"zero"));
    assert_eq!(
        answers(&mut l),
        vec![(
            early,
            GatherOutcome::Failed(GatherError::Disagreement {
                name: "x".into(),
                ours: vec![0, 1, 2],
                theirs: vec![0, 1],
            })
        )]
    );
    assert_eq!((l.rounds(), l.held_bytes()), (1, 7));
    // From now on the leader's list is the round's: a list like the early one is refused.
    let again = l.handle_contribution(t0, 1, contribution("x", &[0, 1], 100, b"one"));
    assert_eq!(
        answers(&mut l),
        vec![(
            again,
            GatherOutcome::Failed(GatherError::Disagreement {
                name: "x".into(),
                ours: vec![0, 1, 2],
                theirs: vec![0, 1],
            })
        )]
    );
    let one = l.handle_contribution(t0, 1, contribution("x", &[0, 1, 2], 100, b"one"));
    let done = GatherOutcome::Done(vec![
        (0, b"zero".to_vec()),
        (1, b"one".to_vec()),
        (2, b"two".to_vec()),
    ]);
    let mut got = answers(&mut l);
    got.sort_by_key(|(t, _)| *t);
    assert_eq!(
        got,
        vec![(two, done.clone()), (leader, done.clone()), (one, done)]
    );
    assert!(l.is_idle());
    // A second contribution of the leader's own with another list is refused, not obeyed.
    l.handle_contribution(t0, 0, contribution("y", &[0, 1], 100, b""));
    let second = l.handle_contribution(t0, 0, contribution("y", &[0, 2], 100, b""));
    assert!(matches!(
        answers(&mut l)[..],
        [(t, GatherOutcome::Failed(GatherError::Disagreement { .. }))] if t == second
    ));
}

#[test]
fn each_member_has_its_own_share_of_the_leaders_bounds() {
    let t0 = Instant::now();
    let cfg = GatherConfig::default()
        .with_max_rounds(8)
        .with_max_bytes(100)
        .with_max_rounds_per_member(2)
        .with_max_bytes_per_member(5);
    let mut l = GatherLeader::new(0, cfg);
    // Worker 1 holds two rounds the leader has not joined, with 4 bytes.
    l.handle_contribution(t0, 1, contribution("a", &[0, 1], 100, b"12"));
    l.handle_contribution(t0, 1, contribution("b", &[0, 1], 100, b"34"));
    let third = l.handle_contribution(t0, 1, contribution("c", &[0, 1], 100, b""));
    let big = l.handle_contribution(t0, 2, contribution("a2", &[0, 2], 100, b"123456"));
    assert_eq!(
        answers(&mut l),
        vec![
            (
                third,
                GatherOutcome::Failed(GatherError::MemberTooManyRounds {
                    name: "c".into(),
                    from: 1,
                    limit: 2,
                })
            ),
            (
                big,
                GatherOutcome::Failed(GatherError::MemberTooManyBytes {
                    name: "a2".into(),
                    from: 2,
                    len: 6,
                    held: 0,
                    limit: 5,
                })
            ),
        ]
    );
    // The others are not held back by worker 1's share, and the leader has none.
    l.handle_contribution(t0, 2, contribution("d", &[0, 2], 100, b"12345"));
    for name in ["e", "f", "g", "h"] {
        l.handle_contribution(t0, 0, contribution(name, &[0, 3], 100, b"xxxxxxxx"));
    }
    assert!(answers(&mut l).is_empty());
    assert_eq!(l.rounds(), 7);
    // A round that ends gives its members their share back.
    l.handle_contribution(t0, 0, contribution("a", &[0, 1], 100, b""));
    assert_eq!(answers(&mut l).len(), 2);
    l.handle_contribution(t0, 1, contribution("c", &[0, 1], 100, b""));
    assert!(answers(&mut l).is_empty());
    assert_eq!(l.rounds(), 7);
}

#[test]
fn only_what_no_honest_request_sends_is_a_forgery() {
    let forged = [
        GatherError::NoMembers { name: "x".into() },
        GatherError::UnsortedMembers {
            name: "x".into(),
            members: vec![2, 1],
        },
        GatherError::NotAMember {
            from: 3,
            name: "x".into(),
        },
    ];
    assert!(forged.iter().all(GatherError::is_forgery));
    // Views that differ, a late or second value, and the bounds can happen to honest members.
    let honest = [
        GatherError::Disagreement {
            name: "x".into(),
            ours: vec![0],
            theirs: vec![0, 1],
        },
        GatherError::Duplicate {
            from: 1,
            name: "x".into(),
        },
        GatherError::NotLeader {
            name: "x".into(),
            leader: 0,
            me: 1,
        },
        GatherError::TooManyRounds {
            name: "x".into(),
            limit: 1,
        },
        GatherError::MemberTooManyRounds {
            name: "x".into(),
            from: 1,
            limit: 1,
        },
    ];
    assert!(!honest.iter().any(GatherError::is_forgery));
    // Every forgery is one `request` never makes: its lists are ascending, non-empty, and
    // include the sender (the caller checks that).
    let r = request("x", &set(&[2, 0, 1]), vec![], Duration::ZERO).unwrap();
    assert_eq!(r.contribution.expected, vec![0, 1, 2]);
}

#[test]
fn a_member_is_told_a_timeout_naming_the_missing_else_the_leaders_failure() {
    assert_eq!(
        GatherFailure::Missing(vec![2, 3]).told(0),
        GatherEnd::TimedOut(vec![2, 3])
    );
    let wrong = GatherFailure::WrongMembers {
        got: vec![0],
        expected: vec![0, 1],
    };
    let message = wrong.to_string();
    let GatherEnd::Failed(super::super::CallError::Remote(e)) = wrong.told(4) else {
        panic!("the leader's failure");
    };
    assert_eq!(
        (e.worker, e.kind, e.message),
        (4, super::super::RemoteErrorKind::Failed, message)
    );
}

#[test]
fn a_barrier_among_workers_is_only_theirs() {
    assert!(check_among("b", (1, "w1"), &set(&[0, 1])).is_ok());
    let e = check_among("b", (2, "w2"), &set(&[0, 1])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "barrier_among \"b\": this worker (w2) is not among the workers listed"
    );
}

#[test]
fn the_leaders_debug_view_counts_what_it_holds() {
    let mut l = GatherLeader::new(0, GatherConfig::default());
    assert_eq!(l.debug_info(), GatherDebugInfo::default());
    let now = Instant::now();
    l.handle_contribution(now, 1, contribution("g", &[0, 1], 1000, b"abc"));
    let info = l.debug_info();
    assert_eq!((info.rounds, info.held_bytes, info.waiting), (1, 3, 1));
    assert_eq!(info.to_string(), "gathers led 1 (3 bytes, 1 waiting)");
}
