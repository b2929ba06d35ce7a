//! The simulated cluster's groups: the static join, a dynamic group's founding, joins and
//! leaves (with their membership messages and events), lost connections, and the graceful
//! shutdown at the end of a run.

use super::*;

impl Cluster {
    /// A static group's init ([`StaticJoin`]): connections made and handshake messages
    /// delivered in a seeded order. Sometimes one rank never starts: every other worker's join
    /// fails at its deadline naming it (and then the group starts again, whole). Else every
    /// join completes, and only after rank 0 heard every worker.
    pub(super) fn static_join(&mut self, rng: &mut SimRng) {
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
    pub(super) fn found_group(&mut self, rng: &mut SimRng) {
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
    pub(super) fn start_join(&mut self, w: WorkerId) {
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
        // A new incarnation draws a new key.
        let key = super::sim_key(self.seed ^ self.stats.rejoins as u64, w);
        self.eps[w as usize].set_secret_key(key);
        self.apps[w as usize] = App::default();
        self.links.retain(|(f, t)| f != w && t != w);
        self.pump();
    }

    /// Worker `w` begins leaving: its endpoint settles, then the coordinator removes it.
    pub(super) fn start_leave(&mut self, w: WorkerId) {
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
    pub(super) fn progress_leaves(&mut self) {
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
    pub(super) fn leave_all(&mut self, rng: &mut SimRng) {
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
    pub(super) fn shut_down(&mut self, rng: &mut SimRng) {
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
    pub(super) fn leave(&mut self, w: WorkerId, rng: &mut SimRng) {
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

    /// Members of a dynamic group that are not leaving (0 for a static group): the workload
    /// always keeps one.
    pub(super) fn staying(&self) -> usize {
        self.group.as_ref().map_or(0, |g| {
            self.alive()
                .iter()
                .filter(|w| !g.leaving.contains_key(w))
                .count()
        })
    }

    /// Whether `w` has no connections: outside a dynamic group and not joining.
    pub(super) fn is_gone(&self, w: WorkerId) -> bool {
        self.group
            .as_ref()
            .is_some_and(|g| g.ms.get(w as usize).is_none_or(Option::is_none))
    }

    /// Moves membership messages to their links and acts on membership events as the driver
    /// does. Returns whether anything moved.
    pub(super) fn pump_membership(&mut self) -> bool {
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

    pub(super) fn membership_event(&mut self, w: WorkerId, ev: MembershipEvent) {
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

    pub(super) fn deliver_membership(&mut self, from: WorkerId, to: WorkerId) {
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

    /// `w`'s connections close (it left, or its join failed): it is outside the group, and
    /// every worker that knew it sees it lost, after what it sent before (a connection
    /// delivers what was sent before it closes).
    pub(super) fn disconnect(&mut self, w: WorkerId) {
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
                self.eps[other as usize].handle_peer_lost(w, super::lost_link(), now);
            }
        }
    }
}
