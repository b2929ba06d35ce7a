//! A seeded cluster simulation of distributed autograd.
//!
//! [`run`] builds random forward passes over N workers (chains, diamonds, nested calls that come
//! back to a worker already on the path such as A→B→C→A, a tensor sent twice or a result used
//! twice), then runs every context's backward at once, delivering messages over per-pair FIFO
//! links in a random order, running local engine work at random moments, and (when asked)
//! killing a worker in the middle and telling each survivor at a random later moment, or (when
//! asked) with one worker's engine failing every local run of each context's first backward.
//! Some
//! contexts can be left idle (forward pass only, no backward): a killed worker's idle contexts
//! must then vanish from every survivor, as its other contexts do.
//!
//! The model engine is linear: every local node is a weighted sum of leaves (parameters),
//! received tensors and earlier nodes, so the exact gradient of every leaf is known from the
//! forward pass. After every step and at the end it checks:
//!
//! - a backward that succeeds does so only when no worker has work left in its context and no
//!   gradient of it is in flight, and every leaf's gradient equals the exact one (after a
//!   death: on every worker that still holds the context);
//! - with no death, every backward succeeds and no message is a protocol violation;
//! - a backward that fails names a dead worker, or the worker whose engine failed; one that
//!   failed on an engine is reported only once no work of it is left anywhere, leaves the
//!   context on every worker, and is run again (the engine healed), when it must succeed with
//!   the exact gradients on top of what the failed pass accumulated;
//! - at the end (after the roots release their contexts) every live worker holds no context
//!   and is idle; nothing hangs.
//!
//! A failed check panics with the seed; `TW_SIM_SEED=<seed>` replays it (see the tests).

use std::collections::{BTreeMap, BTreeSet};

use super::{
    AutogradMessageId, BackwardError, ContextId, DistAutograd, Entry, GradientId, Output,
    RequestToken, Root, TaskId,
};
use crate::name::WorkerId;
use crate::sim::{Links, SimRng};

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Workers (at least 2).
    pub workers: usize,
    /// Concurrent contexts, each rooted on a random worker.
    pub contexts: usize,
    /// How deep calls nest.
    pub max_depth: usize,
    /// Kill one random worker during the backward.
    pub kill: bool,
    /// Contexts whose forward pass runs but whose backward never does (a worker that made one
    /// and died must leave it on no survivor).
    pub idle_contexts: usize,
    /// One random worker's engine fails every local run in each context until that context's
    /// backward has failed once; the root then runs it again.
    pub faulty_engine: bool,
}

