//! The engine side of distributed autograd: what a worker does once its state machine
//! (`tensorwire_core::autograd`) has spoken — requests tracked and answered, gradients placed,
//! sent and received, releases fanned out, backward tasks run on the local engine.

// The state, messages and helpers of the parent module.
use super::*;
use std::time::Instant;
use tensorwire_core::autograd::{ProtocolViolation, Recv};
use tensorwire_core::capability::Capability;
use tensorwire_core::protocol::ProtocolViolation as CoreViolation;
use tensorwire_core::tensor::DType;

/// A send function's message and the seed gradients it runs with.
type Seeded<E> = (
    AutogradMessageId,
    Vec<Option<<E as AutogradEngine>::Tensor>>,
);

/// What the driver does after the state machine spoke, outside the lock.
pub(super) enum Action<E: AutogradEngine> {
    Run {
        task: TaskId,
        roots: Roots<E>,
        context: ContextId,
    },
    Gradient {
        gradient: GradientId,
        to: WorkerId,
        req: GradientRequest,
        placement: RecvPlacement,
    },
    GradientFailed {
        gradient: GradientId,
        error: BackwardError,
    },
    Release {
        to: WorkerId,
        req: ReleaseRequest,
    },
    Reply {
        tx: oneshot::Sender<Result<(), BackwardError>>,
        result: Result<(), BackwardError>,
    },
    /// The answer to a gradient request.
    Answer {
        tx: Answerer,
        answer: GradientAnswer,
    },
    Drop(Box<ContextData<E>>),
}

/// Where the answer to a gradient request goes: the request's reply itself, written by the
/// thread that carries out the state machine's answer (the runner that ran the pass the
/// request started, with no hand-off back to a runtime worker), or the request's task (when
/// the agent could not hand the reply over: a call run inline by a current-thread runtime).
pub(super) enum Answerer {
    Reply(AnswerReply),
    Task(oneshot::Sender<GradientAnswer>),
}

impl Answerer {
    fn send(self, answer: GradientAnswer) {
        match self {
            Answerer::Reply(mut r) => {
                if let Some(reply) = r.reply.take() {
                    reply.send(Ok::<_, String>(answer));
                }
            }
            Answerer::Task(tx) => drop(tx.send(answer)),
        }
    }
}

/// A gradient request's reply, taken from its task. Dropped unanswered (this worker's
/// autograd state went away), it answers that the backward stopped here, as the request's task
/// did when its answer never came.
pub(super) struct AnswerReply {
    reply: Option<tensorwire_rpc::Reply>,
    worker: WorkerId,
    context: ContextId,
}

impl Drop for AnswerReply {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            let stopped: GradientAnswer = Err(BackwardError::Stopped {
                worker: self.worker,
                context: self.context,
            });
            reply.send(Ok::<_, String>(stopped));
        }
    }
}

impl<E: AutogradEngine> Inner<E> {
    pub(super) fn lock(&self) -> MutexGuard<'_, Shared<E>> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn timeout(&self) -> Option<Duration> {
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn named(&self, e: BackwardError) -> DistAutogradError {
        let worker = e.worker();
        let name = self.agent.name_of(worker);
        DistAutogradError::Backward {
            message: format!("{name} (rank {worker}): {e}"),
            worker,
            source: e,
        }
    }

