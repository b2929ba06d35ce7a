//! One memory budget per peer: every byte one peer can make this worker hold is drawn from it.
//!
//! What a peer can make a worker hold is spread over several places that add up: the frames
//! queued for it that it has not read (a peer that never reads), the collective messages it
//! sent that no collective has taken (the process group's inboxes), the frame being received
//! from it (allocated as it arrives), and the records kept on its behalf (idempotence records,
//! references it holds, fetches it parked). Bounded one by one they add up to far more than any
//! of them (1 GiB of inbox + 256 MiB of queue + a half-sent frame); drawn from one budget per
//! peer ([`DEFAULT_PEER_BUDGET`], 256 MiB by default) they cannot.
//!
//! The decision is here, in the [`Ledger`] (pure and deterministic): the holders (the agent's
//! writer queues, the mesh's inboxes, the TCP reader, the protocol endpoint) only report the
//! bytes they take and release, through an [`Account`] of a shared [`Budget`], and act on the
//! answer: a [`Use`] the ledger refuses fails with [`OverBudget`], which names the bound
//! (`peer_budget`) and what the peer holds under each use.
//!
//! Rules, the same for every use:
//! - a take that keeps the peer's total within the budget passes;
//! - a take for a peer that holds nothing passes whatever its size ("one thing alone always
//!   passes": an honest frame larger than the budget is still delivered), so the total is at
//!   most the budget or one single item;
//! - a take made with [`Admit::Always`] passes and counts (a message a collective already
//!   waits for: refusing it would fail honest work; it is taken at once);
//! - anything else is refused and nothing is counted.
//!
//! ```
//! use tensorwire_core::budget::{Admit, Budget, Use};
//!
//! let budget = Budget::new(100);
//! let peer = budget.account(2);
//! peer.take(Use::Inbox, 60, Admit::IfRoom).unwrap();
//! // The queue for the same peer draws from the same budget.
//! let err = peer.take(Use::Queued, 50, Admit::IfRoom).unwrap_err();
//! assert_eq!(err.held.inbox, 60);
//! assert!(err.to_string().contains("peer_budget"), "{err}");
//! peer.release(Use::Inbox, 60);
//! peer.take(Use::Queued, 50, Admit::IfRoom).unwrap();
//! assert_eq!(budget.held(2).total(), 50);
//! ```

use crate::hashing::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

/// The default budget per peer: 256 MiB.
pub const DEFAULT_PEER_BUDGET: usize = 256 << 20;

/// What a peer makes this worker hold, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Use {
    /// Frames queued for it that it has not read yet (replies, calls, acknowledgements).
    Queued,
    /// Collective messages it sent that no collective has taken.
    Inbox,
    /// The frame being received from it, as far as it has arrived.
    Frame,
    /// Records kept on its behalf: idempotence records, references it holds here, fetches it
    /// parked on values being created.
    Records,
    /// Its requests held back, not run, while the frames queued for it wait unread (see
    /// [`Ledger::holds_requests`]).
    Requests,
}

impl fmt::Display for Use {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Use::Queued => "frames queued for it",
            Use::Inbox => "collective messages no collective has taken",
            Use::Frame => "a frame being received",
            Use::Records => "records kept for it",
            Use::Requests => "its requests held until it reads its replies",
        })
    }
}

/// How a take is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Within the budget (or alone: the peer holds nothing else).
    IfRoom,
    /// Whatever the budget: what honest work already waits for. Counted all the same.
    Always,
}

/// What one peer makes this worker hold, in bytes, by [`Use`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Frames queued for it ([`Use::Queued`]).
    pub queued: usize,
    /// Collective messages it sent that no collective has taken ([`Use::Inbox`]).
    pub inbox: usize,
    /// The frame being received from it ([`Use::Frame`]).
    pub frame: usize,
    /// Records kept for it ([`Use::Records`]).
    pub records: usize,
    /// Its requests held back while it does not read ([`Use::Requests`]).
    pub requests: usize,
}

