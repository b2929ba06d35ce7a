//! What happens to the agent's peers, for those who keep state about them
//! ([`Agent::peer_events`](crate::Agent::peer_events)).
//!
//! The agent decides that a peer is lost where its connection breaks (a read or a write
//! fails, or the peer sent what the protocol forbids); every subscriber hears of it once, in
//! the order the agent decided. Distributed autograd uses it to drop the contexts of a worker
//! that died even when no backward pass is running.

use std::sync::{Mutex, PoisonError};

use tensorwire_core::protocol::{LostCause, WorkerId};
use tokio::sync::mpsc;

/// Something that happened to a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerEvent {
    /// The connection to `worker` is gone (it crashed, shut down, or its link broke): its
    /// calls failed, and nothing more comes from it.
    Lost {
        /// The lost worker's rank.
        worker: WorkerId,
        /// Why (the first cause the agent saw; also in the errors of calls to it).
        cause: LostCause,
    },
    /// A worker joined a dynamic group under `worker`'s rank (which may be the rank of a
    /// worker lost before: it is a new worker).
    Joined {
        /// The rank.
        worker: WorkerId,
    },
}

/// A subscription to an agent's [`PeerEvent`]s. Events are kept until read (none is lost to a
/// slow reader); [`recv`](Self::recv) gives `None` once the agent has shut down.
#[derive(Debug)]
pub struct PeerEvents {
    rx: mpsc::UnboundedReceiver<PeerEvent>,
}

impl PeerEvents {
    /// The next event; `None` once the agent has shut down.
    pub async fn recv(&mut self) -> Option<PeerEvent> {
        self.rx.recv().await
    }

    /// The next event if one is waiting.
    pub fn try_recv(&mut self) -> Option<PeerEvent> {
        self.rx.try_recv().ok()
    }
}

/// The agent's subscribers.
#[derive(Debug, Default)]
pub(crate) struct PeerEventHub {
    /// `None` once the agent has shut down.
    subscribers: Mutex<Option<Vec<mpsc::UnboundedSender<PeerEvent>>>>,
}

impl PeerEventHub {
    pub(crate) fn new() -> Self {
        Self {
            subscribers: Mutex::new(Some(Vec::new())),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<mpsc::UnboundedSender<PeerEvent>>>> {
        self.subscribers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn subscribe(&self) -> PeerEvents {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Some(subs) = self.lock().as_mut() {
            subs.push(tx);
        }
        // After shutdown `tx` is dropped here: the subscription ends at once.
        PeerEvents { rx }
    }

    /// Tells every subscriber; those that went away are forgotten.
    pub(crate) fn emit(&self, event: PeerEvent) {
        if let Some(subs) = self.lock().as_mut() {
            subs.retain(|tx| tx.send(event.clone()).is_ok());
        }
    }

    /// The agent shut down: every subscription ends.
    pub(crate) fn close(&self) {
        let subs = self.lock().take();
        drop(subs);
    }
}
