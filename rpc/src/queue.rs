//! What is queued for one peer's writer: bytes counted as frames go in and leave (sent, or
//! dropped when the peer is failed or its connection breaks), drawn from the peer's memory
//! budget (`EndpointConfig::peer_budget`, with its inbox, frame being received and records;
//! see `tensorwire_core::budget`), and the agent's total over every peer. Core counts and
//! decides (`tensorwire_core::protocol::queued`); this queue feeds the writer's channel and
//! tells the writer when the peer is failed.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use tensorwire_core::budget::Account;
pub(crate) use tensorwire_core::protocol::queued::frame_bytes;
use tensorwire_core::protocol::queued::{QueueCount, Queueing};
use tensorwire_core::protocol::LostCause;
use tensorwire_core::wire::Frame;
use tokio::sync::{mpsc, watch};

/// One peer's queue (see the module's documentation).
pub(crate) struct OutQueue {
    count: QueueCount,
    /// Set once, when a frame would pass the budget: the writer drops the queue and fails
    /// the peer with the count's cause.
    failed: watch::Sender<bool>,
}

impl OutQueue {
    /// An empty queue drawing from `account`, counted also in `total`.
    pub(crate) fn new(total: Arc<AtomicUsize>, account: Account) -> Self {
        Self {
            count: QueueCount::new(total, account),
            failed: watch::Sender::new(false),
        }
    }

    /// Nothing queued (a task of ours may then write directly).
    pub(crate) fn is_empty(&self) -> bool {
        self.count.is_empty()
    }

    /// `n` bytes left the queue (sent, or dropped). True when that lets the peer's held
    /// requests run again: the caller runs them.
    pub(crate) fn sub(&self, n: usize) -> bool {
        self.count.left(n)
    }

    /// Told (once) when a frame would have passed the budget.
    pub(crate) fn subscribe_failed(&self) -> watch::Receiver<bool> {
        self.failed.subscribe()
    }

    /// Why the peer is failed, once a frame would have passed the budget.
    pub(crate) fn cause(&self) -> Option<LostCause> {
        self.count.cause()
    }

    /// Queues `frame` for the writer fed by `tx`, as core's count admits it: past the peer's
    /// budget the frame is dropped and the writer told to fail the peer (it frees the queue,
    /// then reports the loss, [`LostCause::OverBudget`]); a frame for a peer being failed is
    /// dropped (its calls fail with that loss). False if the writer is gone.
    pub(crate) fn enqueue(&self, tx: &mpsc::UnboundedSender<Frame>, frame: Frame) -> bool {
        match self.count.admit(frame.content_len()) {
            Queueing::Counted(n) => {
                if tx.send(frame).is_err() {
                    self.count.left(n);
                    return false;
                }
            }
            Queueing::FailedNow => {
                self.failed.send_replace(true);
            }
            Queueing::Dropped => {}
        }
        true
    }
}
