//! The endpoint's input: messages from peers (each checked against state before it changes
//! anything), timers, and peers lost, joined or starting a new incarnation.

use std::time::Instant;

use super::*;

impl<B: Payload> Endpoint<B> {
    /// Handles a message from worker `from`. A message `from` had no right to send (a reply to
    /// a call that went elsewhere or was never made, a delete of a fork another worker holds,
    /// ...) changes nothing and is a [`ProtocolViolation`]: the driver should drop that peer.
    /// Late messages that races explain (a reply after its call timed out, a resent control
    /// message) are not violations: they are ignored or acknowledged again.
    pub fn handle_message(
        &mut self,
        from: WorkerId,
        header: Header,
        body: Option<B>,
        now: Instant,
    ) -> Result<(), ProtocolViolation> {
        self.last_now = Some(now);
        self.check_message(from, &header, body.as_ref())?;
        self.count_activity(Some(&header));
        match header {
            Header::Call {
                id,
                function,
                timeout,
            } => {
                let Some(body) = self.admit(from, id, body, now) else {
                    return Ok(());
                };
                let token = RequestToken {
                    from,
                    id,
                    kind: RequestKind::Call,
                };
                self.incoming.insert(token);
                self.hold_named(token, &body);
                self.deliver_call(token, function, body, deadline_after(now, timeout));
            }
            Header::Remote {
                id,
                function,
                rref,
                fork,
                secret,
                timeout,
            } => {
                let over = self
                    .records_fit(from, bounds::REFERENCE_RECORD_BYTES)
                    .err()
                    .filter(|_| self.takes_requests());
                let body = if self.takes_requests()
                    && self.references_of(from) >= self.config.references_per_peer
                {
                    self.refuse_references(from, id, body, now);
                    None
                } else if let Some(over) = over {
                    self.refuse_over_budget(from, id, &over);
                    if let Some(b) = body {
                        self.release_forks(b.forks(), now);
                    }
                    None
                } else {
                    self.admit(from, id, body, now)
                };
                let Some(body) = body else {
                    // Refused (shutting down, leaving, busy, no body): the value will never
                    // be created, so what waits for it here (fork requests, fetches, method
                    // calls from third parties) settles now.
                    let kind = if self.takes_requests() {
                        RemoteErrorKind::Busy
                    } else {
                        RemoteErrorKind::ShuttingDown
                    };
                    let err = RemoteError {
                        worker: self.me,
                        kind,
                        message: format!("{rref} was not created: worker {} refused it", self.me),
                    };
                    self.fail_creation(rref, err);
                    return Ok(());
                };
                let upto = self.created_upto.entry(from).or_default();
                *upto = (*upto).max(rref.local);
                let o = self.owned.entry(rref).or_default();
                let new = o.forks.insert((fork, from));
                self.count_reference(from, new);
                // Fork requests that overtook the creation are checked before the value
                // exists (see `secrets`).
                self.settle_claims(rref, secret, now);
                let token = RequestToken {
                    from,
                    id,
                    kind: RequestKind::Remote(rref),
                };
                self.incoming.insert(token);
                self.hold_named(token, &body);
                // A method's result (`rref.remote().f()`) on a value still being created waits
                // for it, as a method call does.
                self.deliver_call(token, function, body, deadline_after(now, timeout));
            }
            Header::Fetch {
                id, rref, timeout, ..
            } => {
                if !self.takes_requests() {
                    self.refuse(from, id);
                } else if !self.refused_as_busy(from, id) {
                    self.owner_fetch(from, id, rref, deadline_after(now, timeout));
                }
            }
            Header::Reply { id, outcome, forks } => {
                if outcome.is_ok() && !self.pending.contains_key(&id) {
                    // A late reply: its body never reaches the application, so the references
                    // inside are accepted and dropped here, releasing their parents.
                    self.release_forks(forks, now);
                    return Ok(());
                }
                let outcome = match outcome {
                    Ok(()) => body.ok_or_else(|| {
                        CallError::Remote(RemoteError {
                            worker: from,
                            kind: RemoteErrorKind::Serialization,
                            message: "reply without a body".into(),
                        })
                    }),
                    Err(e) => Err(CallError::Remote(e)),
                };
                self.on_reply(id, outcome, now);
            }
            Header::ForkRequest {
                id,
                floor,
                rref,
                fork,
                secret,
            } => {
                if self.first_time(from, id, floor) {
                    let placeholder = !self.owned.contains_key(&rref);
                    let failed = self
                        .failure_of(rref)
                        .or_else(|| self.released(rref))
                        .or_else(|| self.creator_lost(rref))
                        .map(Err);
                    let o = self.owned.entry(rref).or_insert_with(|| Owned {
                        state: failed,
                        ..Owned::default()
                    });
                    if o.secret.is_none() {
                        // Checked when the creation arrives.
                        o.claims.insert((fork, from), secret);
                    }
                    let new = o.forks.insert((fork, from));
                    self.count_reference(from, new);
                    if placeholder {
                        self.note_placeholder(from, rref);
                    }
                }
                self.ack(from, id);
            }
            Header::ChildAccept { id, floor, fork } => {
                if self.first_time(from, id, floor) {
                    if let Some((parent, _)) = self.children.remove(&fork) {
                        if let Some(u) = self.used.get_mut(&parent) {
                            u.pending_children.remove(&fork);
                        }
                        self.maybe_delete_user(parent, now);
                    }
                }
                self.ack(from, id);
            }
            Header::UserDelete {
                id,
                floor,
                rref,
                fork,
            } => {
                if self.first_time(from, id, floor) {
                    let removed = self
                        .owned
                        .get_mut(&rref)
                        .is_some_and(|o| o.forks.remove(&(fork, from)));
                    self.uncount_reference(removed.then_some(from));
                    self.maybe_release(rref);
                }
                self.ack(from, id);
            }
            Header::Abandoned { rref, reason } => {
                let err = RemoteError {
                    worker: from,
                    kind: RemoteErrorKind::Failed,
                    message: reason,
                };
                self.fail_creation(rref, err);
            }
            Header::Ack { id } => self.on_ack(id, now),
            Header::Shutdown { signal } => self.on_shutdown_signal(from, signal),
            Header::ShutdownFailed { missing, lost } => {
                self.on_shutdown_failed(from, missing, lost);
            }
        }
        if !self.confirm_waits.is_empty() {
            self.settle_confirm_waits(Some(now));
        }
        self.advance_shutdown();
        Ok(())
    }

