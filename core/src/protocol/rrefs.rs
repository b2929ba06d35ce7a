//! Remote references: the application's commands on RRef handles (local references, forks
//! for other workers, accepting a fork, cloning and dropping handles, undoing a fork). The
//! owner/user reference counting they drive is described in the [module docs](super).

use std::time::Instant;

use super::*;

impl<B: Payload> Endpoint<B> {
    /// Waits (without blocking: parked here, with `deadline` among the endpoint's deadlines)
    /// until the owners confirm every reference of `handles` (PyTorch runs a function only once
    /// the references in its arguments are confirmed). `None`: nothing to wait for. Else the
    /// outcome comes as [`Event::ConfirmWaitDone`] with the returned id: once all are
    /// confirmed, or failing when an owner is lost, a creation fails, or the deadline passes.
    ///
    /// On the owner, a reference whose value is still being created (a `remote()` whose
    /// function runs here now) counts as unconfirmed until the value is kept, and fails with
    /// the creation's error: so a function given a reference to a value its own worker is
    /// creating, or the owner's `local_value()`, waits for the value as PyTorch's owner does.
    pub fn wait_confirmed(
        &mut self,
        handles: &[RRefHandle],
        deadline: Option<Instant>,
    ) -> Option<WaitId> {
        let handles: Vec<RRefHandle> = handles
            .iter()
            .copied()
            .filter(|h| self.is_confirmed(*h) == Some(false) || self.being_created_here(*h))
            .collect();
        if handles.is_empty() {
            return None;
        }
        self.next_wait += 1;
        let wait = self.next_wait;
        if let Some(d) = deadline {
            self.timers.insert((d, Timer::ConfirmWait(wait)));
        }
        self.confirm_waits
            .insert(wait, ConfirmWait { handles, deadline });
        Some(wait)
    }

    /// Ends the waits whose references are all confirmed, or whose owner is lost, whose
    /// creation failed, or (with `now`) whose deadline passed.
    pub(super) fn settle_confirm_waits(&mut self, now: Option<Instant>) {
        let mut done = Vec::new();
        let me = self.me;
        for (wait, w) in &mut self.confirm_waits {
            let mut failed = None;
            w.handles.retain(|h| {
                if h.owner != me {
                    return true;
                }
                // Our own value, still being created when the wait began: until it exists.
                match self.owned.get(&h.rref).map(|o| &o.state) {
                    Some(None) => true,
                    Some(Some(Ok(()))) => false,
                    Some(Some(Err(e))) => {
                        failed.get_or_insert(ConfirmError::Creation {
                            rref: h.rref,
                            error: CallError::Remote(e.clone()),
                        });
                        false
                    }
                    None => {
                        failed.get_or_insert(ConfirmError::Creation {
                            rref: h.rref,
                            error: CallError::UnknownRRef(h.rref),
                        });
                        false
                    }
                }
            });
            w.handles.retain(|h| {
                h.owner == me
                    || match self.used.get(&h.fork) {
                        Some(u) => match &u.creation_error {
                            Some(e) => {
                                failed.get_or_insert(ConfirmError::Creation {
                                    rref: h.rref,
                                    error: e.clone(),
                                });
                                false
                            }
                            None => !u.confirmed,
                        },
                        None => {
                            if self.lost.contains_key(&h.owner) {
                                failed.get_or_insert(ConfirmError::OwnerLost {
                                    rref: h.rref,
                                    owner: h.owner,
                                });
                            }
                            false
                        }
                    }
            });
            if failed.is_none() && now.zip(w.deadline).is_some_and(|(n, d)| d <= n) {
                if let Some(h) = w.handles.first() {
                    failed = Some(ConfirmError::Deadline {
                        rref: h.rref,
                        owner: h.owner,
                    });
                }
            }
            match failed {
                Some(e) => done.push((*wait, Err(e))),
                None if w.handles.is_empty() => done.push((*wait, Ok(()))),
                None => {}
            }
        }
        done.sort_by_key(|(wait, _)| *wait);
        for (wait, outcome) in done {
            if let Some(d) = self.confirm_waits.remove(&wait).and_then(|w| w.deadline) {
                self.timers.remove(&(d, Timer::ConfirmWait(wait)));
            }
            self.events
                .push_back(Event::ConfirmWaitDone { wait, outcome });
        }
    }