/// What a run did, for tests that want more than "no check failed".
#[derive(Debug, Clone, Default)]
pub struct SimReport {
    /// Backward passes that succeeded.
    pub succeeded: usize,
    /// Backward passes that failed (each naming a dead worker).
    pub failed: usize,
    /// Gradient messages delivered.
    pub gradients: usize,
    /// Contexts whose forward pass came back to a worker already on the call path.
    pub cycles: usize,
    /// The worker killed, if any.
    pub killed: Option<WorkerId>,
    /// Idle contexts (no backward) made by the worker killed: every survivor dropped them.
    pub idle_of_dead: usize,
    /// Backward passes that failed on the faulty engine and were run again.
    pub retried: usize,
    /// Gradients that arrived after their context was dropped on the receiver (late: dropped
    /// and answered, not a violation).
    pub late_gradients: usize,
    /// Gradients that rode in answers to gradient requests ([`Output::ReplyWithGradients`]).
    pub carried: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Input {
    Leaf(usize),
    Recv(AutogradMessageId),
    Node(usize),
}

#[derive(Debug, Default)]
struct Graph {
    /// Node i: weighted inputs (all `Node` inputs have smaller indices).
    nodes: Vec<Vec<(Input, f64)>>,
    /// Message sent -> the node whose value it carried.
    sends: BTreeMap<AutogradMessageId, usize>,
    root: Option<usize>,
    /// Accumulated leaf gradients.
    grads: BTreeMap<usize, f64>,
}

#[derive(Debug)]
enum Msg {
    Gradient {
        context: ContextId,
        message: AutogradMessageId,
        gradient: GradientId,
        value: f64,
    },
    Reply {
        context: ContextId,
        gradient: GradientId,
        result: Result<(), BackwardError>,
        /// Gradients riding in the answer ([`Output::ReplyWithGradients`]).
        carried: Vec<(AutogradMessageId, f64)>,
    },
    Release {
        context: ContextId,
        cause: Option<BackwardError>,
    },
}

#[derive(Debug)]
struct Worker {
    state: DistAutograd,
    graphs: BTreeMap<ContextId, Graph>,
    /// Seed gradient of each task started by an incoming gradient.
    seeds: BTreeMap<TaskId, f64>,
    /// Local runs waiting to be executed: (task, context, entry).
    jobs: Vec<(TaskId, ContextId, Entry)>,
    /// Gradients a finished run produced for its recv functions.
    produced: BTreeMap<(TaskId, AutogradMessageId), f64>,
    /// Incoming requests: token -> (requester, its gradient id, context).
    requests: BTreeMap<RequestToken, (WorkerId, GradientId, ContextId)>,
    next_token: RequestToken,
    alive: bool,
}

const LEAVES: usize = 3;

/// A value as a linear form over every worker's leaves: (worker, leaf) -> weight.
type Form = BTreeMap<(WorkerId, usize), f64>;

struct Sim {
    rng: SimRng,
    seed: u64,
    workers: Vec<Worker>,
    links: Links<(WorkerId, WorkerId), Msg>,
    /// Peer-lost notices not yet delivered: (survivor, dead).
    notices: Vec<(WorkerId, WorkerId)>,
    /// Root context -> (root worker, expected gradients per (worker, leaf)).
    expected: BTreeMap<ContextId, (WorkerId, Form)>,
    outcomes: BTreeMap<ContextId, Result<(), BackwardError>>,
    dead: BTreeSet<WorkerId>,
    /// Contexts whose backward never runs.
    idle: BTreeSet<ContextId>,
    /// The worker whose engine fails, if any, and the contexts where it works again.
    faulty: Option<WorkerId>,
    healed: BTreeSet<ContextId>,
    /// Leaf gradients a failed pass left, which the next pass adds to.
    baseline: BTreeMap<ContextId, Form>,
    report: SimReport,
}

/// Runs one seeded simulation; panics (naming the seed) when a check fails.
pub fn run(seed: u64, config: &SimConfig) -> SimReport {
    let n = config.workers.max(2);
    let mut sim = Sim {
        rng: SimRng::new(seed),
        seed,
        workers: (0..n)
            .map(|i| Worker {
                state: DistAutograd::new(i as WorkerId),
                graphs: BTreeMap::new(),
                seeds: BTreeMap::new(),
                jobs: Vec::new(),
                produced: BTreeMap::new(),
                requests: BTreeMap::new(),
                next_token: 0,
                alive: true,
            })
            .collect(),
        links: Links::new(),
        notices: Vec::new(),
        expected: BTreeMap::new(),
        outcomes: BTreeMap::new(),
        dead: BTreeSet::new(),
        idle: BTreeSet::new(),
        faulty: None,
        healed: BTreeSet::new(),
        baseline: BTreeMap::new(),
        report: SimReport::default(),
    };
    if config.faulty_engine {
        sim.faulty = Some(sim.rng.below(n) as WorkerId);
    }
    for _ in 0..config.contexts.max(1) {
        sim.forward(config.max_depth);
    }
    let roots: Vec<(ContextId, WorkerId)> =
        sim.expected.iter().map(|(c, (w, _))| (*c, *w)).collect();
    for _ in 0..config.idle_contexts {
        let context = sim.forward(config.max_depth);
        sim.idle.insert(context);
    }
    for (context, root) in roots {
        let w = &mut sim.workers[root as usize];
        if let Err(e) = w.state.backward(context, false, &[Root::scalar()]) {
            sim.fail(&format!("backward refused: {e}"));
        }
        sim.pump(root);
    }
    let kill_at = config.kill.then(|| sim.rng.below(40));
    let mut step = 0usize;
    loop {
        if Some(step) == kill_at {
            sim.kill();
        }
        step += 1;
        if step > 1_000_000 {
            sim.fail("the simulation does not end");
        }
        if !sim.step() {
            if config.kill && sim.dead.is_empty() {
                // Everything ended before the kill came: the worker dies now, with its idle
                // contexts open.
                sim.kill();
                continue;
            }
            break;
        }
    }
    if let Some(victim) = sim.report.killed {
        sim.report.idle_of_dead = sim.idle.iter().filter(|c| c.worker() == victim).count();
    }
    // The roots release what they still hold (a user leaving the context's scope).
    let held: Vec<(ContextId, WorkerId)> =
        sim.expected.iter().map(|(c, (w, _))| (*c, *w)).collect();
    for (context, root) in held {
        let w = &mut sim.workers[root as usize];
        if w.alive && w.state.has_context(context) {
            w.state.release(context).expect("held");
            sim.pump(root);
        }
    }
    while sim.step() {}
    sim.check_end();
    sim.report
}

impl Sim {
    fn fail(&self, what: &str) -> ! {
        panic!(
            "autograd simulation, seed {} (replay with TW_SIM_SEED={}): {what}",
            self.seed, self.seed
        )
    }