    /// Records the send of `tensors` to `to` and builds the request. With `force` the send
    /// is recorded even without tensors: a call made in a context always is (PyTorch records
    /// every Python call in a context), so the callee holds the context and may return
    /// tracked tensors, or send them on, whatever its arguments were.
    pub(super) fn send<'a, A: Serialize + ?Sized>(
        &self,
        context: ContextId,
        to: WorkerId,
        tensors: &[E::Tensor],
        args: &'a A,
        force: bool,
    ) -> Result<ForwardRequest<&'a A>, DistAutogradError> {
        let wire = tensors
            .iter()
            .map(|t| self.engine.export(t))
            .collect::<Result<Vec<_>, _>>()?;
        let requires_grad = tensors
            .iter()
            .map(|t| self.engine.requires_grad(t))
            .collect();
        let mut sh = self.lock();
        let capability = sh
            .state
            .capability(context)
            .ok_or(AutogradError::UnknownContext(context))?;
        let message = if tensors.is_empty() && !force {
            None
        } else {
            let m = sh.state.record_send(context, to, tensors.len())?;
            sh.data
                .entry(context)
                .or_insert_with(ContextData::new)
                .sends
                .insert(m, tensors.to_vec());
            Some(m)
        };
        drop(sh);
        Ok(ForwardRequest {
            context,
            capability,
            message,
            tensors: wire,
            requires_grad,
            args,
        })
    }

    /// Callee side of a forward call: records the recv and tracks the tensors.
    pub(super) async fn receive(
        self: &Arc<Self>,
        caller: WorkerId,
        req: super::Received<'_>,
    ) -> Result<(AutogradContext<E>, Vec<E::Tensor>), String> {
        let (context_id, tensors, requires_grad) = (req.context, req.tensors, req.requires_grad);
        let tracked = match req.message {
            Some(m) => {
                self.track(
                    caller,
                    (context_id, req.capability),
                    m,
                    tensors,
                    requires_grad,
                    Direction::Request,
                )
                .await?
            }
            None => {
                if !tensors.is_empty() {
                    return Err("tensors without an autograd message id".into());
                }
                Vec::new()
            }
        };
        let context = AutogradContext {
            span: context_span(&self.agent, context_id),
            inner: self.clone(),
            id: context_id,
            owned: false,
        };
        Ok((context, tracked))
    }

    /// Records a recv from `from` and returns its tensors, those that required grad on the
    /// sender (`requires_grad`, one per tensor) as tracked leaves. `moved_by` says
    /// which map placed them (a request's: the sender's map; a response's: the sender's
    /// reverse map): their gradients go back by the other. The devices they landed on are
    /// kept: the engine gets host copies, and each gradient is put back on its tensor's
    /// device before it is sent.
    pub(super) async fn track(
        &self,
        from: WorkerId,
        (context, capability): (ContextId, Capability),
        message: AutogradMessageId,
        tensors: &[Tensor],
        requires_grad: &[bool],
        moved_by: Direction,
    ) -> Result<Vec<E::Tensor>, String> {
        if requires_grad.len() != tensors.len() {
            let v = ProtocolViolation::MismatchedFlags {
                from,
                message,
                tensors: tensors.len(),
                flags: requires_grad.len(),
            };
            self.violation(from, &v);
            return Err(v.to_string());
        }
        let devices: Vec<Device> = tensors.iter().map(Tensor::device).collect();
        let mut tracked = Vec::with_capacity(tensors.len());
        for (t, &grad) in tensors.iter().zip(requires_grad) {
            let host = self.to_host(t).await?;
            tracked.push(self.engine.import(&host, grad).map_err(|e| e.to_string())?);
        }
        let first = self
            .lock()
            .state
            .handle_recv(from, context, capability, message);
        let mut sh;
        let recv = if first == Ok(Recv::AskCreator) {
            // Another worker's message made the copy held here with another capability:
            // only the creator can say which one is its own.
            let vouched = self.ask_creator(context, capability).await;
            sh = self.lock();
            sh.state
                .handle_vouch(from, context, capability, message, vouched)
        } else {
            sh = self.lock();
            first
        };
        match recv {
            Ok(Recv::Recorded) => {}
            // What a forgery's copy of the context kept here goes with it.
            Ok(Recv::ReplacedForgery) => drop(sh.data.remove(&context)),
            Ok(Recv::AskCreator) => unreachable!("the creator was asked"),
            Err(RecvError::Violation(v)) => {
                drop(sh);
                self.violation(from, &v);
                return Err(v.to_string());
            }
            Err(e) => return Err(e.to_string()),
        }
        // A request's tensors on the host: their gradients may ride in an answer to their
        // sender (an answer takes the reverse map, as a request's gradients do).
        if moved_by == Direction::Request && devices.iter().all(|d| d.is_cpu()) {
            sh.state.recv_came_in_request(context, message);
        }
        let data = sh.data.entry(context).or_insert_with(ContextData::new);
        for (i, t) in tracked.iter().enumerate() {
            if requires_grad[i] {
                data.recv_leaves
                    .insert(self.engine.leaf_id(t), (message, i));
            }
        }
        data.recvs.insert(message, tracked.clone());
        data.recv_devices.insert(
            message,
            RecvPlacement {
                devices,
                gradients_go: match moved_by {
                    Direction::Request => Direction::Response,
                    Direction::Response => Direction::Request,
                },
            },
        );
        Ok(tracked)
    }

    /// Whether the creator of `context` says `capability` is its own. A question that
    /// fails (the creator lost, its answer late) is a "no": the message is refused, and
    /// nobody is dropped for it.
    async fn ask_creator(&self, context: ContextId, capability: Capability) -> bool {
        let creator = context.worker();
        let req = VouchRequest {
            context,
            capability,
        };
        let asked = match self
            .agent
            .rpc_async::<_, bool>(creator, VOUCH, &req, self.timeout())
        {
            Ok(answer) => answer.await,
            Err(e) => Err(e),
        };
        asked.unwrap_or_else(|e| {
            warn!(
                "could not ask {} (rank {creator}) about the capability of {context}: {e}",
                self.agent.name_of(creator)
            );
            false
        })
    }

    /// Callee side: records the send of the result's tensors back to the caller.
    pub(super) fn respond<R>(
        &self,
        context: ContextId,
        caller: WorkerId,
        out: Vec<E::Tensor>,
        result: R,
    ) -> Result<ForwardResponse<R>, String> {
        let req = self
            .send(context, caller, &out, &(), false)
            .map_err(|e| e.to_string())?;
        Ok(ForwardResponse {
            message: req.message,
            tensors: req.tensors,
            requires_grad: req.requires_grad,
            result,
        })
    }

    /// `t` in host memory, for the engine (which computes on the host): copied off its device
    /// by the agent's device backend when it is on one.
    pub(super) async fn to_host(&self, t: &Tensor) -> Result<Tensor, String> {
        relocate(&**self.agent.device_backend(), t, Device::Cpu)
            .await
            .map_err(|e| {
                format!(
                    "a tensor on {} could not be copied to the host: {e}",
                    t.device()
                )
            })
    }

    /// `from` broke the autograd protocol (the state machine's verdict): counted, and the
    /// peer is dropped as for any violation of the RPC protocol
    /// ([`CoreViolation::Autograd`]) before the message is answered, so every call to it
    /// fails naming the violation and every context it took part in is dropped here.
    pub(super) fn violation(&self, from: WorkerId, v: &ProtocolViolation) {
        self.violations.fetch_add(1, Ordering::Relaxed);
        warn!(
            "autograd protocol violation by {} (rank {from}): {v}; dropping it",
            self.agent.name_of(from)
        );
        self.agent
            .fail_peer(from, CoreViolation::Autograd(v.clone()));
    }

    pub(super) async fn on_gradient(
        self: Arc<Self>,
        cx: CallContext,
        req: GradientRequest,
    ) -> Result<GradientAnswer, String> {
        let from = cx.caller().id;
        let mut seeds = Vec::with_capacity(req.grads.len());
        for g in &req.grads {
            seeds.push(match g {
                Some(t) => Some(
                    self.engine
                        .import(&self.to_host(t).await?, false)
                        .map_err(|e| e.to_string())?,
                ),
                None => None,
            });
        }
        let rx = {
            let mut sh = self.lock();
            let token = sh.next_token;
            sh.next_token += 1;
            // The count, and whether `from` may send this at all, are the state machine's to
            // judge; the shapes are for the tensors this worker sent under the message, which
            // only the driver holds (as for gradients that ride in an answer).
            let sent = sh.state.sent(req.context, req.message);
            let shapes = match (sent, sh.data.get(&req.context)) {
                (Some((to, n)), Some(d)) if to == from && n == seeds.len() => d
                    .sends
                    .get(&req.message)
                    .and_then(|tensors| self.differs(tensors, &seeds)),
                _ => None,
            };
            let handled = match shapes {
                Some(detail) => Err(ProtocolViolation::MismatchedGradients {
                    from,
                    context: req.context,
                    message: req.message,
                    detail,
                }),
                None => {
                    sh.state
                        .handle_gradient(from, req.context, req.message, req.grads.len(), token)
                }
            };
            match handled {
                Ok(task) => {
                    if let (Some(task), Some(d)) = (task, sh.data.get_mut(&req.context)) {
                        d.seeds.insert(task, seeds);
                    }
                    // The answer is written by whichever thread carries it out (the runner
                    // that ran the pass), not handed back to this task first.
                    match tensorwire_rpc::Reply::take() {
                        Some(reply) => {
                            let reply = AnswerReply {
                                reply: Some(reply),
                                worker: self.agent.worker_info().id,
                                context: req.context,
                            };
                            sh.requests.insert(token, Answerer::Reply(reply));
                            None
                        }
                        None => {
                            let (tx, rx) = oneshot::channel();
                            sh.requests.insert(token, Answerer::Task(tx));
                            Some(rx)
                        }
                    }
                }
                Err(v) => {
                    drop(sh);
                    self.violation(from, &v);
                    return Err(format!("protocol violation: {v}"));
                }
            }
        };
        self.pump();
        let Some(rx) = rx else {
            // The reply was taken: this outcome is not sent.
            return Ok(Ok(Vec::new()));
        };
        let span = context_span(&self.agent, req.context);
        // Every request is answered by the state machine (even when its context is dropped);
        // the sender goes away unanswered only with this worker's autograd state.
        Ok(rx.instrument(span).await.unwrap_or_else(|_| {
            Err(BackwardError::Stopped {
                worker: self.agent.worker_info().id,
                context: req.context,
            })
        }))
    }

    pub(super) async fn on_release(
        self: Arc<Self>,
        cx: CallContext,
        req: ReleaseRequest,
    ) -> Result<(), String> {
        let from = cx.caller().id;
        let r = self
            .lock()
            .state
            .handle_release(from, req.context, req.cause);
        if let Err(v) = r {
            self.violation(from, &v);
            return Err(format!("protocol violation: {v}"));
        }
        self.pump_and_wait_releases()
            .instrument(context_span(&self.agent, req.context))
            .await;
        Ok(())
    }

    /// Carries out what the state machine asked for. Releases are sent in the background.
    pub(super) fn pump(self: &Arc<Self>) {
        self.pump_on(false);
    }

    /// [`pump`](Self::pump) on a thread that may run the engine itself (the user's thread
    /// that started a backward pass, or the executor's, never a runtime worker): every run it
    /// starts runs here and now, with no hand-off to another thread and back.
    pub(super) fn pump_here(self: &Arc<Self>) {
        self.pump_on(true);
    }

    fn pump_on(self: &Arc<Self>, here: bool) {
        let inner = self.clone();
        let releases = self.pump_collect_on(here);
        if !releases.is_empty() {
            tokio::spawn(async move { inner.send_releases(releases).await });
        }
    }

    /// [`pump`](Self::pump), waiting for the releases it sends to be answered.
    pub(super) async fn pump_and_wait_releases(self: &Arc<Self>) {
        let releases = self.pump_collect();
        self.send_releases(releases).await;
    }

    pub(super) async fn send_releases(self: &Arc<Self>, releases: Vec<(WorkerId, ReleaseRequest)>) {
        let waits = self.start_releases(releases);
        self.await_releases(waits).await;
    }

    /// Sends the releases now (on the calling thread); their answers are left to
    /// [`await_releases`](Self::await_releases).
    pub(super) fn start_releases(
        &self,
        releases: Vec<(WorkerId, ReleaseRequest)>,
    ) -> Vec<(WorkerId, tensorwire_rpc::RpcFuture<()>)> {
        let mut waits = Vec::new();
        for (to, req) in releases {
            match self
                .agent
                .rpc_async::<_, ()>(to, RELEASE, &req, self.timeout())
            {
                Ok(f) => waits.push((to, f)),
                Err(e) => warn!(
                    "could not send the release of {} to rank {to}: {e}",
                    req.context
                ),
            }
        }
        waits
    }

    /// Waits for the answers of releases sent by [`start_releases`](Self::start_releases): a
    /// peer an answer says is lost is handled as lost; other failures are logged.
    pub(super) async fn await_releases(
        self: &Arc<Self>,
        waits: Vec<(WorkerId, tensorwire_rpc::RpcFuture<()>)>,
    ) {
        for (to, f) in waits {
            if let Err(e) = f.await {
                if let Some(peer) = lost_peer(&e) {
                    self.peer_lost(peer);
                }
                warn!("the release sent to rank {to} failed: {e}");
            }
        }
    }

    pub(super) fn peer_lost(self: &Arc<Self>, peer: WorkerId) {
        self.lock().state.handle_peer_lost(peer);
        self.pump();
    }

    /// Drains the state machine's outputs into actions, runs them, and returns the releases.
    pub(super) fn pump_collect(self: &Arc<Self>) -> Vec<(WorkerId, ReleaseRequest)> {
        self.pump_collect_on(false)
    }

    /// [`pump_collect`](Self::pump_collect); with `here`, every run is inline (see
    /// [`pump_here`](Self::pump_here)).
    fn pump_collect_on(self: &Arc<Self>, here: bool) -> Vec<(WorkerId, ReleaseRequest)> {
        let mut releases = Vec::new();
        loop {
            let actions = self.collect();
            if actions.is_empty() {
                return releases;
            }
            for a in actions {
                match a {
                    Action::Run {
                        task,
                        roots,
                        context,
                    } => {
                        let on = if here {
                            RunOn::Inline
                        } else {
                            self.runs
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .next_run()
                        };
                        match on {
                            // Short runs: cheaper here than a hand-off to a blocking thread and
                            // back; what the run produced is drained by this loop's next turn.
                            RunOn::Inline => {
                                let computed = self.compute(&roots);
                                self.finish_run(task, context, computed);
                            }
                            RunOn::Blocking => {
                                let inner = self.clone();
                                tokio::spawn(async move { inner.run(task, context, roots).await });
                            }
                        }
                    }
                    Action::Gradient {
                        gradient,
                        to,
                        req,
                        placement,
                    } => {
                        let inner = self.clone();
                        if placement.devices.iter().all(|d| d.is_cpu()) {
                            inner.send_gradient(gradient, to, req, placement.gradients_go);
                        } else {
                            // Each gradient goes on its tensor's device first (a copy by the
                            // device backend), then travels by the reverse map from there.
                            tokio::spawn(async move {
                                match inner.place_gradients(req, &placement.devices).await {
                                    Ok(req) => inner.send_gradient(
                                        gradient,
                                        to,
                                        req,
                                        placement.gradients_go,
                                    ),
                                    Err(error) => {
                                        inner
                                            .lock()
                                            .state
                                            .handle_gradient_reply(gradient, Err(error));
                                        inner.pump();
                                    }
                                }
                            });
                        }
                    }
                    Action::GradientFailed { gradient, error } => {
                        self.lock()
                            .state
                            .handle_gradient_reply(gradient, Err(error));
                    }
                    Action::Release { to, req } => releases.push((to, req)),
                    Action::Reply { tx, result } => {
                        let _ = tx.send(result);
                    }
                    Action::Answer { tx, answer } => tx.send(answer),
                    Action::Drop(data) => drop(data),
                }
            }
        }
    }

    /// Sends `req` to `to` as gradient request `gradient`, its tensors placed by the map
    /// `placement` names, and reports the answer to the state machine.
    pub(super) fn send_gradient(
        self: &Arc<Self>,
        gradient: GradientId,
        to: WorkerId,
        req: GradientRequest,
        placement: Direction,
    ) {
        let inner = self.clone();
        match self.agent.rpc_async_placed::<_, GradientAnswer>(
            to,
            GRAD,
            &req,
            self.timeout(),
            placement,
        ) {
            Ok(f) => {
                tokio::spawn(async move {
                    let result = f.await;
                    inner.on_gradient_answer(gradient, to, req.context, result);
                });
            }
            Err(e) => inner.on_gradient_answer(gradient, to, req.context, Err(e)),
        }
    }

    /// Puts each gradient of `req` on the device its tensor landed on here.
    pub(super) async fn place_gradients(
        &self,
        mut req: GradientRequest,
        devices: &[Device],
    ) -> Result<GradientRequest, BackwardError> {
        let backend = self.agent.device_backend();
        for (g, device) in req.grads.iter_mut().zip(devices) {
            if let Some(t) = g {
                *t = relocate(&**backend, t, *device)
                    .await
                    .map_err(|e| BackwardError::Engine {
                        worker: self.agent.worker_info().id,
                        context: req.context,
                        reason: format!("the gradient could not be put on {device}: {e}"),
                    })?;
            }
        }
        Ok(req)
    }

    pub(super) fn on_gradient_answer(
        self: &Arc<Self>,
        gradient: GradientId,
        to: WorkerId,
        context: ContextId,
        result: Result<GradientAnswer, RpcError>,
    ) {
        let (result, lost) = match result {
            Ok(Ok(carried)) if !carried.is_empty() => {
                self.on_carried_gradients(gradient, to, context, carried);
                return;
            }
            Ok(r) => (r.map(drop), None),
            Err(e) => {
                let lost = lost_peer(&e);
                let error = match lost {
                    Some(peer) => BackwardError::PeerLost {
                        worker: peer,
                        context,
                    },
                    None => BackwardError::Request {
                        worker: to,
                        context,
                        reason: e.to_string(),
                    },
                };
                (Err(error), lost)
            }
        };
        {
            let mut sh = self.lock();
            sh.state.handle_gradient_reply(gradient, result);
            if let Some(peer) = lost {
                sh.state.handle_peer_lost(peer);
            }
        }
        self.pump();
    }

    /// The answer to gradient request `gradient` (sent to `to`) carried gradients for send
    /// functions of this worker's: they are run here as part of the work that sent it. A
    /// gradient the engine cannot take fails the request; gradients for messages this worker
    /// never sent to `to`, repeated, or not matching the message's tensors in count or shape
    /// are a violation (`to` is dropped, the request fails naming it and the violation).
    fn on_carried_gradients(
        self: &Arc<Self>,
        gradient: GradientId,
        to: WorkerId,
        context: ContextId,
        carried: Vec<CarriedGradient>,
    ) {
        let imported: Result<Vec<Seeded<E>>, EngineError> = carried
            .into_iter()
            .map(|c| {
                let seeds = c
                    .grads
                    .iter()
                    .map(|g| g.as_ref().map(|g| self.engine.import(g, false)).transpose())
                    .collect::<Result<Vec<_>, _>>()?;
                Ok((c.message, seeds))
            })
            .collect();
        if let Some(v) = imported
            .as_ref()
            .ok()
            .and_then(|imported| self.mismatched(to, context, imported))
        {
            self.lock().state.handle_gradient_reply(
                gradient,
                Err(BackwardError::Request {
                    worker: to,
                    context,
                    reason: v.to_string(),
                }),
            );
            self.violation(to, &v);
            self.pump();
            return;
        }
        let failed = |reason: String| BackwardError::Request {
            worker: to,
            context,
            reason,
        };
        let violation = {
            let mut sh = self.lock();
            match imported {
                Err(e) => {
                    sh.state
                        .handle_gradient_reply(gradient, Err(failed(e.to_string())));
                    None
                }
                Ok(imported) => {
                    let messages: Vec<AutogradMessageId> =
                        imported.iter().map(|(m, _)| *m).collect();
                    match sh.state.handle_gradient_reply_with(gradient, &messages) {
                        Ok(tasks) => {
                            if let Some(d) = sh.data.get_mut(&context) {
                                for (task, (_, seeds)) in tasks.into_iter().zip(imported) {
                                    d.seeds.insert(task, seeds);
                                }
                            }
                            None
                        }
                        Err(v) => {
                            sh.state
                                .handle_gradient_reply(gradient, Err(failed(v.to_string())));
                            Some(v)
                        }
                    }
                }
            }
        };
        if let Some(v) = violation {
            self.violation(to, &v);
        }
        self.pump();
    }

    /// Whether gradients `to` carried in an answer, as the engine imported them, do not match
    /// the tensors of the messages they are for (see [`differs`](Self::differs)): a
    /// violation the state machine cannot see (it holds no tensors). Messages this worker does
    /// not hold are left to the state machine (`UnknownMessage`).
    fn mismatched(
        &self,
        to: WorkerId,
        context: ContextId,
        imported: &[Seeded<E>],
    ) -> Option<ProtocolViolation> {
        let sh = self.lock();
        let d = sh.data.get(&context)?;
        imported.iter().find_map(|(message, grads)| {
            let detail = self.differs(d.sends.get(message)?, grads)?;
            Some(ProtocolViolation::MismatchedGradients {
                from: to,
                context,
                message: *message,
                detail,
            })
        })
    }

    /// What does not match between the tensors a message sent and the gradients a peer sent
    /// for them, as the engine sees both (a tensor may travel in another form, a packed sparse
    /// one say): another count, or a gradient of another shape or element type than its
    /// tensor. An honest peer computes them against the very tensors it received, which kept
    /// their type on the wire, and its engine gives a leaf's gradient the leaf's type (torch
    /// casts every gradient to its input's dtype): a gradient of another type is never an
    /// honest one, so it is refused rather than cast.
    fn differs(&self, sent: &[E::Tensor], grads: &[Option<E::Tensor>]) -> Option<String> {
        if grads.len() != sent.len() {
            return Some(format!(
                "{} gradients for {} tensors",
                grads.len(),
                sent.len()
            ));
        }
        grads.iter().zip(sent).enumerate().find_map(|(i, (g, t))| {
            let g = g.as_ref()?;
            let (got, want) = (self.engine.shape(g), self.engine.shape(t));
            if got != want {
                return Some(format!(
                    "a gradient of shape {got:?} for tensor {i}, of shape {want:?}"
                ));
            }
            let (got, want) = (self.engine.dtype(g), self.engine.dtype(t));
            (got != want).then(|| {
                format!(
                    "a gradient of {} for tensor {i}, of {}",
                    type_name(got),
                    type_name(want)
                )
            })
        })
    }

    /// Turns the state machine's outputs into actions (under the lock).
    pub(super) fn collect(&self) -> Vec<Action<E>> {
        let mut sh = self.lock();
        let mut actions = Vec::new();
        while let Some(o) = sh.state.poll() {
            match o {
                Output::Prepare { .. } => {
                    // candle-style engines keep the graph in the tensors: the dependencies of a
                    // send function are found when it runs.
                }
                Output::RunLocal {
                    task,
                    context,
                    entry,
                } => {
                    let Some(d) = sh.data.get_mut(&context) else {
                        continue;
                    };
                    let roots = match entry {
                        Entry::Roots => std::mem::take(&mut d.roots),
                        Entry::Send(m) => {
                            let seeds = d.seeds.remove(&task).unwrap_or_default();
                            d.sends
                                .get(&m)
                                .map(|ts| {
                                    ts.iter()
                                        .cloned()
                                        .zip(seeds)
                                        .filter_map(|(t, s)| s.map(|s| (t, Some(s))))
                                        .collect()
                                })
                                .unwrap_or_default()
                        }
                    };
                    actions.push(Action::Run {
                        task,
                        roots,
                        context,
                    });
                }
                Output::SendGradient {
                    gradient,
                    task,
                    to,
                    context,
                    message,
                } => {
                    let (grads, placement) = sh
                        .data
                        .get_mut(&context)
                        .map(|d| {
                            (
                                d.produced.remove(&(task, message)).unwrap_or_default(),
                                d.recv_devices.get(&message).cloned(),
                            )
                        })
                        .unwrap_or_default();
                    // A recv always has its placement; without one the gradient stays on the
                    // host and goes back the way a response would.
                    let placement = placement.unwrap_or(RecvPlacement {
                        devices: Vec::new(),
                        gradients_go: Direction::Response,
                    });
                    let wire: Result<Vec<Option<Tensor>>, EngineError> = grads
                        .iter()
                        .map(|g| g.as_ref().map(|g| self.engine.export(g)).transpose())
                        .collect();
                    match wire {
                        Ok(grads) => actions.push(Action::Gradient {
                            gradient,
                            to,
                            req: GradientRequest {
                                context,
                                message,
                                grads,
                            },
                            placement,
                        }),
                        Err(e) => actions.push(Action::GradientFailed {
                            gradient,
                            error: BackwardError::Engine {
                                worker: sh.state.worker(),
                                context,
                                reason: e.to_string(),
                            },
                        }),
                    }
                }
                Output::Reply {
                    request, result, ..
                } => {
                    if let Some(tx) = sh.requests.remove(&request) {
                        actions.push(Action::Answer {
                            tx,
                            answer: result.map(|()| Vec::new()),
                        });
                    }
                }
                Output::ReplyWithGradients {
                    request,
                    task,
                    context,
                    messages,
                    ..
                } => {
                    let produced: Vec<(AutogradMessageId, Vec<Option<E::Tensor>>)> = sh
                        .data
                        .get_mut(&context)
                        .map(|d| {
                            messages
                                .iter()
                                .map(|m| (*m, d.produced.remove(&(task, *m)).unwrap_or_default()))
                                .collect()
                        })
                        .unwrap_or_default();
                    let worker = sh.state.worker();
                    let answer = produced
                        .into_iter()
                        .map(|(message, grads)| {
                            let grads = grads
                                .iter()
                                .map(|g| g.as_ref().map(|g| self.engine.export(g)).transpose())
                                .collect::<Result<Vec<_>, EngineError>>()?;
                            Ok(CarriedGradient { message, grads })
                        })
                        .collect::<Result<Vec<_>, EngineError>>()
                        .map_err(|e| BackwardError::Engine {
                            worker,
                            context,
                            reason: e.to_string(),
                        });
                    if let Some(tx) = sh.requests.remove(&request) {
                        actions.push(Action::Answer { tx, answer });
                    }
                }
                Output::BackwardDone { context, result } => {
                    if let Some(tx) = sh.roots.remove(&context) {
                        actions.push(Action::Reply { tx, result });
                    }
                }
                Output::Release { to, context, cause } => actions.push(Action::Release {
                    to,
                    req: ReleaseRequest { context, cause },
                }),
                Output::Dropped { context } => {
                    if let Some(d) = sh.data.remove(&context) {
                        actions.push(Action::Drop(Box::new(d)));
                    }
                }
            }
        }
        actions
    }

    /// Runs the engine on `roots` here and now, timing it for [`InlineRuns`]; a panic of the
    /// engine is an error of the run.
    pub(super) fn compute(&self, roots: &Roots<E>) -> Result<LeafGradients<E>, String> {
        let started = Instant::now();
        let computed =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.engine.backward(roots)));
        self.runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(started.elapsed());
        match computed {
            Ok(Ok(grads)) => Ok(grads),
            // The engine's own words: the error says it is the engine's already.
            Ok(Err(e)) => Err(e.0),
            Err(panic) => {
                let what = tensorwire_core::protocol::served::panic_message(panic.as_ref());
                Err(format!("the engine panicked: {what}"))
            }
        }
    }

    /// Runs the engine for a task on a blocking thread (or the executor set) and reports to
    /// the state machine.
    pub(super) async fn run(self: Arc<Self>, task: TaskId, context: ContextId, roots: Roots<E>) {
        let inner = self.clone();
        let executor = self
            .executor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let computed = match executor {
            None => tokio::task::spawn_blocking(move || inner.compute(&roots))
                .await
                .unwrap_or_else(|e| Err(format!("the engine's thread failed: {e}"))),
            Some(executor) => {
                // The executor's thread also reports the run and carries out what it made (the
                // gradients it sends, the runs it starts): a pass's messages leave from the
                // thread that computed them, with no hand-off back to a runtime worker between.
                let runtime = tokio::runtime::Handle::current();
                let reported = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let flag = reported.clone();
                executor(Box::new(move || {
                    let computed = inner.compute(&roots);
                    let _runtime = runtime.enter();
                    flag.store(true, std::sync::atomic::Ordering::Release);
                    inner.finish_run(task, context, computed);
                    inner.pump_here();
                }))
                .await;
                if reported.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
                Err("the engine's run ended abnormally".to_owned())
            }
        };
        self.finish_run(task, context, computed);
        self.pump();
    }

    /// Reports a task's run to the state machine: its gradients placed (those of recv leaves
    /// for the messages they go back by, the others accumulated), or its failure. The
    /// outputs are left for the caller to pump.
    pub(super) fn finish_run(
        &self,
        task: TaskId,
        context: ContextId,
        computed: Result<LeafGradients<E>, String>,
    ) {
        let grads = match computed {
            Ok(g) => g,
            Err(e) => {
                self.lock().state.local_failed(task, e);
                return;
            }
        };
        let mut sh = self.lock();
        let Some(d) = sh.data.get_mut(&context) else {
            return;
        };
        let mut reached: Vec<AutogradMessageId> = Vec::new();
        let mut failed = None;
        for (leaf, g) in grads {
            if let Some(&(m, i)) = d.recv_leaves.get(&leaf) {
                let n = d.recvs.get(&m).map_or(0, Vec::len);
                let slot = d.produced.entry((task, m)).or_insert_with(|| vec![None; n]);
                if let Some(s) = slot.get_mut(i) {
                    *s = Some(g);
                }
                if !reached.contains(&m) {
                    reached.push(m);
                }
            } else {
                let sum = match d.grads.get(&leaf) {
                    Some(prev) => match self.engine.accumulate(prev, &g) {
                        Ok(s) => s,
                        Err(e) => {
                            failed = Some(e.to_string());
                            break;
                        }
                    },
                    None => g,
                };
                d.grads.insert(leaf, sum);
            }
        }
        match failed {
            Some(e) => {
                d.produced.retain(|(t, _), _| *t != task);
                sh.state.local_failed(task, e)
            }
            None => sh.state.local_done(task, &reached),
        }
    }
}

/// The peer an RPC error says is gone.
fn lost_peer(e: &RpcError) -> Option<WorkerId> {
    match e {
        RpcError::Call {
            source: CallError::PeerLost { peer, .. },
            ..
        } => Some(*peer),
        _ => None,
    }
}

/// An element type as an error names it (`F32`, or `another type` for one tensorwire's tensors
/// cannot carry).
fn type_name(dtype: Option<DType>) -> String {
    dtype.map_or_else(|| "another type".into(), |d| format!("{d:?}"))
}
