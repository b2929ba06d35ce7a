//! What is queued for one peer's writer: bytes counted as frames go in and leave (sent, or
//! dropped when the peer is failed or its connection breaks), drawn from the peer's memory
//! budget (`EndpointConfig::peer_budget`, with its inbox, frame being received and records;
//! see `tensorwire_core::budget`), and the agent's total over every peer.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tensorwire_core::budget::{Account, Admit, Use};
use tensorwire_core::protocol::LostCause;
use tensorwire_core::wire::Frame;
use tokio::sync::{mpsc, watch};

/// One peer's queue (see the module's documentation).
pub(crate) struct OutQueue {
    bytes: AtomicUsize,
    /// The agent's total over every peer (`Agent::queued_bytes`).
    total: Arc<AtomicUsize>,
    /// The peer's account in the agent's budget.
    account: Account,
    /// Set once, when a frame would pass the budget: the writer drops the queue and fails
    /// the peer with `cause`.
    failed: watch::Sender<bool>,
    /// `failed`'s value, read on every enqueue without the watch's lock.
    has_failed: AtomicBool,
    cause: Mutex<Option<LostCause>>,
}

impl OutQueue {
    /// An empty queue drawing from `account`, counted also in `total`.
    pub(crate) fn new(total: Arc<AtomicUsize>, account: Account) -> Self {
        Self {
            bytes: AtomicUsize::new(0),
            total,
            account,
            failed: watch::Sender::new(false),
            has_failed: AtomicBool::new(false),
            cause: Mutex::new(None),
        }
    }

    /// Nothing queued (a task of ours may then write directly).
    pub(crate) fn is_empty(&self) -> bool {
        self.bytes.load(Ordering::Acquire) == 0
    }

    fn add(&self, n: usize) {
        self.total.fetch_add(n, Ordering::AcqRel);
        self.bytes.fetch_add(n, Ordering::AcqRel);
    }

    /// `n` bytes left the queue (sent, or dropped). True when that lets the peer's held
    /// requests run again (`Ledger::holds_requests`): the caller runs them.
    pub(crate) fn sub(&self, n: usize) -> bool {
        self.total.fetch_sub(n, Ordering::AcqRel);
        self.bytes.fetch_sub(n, Ordering::AcqRel);
        self.account.release_and_resume(Use::Queued, n)
    }

    /// Told (once) when a frame would have passed the budget.
    pub(crate) fn subscribe_failed(&self) -> watch::Receiver<bool> {
        self.failed.subscribe()
    }

    /// Why the peer is failed, once a frame would have passed the budget.
    pub(crate) fn cause(&self) -> Option<LostCause> {
        self.cause
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Queues `frame` for the writer fed by `tx`. Past the peer's budget (a frame alone, the
    /// peer holding nothing else, always passes) the frame is dropped and the writer told to
    /// fail the peer: it frees the queue, then reports the loss, which fails the peer's calls
    /// naming the budget ([`LostCause::OverBudget`]). A frame for a peer being failed is
    /// dropped (its calls fail with that loss). False if the writer is gone.
    pub(crate) fn enqueue(&self, tx: &mpsc::UnboundedSender<Frame>, frame: Frame) -> bool {
        if self.has_failed.load(Ordering::Acquire) {
            return true;
        }
        let n = frame_bytes(&frame);
        if let Err(over) = self.account.take(Use::Queued, n, Admit::IfRoom) {
            let mut cause = self.cause.lock().unwrap_or_else(PoisonError::into_inner);
            if cause.is_none() {
                *cause = Some(LostCause::OverBudget(Box::new(over)));
                self.has_failed.store(true, Ordering::Release);
                self.failed.send_replace(true);
            }
            return true;
        }
        self.add(n);
        if tx.send(frame).is_err() {
            self.sub(n);
            return false;
        }
        true
    }
}

/// The bytes a queued frame holds (at least 1, so that "nothing queued" is a count of 0).
pub(crate) fn frame_bytes(frame: &Frame) -> usize {
    usize::try_from(frame.content_len())
        .unwrap_or(usize::MAX)
        .max(1)
}
