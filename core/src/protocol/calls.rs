//! Calls: the application's commands that make calls, remotes and fetches (deferred ones too,
//! whose bodies come later), and its answers to requests. Their replies, deadlines and
//! failures are handled by the endpoint's input methods.

use std::time::{Duration, Instant};

use super::*;

impl<B: Payload> Endpoint<B> {
    /// Calls `function` on worker `to` (which may be this worker). `timeout` zero means no
    /// deadline. The result arrives as [`Event::Completed`] with the returned id.
    pub fn call(
        &mut self,
        to: WorkerId,
        function: &str,
        body: B,
        timeout: Duration,
        now: Instant,
    ) -> Result<MessageId, CallError> {
        self.ensure_running()?;
        let id = self.fresh_id();
        self.track(id, to, timeout, now, None);
        if to == self.me {
            let token = RequestToken {
                from: self.me,
                id,
                kind: RequestKind::Call,
            };
            self.incoming.insert(token);
            self.hold_named(token, &body);
            let deadline = deadline_after(now, timeout);
            self.deliver_call(token, function.to_owned(), body, deadline);
        } else {
            self.send_out(Transmit {
                to,
                header: Header::Call {
                    id,
                    function: function.to_owned(),
                    timeout,
                },
                body: Some(body),
            });
        }
        Ok(id)
    }

    /// Creates a value on worker `owner` by running `function` there, and returns a handle on
    /// the new reference at once. [`Event::Completed`] with the returned message id reports
    /// whether creating the value succeeded (its body is empty on success).
    pub fn remote(
        &mut self,
        owner: WorkerId,
        function: &str,
        body: B,
        timeout: Duration,
        now: Instant,
    ) -> Result<(RRefHandle, MessageId), CallError> {
        let (handle, id) = self.remote_deferred(owner, function, timeout, now)?;
        self.supply_body(id, body);
        Ok((handle, id))
    }

    /// Asks the owner for the value behind `handle` (`to_here`); on the owner itself the
    /// application is asked through [`Event::Fetch`] once the value exists.
    pub fn fetch(
        &mut self,
        handle: RRefHandle,
        timeout: Duration,
        now: Instant,
    ) -> Result<MessageId, CallError> {
        self.ensure_running()?;
        self.check_usable(handle)?;
        let id = self.fresh_id();
        self.track(id, handle.owner, timeout, now, None);
        if handle.owner == self.me {
            self.owner_fetch(self.me, id, handle.rref, deadline_after(now, timeout));
        } else {
            self.send_out(Transmit {
                to: handle.owner,
                header: Header::Fetch {
                    id,
                    rref: handle.rref,
                    fork: handle.fork,
                    timeout,
                },
                body: None,
            });
        }
        Ok(id)
    }

    /// Answers an incoming request; returns whether the answer was expected. For a `Remote`
    /// request, `Ok` means the value is now kept under its reference (the body is not sent).
    /// A token answered twice, after [`stop`](Self::stop), or from a caller lost meanwhile is
    /// ignored (`false`): the application must then not keep the value it made.
    pub fn respond(&mut self, token: RequestToken, outcome: Result<B, RemoteError>) -> bool {
        let answered = self.respond_inner(token, outcome);
        if answered {
            self.release_holds(&token);
        }
        if !self.confirm_waits.is_empty() {
            // A value kept (or failed) here ends the waits for its creation.
            self.settle_confirm_waits(None);
        }
        self.advance_shutdown();
        answered
    }

    fn respond_inner(&mut self, token: RequestToken, outcome: Result<B, RemoteError>) -> bool {
        if !self.incoming.remove(&token) {
            return false;
        }
        // A request answered counts as activity even when it was our own (no message).
        self.count_activity(None);
        let rref = match token.kind {
            RequestKind::Remote(rref) => rref,
            RequestKind::Fetch(rref) => {
                // A fetch being served pins the value: the last reference may have gone since.
                self.reply(token.from, token.id, outcome);
                self.maybe_release(rref);
                return true;
            }
            RequestKind::Call => {
                self.reply(token.from, token.id, outcome);
                return true;
            }
        };
        let kept = outcome.as_ref().map(|_| ()).map_err(Clone::clone);
        if let Err(e) = &kept {
            self.remember_failure(rref, e);
        }
        let mut forgotten = None;
        if let Some(o) = self.owned.get_mut(&rref) {
            if kept.is_err() && token.from != self.me {
                // The creator learns that no value exists and sends no delete for its
                // fork (the reference's own id): forget it, or the record stays forever.
                forgotten = o.forks.remove(&(rref, token.from)).then_some(token.from);
            }
            o.state = Some(kept.clone());
        }
        if kept.is_ok() {
            self.placeholder_kept(rref);
        }
        let waiting = self.take_parked_fetches(rref);
        self.uncount_reference(forgotten);
        self.reply(token.from, token.id, outcome);
        for (from, id, deadline) in waiting {
            self.owner_fetch(from, id, rref, deadline);
        }
        self.settle_parked_calls(rref);
        self.maybe_release(rref);
        true
    }

    /// Like [`call`](Self::call), for a call whose body is not ready yet (its tensors are
    /// being copied off a device): the call gets its id and deadline now, and its place in
    /// the order of messages to `to`. Messages made later for `to` wait behind it until
    /// [`supply_body`](Self::supply_body) or [`abandon`](Self::abandon).
    pub fn call_deferred(
        &mut self,
        to: WorkerId,
        function: &str,
        timeout: Duration,
        now: Instant,
    ) -> Result<MessageId, CallError> {
        self.ensure_running()?;
        let id = self.fresh_id();
        self.track(id, to, timeout, now, None);
        let header = Header::Call {
            id,
            function: function.to_owned(),
            timeout,
        };
        self.defer(id, to, header, deadline_after(now, timeout));
        Ok(id)
    }

