//! The requests a node holds back: a peer's calls are not handed to the driver while its
//! budget says so ([`Account::holds_requests`](crate::budget::Account::holds_requests): the
//! frames queued for it wait unread past the hold mark, or as many of its requests run as one
//! peer's may at once). Running them would only add replies nobody reads, on time taken from
//! the peers that read theirs. Held requests keep their order (one arriving while others are
//! held waits behind them), are counted in the peer's budget (`Use::Requests`; one past it
//! drops the peer, as a queue past it does), run once the peer reads again or one of its
//! requests ends, and are dropped with the peer.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use crate::budget::{Admit, OverBudget, Use};
use crate::protocol::gather::GATHER_FUNCTION;
use crate::protocol::{Endpoint, Event, Payload, WorkerId};

/// A held request: the event, the bytes it is counted as, and whether it counts as running
/// once it runs (a gather's call does not: it waits for the other members, holding nothing
/// but its round, which the gathers bound per member themselves).
type Request<B> = (Event<B>, usize, bool);

/// The requests held back, by peer, and those that may run now.
#[derive(Debug)]
pub(super) struct Held<B> {
    queues: BTreeMap<WorkerId, VecDeque<Request<B>>>,
    /// Held requests that may run now (already counted as running).
    ready: VecDeque<Event<B>>,
    /// Peers that passed their budget with a request held: the driver drops them.
    over: VecDeque<(WorkerId, OverBudget)>,
}

impl<B> Default for Held<B> {
    fn default() -> Self {
        Self {
            queues: BTreeMap::new(),
            ready: VecDeque::new(),
            over: VecDeque::new(),
        }
    }
}

/// Whether a request of `function` from `from` to worker `me` counts as a running request of
/// its sender: a peer's, except a gather's contribution (see [`GATHER_FUNCTION`]).
pub(super) fn counts(me: WorkerId, from: WorkerId, function: &str) -> bool {
    from != me && function != GATHER_FUNCTION
}

/// The bytes a request is counted as in its sender's budget (at least one).
fn request_bytes<B: Payload>(body: &B) -> usize {
    body.wire_bytes().max(1)
}

impl<B: Payload> Held<B> {
    /// A request the endpoint produced: `Some` to hand to the driver now (counted as running),
    /// `None` if held (or its peer passed its budget: [`take_over`](Self::take_over)).
    /// Anything else, and this worker's own requests, pass.
    pub(super) fn admit(&mut self, ep: &Endpoint<B>, ev: Event<B>) -> Option<Event<B>> {
        let (from, counted, bytes) = match &ev {
            Event::Call {
                token,
                function,
                body,
                ..
            }
            | Event::Remote {
                token,
                function,
                body,
                ..
            } => (
                token.from(),
                counts(ep.id(), token.from(), function),
                request_bytes(body),
            ),
            _ => return Some(ev),
        };
        if from == ep.id() {
            return Some(ev);
        }
        let account = ep.budget().account(from);
        let behind_others = self.queues.get(&from).is_some_and(|q| !q.is_empty());
        if !behind_others && account.start_request_unless_held(counted) {
            return Some(ev);
        }
        match account.take(Use::Requests, bytes, Admit::IfRoom) {
            Ok(()) => self
                .queues
                .entry(from)
                .or_default()
                .push_back((ev, bytes, counted)),
            Err(over) => self.over.push_back((from, over)),
        }
        None
    }

    /// Moves `peer`'s held requests to the ready ones, in order, while its budget no longer
    /// holds them. True if some moved.
    pub(super) fn resume(&mut self, ep: &Endpoint<B>, peer: WorkerId) -> bool {
        let account = ep.budget().account(peer);
        let mut moved = false;
        while !account.holds_requests() {
            let Some(queue) = self.queues.get_mut(&peer) else {
                break;
            };
            let next = queue.pop_front();
            if queue.is_empty() {
                self.queues.remove(&peer);
            }
            let Some((ev, bytes, counted)) = next else {
                break;
            };
            account.release(Use::Requests, bytes);
            if counted {
                account.start_request();
            }
            self.ready.push_back(ev);
            moved = true;
        }
        moved
    }

    /// The next held request that may run.
    pub(super) fn take_ready(&mut self) -> Option<Event<B>> {
        self.ready.pop_front()
    }

    /// The next peer that passed its budget with a request held.
    pub(super) fn take_over(&mut self) -> Option<(WorkerId, OverBudget)> {
        self.over.pop_front()
    }

    /// Forgets `peer`'s held requests (it is lost), giving their bytes back to its budget. The
    /// references forked for this worker in their arguments are accepted and dropped at once,
    /// as for a request refused, so that their owners stop counting them.
    pub(super) fn drop_peer(&mut self, ep: &mut Endpoint<B>, peer: WorkerId, now: Instant) {
        let Some(queue) = self.queues.remove(&peer) else {
            return;
        };
        let mut bytes = 0usize;
        for (ev, b, _) in queue {
            bytes = bytes.saturating_add(b);
            if let Event::Call { body, .. } | Event::Remote { body, .. } = ev {
                for fork in body.forks() {
                    let handle = ep.accept_fork(fork, now);
                    ep.drop_handle(handle, now);
                }
            }
        }
        ep.budget().account(peer).release(Use::Requests, bytes);
    }

    /// Whether requests of `peer` are held.
    pub(super) fn holds(&self, peer: WorkerId) -> bool {
        self.queues.contains_key(&peer)
    }
}
