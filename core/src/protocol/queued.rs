//! What is queued for one peer's writer, counted, and the rules of the count: a frame counts
//! its bytes (at least one, so that "nothing queued" is a count of 0), drawn from the peer's
//! memory budget ([`Use::Queued`], beside its inbox, frame being received and records); a
//! frame that would pass the budget (a frame alone, the peer holding nothing else, always
//! passes) fails the peer, once, with that first overrun as its cause, and from then on
//! frames for it are dropped uncounted; bytes that leave (sent, or dropped) are given back,
//! which may let its held requests run again. The agent's writer queue does what
//! [`QueueCount::admit`] says and keeps the channel and the failure's signal.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::AtomicUsize;
//! use tensorwire_core::budget::Budget;
//! use tensorwire_core::protocol::queued::{QueueCount, Queueing};
//!
//! let count = QueueCount::new(Arc::new(AtomicUsize::new(0)), Budget::new(100).account(1));
//! assert_eq!(count.admit(60), Queueing::Counted(60));
//! assert_eq!(count.admit(60), Queueing::FailedNow); // past the budget: the peer fails
//! assert_eq!(count.admit(1), Queueing::Dropped);
//! count.left(60);
//! assert!(count.is_empty() && count.cause().is_some());
//! ```

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::LostCause;
use crate::budget::{Account, Admit, Use};
use crate::wire::Frame;

/// What to do with a frame for the writer ([`QueueCount::admit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queueing {
    /// Queue it: counted as this many bytes (give them back with [`QueueCount::left`]).
    Counted(usize),
    /// It passed the budget: drop it, and fail the peer now (its writer frees the queue and
    /// reports the loss, [`QueueCount::cause`]).
    FailedNow,
    /// The peer is being failed already: drop it.
    Dropped,
}

/// One peer's queued bytes (see the module's documentation).
#[derive(Debug)]
pub struct QueueCount {
    bytes: AtomicUsize,
    /// The agent's total over every peer.
    total: Arc<AtomicUsize>,
    /// The peer's account in the agent's budget.
    account: Account,
    /// `cause` is set: read on every admit without its lock.
    has_failed: AtomicBool,
    cause: Mutex<Option<LostCause>>,
}

impl QueueCount {
    /// Nothing queued, drawing from `account`, counted also in `total`.
    pub fn new(total: Arc<AtomicUsize>, account: Account) -> Self {
        Self {
            bytes: AtomicUsize::new(0),
            total,
            account,
            has_failed: AtomicBool::new(false),
            cause: Mutex::new(None),
        }
    }

    /// Nothing queued (a task may then write directly).
    pub fn is_empty(&self) -> bool {
        self.bytes.load(Ordering::Acquire) == 0
    }

    /// A frame of `content` bytes is to be queued: whether it is, and as how many bytes.
    pub fn admit(&self, content: u64) -> Queueing {
        if self.has_failed.load(Ordering::Acquire) {
            return Queueing::Dropped;
        }
        let n = usize::try_from(content).unwrap_or(usize::MAX).max(1);
        if let Err(over) = self.account.take(Use::Queued, n, Admit::IfRoom) {
            let mut cause = self.cause.lock().unwrap_or_else(PoisonError::into_inner);
            if cause.is_some() {
                return Queueing::Dropped;
            }
            *cause = Some(LostCause::OverBudget(Box::new(over)));
            self.has_failed.store(true, Ordering::Release);
            return Queueing::FailedNow;
        }
        self.total.fetch_add(n, Ordering::AcqRel);
        self.bytes.fetch_add(n, Ordering::AcqRel);
        Queueing::Counted(n)
    }

    /// `n` counted bytes left the queue (sent, or dropped). True when that lets the peer's
    /// held requests run again (`Ledger::holds_requests`): the caller runs them.
    pub fn left(&self, n: usize) -> bool {
        self.total.fetch_sub(n, Ordering::AcqRel);
        self.bytes.fetch_sub(n, Ordering::AcqRel);
        self.account.release_and_resume(Use::Queued, n)
    }

    /// Why the peer is failed, once a frame would have passed the budget.
    pub fn cause(&self) -> Option<LostCause> {
        self.cause
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The bytes a queued `frame` counts (as [`QueueCount::admit`] counts them).
pub fn frame_bytes(frame: &Frame) -> usize {
    usize::try_from(frame.content_len())
        .unwrap_or(usize::MAX)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Budget;

    fn count(budget: usize) -> (QueueCount, Arc<AtomicUsize>, Budget) {
        let total = Arc::new(AtomicUsize::new(0));
        let budget = Budget::new(budget);
        (
            QueueCount::new(Arc::clone(&total), budget.account(3)),
            total,
            budget,
        )
    }

    #[test]
    fn frames_count_their_bytes_at_least_one_in_the_peer_the_total_and_the_budget() {
        let (q, total, budget) = count(1000);
        assert!(q.is_empty());
        assert_eq!(q.admit(0), Queueing::Counted(1));
        assert_eq!(q.admit(40), Queueing::Counted(40));
        assert!(!q.is_empty());
        assert_eq!(total.load(Ordering::Acquire), 41);
        assert_eq!(budget.held(3).queued, 41);
        q.left(41);
        assert!(q.is_empty());
        assert_eq!(
            (total.load(Ordering::Acquire), budget.held(3).queued),
            (0, 0)
        );
        assert_eq!(frame_bytes(&Frame::message(Vec::new(), Vec::new())), 1);
    }

    #[test]
    fn a_frame_past_the_budget_fails_the_peer_once_and_later_frames_are_dropped_uncounted() {
        let (q, total, _budget) = count(100);
        // Alone, a frame passes whatever its size.
        assert_eq!(q.admit(500), Queueing::Counted(500));
        assert_eq!(q.admit(1), Queueing::FailedNow);
        let Some(LostCause::OverBudget(_)) = q.cause() else {
            panic!("the cause is the overrun: {:?}", q.cause());
        };
        assert_eq!(q.admit(1), Queueing::Dropped);
        assert_eq!(total.load(Ordering::Acquire), 500);
        // Freed, it stays failed: its writer is failing it.
        q.left(500);
        assert_eq!(q.admit(1), Queueing::Dropped);
        assert!(q.is_empty());
    }

    #[test]
    fn bytes_that_leave_let_the_peers_held_requests_run_again() {
        let (q, _total, budget) = count(1 << 20);
        budget.set_hold_mark(100);
        assert_eq!(q.admit(150), Queueing::Counted(150));
        // Past the hold mark its requests wait; all of it sent, they run again, once.
        assert!(budget.holds_requests(3));
        assert!(q.left(150));
        assert_eq!(q.admit(10), Queueing::Counted(10));
        assert!(!q.left(10), "nothing was held");
        assert!(!budget.holds_requests(3));
    }
}
