//! What is queued for one peer's writer: bytes counted as frames go in and leave (sent, or
//! dropped when the peer is failed), bounded per peer (`RpcOptions::peer_queue_bytes`), and
//! the agent's total over every peer.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tensorwire_core::protocol::LostCause;
use tensorwire_core::wire::Frame;
use tokio::sync::{mpsc, watch};

/// One peer's queue (see the module's documentation).
pub(crate) struct OutQueue {
    bytes: AtomicUsize,
    /// The agent's total over every peer (`Agent::queued_bytes`).
    total: Arc<AtomicUsize>,
    bound: usize,
    /// Set once, when a frame would pass the bound: the writer drops the queue and fails
    /// the peer with `cause`.
    failed: watch::Sender<bool>,
    /// `failed`'s value, read on every enqueue without the watch's lock.
    has_failed: AtomicBool,
    cause: Mutex<Option<LostCause>>,
}

impl OutQueue {
    /// An empty queue bounded by `bound` bytes, counted also in `total`.
    pub(crate) fn new(total: Arc<AtomicUsize>, bound: usize) -> Self {
        Self {
            bytes: AtomicUsize::new(0),
            total,
            bound,
            failed: watch::Sender::new(false),
            has_failed: AtomicBool::new(false),
            cause: Mutex::new(None),
        }
    }

    /// Nothing queued (a task of ours may then write directly).
    pub(crate) fn is_empty(&self) -> bool {
        self.bytes.load(Ordering::Acquire) == 0
    }

    fn add(&self, n: usize) -> usize {
        self.total.fetch_add(n, Ordering::AcqRel);
        self.bytes.fetch_add(n, Ordering::AcqRel) + n
    }

    /// `n` bytes left the queue (sent, or dropped).
    pub(crate) fn sub(&self, n: usize) {
        self.total.fetch_sub(n, Ordering::AcqRel);
        self.bytes.fetch_sub(n, Ordering::AcqRel);
    }

    /// Told (once) when a frame would have passed the bound.
    pub(crate) fn subscribe_failed(&self) -> watch::Receiver<bool> {
        self.failed.subscribe()
    }

    /// Why the peer is failed, once a frame would have passed the bound.
    pub(crate) fn cause(&self) -> Option<LostCause> {
        self.cause
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Queues `frame` for the writer fed by `tx`. Past the bound (a frame alone always passes)
    /// the frame is dropped and the writer told to fail the peer: it frees the queue, then
    /// reports the loss, which fails the peer's calls naming the bound. A frame for a peer
    /// being failed is dropped (its calls fail with that loss). False if the writer is gone.
    pub(crate) fn enqueue(&self, tx: &mpsc::UnboundedSender<Frame>, frame: Frame) -> bool {
        if self.has_failed.load(Ordering::Acquire) {
            return true;
        }
        let n = frame_bytes(&frame);
        let total = self.add(n);
        if total > self.bound && total != n {
            self.sub(n);
            let mut cause = self.cause.lock().unwrap_or_else(PoisonError::into_inner);
            if cause.is_none() {
                *cause = Some(LostCause::Unread {
                    queued: total as u64,
                    bound: self.bound as u64,
                });
                self.has_failed.store(true, Ordering::Release);
                self.failed.send_replace(true);
            }
            return true;
        }
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