    fn coef(&mut self) -> f64 {
        (self.rng.below(5) as f64) - 2.0 + if self.rng.chance(50) { 0.5 } else { 0.0 }
    }

    fn graph(&mut self, w: WorkerId, c: ContextId) -> &mut Graph {
        self.workers[w as usize].graphs.entry(c).or_default()
    }

    fn add_node(&mut self, w: WorkerId, c: ContextId, inputs: Vec<(Input, f64)>) -> usize {
        let g = self.graph(w, c);
        g.nodes.push(inputs);
        g.nodes.len() - 1
    }

    /// One forward pass rooted on a random worker.
    fn forward(&mut self, max_depth: usize) -> ContextId {
        let n = self.workers.len();
        let root = self.rng.below(n) as WorkerId;
        let context = self.workers[root as usize]
            .state
            .new_context()
            .expect("ids left");
        let mut path = vec![root];
        let mut cycle = false;
        let node = self.build(context, root, None, 0, max_depth, &mut path, &mut cycle);
        self.graph(root, context).root = Some(node);
        if cycle {
            self.report.cycles += 1;
        }
        // Exact gradients: every value as a linear form over all leaves.
        let mut forms: BTreeMap<(WorkerId, usize), Form> = BTreeMap::new();
        let expected = self.form(root, context, node, &mut forms);
        self.expected.insert(context, (root, expected));
        context
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        &mut self,
        context: ContextId,
        w: WorkerId,
        received: Option<AutogradMessageId>,
        depth: usize,
        max_depth: usize,
        path: &mut Vec<WorkerId>,
        cycle: &mut bool,
    ) -> usize {
        let n = self.workers.len();
        let mut inputs = Vec::new();
        if let Some(m) = received {
            let c = self.coef();
            inputs.push((Input::Recv(m), c));
        }
        let leaf = self.rng.below(LEAVES);
        let c = self.coef();
        inputs.push((Input::Leaf(leaf), c));
        let calls = if depth < max_depth {
            self.rng.below(3) + usize::from(depth == 0)
        } else {
            0
        };
        for _ in 0..calls {
            let mut callee = self.rng.below(n - 1) as WorkerId;
            if callee >= w {
                callee += 1;
            }
            // The argument: a node made here before (a tensor sent twice), or a new one.
            let existing = self.graph(w, context).nodes.len();
            let arg = if existing > 0 && self.rng.chance(40) {
                self.rng.below(existing)
            } else {
                let leaf = self.rng.below(LEAVES);
                let c = self.coef();
                self.add_node(w, context, vec![(Input::Leaf(leaf), c)])
            };
            let msg = self.workers[w as usize]
                .state
                .record_send(context, callee, 1)
                .expect("context here");
            self.graph(w, context).sends.insert(msg, arg);
            let capability = self.workers[w as usize]
                .state
                .capability(context)
                .expect("context here");
            if let Err(e) = self.workers[callee as usize]
                .state
                .handle_recv(w, context, capability, msg)
            {
                self.fail(&format!("forward recv: {e}"));
            }
            // Most requests' tensors land on the host (their gradients may ride in answers);
            // some do not (they go back in requests of their own).
            if self.rng.chance(75) {
                self.workers[callee as usize]
                    .state
                    .recv_came_in_request(context, msg);
            }
            if path.contains(&callee) {
                *cycle = true;
            }
            path.push(callee);
            let result = self.build(
                context,
                callee,
                Some(msg),
                depth + 1,
                max_depth,
                path,
                cycle,
            );
            path.pop();
            let back = self.workers[callee as usize]
                .state
                .record_send(context, w, 1)
                .expect("context there");
            self.graph(callee, context).sends.insert(back, result);
            if let Err(e) = self.workers[w as usize]
                .state
                .handle_recv(callee, context, capability, back)
            {
                self.fail(&format!("forward recv: {e}"));
            }
            let c = self.coef();
            inputs.push((Input::Recv(back), c));
            if self.rng.chance(25) {
                // The result used twice.
                let c = self.coef();
                inputs.push((Input::Recv(back), c));
            }
        }
        let existing = self.graph(w, context).nodes.len();
        if existing > 0 && self.rng.chance(30) {
            // An earlier node (perhaps one sent away too) feeds this one as well.
            let j = self.rng.below(existing);
            let c = self.coef();
            inputs.push((Input::Node(j), c));
        }
        self.add_node(w, context, inputs)
    }