    /// Call `id`'s deadline passed: its timer fired, or the callee, which waited on its
    /// behalf, said so first ([`RemoteErrorKind::Deadline`]). Either way it fails the same.
    pub(super) fn expire_call(&mut self, id: MessageId, now: Instant) {
        let Some(p) = self.pending.get(&id) else {
            return;
        };
        let (to, after, confirms) = (p.to, p.timeout, p.confirms);
        match confirms.and_then(|fork| self.used.get_mut(&fork).map(|u| (fork, u))) {
            Some((fork, u)) => {
                // A `remote()` whose creation timed out. Its messages to the owner keep
                // their order, so the owner has registered (or will register) this fork
                // before any delete of ours: count it as confirmed for deletion, so the
                // owner frees the value once it exists and nobody refers to it.
                u.confirmed = true;
                let err = CallError::RRefCreationTimedOut {
                    rref: u.rref,
                    owner: to,
                    after,
                };
                u.creation_error = Some(err.clone());
                self.fail(id, err);
                self.maybe_delete_user(fork, now);
            }
            None => self.fail(id, CallError::Timeout { to, after }),
        }
    }

    /// Whether `from` may send `header` (with `body`: a method call's target, the references
    /// a request passes on), judged against what we sent and hold.
    pub(super) fn check_message(
        &self,
        from: WorkerId,
        header: &Header,
        body: Option<&B>,
    ) -> Result<(), ProtocolViolation> {
        let target = body.and_then(Payload::target);
        let never_issued = |id: MessageId| id <= self.first_id || id > self.next_id;
        let repeated = |id: MessageId, kind: RequestKind| {
            let token = RequestToken { from, id, kind };
            if self.incoming.tokens.contains(&token) {
                Err(ProtocolViolation::RepeatedRequest { id })
            } else {
                Ok(())
            }
        };
        let method = |what| match target {
            Some(t) => self.check_holder(from, t.rref, t.fork, what),
            None => Ok(()),
        };
        let arguments = || match body {
            Some(b) => self.check_arguments(from, &b.forks()),
            None => Ok(()),
        };
        match *header {
            Header::Call { id, .. } => {
                method("method call")?;
                arguments()?;
                repeated(id, RequestKind::Call)
            }
            Header::Fetch { id, rref, fork, .. } => {
                self.check_holder(from, rref, fork, "fetch")?;
                if self.parked.contains(from, id) {
                    return Err(ProtocolViolation::RepeatedRequest { id });
                }
                repeated(id, RequestKind::Fetch(rref))
            }
            Header::Reply { id, .. } => {
                if never_issued(id) {
                    return Err(ProtocolViolation::UnknownId { id, what: "reply" });
                }
                match self.pending.get(&id) {
                    Some(p) if p.to != from => Err(ProtocolViolation::WrongPeer {
                        id,
                        what: "reply",
                        sent_to: p.to,
                    }),
                    // Answered, timed out or failed already: a late reply.
                    _ => Ok(()),
                }
            }
            Header::Ack { id } => {
                if never_issued(id) {
                    return Err(ProtocolViolation::UnknownId {
                        id,
                        what: "acknowledgement",
                    });
                }
                match self.unacked.get(&id) {
                    Some(u) if u.to != from => Err(ProtocolViolation::WrongPeer {
                        id,
                        what: "acknowledgement",
                        sent_to: u.to,
                    }),
                    _ => Ok(()),
                }
            }
            Header::Remote { rref, fork, .. } => {
                method("remote method call")?;
                arguments()?;
                if rref.created_on != from {
                    return Err(ProtocolViolation::ForeignCreation {
                        rref,
                        creator: rref.created_on,
                    });
                }
                let upto = self.created_upto.get(&from).copied().unwrap_or(0);
                if fork != rref || rref.local <= upto {
                    return Err(ProtocolViolation::RepeatedCreation { rref, fork });
                }
                Ok(())
            }
            // Forks are registered per holder, so a claim of a fork id someone else holds only
            // registers the claimant's own entry (first come does not take it: that would let
            // a peer that guessed the next id get the honest child dropped). Two things are
            // wrong whatever the order: a request for the creator's own fork (the reference's
            // id) from anyone else, and a delete of a fork only another worker holds.
            Header::UserDelete { rref, fork, .. } | Header::ForkRequest { rref, fork, .. } => {
                if fork == rref && from != rref.created_on {
                    let holder = rref.created_on;
                    return Err(ProtocolViolation::ForeignFork { rref, fork, holder });
                }
                if let (Header::UserDelete { .. }, Some(o)) = (header, self.owned.get(&rref)) {
                    if !o.forks.contains(&(fork, from)) {
                        // Held by others only, or forgotten already (a failed creation's fork).
                        if let Some(&(_, holder)) = o.forks.iter().find(|(f, _)| *f == fork) {
                            return Err(ProtocolViolation::ForeignFork { rref, fork, holder });
                        }
                    }
                }
                // Only a worker given the reference knows its capability (see `secrets`).
                if let Header::ForkRequest { secret, .. } = *header {
                    self.check_capability(from, rref, fork, secret)?;
                }
                let known = self
                    .owned
                    .get(&rref)
                    .is_some_and(|o| o.forks.contains(&(fork, from)));
                let limit = self.config.references_per_peer;
                if matches!(header, Header::ForkRequest { .. })
                    && !known
                    && self.references_of(from) >= limit
                {
                    return Err(ProtocolViolation::TooManyReferences { limit });
                }
                let limit = self.config.pending_forks_per_peer;
                if matches!(header, Header::ForkRequest { .. })
                    && !self.owned.contains_key(&rref)
                    && self.pending_forks_of(from) >= limit
                {
                    return Err(ProtocolViolation::TooManyPendingForks { limit });
                }
                Ok(())
            }
            Header::Abandoned { rref, .. } if rref.created_on != from => {
                Err(ProtocolViolation::ForeignFork {
                    rref,
                    fork: rref,
                    holder: rref.created_on,
                })
            }
            Header::Shutdown { signal } => self.check_shutdown_signal(from, signal),
            Header::ShutdownFailed { ref missing, .. } => self.check_shutdown_failed(from, missing),
            Header::ChildAccept { fork, .. } => match self.children.get(&fork) {
                Some(&(_, to)) if to != from => Err(ProtocolViolation::ForeignFork {
                    rref: fork,
                    fork,
                    holder: to,
                }),
                _ => Ok(()),
            },
            _ => Ok(()),
        }
    }