impl Held {
    /// Everything, over every use.
    pub fn total(&self) -> usize {
        self.queued
            .saturating_add(self.inbox)
            .saturating_add(self.frame)
            .saturating_add(self.records)
            .saturating_add(self.requests)
    }

    fn of_mut(&mut self, what: Use) -> &mut usize {
        match what {
            Use::Queued => &mut self.queued,
            Use::Inbox => &mut self.inbox,
            Use::Frame => &mut self.frame,
            Use::Records => &mut self.records,
            Use::Requests => &mut self.requests,
        }
    }

    /// The bytes held under `what`.
    pub fn of(&self, what: Use) -> usize {
        match what {
            Use::Queued => self.queued,
            Use::Inbox => self.inbox,
            Use::Frame => self.frame,
            Use::Records => self.records,
            Use::Requests => self.requests,
        }
    }
}

impl fmt::Display for Held {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes queued for it, {} in collective inboxes, {} of a frame being received, {} \
             of records, {} of requests held",
            self.queued, self.inbox, self.frame, self.records, self.requests
        )
    }
}

/// A take the budget refused: the peer, what it asked for, what it holds, and the bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "peer {peer} would make this worker hold {} bytes ({asked} more for {what}), past its budget \
     of {budget} bytes per peer (peer_budget); it holds {held}",
    held.total().saturating_add(*asked)
)]
pub struct OverBudget {
    /// The peer (its worker id, or its world rank in a process group).
    pub peer: u32,
    /// What the refused bytes were for.
    pub what: Use,
    /// The bytes refused.
    pub asked: usize,
    /// What the peer held before.
    pub held: Held,
    /// The budget per peer (`peer_budget`).
    pub budget: usize,
}

/// The share of the budget a peer's unread frames may reach before its requests are held
/// ([`Ledger::holds_requests`]): an eighth (32 MiB of the default 256 MiB).
pub const HOLD_REQUESTS_FRACTION: usize = 8;

/// Requests of one peer that run at once (handed to their handlers, not answered yet) before
/// its next ones are held ([`Ledger::holds_requests`]): each peer's requests are served in
/// turn with the others', not all of one flood before an honest peer's call.
pub const RUNNING_PER_PEER: usize = 64;

/// The budget's accounts, one per peer: the sans-IO decision (see the module's documentation).
#[derive(Debug, Clone)]
pub struct Ledger {
    budget: usize,
    peers: HashMap<u32, Held>,
    /// The most each peer held at once since the ledger was made (for tests and benchmarks).
    peaks: HashMap<u32, usize>,
    /// Frames queued for a peer, unread, from which its requests are held.
    hold_mark: usize,
    /// The peers whose requests are held now.
    holding: HashSet<u32>,
    /// Peers whose requests were held and may run again, not yet taken by
    /// [`take_resumed`](Self::take_resumed).
    resumed: Vec<u32>,
    /// Requests of each peer running now ([`start_request`](Self::start_request)).
    running: HashMap<u32, usize>,
    /// How many of one peer's requests may run at once.
    running_cap: usize,
}

impl Ledger {
    /// An empty ledger that lets each peer hold `budget` bytes, and holds a peer's requests
    /// once an eighth of it ([`HOLD_REQUESTS_FRACTION`]) waits unread in its queue.
    pub fn new(budget: usize) -> Self {
        Ledger {
            budget,
            peers: HashMap::default(),
            peaks: HashMap::default(),
            hold_mark: (budget / HOLD_REQUESTS_FRACTION).max(1),
            holding: HashSet::default(),
            resumed: Vec::new(),
            running: HashMap::default(),
            running_cap: RUNNING_PER_PEER,
        }
    }

    /// Sets how many of one peer's requests may run at once (at least 1; default
    /// [`RUNNING_PER_PEER`]).
    pub fn set_running_cap(&mut self, requests: usize) {
        self.running_cap = requests.max(1);
    }

    /// One of `peer`'s requests starts running (its handler is called).
    pub fn start_request(&mut self, peer: u32) {
        *self.running.entry(peer).or_insert(0) += 1;
    }

