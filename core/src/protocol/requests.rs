//! Requests and their answers inside the endpoint: admitting a peer's request (or refusing it as
//! busy or shutting down), delivering calls (parked while their target is being created),
//! replying, completing and failing our own calls, remembering failed creations, and the set of
//! requests being served, counted per caller ([`Serving`]).

use std::time::Instant;

use super::*;

impl<B: Payload> Endpoint<B> {
    pub(super) fn ensure_running(&self) -> Result<(), CallError> {
        match self.state {
            RunState::Running => Ok(()),
            _ => Err(CallError::NotRunning),
        }
    }

    pub(super) fn check_handle(&self, handle: RRefHandle) -> Result<(), CallError> {
        let known = if handle.owner == self.me {
            self.owned.contains_key(&handle.rref)
        } else {
            self.used.get(&handle.fork).is_some_and(|u| u.handles > 0)
        };
        if known {
            Ok(())
        } else if let Some(cause) = self.lost.get(&handle.owner) {
            // Forgotten with its owner: say so, rather than "unknown".
            Err(CallError::OwnerLost {
                rref: handle.rref,
                owner: handle.owner,
                cause: cause.clone(),
            })
        } else {
            Err(CallError::UnknownRRef(handle.rref))
        }
    }

    /// [`check_handle`](Self::check_handle), and the reference's creation did not fail or time
    /// out: for fetching it or passing it on.
    pub(super) fn check_usable(&self, handle: RRefHandle) -> Result<(), CallError> {
        self.check_handle(handle)?;
        match self
            .used
            .get(&handle.fork)
            .and_then(|u| u.creation_error.clone())
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Accepts an incoming request with a body, or refuses it (shutting down, no body).
    pub(super) fn admit(
        &mut self,
        from: WorkerId,
        id: MessageId,
        body: Option<B>,
        now: Instant,
    ) -> Option<B> {
        if self.lost.contains_key(&from) {
            // Its connection is gone: what it asked can never be answered. Its requests were
            // forgotten when it was lost, and one still on its way goes the same way, its
            // forks released as a refused request's are.
            if let Some(b) = body {
                self.release_forks(b.forks(), now);
            }
            return None;
        }
        if !self.takes_requests() {
            self.refuse(from, id);
            // The references the request carried were forked for this worker: accepted and
            // dropped here, so that their parents stop waiting for them.
            if let Some(b) = body {
                self.release_forks(b.forks(), now);
            }
            return None;
        }
        if body.is_none() {
            let err = RemoteError {
                worker: self.me,
                kind: RemoteErrorKind::Serialization,
                message: "request without a body".into(),
            };
            self.reply(from, id, Err(err));
        }
        if self.refused_as_busy(from, id) {
            if let Some(b) = body {
                self.release_forks(b.forks(), now);
            }
            return None;
        }
        body
    }

    /// Request `token` (just admitted, counted as incoming) holds the references owned here
    /// that its body names, from now until it is answered ([`release_holds`](Self::release_holds)):
    /// its target, and, from a peer, the references passed back to their owner among its
    /// arguments. The application takes its own handle on an argument only when it decodes
    /// the arguments (`accept_fork`), later, and the caller's delete of its fork travels right
    /// behind the call: without this hold, a caller that drops its reference at once
    /// (`remote(w, f).rpc_sync().method()`, a temporary passed to its owner) would have the
    /// value freed before the call ran. A call to ourselves took its arguments' handles when it
    /// forked them (`fork_for`), so only its target is held. `check_message` has already
    /// checked that a peer holds every reference its request names; a reference with no
    /// record here (the creator's own fork of a value whose creation failed) holds nothing.
    pub(super) fn hold_named(&mut self, token: RequestToken, body: &B) {
        let me = self.me;
        let mut named: Vec<RRefId> = body.target().map(|t| t.rref).into_iter().collect();
        if token.from != me {
            named.extend(
                body.forks()
                    .iter()
                    .filter(|f| f.owner == me)
                    .map(|f| f.rref),
            );
        }
        let mut held = Vec::new();
        for rref in named {
            if let Some(o) = self.owned.get_mut(&rref) {
                o.request_holds += 1;
                held.push(rref);
            }
        }
        if !held.is_empty() {
            self.holds.insert(token, held);
        }
    }

    /// Request `token` ended (answered, refused, or its caller lost): the references it held
    /// since its arrival ([`hold_named`](Self::hold_named)) are let go, and a value nothing
    /// else refers to any more is released. Whatever the outcome, so that arguments a failed
    /// decode never accepted leave nothing behind.
    pub(super) fn release_holds(&mut self, token: &RequestToken) {
        for rref in self.holds.remove(token).unwrap_or_default() {
            if let Some(o) = self.owned.get_mut(&rref) {
                o.request_holds = o.request_holds.saturating_sub(1);
            }
            self.maybe_release(rref);
        }
    }

    /// Answers request `id` from `from` with [`RemoteErrorKind::Busy`] if `from` already has
    /// its share of requests being served here; whether it did.
    pub(super) fn refused_as_busy(&mut self, from: WorkerId, id: MessageId) -> bool {
        let limit = self.config.requests_per_peer;
        if from == self.me || self.incoming.of(from) < limit {
            return false;
        }
        let err = RemoteError {
            worker: self.me,
            kind: RemoteErrorKind::Busy,
            message: format!(
                "worker {} is already serving {limit} requests from worker {from}, its bound \
                 per caller (requests_per_peer)",
                self.me
            ),
        };
        self.reply(from, id, Err(err));
        true
    }

    /// The value of `rref` will never be created here: remembered, and what waits for it
    /// settles with `err`.
    pub(super) fn fail_creation(&mut self, rref: RRefId, err: RemoteError) {
        self.remember_failure(rref, &err);
        let waiting = match self.owned.get_mut(&rref) {
            Some(o) if o.state.is_none() => {
                o.state = Some(Err(err));
                self.take_parked_fetches(rref)
            }
            _ => Vec::new(),
        };
        for (caller, id, deadline) in waiting {
            self.owner_fetch(caller, id, rref, deadline);
        }
        self.settle_parked_calls(rref);
        self.maybe_release(rref);
    }

    /// Whether new requests from peers are served: running, and not leaving a dynamic group
    /// (a leaver answers what it took, and nothing more, so that it settles).
    pub(super) fn takes_requests(&self) -> bool {
        self.state == RunState::Running && !self.is_leaving()
    }

    pub(super) fn refuse(&mut self, from: WorkerId, id: MessageId) {
        let message = if self.is_leaving() {
            format!("worker {} is leaving the group", self.me)
        } else {
            "RPC is no longer running on this worker".into()
        };
        let err = RemoteError {
            worker: self.me,
            kind: RemoteErrorKind::ShuttingDown,
            message,
        };
        self.reply(from, id, Err(err));
    }

    pub(super) fn reply(&mut self, to: WorkerId, id: MessageId, outcome: Result<B, RemoteError>) {
        if to == self.me {
            if let (Ok(body), false) = (&outcome, self.pending.contains_key(&id)) {
                // Our own call ended before its answer: release what the answer carries.
                // (A call ends by a timer or a lost peer, both handled with the time, so the
                // endpoint has been told one.)
                if let Some(now) = self.last_now {
                    let forks = body.forks();
                    self.release_forks(forks, now);
                }
                return;
            }
            let outcome = outcome.map_err(CallError::Remote);
            self.finish(id, outcome);
            return;
        }
        let t = match outcome {
            Ok(body) => Transmit {
                to,
                header: Header::Reply {
                    id,
                    outcome: Ok(()),
                    forks: body.forks(),
                },
                body: Some(body),
            },
            Err(e) => Transmit {
                to,
                header: Header::Reply {
                    id,
                    outcome: Err(e),
                    forks: Vec::new(),
                },
                body: None,
            },
        };
        self.send_out(t);
    }

    /// Accepts and drops at once forks that arrived for us in a body nobody will see, so that
    /// their parents and owners let go of them by the usual messages.
    pub(super) fn release_forks(&mut self, forks: Vec<RRefForkData>, now: Instant) {
        for f in forks {
            let handle = self.accept_fork(f, now);
            self.drop_handle(handle, now);
        }
    }

    pub(super) fn on_reply(&mut self, id: MessageId, outcome: Result<B, CallError>, now: Instant) {
        if matches!(&outcome, Err(CallError::Remote(e)) if e.kind == RemoteErrorKind::Deadline) {
            // The callee stopped waiting at our deadline before our own timer fired (its clock
            // is ahead, or its message overtook our timer): the same end as our timer's.
            self.expire_call(id, now);
            return;
        }
        let confirms = self.pending.get(&id).and_then(|p| p.confirms);
        if let Some(fork) = confirms {
            if let Some(u) = self.used.get_mut(&fork) {
                u.confirmed = true;
                match &outcome {
                    Ok(_) => self
                        .events
                        .push_back(Event::Confirmed { rref: u.rref, fork }),
                    Err(e) => {
                        // The value was never created: the owner keeps nothing for this fork.
                        u.void = true;
                        u.creation_error = Some(e.clone());
                    }
                }
            }
            self.maybe_delete_user(fork, now);
        }
        self.finish(id, outcome);
    }

    pub(super) fn finish(&mut self, id: MessageId, outcome: Result<B, CallError>) {
        if let Some(p) = self.pending.remove(&id) {
            match p.deadline {
                Some(_) if p.queued => {
                    let pending = &self.pending;
                    self.call_deadlines
                        .remove(id, |call| pending.contains_key(&call));
                }
                Some(d) => {
                    self.timers.remove(&(d, Timer::Call(id)));
                }
                None => {}
            }
            self.events.push_back(Event::Completed { id, outcome });
        }
    }

    pub(super) fn fail(&mut self, id: MessageId, err: CallError) {
        self.finish(id, Err(err));
    }

    pub(super) fn owner_fetch(
        &mut self,
        from: WorkerId,
        id: MessageId,
        rref: RRefId,
        deadline: Option<Instant>,
    ) {
        let Some(o) = self.owned.get_mut(&rref) else {
            let err = self.failure_of(rref).unwrap_or_else(|| RemoteError {
                worker: self.me,
                kind: RemoteErrorKind::RRef,
                message: format!(
                    "unknown remote reference {rref} (never created here, or already released)"
                ),
            });
            self.reply(from, id, Err(err));
            return;
        };
        match &o.state {
            None => {
                let limit = self.config.parked_fetches_per_peer;
                if from != self.me && self.parked_fetches_of(from) >= limit {
                    let err = RemoteError {
                        worker: self.me,
                        kind: RemoteErrorKind::Busy,
                        message: format!(
                            "worker {} already holds {limit} fetches from worker {from} \
                             parked on values still being created, its bound per caller \
                             (parked_fetches_per_peer)",
                            self.me
                        ),
                    };
                    self.reply(from, id, Err(err));
                    return;
                }
                if let Err(over) = self.records_fit(from, bounds::PARKED_FETCH_BYTES) {
                    self.refuse_over_budget(from, id, &over);
                    return;
                }
                let Some(o) = self.owned.get_mut(&rref) else {
                    return;
                };
                o.fetches.push((from, id, deadline));
                self.parked.add(from, id);
                self.charge_records(from);
                if let Some(d) = deadline {
                    self.timers.insert((d, Timer::Fetches(rref)));
                }
            }
            Some(Err(e)) => {
                let e = e.clone();
                self.reply(from, id, Err(e));
            }
            Some(Ok(())) => {
                let token = RequestToken {
                    from,
                    id,
                    kind: RequestKind::Fetch(rref),
                };
                self.incoming.insert(token);
                self.events.push_back(Event::Fetch { token, rref });
            }
        }
    }

    /// Remembers that creating `rref` here failed.
    pub(super) fn remember_failure(&mut self, rref: RRefId, err: &RemoteError) {
        if self.failed.len() == FAILED_KEPT {
            self.failed.pop_front();
        }
        self.failed.push_back((rref, err.clone()));
    }

    /// The error for a reference with no record here that was created and released already
    /// (see `created_upto`), if it was.
    pub(super) fn released(&self, rref: RRefId) -> Option<RemoteError> {
        let created = rref.created_on == self.me
            || self
                .created_upto
                .get(&rref.created_on)
                .is_some_and(|upto| rref.local <= *upto);
        (created && !self.owned.contains_key(&rref)).then(|| RemoteError {
            worker: self.me,
            kind: RemoteErrorKind::RRef,
            message: format!("{rref} was released on its owner (a worker that passed it on died before the owner learned of the fork)"),
        })
    }

    /// The error for a reference whose creator was lost (its creation will never come).
    pub(super) fn creator_lost(&self, rref: RRefId) -> Option<RemoteError> {
        self.lost
            .contains_key(&rref.created_on)
            .then(|| RemoteError {
                worker: self.me,
                kind: RemoteErrorKind::RRef,
                message: format!(
                    "{rref} was never created: its creator, worker {}, was lost",
                    rref.created_on
                ),
            })
    }

    /// Why creating `rref` here failed, if it did (and is still remembered).
    pub(super) fn failure_of(&self, rref: RRefId) -> Option<RemoteError> {
        self.failed
            .iter()
            .find(|(r, _)| *r == rref)
            .map(|(_, e)| e.clone())
    }

    /// Hands a call (or a `remote()` creation: the token says which) to the application,
    /// unless it is a method call on a value this worker is still creating: then it waits
    /// (parked) until the value exists, its creation fails, or the caller's deadline passes.
    /// (The request is counted as incoming all along.) A creation that runs a method of a value
    /// that failed or is gone fails as a creation, so that what waits for the new value learns
    /// it.
    pub(super) fn deliver_call(
        &mut self,
        token: RequestToken,
        function: String,
        body: B,
        deadline: Option<Instant>,
    ) {
        if let Some(rref) = body.target().map(|t| t.rref) {
            if !self.owned.contains_key(&rref) {
                // No record: its creation failed, or it was created and released, or its
                // creator is gone: say so. Else its creation has not arrived yet (the caller
                // got the reference from a third worker): wait for it, as a fork request does.
                if let Some(err) = self
                    .failure_of(rref)
                    .or_else(|| self.released(rref))
                    .or_else(|| self.creator_lost(rref))
                {
                    self.refuse_delivery(token, err);
                    return;
                }
                self.owned.insert(rref, Owned::default());
            }
            match self.owned.get(&rref).map(|o| &o.state) {
                Some(None) => {
                    if let Some(d) = deadline {
                        self.timers.insert((d, Timer::ParkedCalls(rref)));
                    }
                    self.parked_calls.entry(rref).or_default().push(ParkedCall {
                        token,
                        function,
                        body,
                        deadline,
                    });
                    return;
                }
                Some(Some(Err(e))) => {
                    let err = RemoteError {
                        worker: self.me,
                        kind: RemoteErrorKind::RRef,
                        message: format!(
                            "creating the value of {rref} on worker {} failed: {}",
                            self.me, e.message
                        ),
                    };
                    self.refuse_delivery(token, err);
                    self.maybe_release(rref);
                    return;
                }
                _ => {}
            }
        }
        let event = match token.kind {
            RequestKind::Remote(rref) => Event::Remote {
                token,
                function,
                body,
                rref,
                deadline,
            },
            _ => Event::Call {
                token,
                function,
                body,
                deadline,
            },
        };
        self.events.push_back(event);
    }

    /// Answers a call that will not be delivered with `err`; a creation fails as such.
    fn refuse_delivery(&mut self, token: RequestToken, err: RemoteError) {
        match token.kind {
            RequestKind::Remote(_) => {
                self.respond(token, Err(err));
            }
            _ => {
                self.incoming.remove(&token);
                self.reply(token.from, token.id, Err(err));
                self.release_holds(&token);
            }
        }
    }

    /// The creation of `rref` ended: the calls parked on it run, or fail with it.
    pub(super) fn settle_parked_calls(&mut self, rref: RRefId) {
        for c in self.parked_calls.remove(&rref).unwrap_or_default() {
            self.deliver_call(c.token, c.function, c.body, c.deadline);
        }
    }

    /// Method calls parked on `rref`, still being created, fail at their caller's deadline.
    pub(super) fn expire_parked_calls(&mut self, rref: RRefId, now: Instant) {
        let mut expired = Vec::new();
        if let Some(parked) = self.parked_calls.get_mut(&rref) {
            parked.retain(|c| {
                let keep = c.deadline.is_none_or(|d| d > now);
                if !keep {
                    expired.push(c.token);
                }
                keep
            });
            if parked.is_empty() {
                self.parked_calls.remove(&rref);
            }
        }
        for token in expired {
            let err = RemoteError {
                worker: self.me,
                kind: RemoteErrorKind::Deadline,
                message: format!(
                    "the value of {rref} was still being created at the caller's deadline"
                ),
            };
            self.refuse_delivery(token, err);
            self.maybe_release(rref);
        }
    }

    /// Fetches parked on `rref`, still being created, fail at their caller's deadline.
    pub(super) fn expire_parked_fetches(&mut self, rref: RRefId, now: Instant) {
        let mut expired = Vec::new();
        if let Some(o) = self.owned.get_mut(&rref) {
            o.fetches.retain(|(from, id, deadline)| {
                let keep = deadline.is_none_or(|d| d > now);
                if !keep {
                    expired.push((*from, *id));
                }
                keep
            });
        }
        for (from, id) in expired {
            self.parked.remove(from, id);
            self.charge_records(from);
            let err = RemoteError {
                worker: self.me,
                kind: RemoteErrorKind::Deadline,
                message: format!(
                    "the value of {rref} was still being created at the caller's deadline"
                ),
            };
            self.reply(from, id, Err(err));
            self.maybe_release(rref);
        }
    }
}

/// Requests being served (handed to the application, not answered yet), counted per caller
/// so that admission can bound each caller's share
/// ([`EndpointConfig::requests_per_peer`]).
#[derive(Debug, Default)]
pub(super) struct Serving {
    pub(super) tokens: HashSet<RequestToken>,
    pub(super) per_peer: HashMap<WorkerId, usize>,
}

impl Serving {
    pub(super) fn insert(&mut self, token: RequestToken) -> bool {
        let new = self.tokens.insert(token);
        if new {
            *self.per_peer.entry(token.from).or_insert(0) += 1;
        }
        new
    }

    pub(super) fn remove(&mut self, token: &RequestToken) -> bool {
        let had = self.tokens.remove(token);
        if had {
            // A count that reaches 0 stays (one entry per peer, dropped by `retain` when the
            // peer goes): a peer's next request then finds its entry, with no map growth.
            if let Some(n) = self.per_peer.get_mut(&token.from) {
                *n -= 1;
            }
        }
        had
    }

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&RequestToken) -> bool) {
        let per_peer = &mut self.per_peer;
        self.tokens.retain(|t| {
            let k = keep(t);
            if !k {
                if let Some(n) = per_peer.get_mut(&t.from) {
                    *n -= 1;
                }
            }
            k
        });
        per_peer.retain(|_, n| *n > 0);
    }

    pub(super) fn clear(&mut self) {
        self.tokens.clear();
        self.per_peer.clear();
    }

    pub(super) fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &RequestToken> {
        self.tokens.iter()
    }

    /// Requests from `peer` being served.
    pub(super) fn of(&self, peer: WorkerId) -> usize {
        self.per_peer.get(&peer).copied().unwrap_or(0)
    }
}