    /// Whether `from` holds fork `fork` of `rref`, owned here: the fork is registered to it
    /// (by its creation, its fork request, or our own fork for it, each of which reaches us
    /// before anything it sends through the fork, on the same link). One exception keeps
    /// honest races whole: the creator's own fork (`fork == rref`, made by `from`) is
    /// forgotten here when the creation fails or is refused, and the reference's record may
    /// be gone since; the creator may still name it, and is answered with the failure (no
    /// value exists to give away).
    pub(super) fn check_holder(
        &self,
        from: WorkerId,
        rref: RRefId,
        fork: ForkId,
        what: &'static str,
    ) -> Result<(), ProtocolViolation> {
        let creators_own = fork == rref && rref.created_on == from;
        let holds = match self.owned.get(&rref) {
            Some(o) => {
                o.forks.contains(&(fork, from)) || (creators_own && matches!(o.state, Some(Err(_))))
            }
            None => creators_own,
        };
        if holds {
            Ok(())
        } else {
            Err(ProtocolViolation::NotAHolder {
                what,
                rref,
                fork,
                sender: from,
            })
        }
    }

    /// Whether `from` may pass on the references `forks` in a request's arguments: each was
    /// forked by `from` itself (their parent), and one owned here through a fork `from`
    /// holds ([`check_holder`](Self::check_holder)), since the owner holds the value for the
    /// request from its arrival (`hold_named`) and gives the application a handle on it. Else
    /// a [`ProtocolViolation::NotAHolder`] naming the fork: a peer never given a reference
    /// (ids are easy to guess) gets no handle on its value, and cannot pass its fork off as
    /// ours or another's (a fork whose parent is the receiver takes no handle when accepted,
    /// so a forged one would make the receiver drop a handle it never took).
    pub(super) fn check_arguments(
        &self,
        from: WorkerId,
        forks: &[RRefForkData],
    ) -> Result<(), ProtocolViolation> {
        const WHAT: &str = "call with the reference in its arguments";
        for f in forks {
            if f.parent != from {
                return Err(ProtocolViolation::NotAHolder {
                    what: WHAT,
                    rref: f.rref,
                    fork: f.fork,
                    sender: from,
                });
            }
            if f.owner == self.me {
                self.check_holder(from, f.rref, f.fork, WHAT)?;
            }
        }
        Ok(())
    }

