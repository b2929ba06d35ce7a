//! A task spawned only once it has something to do.
//!
//! A pass of the engine runs on a thread that holds no runtime worker (the thread that called
//! `backward`, a blocking thread, a worker inside `block_in_place`). A task spawned from such
//! a thread goes to the runtime's shared queue and wakes a parked worker, which polls it once
//! (the future registers its waker: the answer to a gradient request sent, the answers to a
//! release) and parks again: two switches on a sender's host while the message it just wrote
//! is on its way, on the step's critical path when the host's cores are shared. Here the
//! future is polled once on the calling thread instead, and spawned only when it is woken:
//! by the thread that delivers what it waits for (the worker that read the answer, a
//! runtime worker already running, which spawns it locally without waking another).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

type Boxed = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The future parked until its first wake-up, and whether that wake-up came already (while
/// the first poll was still returning).
struct Parked {
    future: Option<Boxed>,
    woken: bool,
}

struct Lazy {
    runtime: tokio::runtime::Handle,
    parked: Mutex<Parked>,
}

impl Lazy {
    fn parked(&self) -> std::sync::MutexGuard<'_, Parked> {
        // Only moves a box in and out under the lock: a poisoned one is consistent.
        self.parked.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Wake for Lazy {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let future = {
            let mut p = self.parked();
            p.woken = true;
            p.future.take()
        };
        if let Some(future) = future {
            // A task from now on: it polls the future with its own waker.
            drop(self.runtime.spawn(future));
        }
    }
}

/// Runs `future` to its end as `tokio::spawn` would (its output dropped), on the runtime of
/// the calling thread's context (it must be in one), but polls it once here first and
/// spawns it only when it is woken after that (see the module's docs). A future that is
/// ready at once never becomes a task.
pub(crate) fn spawn_when_woken(future: impl Future<Output = ()> + Send + 'static) {
    let lazy = Arc::new(Lazy {
        runtime: tokio::runtime::Handle::current(),
        parked: Mutex::new(Parked {
            future: None,
            woken: false,
        }),
    });
    let mut future: Boxed = Box::pin(future);
    let waker = Waker::from(Arc::clone(&lazy));
    if let Poll::Ready(()) = future.as_mut().poll(&mut Context::from_waker(&waker)) {
        return;
    }
    let woken = {
        let mut p = lazy.parked();
        if p.woken {
            true
        } else {
            p.future = Some(future);
            return;
        }
    };
    // Woken while the first poll returned: it has something to do now.
    debug_assert!(woken);
    drop(lazy.runtime.spawn(future));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_future_woken_later_runs_to_its_end_as_a_task() {
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<u32>();
        spawn_when_woken(async move {
            let v = rx.await.unwrap_or(0);
            let _ = done_tx.send(v + 1);
        });
        tx.send(41).unwrap();
        assert_eq!(done_rx.await.unwrap(), 42);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_future_ready_at_once_runs_here_without_a_task() {
        let ran = Arc::new(AtomicUsize::new(0));
        let r = Arc::clone(&ran);
        let thread = std::thread::current().id();
        spawn_when_woken(async move {
            assert_eq!(std::thread::current().id(), thread);
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wake_up_during_the_first_poll_is_not_lost() {
        // The future wakes itself and then waits: the wake-up arrives before it is parked.
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let mut first = true;
        let mut done_tx = Some(done_tx);
        spawn_when_woken(std::future::poll_fn(move |cx| {
            if std::mem::take(&mut first) {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let _ = done_tx.take().map(|t| t.send(()));
            Poll::Ready(())
        }));
        done_rx.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_future_whose_sender_goes_away_still_ends() {
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<bool>();
        spawn_when_woken(async move {
            let _ = done_tx.send(rx.await.is_err());
        });
        drop(tx);
        assert!(done_rx.await.unwrap());
    }
}