    /// One of `peer`'s requests is answered. True when its held requests may run now.
    pub fn finish_request(&mut self, peer: u32) -> bool {
        // A count that reaches 0 stays (one entry per peer, as `peaks` keeps one): the peer's
        // next request finds it, with no removal and insert of an entry a request.
        let running = self.running.get_mut(&peer).map_or(0, |n| {
            *n = n.saturating_sub(1);
            *n
        });
        !(self.holding.contains(&peer) || running >= self.running_cap)
    }

    /// Unless `peer`'s requests are held ([`holds_requests`](Self::holds_requests)), starts
    /// one running when it is `counted` ([`start_request`](Self::start_request)): true if it
    /// may run. One look-up of its count for both.
    pub fn start_request_unless_held(&mut self, peer: u32, counted: bool) -> bool {
        if self.holding.contains(&peer) {
            return false;
        }
        if !counted {
            return self.running(peer) < self.running_cap;
        }
        let running = self.running.entry(peer).or_insert(0);
        if *running >= self.running_cap {
            return false;
        }
        *running += 1;
        true
    }

    /// How many of `peer`'s requests run now.
    pub fn running(&self, peer: u32) -> usize {
        self.running.get(&peer).copied().unwrap_or(0)
    }

    /// Sets the bytes of frames queued for a peer, unread, from which its requests are held
    /// (at least 1). They run again once its queue is down to half of it.
    pub fn set_hold_mark(&mut self, bytes: usize) {
        self.hold_mark = bytes.max(1);
    }

    /// The bytes queued for a peer from which its requests are held.
    pub fn hold_mark(&self) -> usize {
        self.hold_mark
    }

    /// Whether `peer`'s requests are to be held, not run: the frames queued for it (replies,
    /// calls, acknowledgements) wait unread past the hold mark (an eighth of the budget by
    /// default, [`set_hold_mark`](Self::set_hold_mark)), and have not come down to half of it
    /// since; or [`RUNNING_PER_PEER`] of its requests run already (they are served in turn
    /// with other peers', whose own requests are not held by it). Running them would only produce replies nobody reads, on time taken from the
    /// peers that do read; reading the peer goes on (its replies to this worker's calls are
    /// still taken), so two busy peers never wait on each other.
    pub fn holds_requests(&self, peer: u32) -> bool {
        self.holding.contains(&peer) || self.running(peer) >= self.running_cap
    }