    /// Whether `handle` names a value this worker owns whose creation has not ended yet.
    pub(super) fn being_created_here(&self, handle: RRefHandle) -> bool {
        handle.owner == self.me
            && self
                .owned
                .get(&handle.rref)
                .is_some_and(|o| o.state.is_none())
    }

    /// A reference to a value this worker already holds (PyTorch's `RRef(value)`): the
    /// application keeps the value under the returned handle's `rref`, which starts with one
    /// local handle.
    pub fn local_rref(&mut self) -> Result<RRefHandle, CallError> {
        self.ensure_running()?;
        let rref = self.fresh_global();
        let secret = Some(self.secret_of(rref));
        self.owned.insert(
            rref,
            Owned {
                local_handles: 1,
                state: Some(Ok(())),
                secret,
                ..Owned::default()
            },
        );
        Ok(RRefHandle {
            rref,
            fork: rref,
            owner: self.me,
        })
    }

    /// Undoes [`fork_for`](Self::fork_for) for fork data made for worker `to` that will never
    /// reach it (the message carrying it was abandoned before it was sent): a handle taken
    /// for ourselves is dropped, the parent stops waiting for the child, and an owner forgets
    /// the fork it registered.
    pub fn cancel_fork(&mut self, data: RRefForkData, to: WorkerId, now: Instant) {
        if data.parent != self.me {
            return;
        }
        let handle = RRefHandle {
            rref: data.rref,
            fork: data.fork,
            owner: data.owner,
        };
        if to == self.me {
            self.drop_handle(handle, now);
            return;
        }
        // Otherwise only a fresh fork for a third worker registered anything: as the owner,
        // the fork in the reference's record; as a user, a pending child.
        if data.owner == self.me {
            let registered = data.fork != data.rref
                && self
                    .owned
                    .get_mut(&data.rref)
                    .is_some_and(|o| o.forks.remove(&(data.fork, to)));
            self.uncount_reference(registered.then_some(to));
            if registered {
                self.maybe_release(data.rref);
            }
        } else if let Some((parent, _)) = self.children.remove(&data.fork) {
            if let Some(u) = self.used.get_mut(&parent) {
                u.pending_children.remove(&data.fork);
            }
            self.maybe_delete_user(parent, now);
        }
    }

    /// Makes the data that passes `handle` to worker `to` inside call arguments: a new fork
    /// when `to` is a third worker. Our fork stays alive until the owner confirms the child.
    pub fn fork_for(
        &mut self,
        handle: RRefHandle,
        to: WorkerId,
    ) -> Result<RRefForkData, CallError> {
        self.check_usable(handle)?;
        let me = self.me;
        let secret = self.secret_for(handle);
        if to == me {
            // Passed to ourselves: the receiver's handle is taken now, so the reference stays
            // alive while the message is on its way (a handler not run yet, a body still being
            // copied); `accept_fork` takes no other.
            if handle.owner == me {
                if let Some(o) = self.owned.get_mut(&handle.rref) {
                    o.local_handles += 1;
                }
            } else if let Some(u) = self.used.get_mut(&handle.fork) {
                u.handles += 1;
            }
            return Ok(RRefForkData {
                rref: handle.rref,
                fork: handle.fork,
                owner: handle.owner,
                parent: me,
                secret,
            });
        }
        if to == handle.owner {
            // Our fork goes back to the owner: no new fork. Our delete of it may travel right
            // behind the message (a caller that drops its reference at once), so the owner
            // holds the value for the request from its arrival until it is answered
            // (`hold_named`), and its application takes its own handle when it decodes the
            // arguments (`accept_fork`), before the answer.
            return Ok(RRefForkData {
                rref: handle.rref,
                fork: handle.fork,
                owner: handle.owner,
                parent: me,
                secret,
            });
        }
        let fork = self.fresh_global();
        if handle.owner == me {
            // The owner registers the fork at once: the receiver starts confirmed.
            if let Some(o) = self.owned.get_mut(&handle.rref) {
                let new = o.forks.insert((fork, to));
                self.count_reference(to, new);
            }
        } else if let Some(u) = self.used.get_mut(&handle.fork) {
            u.pending_children.insert(fork);
            self.children.insert(fork, (handle.fork, to));
        }
        Ok(RRefForkData {
            rref: handle.rref,
            fork,
            owner: handle.owner,
            parent: me,
            secret,
        })
    }