    fn form(
        &self,
        w: WorkerId,
        context: ContextId,
        node: usize,
        memo: &mut BTreeMap<(WorkerId, usize), Form>,
    ) -> Form {
        if let Some(f) = memo.get(&(w, node)) {
            return f.clone();
        }
        let g = &self.workers[w as usize].graphs[&context];
        let mut out = Form::new();
        for (input, c) in g.nodes[node].clone() {
            let f = match input {
                Input::Leaf(l) => BTreeMap::from([((w, l), 1.0)]),
                Input::Node(j) => self.form(w, context, j, memo),
                Input::Recv(m) => {
                    let sender = m.worker();
                    let sg = &self.workers[sender as usize].graphs[&context];
                    self.form(sender, context, sg.sends[&m], memo)
                }
            };
            for (k, v) in f {
                *out.entry(k).or_default() += c * v;
            }
        }
        memo.insert((w, node), out.clone());
        out
    }

    /// Carries out worker `w`'s outputs.
    fn pump(&mut self, w: WorkerId) {
        while let Some(o) = self.workers[w as usize].state.poll() {
            match o {
                Output::Prepare { .. } => {}
                Output::RunLocal {
                    task,
                    context,
                    entry,
                } => self.workers[w as usize].jobs.push((task, context, entry)),
                Output::SendGradient {
                    gradient,
                    task,
                    to,
                    context,
                    message,
                } => {
                    let value = self.workers[w as usize]
                        .produced
                        .remove(&(task, message))
                        .unwrap_or_else(|| self.fail("a gradient nobody produced"));
                    self.send(
                        w,
                        to,
                        Msg::Gradient {
                            context,
                            message,
                            gradient,
                            value,
                        },
                    );
                }
                Output::Reply {
                    to,
                    request,
                    result,
                } => {
                    let (requester, gradient, context) = self.workers[w as usize]
                        .requests
                        .remove(&request)
                        .unwrap_or_else(|| self.fail("a reply to an unknown request"));
                    if requester != to {
                        self.fail("a reply to the wrong worker");
                    }
                    self.send(
                        w,
                        to,
                        Msg::Reply {
                            context,
                            gradient,
                            result,
                            carried: Vec::new(),
                        },
                    );
                }
                Output::ReplyWithGradients {
                    to,
                    request,
                    task,
                    context: _,
                    messages,
                } => {
                    let (requester, gradient, context) = self.workers[w as usize]
                        .requests
                        .remove(&request)
                        .unwrap_or_else(|| self.fail("an answer to an unknown request"));
                    if requester != to {
                        self.fail("an answer to the wrong worker");
                    }
                    let carried = messages
                        .iter()
                        .map(|m| {
                            let value = self.workers[w as usize]
                                .produced
                                .remove(&(task, *m))
                                .unwrap_or_else(|| self.fail("a gradient nobody produced"));
                            (*m, value)
                        })
                        .collect();
                    self.report.carried += messages.len();
                    self.send(
                        w,
                        to,
                        Msg::Reply {
                            context,
                            gradient,
                            result: Ok(()),
                            carried,
                        },
                    );
                }
                Output::BackwardDone { context, result } => {
                    if self.outcomes.contains_key(&context) {
                        self.fail(&format!("{context} finished twice"));
                    }
                    match &result {
                        Ok(()) => self.check_success(context),
                        Err(BackwardError::Engine { worker, .. })
                            if Some(*worker) == self.faulty && !self.healed.contains(&context) =>
                        {
                            self.check_failed_on_engine(context);
                            if self.retry(w, context) {
                                continue;
                            }
                        }
                        Err(e) if !self.dead.contains(&e.worker()) => {
                            self.fail(&format!("{context} failed naming a live worker: {e}"))
                        }
                        Err(_) => {}
                    }
                    self.outcomes.insert(context, result);
                }
                Output::Release { to, context, cause } => {
                    self.send(w, to, Msg::Release { context, cause })
                }
                Output::Dropped { context } => {
                    let worker = &mut self.workers[w as usize];
                    worker.graphs.remove(&context);
                    worker.jobs.retain(|j| j.1 != context);
                }
            }
        }
    }