    /// The peers whose requests were held and may run again since the last call (each once).
    pub fn take_resumed(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.resumed)
    }

    /// Starts or stops holding `peer`'s requests after its queue changed.
    fn update_holding(&mut self, peer: u32) {
        let queued = self.held(peer).queued;
        if queued >= self.hold_mark {
            self.holding.insert(peer);
        } else if queued <= self.hold_mark / 2 && self.holding.remove(&peer) {
            self.resumed.push(peer);
        }
    }

    /// The budget per peer.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Takes `bytes` for `what` on `peer`'s account, or refuses them (see the module's rules).
    pub fn take(
        &mut self,
        peer: u32,
        what: Use,
        bytes: usize,
        admit: Admit,
    ) -> Result<(), OverBudget> {
        let held = self.peers.get(&peer).copied().unwrap_or_default();
        let total = held.total();
        if admit == Admit::IfRoom && total > 0 && total.saturating_add(bytes) > self.budget {
            return Err(OverBudget {
                peer,
                what,
                asked: bytes,
                held,
                budget: self.budget,
            });
        }
        if bytes == 0 {
            return Ok(());
        }
        let entry = self.peers.entry(peer).or_default();
        let slot = entry.of_mut(what);
        *slot = slot.saturating_add(bytes);
        let total = entry.total();
        let peak = self.peaks.entry(peer).or_insert(0);
        *peak = (*peak).max(total);
        if what == Use::Queued {
            self.update_holding(peer);
        }
        Ok(())
    }

    /// Whether [`take`](Self::take) would pass `bytes` more for `what` with
    /// [`Admit::IfRoom`], without taking them.
    pub fn check(&self, peer: u32, what: Use, bytes: usize) -> Result<(), OverBudget> {
        let held = self.peers.get(&peer).copied().unwrap_or_default();
        let total = held.total();
        if total > 0 && total.saturating_add(bytes) > self.budget {
            return Err(OverBudget {
                peer,
                what,
                asked: bytes,
                held,
                budget: self.budget,
            });
        }
        Ok(())
    }

    /// Moves the charge of one item (a frame being received, which grows as it arrives) from
    /// `from` bytes to `to` bytes: a growth is admitted as a take of the whole item would be
    /// (alone, it passes whatever its size), a shrink is a release.
    pub fn resize(
        &mut self,
        peer: u32,
        what: Use,
        from: usize,
        to: usize,
    ) -> Result<(), OverBudget> {
        if to <= from {
            self.release(peer, what, from - to);
            return Ok(());
        }
        let held = self.held(peer);
        let others = held.total().saturating_sub(from);
        if others > 0 && others.saturating_add(to) > self.budget {
            return Err(OverBudget {
                peer,
                what,
                asked: to - from,
                held,
                budget: self.budget,
            });
        }
        self.take(peer, what, to - from, Admit::Always)
    }

    /// Gives back `bytes` of `what` on `peer`'s account (never below zero).
    pub fn release(&mut self, peer: u32, what: Use, bytes: usize) {
        if bytes == 0 {
            return;
        }
        if let Some(entry) = self.peers.get_mut(&peer) {
            let slot = entry.of_mut(what);
            *slot = slot.saturating_sub(bytes);
            if entry.total() == 0 {
                self.peers.remove(&peer);
            }
        }
        if what == Use::Queued {
            self.update_holding(peer);
        }
    }

    /// What `peer` holds now.
    pub fn held(&self, peer: u32) -> Held {
        self.peers.get(&peer).copied().unwrap_or_default()
    }

    /// The most `peer` held at once so far.
    pub fn peak(&self, peer: u32) -> usize {
        self.peaks.get(&peer).copied().unwrap_or(0)
    }
}

/// A [`Ledger`] shared by the holders of one worker (the agent's queues, the mesh's inboxes,
/// the transport's readers): each reports through an [`Account`]. The lock guards the ledger
/// alone, for O(1) work, and is never held across anything else.
#[derive(Debug, Clone)]
pub struct Budget {
    ledger: Arc<Mutex<Ledger>>,
}

impl Default for Budget {
    /// A budget of [`DEFAULT_PEER_BUDGET`] per peer.
    fn default() -> Self {
        Budget::new(DEFAULT_PEER_BUDGET)
    }
}

impl PartialEq for Budget {
    /// The same shared ledger.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.ledger, &other.ledger)
    }
}