    /// Handles the passing of time: expired calls fail, unacknowledged control messages are
    /// sent again.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.last_now = Some(now);
        let retry = self.config.control_retry;
        let mut resend = Vec::new();
        loop {
            // The earlier of the set's first and the in-order calls' first, in the set's
            // order (deadline, then timer): as if every deadline were in the one set.
            let set = self.timers.first().copied().filter(|(d, _)| *d <= now);
            let call = (self.call_deadlines.first())
                .filter(|(d, _)| *d <= now)
                .map(|(d, id)| (d, Timer::Call(id)));
            let (deadline, timer) = match (set, call) {
                (Some(t), Some(c)) if c < t => c,
                (Some(t), _) => t,
                (None, Some(c)) => c,
                (None, None) => break,
            };
            if call == Some((deadline, timer)) {
                if let Timer::Call(id) = timer {
                    // Its end takes it out of the queue (`finish`); one not pending any more
                    // (never so: the first is a pending call's) goes here.
                    self.expire_call(id, now);
                    if self.call_deadlines.first() == Some((deadline, id)) {
                        let pending = &self.pending;
                        self.call_deadlines
                            .remove(id, |call| pending.contains_key(&call));
                    }
                }
                continue;
            }
            self.timers.pop_first();
            match timer {
                Timer::Call(id) => self.expire_call(id, now),
                Timer::Control(id) => {
                    if let Some(u) = self.unacked.get_mut(&id) {
                        if u.next_try <= now {
                            u.next_try = now + retry;
                            resend.push((id, u.next_try));
                        }
                    }
                }
                Timer::Fetches(rref) => self.expire_parked_fetches(rref, now),
                Timer::ParkedCalls(rref) => self.expire_parked_calls(rref, now),
                // Settled below, with every other wait.
                Timer::ConfirmWait(_) => {}
            }
        }
        // (Timers for resends go in after the loop: a zero retry interval must not spin it.)
        for (id, next_try) in resend {
            self.timers.insert((next_try, Timer::Control(id)));
            if let Some(u) = self.unacked.get(&id) {
                let t = Transmit {
                    to: u.to,
                    header: u.header.clone(),
                    body: None,
                };
                self.send_out(t);
            }
        }
        self.settle_confirm_waits(Some(now));
        self.advance_shutdown();
        self.expire_shutdown(now);
    }

    /// The connection to `peer` is gone for good: its calls fail naming it, control messages
    /// to it are dropped, requests from it are forgotten, and its forks no longer keep our
    /// values alive. The first report of a loss records `cause` and emits
    /// [`Event::PeerLost`]; later ones keep that first cause and emit nothing.
    pub fn handle_peer_lost(&mut self, peer: WorkerId, cause: LostCause, now: Instant) {
        self.last_now = Some(now);
        // Its requests the application has not taken yet go too (else a driver that holds a
        // peer's requests while it does not read would hold these for good), their forks
        // released as a refused request's are.
        let mut forks = Vec::new();
        self.events.retain_mut(|ev| match ev {
            Event::Call { token, body, .. } | Event::Remote { token, body, .. }
                if token.from == peer =>
            {
                forks.extend(body.forks());
                false
            }
            _ => true,
        });
        self.release_forks(forks, now);
        let cause = match self.lost.entry(peer) {
            std::collections::hash_map::Entry::Occupied(e) => e.get().clone(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let cause = e.insert(cause).clone();
                self.events.push_back(Event::PeerLost {
                    peer,
                    cause: cause.clone(),
                });
                // A shutdown waiting for reports looks at its members again (this one may
                // never send its report).
                self.forget_missing_reports();
                cause
            }
        };
        self.parked.forget(peer);
        self.forget_placeholders_of(peer);
        // Its forks are dropped from every record below.
        self.references.remove(&peer);
        // A lost peer's control messages are never resent (a new incarnation starts afresh):
        // its idempotence records go, and with them every record its budget counted.
        self.seen_control.remove(&peer);
        self.charge_records(peer);
        let ids: Vec<MessageId> = self
            .pending
            .iter()
            .filter(|(_, p)| p.to == peer)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.fail(
                id,
                CallError::PeerLost {
                    peer,
                    cause: cause.clone(),
                },
            );
        }
        self.unacked.retain(|_, u| u.to != peer);
        self.unacked_to.remove(&peer);
        self.incoming.retain(|t| t.from != peer);
        // Its requests will never be answered: what they held goes (released below with the
        // rest, once its forks are dropped from the records).
        let ended: Vec<RequestToken> = self
            .holds
            .keys()
            .filter(|t| t.from == peer)
            .copied()
            .collect();
        for token in ended {
            self.release_holds(&token);
        }
        for parked in self.parked_calls.values_mut() {
            parked.retain(|c| c.token.from != peer);
        }
        self.parked_calls.retain(|_, v| !v.is_empty());
        // Nothing more goes to it: held messages are dropped, bodies not ready are not awaited
        // (their calls failed above).
        self.held.remove(&peer);
        self.deferred.retain(|_, d| d.to != peer);
        // Forks of references the lost peer owned can never be confirmed or deleted: forget
        // them (their handles fail to fetch as unknown), and the children made from them.
        let gone: Vec<ForkId> = self
            .used
            .iter()
            .filter(|(_, u)| u.owner == peer)
            .map(|(f, _)| *f)
            .collect();
        for fork in gone {
            self.used.remove(&fork);
        }
        self.children
            .retain(|_, (parent, _)| self.used.contains_key(parent));
        // Children sent to the lost peer will never accept: stop waiting for them.
        let orphans: Vec<(ForkId, ForkId)> = self
            .children
            .iter()
            .filter(|(_, (_, to))| *to == peer)
            .map(|(c, (p, _))| (*c, *p))
            .collect();
        for (child, parent) in orphans {
            self.children.remove(&child);
            if let Some(u) = self.used.get_mut(&parent) {
                u.pending_children.remove(&child);
            }
            self.maybe_delete_user(parent, now);
        }
        let rrefs: Vec<RRefId> = self.owned.keys().copied().collect();
        for rref in rrefs {
            let mut waiting = Vec::new();
            if let Some(o) = self.owned.get_mut(&rref) {
                o.forks.retain(|&(_, holder)| holder != peer);
                o.claims.retain(|&(_, sender), _| sender != peer);
                o.fetches.retain(|(from, _, _)| *from != peer);
                if o.state.is_none() && rref.created_on == peer {
                    // Its creator is gone before its creation arrived (a placeholder made by a
                    // third party's fork request): it will never be created.
                    let err = RemoteError {
                        worker: self.me,
                        kind: RemoteErrorKind::RRef,
                        message: format!(
                            "{rref} was never created: its creator, worker {peer}, is gone ({cause})"
                        ),
                    };
                    o.state = Some(Err(err));
                    waiting = self.take_parked_fetches(rref);
                }
            }
            for (from, id, deadline) in waiting {
                self.owner_fetch(from, id, rref, deadline);
            }
            self.settle_parked_calls(rref);
            self.maybe_release(rref);
        }
        self.settle_confirm_waits(None);
        self.advance_shutdown();
    }

    /// Starts this endpoint's ids (message ids and the ids of references it creates) above
    /// every id of its earlier incarnations: a worker that joins a dynamic group again under
    /// the same rank (`incarnation`: its place in the group's admission order) must not reuse
    /// an id its peers may still hold from the earlier one. Only before any id was issued;
    /// returns whether it took effect.
    pub fn begin_incarnation(&mut self, incarnation: u64) -> bool {
        if self.next_id != self.first_id {
            return false;
        }
        self.first_id = incarnation.saturating_mul(1 << 40);
        self.next_id = self.first_id;
        true
    }

    /// Worker `peer` (re)joined the group (dynamic groups): it is no longer counted as lost,
    /// and a new incarnation of it starts with a clean slate (its control messages' ids
    /// start afresh).
    pub fn handle_peer_joined(&mut self, peer: WorkerId) {
        self.lost.remove(&peer);
        self.seen_control.remove(&peer);
        self.forget_placeholders_of(peer);
        self.charge_records(peer);
        self.forget_shutdown_of(peer);
        self.created_upto.remove(&peer);
    }
}