    fn send(&mut self, from: WorkerId, to: WorkerId, msg: Msg) {
        if self.workers[from as usize].alive && self.workers[to as usize].alive {
            self.links.send((from, to), msg);
        }
    }

    /// One random action; false when nothing is left to do.
    fn step(&mut self) -> bool {
        let links = self.links.ready();
        let jobs: Vec<(WorkerId, usize)> = self
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.alive)
            .flat_map(|(i, w)| (0..w.jobs.len()).map(move |j| (i as WorkerId, j)))
            .collect();
        let choices = links.len() + jobs.len() + self.notices.len();
        if choices == 0 {
            return false;
        }
        let pick = self.rng.below(choices);
        if pick < links.len() {
            let (from, to) = links[pick];
            let msg = self.links.pop((from, to)).expect("ready");
            self.deliver(from, to, msg);
        } else if pick < links.len() + jobs.len() {
            let (w, j) = jobs[pick - links.len()];
            let job = self.workers[w as usize].jobs.remove(j);
            self.run_local(w, job);
        } else {
            let (survivor, dead) = self.notices.remove(pick - links.len() - jobs.len());
            if self.workers[survivor as usize].alive {
                self.workers[survivor as usize].state.handle_peer_lost(dead);
                self.pump(survivor);
            }
        }
        true
    }