    /// Takes a reference received in call arguments and returns our handle on it. A new fork
    /// from a third worker starts the confirmation with the owner.
    pub fn accept_fork(&mut self, data: RRefForkData, now: Instant) -> RRefHandle {
        let handle = RRefHandle {
            rref: data.rref,
            fork: if data.owner == self.me {
                data.rref
            } else {
                data.fork
            },
            owner: data.owner,
        };
        if data.parent == self.me {
            // Passed to ourselves: `fork_for` took this handle already.
            return handle;
        }
        if data.owner == self.me {
            let me = self.me;
            let o = self.owned.entry(data.rref).or_insert_with(|| Owned {
                // The sender's fork (or a fork request before it) would have made the record:
                // without one, the value was never created here (its creation was abandoned).
                state: Some(Err(RemoteError {
                    worker: me,
                    kind: RemoteErrorKind::RRef,
                    message: format!("no value was ever created for {} here", data.rref),
                })),
                ..Owned::default()
            });
            o.local_handles += 1;
            return handle;
        }
        if let Some(u) = self.used.get_mut(&data.fork) {
            // Already held here: one more handle on the fork.
            u.handles += 1;
            return handle;
        }
        let from_owner = data.parent == data.owner;
        self.used.insert(
            data.fork,
            Used {
                rref: data.rref,
                owner: data.owner,
                parent: (!from_owner).then_some(data.parent),
                confirmed: from_owner,
                handles: 1,
                pending_children: HashSet::default(),
                void: false,
                creation_error: None,
                secret: data.secret,
            },
        );
        if from_owner {
            self.events.push_back(Event::Confirmed {
                rref: data.rref,
                fork: data.fork,
            });
        } else {
            let (rref, fork, secret) = (data.rref, data.fork, data.secret);
            self.send_control(
                data.owner,
                |id, floor| Header::ForkRequest {
                    id,
                    floor,
                    rref,
                    fork,
                    secret,
                },
                now,
            );
        }
        handle
    }

    /// Adds a local handle (cloning an `RRef` value in the application).
    pub fn clone_handle(&mut self, handle: RRefHandle) -> Result<(), CallError> {
        self.check_handle(handle)?;
        if handle.owner == self.me {
            if let Some(o) = self.owned.get_mut(&handle.rref) {
                o.local_handles += 1;
            }
        } else if let Some(u) = self.used.get_mut(&handle.fork) {
            u.handles += 1;
        }
        Ok(())
    }

    /// Drops one local handle. A user's last handle tells the owner (once its fork is confirmed
    /// and no child of it is pending); the owner's last reference releases the value.
    pub fn drop_handle(&mut self, handle: RRefHandle, now: Instant) {
        if handle.owner == self.me {
            if let Some(o) = self.owned.get_mut(&handle.rref) {
                o.local_handles = o.local_handles.saturating_sub(1);
            }
            self.maybe_release(handle.rref);
            return;
        }
        if let Some(u) = self.used.get_mut(&handle.fork) {
            u.handles = u.handles.saturating_sub(1);
        }
        self.maybe_delete_user(handle.fork, now);
    }
}