impl Budget {
    /// A budget of `bytes` per peer.
    pub fn new(bytes: usize) -> Self {
        Budget {
            ledger: Arc::new(Mutex::new(Ledger::new(bytes))),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Ledger) -> R) -> R {
        f(&mut self.ledger.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The account of `peer`.
    pub fn account(&self, peer: u32) -> Account {
        Account {
            budget: self.clone(),
            peer,
        }
    }

    /// The budget per peer.
    pub fn limit(&self) -> usize {
        self.with(|l| l.budget())
    }

    /// What `peer` holds now.
    pub fn held(&self, peer: u32) -> Held {
        self.with(|l| l.held(peer))
    }

    /// The most `peer` held at once so far.
    pub fn peak(&self, peer: u32) -> usize {
        self.with(|l| l.peak(peer))
    }

    /// [`Ledger::holds_requests`].
    pub fn holds_requests(&self, peer: u32) -> bool {
        self.with(|l| l.holds_requests(peer))
    }

    /// [`Ledger::take_resumed`].
    pub fn take_resumed(&self) -> Vec<u32> {
        self.with(Ledger::take_resumed)
    }

    /// [`Ledger::set_hold_mark`].
    pub fn set_hold_mark(&self, bytes: usize) {
        self.with(|l| l.set_hold_mark(bytes));
    }

    /// [`Ledger::set_running_cap`].
    pub fn set_running_cap(&self, requests: usize) {
        self.with(|l| l.set_running_cap(requests));
    }
}

/// One peer's account in a shared [`Budget`].
#[derive(Debug, Clone, PartialEq)]
pub struct Account {
    budget: Budget,
    peer: u32,
}

impl Account {
    /// The peer.
    pub fn peer(&self) -> u32 {
        self.peer
    }

    /// The budget it draws from.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// [`Ledger::take`] on this account.
    pub fn take(&self, what: Use, bytes: usize, admit: Admit) -> Result<(), OverBudget> {
        self.budget.with(|l| l.take(self.peer, what, bytes, admit))
    }

    /// [`Ledger::check`] on this account.
    pub fn check(&self, what: Use, bytes: usize) -> Result<(), OverBudget> {
        self.budget.with(|l| l.check(self.peer, what, bytes))
    }

    /// [`Ledger::release`] on this account.
    pub fn release(&self, what: Use, bytes: usize) {
        self.budget.with(|l| l.release(self.peer, what, bytes));
    }

    /// [`Ledger::release`] on this account; true when that let the peer's held requests run
    /// again (taken off [`Ledger::take_resumed`]'s list: the caller runs them).
    pub fn release_and_resume(&self, what: Use, bytes: usize) -> bool {
        self.budget.with(|l| {
            l.release(self.peer, what, bytes);
            let before = l.resumed.len();
            l.resumed.retain(|p| *p != self.peer);
            l.resumed.len() != before
        })
    }

    /// [`Ledger::holds_requests`] for this account's peer.
    pub fn holds_requests(&self) -> bool {
        self.budget.holds_requests(self.peer)
    }

    /// Unless this account's peer's requests are held ([`Ledger::holds_requests`]), starts
    /// one running when it is `counted` ([`Ledger::start_request`]): true if it may run. One
    /// turn of the ledger's lock for both.
    pub fn start_request_unless_held(&self, counted: bool) -> bool {
        self.budget
            .with(|l| l.start_request_unless_held(self.peer, counted))
    }

    /// [`Ledger::start_request`] for this account's peer.
    pub fn start_request(&self) {
        self.budget.with(|l| l.start_request(self.peer));
    }

    /// [`Ledger::finish_request`] for this account's peer.
    pub fn finish_request(&self) -> bool {
        self.budget.with(|l| l.finish_request(self.peer))
    }

    /// [`Ledger::resize`] on this account.
    pub fn resize(&self, what: Use, from: usize, to: usize) -> Result<(), OverBudget> {
        self.budget.with(|l| l.resize(self.peer, what, from, to))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_use_of_a_peer_draws_from_one_budget() {
        let mut l = Ledger::new(100);
        l.take(1, Use::Inbox, 40, Admit::IfRoom).unwrap();
        l.take(1, Use::Queued, 30, Admit::IfRoom).unwrap();
        l.take(1, Use::Frame, 20, Admit::IfRoom).unwrap();
        l.take(1, Use::Records, 10, Admit::IfRoom).unwrap();
        assert_eq!(l.held(1).total(), 100);
        // Full: any use of the same peer is refused, nothing is counted, the bound is named.
        for what in [Use::Inbox, Use::Queued, Use::Frame, Use::Records] {
            let err = l.take(1, what, 1, Admit::IfRoom).unwrap_err();
            assert_eq!(err.budget, 100);
            assert_eq!(err.held.total(), 100);
            assert_eq!(err.what, what);
            let text = err.to_string();
            assert!(
                text.contains("past its budget of 100 bytes per peer (peer_budget)"),
                "{text}"
            );
            assert!(text.contains("40 in collective inboxes"), "{text}");
        }
        assert_eq!(l.held(1).total(), 100);
        // Another peer has its own account.
        l.take(2, Use::Queued, 100, Admit::IfRoom).unwrap();
        // Released bytes make room again.
        l.release(1, Use::Inbox, 40);
        l.take(1, Use::Queued, 40, Admit::IfRoom).unwrap();
        assert_eq!(
            l.held(1),
            Held {
                queued: 70,
                inbox: 0,
                frame: 20,
                records: 10,
                requests: 0
            }
        );
        assert_eq!(l.peak(1), 100);
    }

    #[test]
    fn one_item_alone_passes_and_what_is_waited_for_always_does() {
        let mut l = Ledger::new(100);
        // Alone: an honest frame larger than the budget is delivered.
        l.take(1, Use::Frame, 1000, Admit::IfRoom).unwrap();
        assert!(l.take(1, Use::Queued, 1, Admit::IfRoom).is_err());
        l.take(1, Use::Inbox, 5, Admit::Always).unwrap();
        assert_eq!(l.held(1).total(), 1005);
        l.release(1, Use::Frame, 1000);
        l.release(1, Use::Inbox, 5);
        assert_eq!(l.held(1), Held::default());
        // An account that empties is forgotten; releasing more than held stays at zero.
        l.release(1, Use::Inbox, 7);
        assert_eq!(l.held(1), Held::default());
        assert!(l.peers.is_empty());
    }

    #[test]
    fn a_flood_of_every_kind_never_holds_more_than_the_budget() {
        // Interleaved takes of every use, some released, in a fixed pseudo-random order: the
        // total never passes the budget (items are smaller than it), and refusals count nothing.
        let budget = 1 << 20;
        let mut l = Ledger::new(budget);
        let mut held: Vec<(Use, usize)> = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let uses = [Use::Queued, Use::Inbox, Use::Frame, Use::Records];
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let what = uses[(x % 4) as usize];
            let bytes = (x >> 8) as usize % (budget / 8) + 1;
            if x % 5 == 0 {
                if let Some((w, b)) = held.pop() {
                    l.release(1, w, b);
                }
            } else if l.take(1, what, bytes, Admit::IfRoom).is_ok() {
                held.push((what, bytes));
            }
            let sum: usize = held.iter().map(|(_, b)| b).sum();
            assert_eq!(l.held(1).total(), sum);
            assert!(sum <= budget);
        }
        assert!(l.peak(1) <= budget);
        assert!(l.peak(1) > budget / 2, "the flood came near the budget");
    }

    #[test]
    fn a_peers_requests_are_held_while_its_queue_waits_unread_and_resume_at_half() {
        let mut l = Ledger::new(1000);
        assert_eq!(l.hold_mark(), 125);
        l.set_hold_mark(100);
        // Below the mark: run.
        l.take(1, Use::Queued, 99, Admit::IfRoom).unwrap();
        assert!(!l.holds_requests(1));
        // Other uses do not count: what it sent is not what waits for it.
        l.take(1, Use::Inbox, 500, Admit::IfRoom).unwrap();
        assert!(!l.holds_requests(1));
        // At the mark: held; another peer is not.
        l.take(1, Use::Queued, 1, Admit::IfRoom).unwrap();
        l.take(2, Use::Queued, 10, Admit::IfRoom).unwrap();
        assert!(l.holds_requests(1) && !l.holds_requests(2));
        // Draining above half: still held (no flapping at the mark).
        l.release(1, Use::Queued, 40);
        assert!(l.holds_requests(1));
        assert!(l.take_resumed().is_empty());
        // At half: it runs again, and is reported once.
        l.release(1, Use::Queued, 10);
        assert!(!l.holds_requests(1));
        assert_eq!(l.take_resumed(), vec![1]);
        assert!(l.take_resumed().is_empty());
        // A queue freed at once (its peer lost) resumes too.
        l.take(1, Use::Queued, 100, Admit::IfRoom).unwrap();
        assert!(l.holds_requests(1));
        l.release(1, Use::Queued, 150);
        assert_eq!(l.take_resumed(), vec![1]);
        // Held requests are counted in the budget as any use is.
        l.take(1, Use::Requests, 400, Admit::IfRoom).unwrap();
        let err = l.take(1, Use::Requests, 200, Admit::IfRoom).unwrap_err();
        assert!(err.to_string().contains("400 of requests held"), "{err}");
    }

    #[test]
    fn a_peer_runs_so_many_requests_at_once_and_no_more() {
        let mut l = Ledger::new(1 << 20);
        l.set_running_cap(2);
        l.start_request(1);
        assert!(!l.holds_requests(1));
        l.start_request(1);
        assert!(l.holds_requests(1), "two of its requests run");
        assert!(!l.holds_requests(2), "another peer's are not held by it");
        assert!(l.finish_request(1), "one answered: the next may run");
        assert_eq!(l.running(1), 1);
        // Held for its queue, a finished request lets nothing run.
        l.set_hold_mark(10);
        l.take(1, Use::Queued, 10, Admit::IfRoom).unwrap();
        assert!(!l.finish_request(1));
        assert_eq!(l.running(1), 0);
        assert!(l.holds_requests(1));
    }

    #[test]
    fn a_request_starts_unless_held_by_the_cap_or_the_queue() {
        let mut l = Ledger::new(1 << 20);
        l.set_running_cap(2);
        assert!(l.start_request_unless_held(1, true));
        assert!(
            l.start_request_unless_held(1, false),
            "not counted: runs, not counted"
        );
        assert!(l.start_request_unless_held(1, true));
        assert_eq!(l.running(1), 2);
        assert!(!l.start_request_unless_held(1, true), "at the cap: held");
        assert!(
            !l.start_request_unless_held(1, false),
            "at the cap, uncounted too"
        );
        assert_eq!(l.running(1), 2, "a held request is not counted");
        assert!(l.start_request_unless_held(2, true), "another peer's runs");
        // Down to none and up again: the count kept at 0 counts from there.
        assert!(l.finish_request(1));
        assert!(l.finish_request(1));
        assert!(
            l.finish_request(1),
            "one more finish than starts stays at 0"
        );
        assert_eq!(l.running(1), 0);
        assert!(l.start_request_unless_held(1, true));
        assert_eq!(l.running(1), 1);
        // Held for its queue: nothing starts, counted or not.
        l.set_hold_mark(10);
        l.take(1, Use::Queued, 10, Admit::IfRoom).unwrap();
        assert!(!l.start_request_unless_held(1, true));
        assert!(!l.start_request_unless_held(1, false));
        assert_eq!(l.running(1), 1);
    }

    #[test]
    fn an_account_says_when_its_release_let_its_requests_run() {
        let b = Budget::new(80);
        let a = b.account(5);
        a.take(Use::Queued, 10, Admit::IfRoom).unwrap();
        assert!(a.holds_requests());
        assert!(!a.release_and_resume(Use::Queued, 4));
        assert!(a.release_and_resume(Use::Queued, 1));
        assert!(
            b.take_resumed().is_empty(),
            "taken by the account's release"
        );
    }

    #[test]
    fn accounts_of_a_shared_budget_resize() {
        let b = Budget::new(100);
        let a = b.account(3);
        a.resize(Use::Frame, 0, 60).unwrap();
        a.take(Use::Queued, 30, Admit::IfRoom).unwrap();
        let err = a.resize(Use::Frame, 60, 80).unwrap_err();
        assert_eq!(err.asked, 20);
        a.resize(Use::Frame, 60, 0).unwrap();
        assert_eq!(b.held(3).total(), 30);
        assert_eq!(b.peak(3), 90);
        // Alone, an item grows past the budget (an honest frame larger than it).
        let c = b.account(4);
        c.resize(Use::Frame, 0, 60).unwrap();
        c.resize(Use::Frame, 60, 250).unwrap();
        assert!(c.take(Use::Queued, 1, Admit::IfRoom).is_err());
        c.resize(Use::Frame, 250, 0).unwrap();
        assert_eq!(a.budget(), &b);
    }
}