    /// Like [`remote`](Self::remote), for a body that is not ready yet; see
    /// [`call_deferred`](Self::call_deferred). The handle is usable at once: a fetch or a fork
    /// made meanwhile reaches the owner after the creation does, so it never finds the
    /// reference unknown.
    pub fn remote_deferred(
        &mut self,
        owner: WorkerId,
        function: &str,
        timeout: Duration,
        now: Instant,
    ) -> Result<(RRefHandle, MessageId), CallError> {
        self.ensure_running()?;
        let rref = self.fresh_global();
        let handle = RRefHandle {
            rref,
            fork: rref,
            owner,
        };
        let id = self.fresh_id();
        let secret = self.secret_of(rref);
        if owner == self.me {
            // Fetches park on the record until the value exists.
            let o = self.owned.entry(rref).or_default();
            o.local_handles += 1;
            o.secret = Some(secret);
            self.track(id, owner, timeout, now, None);
        } else {
            self.used.insert(
                rref,
                Used {
                    rref,
                    owner,
                    parent: None,
                    confirmed: false,
                    handles: 1,
                    pending_children: HashSet::default(),
                    void: false,
                    creation_error: None,
                    secret,
                },
            );
            self.track(id, owner, timeout, now, Some(rref));
        }
        let header = Header::Remote {
            id,
            function: function.to_owned(),
            rref,
            fork: rref,
            secret,
            timeout,
        };
        self.defer(id, owner, header, deadline_after(now, timeout));
        Ok((handle, id))
    }

    /// The body of a deferred call or remote is ready: it goes out (with what waited behind
    /// it), or runs here if it was for this worker. Unknown ids are ignored (stopped since).
    pub fn supply_body(&mut self, id: MessageId, body: B) {
        self.supply_body_inner(id, body);
        self.advance_shutdown();
    }

    fn supply_body_inner(&mut self, id: MessageId, body: B) {
        let Some(d) = self.deferred.remove(&id) else {
            return;
        };
        if d.to == self.me {
            let (token, event) = match d.header {
                Header::Call { function, .. } => {
                    let token = RequestToken {
                        from: self.me,
                        id,
                        kind: RequestKind::Call,
                    };
                    let event = Event::Call {
                        token,
                        function,
                        body,
                        deadline: d.deadline,
                    };
                    (token, event)
                }
                Header::Remote { function, rref, .. } => {
                    let token = RequestToken {
                        from: self.me,
                        id,
                        kind: RequestKind::Remote(rref),
                    };
                    let event = Event::Remote {
                        token,
                        function,
                        body,
                        rref,
                        deadline: d.deadline,
                    };
                    (token, event)
                }
                _ => return,
            };
            self.incoming.insert(token);
            if let Event::Call { body, .. } | Event::Remote { body, .. } = &event {
                self.hold_named(token, body);
            }
            self.events.push_back(event);
            return;
        }
        let ready = Transmit {
            to: d.to,
            header: d.header,
            body: Some(body),
        };
        if let Some(queue) = self.held.get_mut(&d.to) {
            if let Some(slot) = queue
                .iter_mut()
                .find(|s| matches!(s, Slot::Waiting(w) if *w == id))
            {
                *slot = Slot::Ready(ready);
            }
        }
        self.flush_held(d.to);
    }

    /// The body of a deferred call or remote cannot be made (a device copy failed): the
    /// call fails with [`CallError::Local`], nothing is sent, and what waited behind it goes.
    /// A deferred `remote` leaves a reference whose uses fail with the same error.
    pub fn abandon(&mut self, id: MessageId, reason: &str, now: Instant) {
        self.abandon_inner(id, reason, now);
        self.settle_confirm_waits(None);
        self.advance_shutdown();
    }

    fn abandon_inner(&mut self, id: MessageId, reason: &str, now: Instant) {
        let Some(d) = self.deferred.remove(&id) else {
            return;
        };
        let err = CallError::Local(reason.to_owned());
        if let Header::Remote { rref, .. } = d.header {
            if d.to == self.me {
                if let Some(o) = self.owned.get_mut(&rref) {
                    o.state = Some(Err(RemoteError {
                        worker: self.me,
                        kind: RemoteErrorKind::Failed,
                        message: reason.to_owned(),
                    }));
                }
                let waiting = self.take_parked_fetches(rref);
                for (from, fetch, deadline) in waiting {
                    self.owner_fetch(from, fetch, rref, deadline);
                }
                self.settle_parked_calls(rref);
            } else if let Some(u) = self.used.get_mut(&rref) {
                // The owner never heard of it: nothing to delete there.
                u.confirmed = true;
                u.void = true;
                u.creation_error = Some(err.clone());
            }
        }
        if let Some(queue) = self.held.get_mut(&d.to) {
            match (
                &d.header,
                queue
                    .iter()
                    .position(|s| matches!(s, Slot::Waiting(w) if *w == id)),
            ) {
                // Messages behind it may refer to the reference (a fetch, a fork passed to the
                // owner): the owner learns that it will never exist, in the creation's place.
                (Header::Remote { rref, .. }, Some(at)) => {
                    queue[at] = Slot::Ready(Transmit {
                        to: d.to,
                        header: Header::Abandoned {
                            rref: *rref,
                            reason: reason.to_owned(),
                        },
                        body: None,
                    });
                }
                (_, Some(at)) => {
                    queue.remove(at);
                }
                (_, None) => {}
            }
        }
        self.flush_held(d.to);
        self.fail(id, err);
        if let Header::Remote { rref, .. } = d.header {
            if d.to == self.me {
                self.maybe_release(rref);
            } else {
                self.maybe_delete_user(rref, now);
            }
        }
    }
}
