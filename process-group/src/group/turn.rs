//! The arena's turn lock ([`TurnLock`]): collectives through a group arena run one at a time,
//! in the order they were issued. A collective's future queues for its turn in a fair lock
//! ([`TurnLock::lock`]); a collective run in its issuing call ([`TurnLock::try_lock`]) takes the
//! turn only when nobody holds it or waits for it, with one compare-and-swap, and gives it back
//! with one atomic operation (a `tokio::sync::Mutex` took a compare-and-swap to take and, to give
//! back, the lock of its waiters' list: about 180 instructions per collective on the synchronous
//! path, counted).
//!
//! The state word holds [`IN_CALL`] while a turn taken in a call is held, plus [`QUEUED`] for each
//! future that waits for its turn or holds it. A future queues in a fair `tokio` mutex (so its
//! wait spends the task's cooperative budget as before) and, once first there, waits for a turn
//! taken in a call to be given back; a turn is taken in a call only when the word is 0, so never
//! ahead of a future issued earlier.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Set while a turn taken in a call ([`TurnLock::try_lock`]) is held.
const IN_CALL: usize = 1;
/// Added for each future that waits for its turn or holds it ([`TurnLock::lock`]).
const QUEUED: usize = 2;

/// A value that one turn at a time may use (see the module's docs).
pub(super) struct TurnLock<T> {
    state: AtomicUsize,
    /// The futures' queue (fair: first come, first served).
    queue: tokio::sync::Mutex<()>,
    /// Told when a turn taken in a call is given back while a future queues.
    given_back: tokio::sync::Notify,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a `TurnGuard`, and at most one guard exists at a
// time (see `TurnLock::try_lock` and `TurnLock::lock`); it moves between threads with the guard.
unsafe impl<T: Send> Sync for TurnLock<T> {}

/// A held turn: the value, until it is dropped.
pub(super) struct TurnGuard<'a, T> {
    lock: &'a TurnLock<T>,
    /// A future's place at the head of the queue (`None`: a turn taken in a call).
    queued: Option<Queued<'a>>,
}

/// A future's place in the queue: counted in the state word until dropped (also when the
/// future waiting for its turn is dropped).
struct Queued<'a> {
    state: &'a AtomicUsize,
    head: Option<tokio::sync::MutexGuard<'a, ()>>,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        // The queue's next future goes first; then the count lets a call take the turn.
        drop(self.head.take());
        self.state.fetch_sub(QUEUED, Ordering::Release);
    }
}

impl<T> TurnLock<T> {
    pub(super) fn new(value: T) -> Self {
        TurnLock {
            state: AtomicUsize::new(0),
            queue: tokio::sync::Mutex::new(()),
            given_back: tokio::sync::Notify::new(),
            value: UnsafeCell::new(value),
        }
    }

    /// The turn, now, when nobody holds it or waits for it.
    pub(super) fn try_lock(&self) -> Option<TurnGuard<'_, T>> {
        self.state
            .compare_exchange(0, IN_CALL, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        Some(TurnGuard {
            lock: self,
            queued: None,
        })
    }

    /// The turn, after every collective that took it or queued for it before (fair).
    pub(super) async fn lock(&self) -> TurnGuard<'_, T> {
        self.state.fetch_add(QUEUED, Ordering::Relaxed);
        let mut queued = Queued {
            state: &self.state,
            head: None,
        };
        queued.head = Some(self.queue.lock().await);
        // First in the queue: only a turn taken in a call (before this queued) may be held.
        loop {
            let given_back = self.given_back.notified();
            tokio::pin!(given_back);
            given_back.as_mut().enable();
            if self.state.load(Ordering::Acquire) & IN_CALL == 0 {
                break;
            }
            given_back.await;
        }
        TurnGuard {
            lock: self,
            queued: Some(queued),
        }
    }
}

impl<T> Drop for TurnGuard<'_, T> {
    fn drop(&mut self) {
        if self.queued.is_some() {
            return; // `Queued`'s drop gives the turn back.
        }
        let before = self.lock.state.fetch_and(!IN_CALL, Ordering::Release);
        if before != IN_CALL {
            // A future queued meanwhile: its head waits for this.
            self.lock.given_back.notify_waiters();
        }
    }
}

impl<T> std::ops::Deref for TurnGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `TurnLock`'s `Sync`).
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> std::ops::DerefMut for TurnGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and borrowed mutably through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::sync::Arc;
    use std::task::{Context, Poll, Waker};

    #[test]
    fn a_call_takes_the_turn_only_when_nobody_holds_or_queues_for_it() {
        let lock = TurnLock::new(0u32);
        let held = lock.try_lock().expect("free");
        assert!(lock.try_lock().is_none(), "held in a call");
        // A future queues behind the turn taken in the call.
        let mut cx = Context::from_waker(Waker::noop());
        let mut queued = Box::pin(lock.lock());
        assert!(queued.as_mut().poll(&mut cx).is_pending());
        drop(held);
        // Given back: the queued future has it, and a call does not jump ahead of it.
        assert!(lock.try_lock().is_none(), "a future queued first");
        let Poll::Ready(mut guard) = queued.as_mut().poll(&mut cx) else {
            panic!("the queued future did not get the turn given back");
        };
        *guard += 1;
        assert!(lock.try_lock().is_none(), "held by the future");
        drop(guard);
        drop(queued);
        assert_eq!(*lock.try_lock().expect("free again"), 1);
    }

    #[test]
    fn a_future_dropped_while_queued_gives_its_place_back() {
        let lock = TurnLock::new(());
        let held = lock.try_lock().unwrap();
        let mut cx = Context::from_waker(Waker::noop());
        let mut queued = Box::pin(lock.lock());
        assert!(queued.as_mut().poll(&mut cx).is_pending());
        drop(queued);
        drop(held);
        assert!(lock.try_lock().is_some(), "nobody queues any more");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn turns_of_calls_and_futures_on_threads_never_overlap() {
        let lock = Arc::new(TurnLock::new((0u64, false)));
        let mut tasks = Vec::new();
        for t in 0..4 {
            let lock = lock.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..2000 {
                    let mut g = match (t % 2 == 0).then(|| lock.try_lock()).flatten() {
                        Some(g) => g,
                        None => lock.lock().await,
                    };
                    assert!(!g.1, "two turns at once");
                    g.1 = true;
                    g.0 += 1;
                    tokio::task::yield_now().await;
                    g.1 = false;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(lock.try_lock().unwrap().0, 8000);
    }
}
