//! A peer's inbox: the messages it sent, filed by collective key until a collective takes
//! them, and whether its connection still delivers.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use tensorwire_core::collective::inbox::Held;
use tensorwire_core::ports::process_group::MeshViolation;

use super::Incoming;

/// Whether a peer's connection is still delivering.
#[derive(Debug, Clone)]
pub(super) enum PeerStatus {
    Open,
    /// The peer said goodbye.
    Left,
    /// The connection broke.
    Dead,
}

/// Messages of one collective from one peer, and the executor waiting for them.
#[derive(Default)]
struct Slot {
    queue: VecDeque<Incoming>,
    waker: Option<Waker>,
}

struct InboxState {
    slots: HashMap<u64, Slot>,
    status: PeerStatus,
    /// What the slots hold: bounded by the mesh's [`InboxLimits`].
    held: Held,
}

/// Messages from one peer, sorted by sequence number.
pub(super) struct Inbox {
    state: Mutex<InboxState>,
}

impl Inbox {
    pub(super) fn new() -> Self {
        Inbox {
            state: Mutex::new(InboxState {
                slots: HashMap::new(),
                status: PeerStatus::Open,
                held: Held::default(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Files `message` under collective key `seq` if `admit` (given what the inbox holds and
    /// whether a collective waits for exactly this message) lets it in; a message from a peer
    /// that is no longer open is dropped.
    pub(super) fn push(
        &self,
        seq: u64,
        message: Incoming,
        admit: impl FnOnce(Held, bool) -> Result<(), MeshViolation>,
    ) -> Result<(), MeshViolation> {
        let waker = {
            let mut state = self.lock();
            if !matches!(state.status, PeerStatus::Open) {
                return Ok(());
            }
            let waited_on = state
                .slots
                .get(&seq)
                .is_some_and(|s| s.waker.is_some() && s.queue.is_empty());
            admit(state.held, waited_on)?;
            state.held.bytes += message.payload.len();
            state.held.messages += 1;
            let slot = state.slots.entry(seq).or_default();
            slot.queue.push_back(message);
            slot.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// The next message of collective `seq`: `Ready(None)` once the peer's connection has
    /// ended and everything that arrived before has been taken.
    pub(super) fn poll_recv(&self, seq: u64, cx: &mut Context<'_>) -> Poll<Option<Incoming>> {
        let mut state = self.lock();
        let open = matches!(state.status, PeerStatus::Open);
        let slot = state.slots.entry(seq).or_default();
        if let Some(m) = slot.queue.pop_front() {
            state.held.bytes -= m.payload.len();
            state.held.messages -= 1;
            return Poll::Ready(Some(m));
        }
        if !open {
            return Poll::Ready(None);
        }
        slot.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Whether a message of collective `seq` waits, without taking it: `Ready(true)` when one
    /// does, `Ready(false)` once the connection has ended with none left, else `Pending` (and
    /// the task is woken when one arrives).
    pub(super) fn poll_arrived(&self, seq: u64, cx: &mut Context<'_>) -> Poll<bool> {
        let mut state = self.lock();
        let open = matches!(state.status, PeerStatus::Open);
        let slot = state.slots.entry(seq).or_default();
        if !slot.queue.is_empty() {
            return Poll::Ready(true);
        }
        if !open {
            return Poll::Ready(false);
        }
        slot.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    #[cfg(test)]
    pub(super) fn held(&self) -> Held {
        self.lock().held
    }

    pub(super) fn has_message(&self, seq: u64) -> bool {
        self.lock()
            .slots
            .get(&seq)
            .is_some_and(|s| !s.queue.is_empty())
    }

    pub(super) fn release(&self, seq: u64) {
        let mut state = self.lock();
        if let Some(slot) = state.slots.remove(&seq) {
            state.held.bytes -= slot.queue.iter().map(|m| m.payload.len()).sum::<usize>();
            state.held.messages -= slot.queue.len();
        }
    }

    /// Forgets every message filed under a key `of` selects; whether there was one.
    pub(super) fn purge(&self, of: impl Fn(u64) -> bool) -> bool {
        let mut state = self.lock();
        let keys: Vec<u64> = state.slots.keys().copied().filter(|k| of(*k)).collect();
        let mut any = false;
        for k in keys {
            if let Some(slot) = state.slots.remove(&k) {
                any |= !slot.queue.is_empty();
                state.held.bytes -= slot.queue.iter().map(|m| m.payload.len()).sum::<usize>();
                state.held.messages -= slot.queue.len();
            }
        }
        any
    }

    /// Ends delivery: receivers drain what arrived, then see the end. Once the peer is dead
    /// (the mesh is broken: no collective starts any more) only the messages `taken` says a
    /// collective already running may still take are kept; the rest are dropped at once.
    pub(super) fn close(&self, status: PeerStatus, taken: impl Fn(u64) -> bool) {
        let wakers: Vec<Waker> = {
            let mut state = self.lock();
            if matches!(state.status, PeerStatus::Open) {
                state.status = status;
            }
            let dead = matches!(state.status, PeerStatus::Dead);
            let wakers = state
                .slots
                .values_mut()
                .filter_map(|s| s.waker.take())
                .collect();
            if dead {
                let state = &mut *state;
                let held = &mut state.held;
                state.slots.retain(|key, slot| {
                    let keep = taken(*key);
                    if !keep {
                        held.bytes -= slot.queue.iter().map(|m| m.payload.len()).sum::<usize>();
                        held.messages -= slot.queue.len();
                    }
                    keep
                });
            }
            wakers
        };
        for w in wakers {
            w.wake();
        }
    }

    pub(super) fn status(&self) -> PeerStatus {
        self.lock().status.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::super::group::{split_key, P2P_BIT};
    use super::*;
    use bytes::Bytes;
    use tensorwire_core::collective::Signature;

    #[test]
    fn inbox_delivers_then_reports_the_end() {
        let inbox = Inbox::new();
        let mut cx = Context::from_waker(Waker::noop());
        inbox
            .push(
                1,
                Incoming {
                    signature: Signature::Barrier.encode(),
                    payload: Bytes::from_static(b"a"),
                },
                |_, _| Ok(()),
            )
            .unwrap();
        assert_eq!(inbox.held().bytes, 1);
        assert!(inbox.has_message(1));
        assert!(!inbox.has_message(2));
        assert!(inbox.poll_recv(2, &mut cx).is_pending());
        inbox.close(PeerStatus::Left, |_| false);
        match inbox.poll_recv(1, &mut cx) {
            Poll::Ready(Some(m)) => assert_eq!(&m.payload[..], b"a"),
            other => panic!(
                "expected the queued message, got {:?}",
                other.map(|m| m.is_some())
            ),
        }
        assert!(matches!(inbox.poll_recv(1, &mut cx), Poll::Ready(None)));
        assert!(matches!(inbox.poll_recv(2, &mut cx), Poll::Ready(None)));
        // Slots made after the end are closed from the start.
        assert!(matches!(inbox.poll_recv(3, &mut cx), Poll::Ready(None)));
        assert!(matches!(inbox.status(), PeerStatus::Left));
        inbox.release(1);
        assert!(!inbox.has_message(1));
    }

    #[test]
    fn a_dead_peers_messages_are_dropped_but_those_a_running_collective_may_take() {
        let inbox = Inbox::new();
        let mut cx = Context::from_waker(Waker::noop());
        for (key, len) in [(1u64, 3usize), (5, 100), (P2P_BIT | 9, 7)] {
            inbox
                .push(
                    key,
                    Incoming {
                        signature: Signature::Barrier.encode(),
                        payload: Bytes::from(vec![0u8; len]),
                    },
                    |_, _| Ok(()),
                )
                .unwrap();
        }
        assert_eq!(
            inbox.held(),
            Held {
                bytes: 110,
                messages: 3
            }
        );
        // This rank has reached collective 1 only; collective 5 will never run.
        inbox.close(PeerStatus::Dead, |key| {
            split_key(key).is_none_or(|(_, s)| s <= 1)
        });
        assert_eq!(
            inbox.held(),
            Held {
                bytes: 10,
                messages: 2
            }
        );
        assert!(!inbox.has_message(5));
        assert!(matches!(inbox.poll_recv(1, &mut cx), Poll::Ready(Some(_))));
        assert!(matches!(inbox.poll_recv(1, &mut cx), Poll::Ready(None)));
        // Nothing is filed after the end.
        assert_eq!(
            inbox.push(
                2,
                Incoming {
                    signature: Signature::Barrier.encode(),
                    payload: Bytes::from_static(b"late"),
                },
                |_, _| Ok(()),
            ),
            Ok(())
        );
        assert!(!inbox.has_message(2));
    }
}
