//! A peer's inbox: the messages it sent, filed by collective key until a collective takes
//! them, and whether its connection still delivers.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use tensorwire_core::budget::{Account, Admit, Use};
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
    /// What the slots hold: bounded by the mesh's [`InboxLimits`](tensorwire_core::collective::inbox::InboxLimits).
    held: Held,
}

/// Messages from one peer, sorted by sequence number. Their bytes draw from the peer's
/// memory budget (`account`) while they are held.
pub(super) struct Inbox {
    state: Mutex<InboxState>,
    account: Account,
}

impl Drop for Inbox {
    fn drop(&mut self) {
        let held = self.lock().held.bytes;
        self.account.release(Use::Inbox, held);
    }
}

impl InboxState {
    /// Messages of `bytes` bytes in all (`count` of them) leave the inbox.
    fn forget(&mut self, account: &Account, bytes: usize, count: usize) {
        self.held.bytes -= bytes;
        self.held.messages -= count;
        account.release(Use::Inbox, bytes);
    }
}

impl Inbox {
    pub(super) fn new(account: Account) -> Self {
        Inbox {
            state: Mutex::new(InboxState {
                slots: HashMap::new(),
                status: PeerStatus::Open,
                held: Held::default(),
            }),
            account,
        }
    }

    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Files `message` under collective key `seq` if `admit` (given what the inbox holds and
    /// whether a collective waits for exactly this message) lets it in; a message from a peer
    /// that is no longer open, or for a key `refused` says no collective will take any more
    /// (see [`Inbox::refuse`]), is dropped.
    pub(super) fn push(
        &self,
        seq: u64,
        message: Incoming,
        admit: impl FnOnce(Held, bool) -> Result<(), MeshViolation>,
        refused: impl FnOnce(u64) -> bool,
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
            if refused(seq) {
                return Ok(());
            }
            // What a collective waits for is handed over at once; anything else is held
            // within the peer's budget (alone, it passes whatever its size).
            let how = if waited_on {
                Admit::Always
            } else {
                Admit::IfRoom
            };
            self.account
                .take(Use::Inbox, message.payload.len(), how)
                .map_err(MeshViolation::OverBudget)?;
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
    /// ended and everything that arrived before has been taken, or at once when `refused`
    /// says the key takes no more messages (a disagreement fails its collective).
    ///
    /// `refused` is asked under the inbox's lock, so a receiver that finds the key open is
    /// woken by the [`Inbox::refuse`] that closes it.
    pub(super) fn poll_recv(
        &self,
        seq: u64,
        cx: &mut Context<'_>,
        refused: impl FnOnce(u64) -> bool,
    ) -> Poll<Option<Incoming>> {
        let mut state = self.lock();
        if refused(seq) {
            return Poll::Ready(None);
        }
        let open = matches!(state.status, PeerStatus::Open);
        let slot = state.slots.entry(seq).or_default();
        if let Some(m) = slot.queue.pop_front() {
            state.forget(&self.account, m.payload.len(), 1);
            return Poll::Ready(Some(m));
        }
        if !open {
            return Poll::Ready(None);
        }
        slot.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Whether a message of collective `seq` waits, without taking it: `Ready(true)` when one
    /// does, `Ready(false)` once the connection has ended with none left or `refused` says
    /// the key takes no more (as [`Inbox::poll_recv`]), else `Pending` (and the task is woken
    /// when one arrives).
    pub(super) fn poll_arrived(
        &self,
        seq: u64,
        cx: &mut Context<'_>,
        refused: impl FnOnce(u64) -> bool,
    ) -> Poll<bool> {
        let mut state = self.lock();
        if refused(seq) {
            return Poll::Ready(false);
        }
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
            let bytes = slot.queue.iter().map(|m| m.payload.len()).sum::<usize>();
            state.forget(&self.account, bytes, slot.queue.len());
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
                let bytes = slot.queue.iter().map(|m| m.payload.len()).sum::<usize>();
                state.forget(&self.account, bytes, slot.queue.len());
            }
        }
        any
    }

    /// Ends delivery under the keys `of` selects, while the connection goes on delivering
    /// the others: their messages are dropped and their waiting receivers woken, to find (by
    /// the `refused` they poll with, which must now select these keys) that nothing more
    /// comes. A disagreement fails those collectives; earlier ones of its group still take
    /// their messages.
    pub(super) fn refuse(&self, of: impl Fn(u64) -> bool) {
        let wakers: Vec<Waker> = {
            let mut state = self.lock();
            let state = &mut *state;
            let held = &mut state.held;
            let account = &self.account;
            let mut wakers = Vec::new();
            state.slots.retain(|key, slot| {
                if !of(*key) {
                    return true;
                }
                let bytes = slot.queue.iter().map(|m| m.payload.len()).sum::<usize>();
                held.bytes -= bytes;
                held.messages -= slot.queue.len();
                account.release(Use::Inbox, bytes);
                wakers.extend(slot.waker.take());
                false
            });
            wakers
        };
        for w in wakers {
            w.wake();
        }
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
                let account = &self.account;
                state.slots.retain(|key, slot| {
                    let keep = taken(*key);
                    if !keep {
                        let bytes = slot.queue.iter().map(|m| m.payload.len()).sum::<usize>();
                        held.bytes -= bytes;
                        held.messages -= slot.queue.len();
                        account.release(Use::Inbox, bytes);
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
        let inbox = Inbox::new(tensorwire_core::budget::Budget::default().account(1));
        let mut cx = Context::from_waker(Waker::noop());
        inbox
            .push(
                1,
                Incoming {
                    signature: Signature::Barrier.encode(),
                    payload: Bytes::from_static(b"a"),
                },
                |_, _| Ok(()),
                |_| false,
            )
            .unwrap();
        assert_eq!(inbox.held().bytes, 1);
        assert!(inbox.has_message(1));
        assert!(!inbox.has_message(2));
        assert!(inbox.poll_recv(2, &mut cx, |_| false).is_pending());
        inbox.close(PeerStatus::Left, |_| false);
        match inbox.poll_recv(1, &mut cx, |_| false) {
            Poll::Ready(Some(m)) => assert_eq!(&m.payload[..], b"a"),
            other => panic!(
                "expected the queued message, got {:?}",
                other.map(|m| m.is_some())
            ),
        }
        assert!(matches!(
            inbox.poll_recv(1, &mut cx, |_| false),
            Poll::Ready(None)
        ));
        assert!(matches!(
            inbox.poll_recv(2, &mut cx, |_| false),
            Poll::Ready(None)
        ));
        // Slots made after the end are closed from the start.
        assert!(matches!(
            inbox.poll_recv(3, &mut cx, |_| false),
            Poll::Ready(None)
        ));
        assert!(matches!(inbox.status(), PeerStatus::Left));
        inbox.release(1);
        assert!(!inbox.has_message(1));
    }

    #[test]
    fn a_dead_peers_messages_are_dropped_but_those_a_running_collective_may_take() {
        let inbox = Inbox::new(tensorwire_core::budget::Budget::default().account(1));
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
                    |_| false,
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
        assert!(matches!(
            inbox.poll_recv(1, &mut cx, |_| false),
            Poll::Ready(Some(_))
        ));
        assert!(matches!(
            inbox.poll_recv(1, &mut cx, |_| false),
            Poll::Ready(None)
        ));
        // Nothing is filed after the end.
        assert_eq!(
            inbox.push(
                2,
                Incoming {
                    signature: Signature::Barrier.encode(),
                    payload: Bytes::from_static(b"late"),
                },
                |_, _| Ok(()),
                |_| false,
            ),
            Ok(())
        );
        assert!(!inbox.has_message(2));
    }

    #[test]
    fn refused_keys_wake_their_receivers_and_take_nothing_more_while_others_still_deliver() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;

        struct Count(AtomicUsize);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let message = |payload: &'static [u8]| Incoming {
            signature: Signature::Barrier.encode(),
            payload: Bytes::from_static(payload),
        };
        let inbox = Inbox::new(tensorwire_core::budget::Budget::default().account(1));
        // Collectives 4 and up are refused once `cut` is set: a disagreement about #4.
        let cut = AtomicBool::new(false);
        let refused = |key: u64| cut.load(Ordering::SeqCst) && key >= 4;
        let (earlier, later) = (
            Arc::new(Count(AtomicUsize::new(0))),
            Arc::new(Count(AtomicUsize::new(0))),
        );
        let earlier_waker = std::task::Waker::from(earlier.clone());
        let later_waker = std::task::Waker::from(later.clone());
        assert!(inbox
            .poll_recv(3, &mut Context::from_waker(&earlier_waker), refused)
            .is_pending());
        assert!(inbox
            .poll_recv(4, &mut Context::from_waker(&later_waker), refused)
            .is_pending());
        inbox
            .push(5, message(b"five"), |_, _| Ok(()), refused)
            .unwrap();
        assert_eq!(inbox.held().messages, 1);

        cut.store(true, Ordering::SeqCst);
        inbox.refuse(|key| key >= 4);
        // The receiver of #4 is woken and finds the end; #5's message is gone.
        assert_eq!(later.0.load(Ordering::SeqCst), 1);
        assert_eq!(earlier.0.load(Ordering::SeqCst), 0);
        assert_eq!(inbox.held(), Held::default());
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(
            inbox.poll_recv(4, &mut cx, refused),
            Poll::Ready(None)
        ));
        assert!(matches!(
            inbox.poll_arrived(5, &mut cx, refused),
            Poll::Ready(false)
        ));
        // Nothing is filed under a refused key any more; #3 still takes its message.
        inbox
            .push(6, message(b"six"), |_, _| Ok(()), refused)
            .unwrap();
        assert!(!inbox.has_message(6));
        inbox
            .push(3, message(b"three"), |_, _| Ok(()), refused)
            .unwrap();
        assert_eq!(earlier.0.load(Ordering::SeqCst), 1);
        assert!(matches!(
            inbox.poll_arrived(3, &mut cx, refused),
            Poll::Ready(true)
        ));
        match inbox.poll_recv(3, &mut cx, refused) {
            Poll::Ready(Some(m)) => assert_eq!(&m.payload[..], b"three"),
            other => panic!("#3 got {:?}", other.map(|m| m.is_some())),
        }
        assert!(matches!(inbox.status(), PeerStatus::Open));
    }
}
