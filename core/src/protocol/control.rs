//! The reference protocol's control messages inside the endpoint: releasing values and user
//! forks, sending control messages until acknowledged, and the idempotence records that let a
//! resent one be acknowledged without being handled twice.

use std::time::Instant;

use super::*;

impl<B: Payload> Endpoint<B> {
    pub(super) fn maybe_release(&mut self, rref: RRefId) {
        let Some(o) = self.owned.get(&rref) else {
            return;
        };
        let busy = !o.forks.is_empty()
            || o.local_handles > 0
            || o.request_holds > 0
            || !o.fetches.is_empty()
            || self.parked_calls.contains_key(&rref);
        let serving = self
            .incoming
            .iter()
            .any(|t| matches!(t.kind, RequestKind::Remote(r) | RequestKind::Fetch(r) if r == rref));
        // A creation here whose body is still being copied is as good as one being served.
        let creating = self
            .deferred
            .values()
            .any(|d| matches!(d.header, Header::Remote { rref: r, .. } if r == rref));
        if busy || serving || creating {
            return;
        }
        let had_value = matches!(o.state, Some(Ok(())));
        if let Some(o) = self.owned.remove(&rref) {
            self.uncount_placeholder(o.placeholder_of);
        }
        if had_value {
            self.events.push_back(Event::ReleaseValue { rref });
        }
    }

    pub(super) fn maybe_delete_user(&mut self, fork: ForkId, now: Instant) {
        let Some(u) = self.used.get(&fork) else {
            return;
        };
        if u.handles > 0 || !u.pending_children.is_empty() || !u.confirmed {
            return;
        }
        let (owner, rref, void) = (u.owner, u.rref, u.void);
        self.used.remove(&fork);
        if !void {
            self.send_control(
                owner,
                |id, floor| Header::UserDelete {
                    id,
                    floor,
                    rref,
                    fork,
                },
                now,
            );
        }
    }

    pub(super) fn send_control(
        &mut self,
        to: WorkerId,
        make: impl FnOnce(MessageId, MessageId) -> Header,
        now: Instant,
    ) {
        let id = self.fresh_id();
        // Our oldest unacknowledged control message to `to`, this one included. (A resent
        // message keeps the floor it was made with: lower than today's, so still true.)
        let floor = self.control_floor(to).min(id);
        let header = make(id, floor);
        let next_try = now + self.config.control_retry;
        self.timers.insert((next_try, Timer::Control(id)));
        self.unacked_to.entry(to).or_default().insert(id);
        self.unacked.insert(
            id,
            Unacked {
                to,
                header: header.clone(),
                next_try,
            },
        );
        self.send_out(Transmit {
            to,
            header,
            body: None,
        });
    }

    pub(super) fn first_time(&mut self, from: WorkerId, id: MessageId, floor: MessageId) -> bool {
        let seen = self.seen_control.entry(from).or_default();
        if floor > seen.floor {
            seen.floor = floor;
            seen.ids = seen.ids.split_off(&floor);
        }
        let first = id >= seen.floor && seen.ids.insert(id);
        // Our bound, whatever floor the peer sends: forget the oldest records. A peer's
        // control messages reach us in the order of their ids on its link, so an id below the
        // oldest kept one has arrived already (a copy of it is acknowledged, not handled).
        while seen.ids.len() > self.config.idempotence_records_per_peer {
            seen.ids.pop_first();
            if let Some(&oldest) = seen.ids.first() {
                seen.floor = oldest;
            }
        }
        self.charge_records(from);
        first
    }

    /// The floor to put in a control message to `to`: our oldest control message to it not
    /// yet acknowledged, or our next id.
    pub(super) fn control_floor(&self, to: WorkerId) -> MessageId {
        self.unacked_to
            .get(&to)
            .and_then(|ids| ids.first().copied())
            .unwrap_or(self.next_id + 1)
    }

    pub(super) fn ack(&mut self, to: WorkerId, id: MessageId) {
        self.send_out(Transmit {
            to,
            header: Header::Ack { id },
            body: None,
        });
    }

    pub(super) fn on_ack(&mut self, id: MessageId, now: Instant) {
        let Some(u) = self.unacked.remove(&id) else {
            return;
        };
        self.timers.remove(&(u.next_try, Timer::Control(id)));
        if let Some(ids) = self.unacked_to.get_mut(&u.to) {
            ids.remove(&id);
            if ids.is_empty() {
                self.unacked_to.remove(&u.to);
            }
        }
        if let Header::ForkRequest { fork, .. } = u.header {
            // The owner confirmed our fork: tell the parent, then we may delete if dropped.
            let parent = match self.used.get_mut(&fork) {
                Some(used) if !used.confirmed => {
                    used.confirmed = true;
                    self.events.push_back(Event::Confirmed {
                        rref: used.rref,
                        fork,
                    });
                    used.parent
                }
                _ => None,
            };
            if let Some(parent) = parent {
                self.send_control(
                    parent,
                    |id, floor| Header::ChildAccept { id, floor, fork },
                    now,
                );
            }
            self.maybe_delete_user(fork, now);
        }
    }
}