    fn deliver(&mut self, from: WorkerId, to: WorkerId, msg: Msg) {
        match msg {
            Msg::Gradient {
                context,
                message,
                gradient,
                value,
            } => {
                self.report.gradients += 1;
                let worker = &mut self.workers[to as usize];
                let token = worker.next_token;
                worker.next_token += 1;
                match worker
                    .state
                    .handle_gradient(from, context, message, 1, token)
                {
                    Ok(task) => {
                        if let Some(task) = task {
                            worker.seeds.insert(task, value);
                        } else {
                            // A gradient that crossed the release (or the loss) of its context:
                            // dropped and answered with the reason, never a violation.
                            self.report.late_gradients += 1;
                        }
                        worker.requests.insert(token, (from, gradient, context));
                    }
                    Err(v) => {
                        // Gradients go only to workers that sent the message in this context,
                        // and a context dropped there is remembered: a violation is a bug.
                        self.fail(&format!("violation in a normal flow: {v}"));
                    }
                }
            }
            Msg::Reply {
                gradient,
                result,
                carried,
                ..
            } => {
                if carried.is_empty() {
                    self.workers[to as usize]
                        .state
                        .handle_gradient_reply(gradient, result)
                } else {
                    let messages: Vec<AutogradMessageId> =
                        carried.iter().map(|(m, _)| *m).collect();
                    let worker = &mut self.workers[to as usize];
                    match worker.state.handle_gradient_reply_with(gradient, &messages) {
                        Ok(tasks) => {
                            for (task, (_, value)) in tasks.into_iter().zip(carried) {
                                worker.seeds.insert(task, value);
                            }
                        }
                        Err(v) => self.fail(&format!("violation in an answer: {v}")),
                    }
                }
            }
            Msg::Release { context, cause } => {
                if let Err(v) = self.workers[to as usize]
                    .state
                    .handle_release(from, context, cause)
                {
                    self.fail(&format!("violation in a release: {v}"));
                }
            }
        }
        self.pump(to);
    }

    /// The model engine: propagates the seed from `entry` through the local nodes.
    fn run_local(&mut self, w: WorkerId, (task, context, entry): (TaskId, ContextId, Entry)) {
        if Some(w) == self.faulty && !self.healed.contains(&context) {
            let worker = &mut self.workers[w as usize];
            worker.seeds.remove(&task);
            worker.state.local_failed(task, "simulated engine failure");
            self.pump(w);
            return;
        }
        let worker = &mut self.workers[w as usize];
        let Some(g) = worker.graphs.get_mut(&context) else {
            return;
        };
        let (start, seed) = match entry {
            Entry::Roots => (g.root.expect("root graph"), 1.0),
            Entry::Send(m) => (
                g.sends[&m],
                worker.seeds.remove(&task).expect("seeded task"),
            ),
        };
        let mut node_grads = vec![0.0; g.nodes.len()];
        node_grads[start] = seed;
        let mut recv_grads: BTreeMap<AutogradMessageId, f64> = BTreeMap::new();
        for i in (0..=start).rev() {
            let gi = node_grads[i];
            if gi == 0.0 {
                continue;
            }
            for (input, c) in g.nodes[i].clone() {
                match input {
                    Input::Leaf(l) => *g.grads.entry(l).or_default() += c * gi,
                    Input::Node(j) => node_grads[j] += c * gi,
                    Input::Recv(m) => *recv_grads.entry(m).or_default() += c * gi,
                }
            }
        }
        let reached: Vec<AutogradMessageId> = recv_grads.keys().copied().collect();
        for (m, v) in recv_grads {
            worker.produced.insert((task, m), v);
        }
        worker.state.local_done(task, &reached);
        self.pump(w);
    }

    fn kill(&mut self) {
        let n = self.workers.len();
        let victim = self.rng.below(n) as WorkerId;
        self.workers[victim as usize].alive = false;
        self.dead.insert(victim);
        self.report.killed = Some(victim);
        self.links.retain(|(a, b)| a != victim && b != victim);
        for s in 0..n as WorkerId {
            if s != victim {
                self.notices.push((s, victim));
            }
        }
    }

    /// A backward of `context` failed on the faulty engine: no work of it is left anywhere, and
    /// (without a death) every worker it reached still holds the context.
    fn check_failed_on_engine(&mut self, context: ContextId) {
        self.check_quiet(context);
        if self.dead.is_empty() {
            for w in &self.workers {
                if w.graphs.contains_key(&context) && !w.state.has_context(context) {
                    self.fail(&format!(
                        "{context} failed on an engine and worker {} dropped it",
                        w.state.worker()
                    ));
                }
            }
        }
    }

    /// Runs the backward of `context` again from its root `w`, the faulty engine healed for
    /// it; what the failed pass accumulated becomes the baseline. False when the root no
    /// longer holds the context (a death dropped it meanwhile).
    fn retry(&mut self, w: WorkerId, context: ContextId) -> bool {
        if !self.workers[w as usize].state.has_context(context) {
            return false;
        }
        self.healed.insert(context);
        self.report.retried += 1;
        let mut baseline = Form::new();
        for (i, worker) in self.workers.iter().enumerate() {
            if let Some(g) = worker.graphs.get(&context) {
                for (l, v) in &g.grads {
                    baseline.insert((i as WorkerId, *l), *v);
                }
            }
        }
        self.baseline.insert(context, baseline);
        if let Err(e) = self.workers[w as usize]
            .state
            .backward(context, false, &[Root::scalar()])
        {
            self.fail(&format!(
                "{context}: the backward after a failure is refused: {e}"
            ));
        }
        true
    }

    /// No work of `context` is running or queued anywhere, and none of its gradients or answers
    /// is in flight.
    fn check_quiet(&mut self, context: ContextId) {
        for w in &self.workers {
            if w.alive && w.state.is_busy(context) {
                self.fail(&format!(
                    "{context} finished while worker {} still works in it",
                    w.state.worker()
                ));
            }
            if w.alive && w.jobs.iter().any(|j| j.1 == context) {
                self.fail(&format!(
                    "{context} finished while worker {} has a local run queued",
                    w.state.worker()
                ));
            }
        }
        for (_, q) in self.links.iter() {
            for m in q {
                let c = match m {
                    Msg::Gradient { context, .. } | Msg::Reply { context, .. } => *context,
                    Msg::Release { .. } => continue,
                };
                if c == context {
                    self.fail(&format!("{context} finished with a gradient in flight"));
                }
            }
        }
    }

    fn check_success(&mut self, context: ContextId) {
        self.report.succeeded += 1;
        self.check_quiet(context);
        let expected = self.expected[&context].1.clone();
        let baseline = self.baseline.get(&context).cloned().unwrap_or_default();
        for (i, w) in self.workers.iter().enumerate() {
            let got = w.graphs.get(&context).map(|g| g.grads.clone());
            if !self.dead.is_empty() && (got.is_none() || !w.alive) {
                // A worker that learned of a death after its part was done has dropped the
                // context (and its gradients) by now: nothing to compare.
                continue;
            }
            for l in 0..LEAVES {
                let want = expected.get(&(i as WorkerId, l)).copied().unwrap_or(0.0)
                    + baseline.get(&(i as WorkerId, l)).copied().unwrap_or(0.0);
                let have = got.as_ref().and_then(|g| g.get(&l).copied()).unwrap_or(0.0);
                if (want - have).abs() > 1e-9 * want.abs().max(1.0) {
                    self.fail(&format!(
                        "{context}: worker {i} leaf {l} has gradient {have}, expected {want}"
                    ));
                }
            }
        }
    }

    fn check_end(&mut self) {
        for (context, (root, _)) in self.expected.clone() {
            let root_alive = self.workers[root as usize].alive;
            if self.idle.contains(&context) {
                continue;
            }
            match self.outcomes.get(&context) {
                None if root_alive => self.fail(&format!("{context}'s backward never finished")),
                Some(Err(e)) if self.dead.is_empty() => {
                    self.fail(&format!("{context} failed with no death: {e}"))
                }
                Some(Err(_)) => self.report.failed += 1,
                _ => {}
            }
        }
        for w in &self.workers {
            if !w.alive {
                continue;
            }
            if w.state.context_count() != 0 {
                self.fail(&format!(
                    "worker {} still holds {} context(s) at the end",
                    w.state.worker(),
                    w.state.context_count()
                ));
            }
            if !w.state.is_idle() {
                self.fail(&format!(
                    "worker {} is not idle at the end",
                    w.state.worker()
                ));
            }
        }
    }
}
