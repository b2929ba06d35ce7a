//! A call dropped before its outcome is read: its waiter goes at once when the agent's lock is
//! free, and is taken out by the driver when the lock's holder drops it (this thread, under
//! the guard) or another thread holds the lock meanwhile. `Drop` never waits for the lock
//! (it would deadlock in the first case and in the second, where the holder waits on us).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::tests::{pair_serving, until};
use crate::{Agent, Functions, Shutdown};

/// Two agents, w0 and w1; w1's `hold` counts itself started and waits for a permit of `gate`.
async fn pair(gate: &Arc<Semaphore>, started: &Arc<AtomicUsize>) -> Vec<Agent> {
    let f = Functions::new();
    let (gate, started) = (Arc::clone(gate), Arc::clone(started));
    f.register("hold", move |(): ()| {
        let (gate, started) = (Arc::clone(&gate), Arc::clone(&started));
        async move {
            started.fetch_add(1, Ordering::SeqCst);
            gate.acquire().await.map_err(|e| e.to_string())?.forget();
            Ok::<_, String>(())
        }
    })
    .unwrap();
    f.register(
        "add",
        |(a, b): (i64, i64)| async move { Ok::<_, String>(a + b) },
    )
    .unwrap();
    pair_serving(&f).await
}

fn waiting(a: &Agent) -> usize {
    a.lock().waiters.len()
}

#[tokio::test(start_paused = true)]
async fn a_call_dropped_unread_leaves_no_waiter_and_never_waits_for_the_lock() {
    let (gate, started) = (Arc::new(Semaphore::new(0)), Arc::new(AtomicUsize::new(0)));
    let agents = pair(&gate, &started).await;
    let a = &agents[0];
    let hold = || a.rpc_async::<_, ()>("w1", "hold", &(), None).unwrap();

    // The lock free: the waiter goes with the call.
    let call = hold();
    assert_eq!(waiting(a), 1);
    drop(call);
    assert_eq!(waiting(a), 0);

    // Dropped by the lock's holder, under its guard: left for the driver.
    let call = hold();
    {
        let st = a.lock();
        drop(call);
        assert_eq!(st.waiters.len(), 1, "the waiter is left for the driver");
    }
    until(|| waiting(a) == 0).await;

    // Dropped while another thread holds the lock (and waits for this one to go on).
    let call = hold();
    std::thread::scope(|s| {
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        s.spawn(move || {
            let st = a.lock();
            held_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            drop(st);
        });
        held_rx.recv().unwrap();
        drop(call);
        go_tx.send(()).unwrap();
    });
    assert_eq!(waiting(a), 1, "the waiter is left for the driver");
    until(|| waiting(a) == 0).await;

    // The dropped calls run to their end on w1; their replies find no waiter, and calls
    // still work.
    until(|| started.load(Ordering::SeqCst) == 3).await;
    gate.add_permits(3);
    until(|| gate.available_permits() == 0).await;
    let sum: i64 = a.rpc_sync("w1", "add", &(2i64, 3i64), None).await.unwrap();
    assert_eq!(sum, 5);
    assert_eq!(waiting(a), 0);
    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}

/// Counts its wake-ups.
struct Count(AtomicUsize);

impl std::task::Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// `rpc_sync`'s waiter is made with the waker of the task that polls it, whose first poll of
/// the outcome then registers nothing: the reply wakes that waker, and the next poll reads it.
#[tokio::test(start_paused = true)]
async fn a_sync_calls_waiter_holds_its_tasks_waker_from_the_start() {
    let (gate, started) = (Arc::new(Semaphore::new(0)), Arc::new(AtomicUsize::new(0)));
    let agents = pair(&gate, &started).await;
    let a = &agents[0];
    let count = Arc::new(Count(AtomicUsize::new(0)));
    let waker = std::task::Waker::from(Arc::clone(&count));
    let mut cx = std::task::Context::from_waker(&waker);
    {
        let mut call = std::pin::pin!(a.rpc_sync::<_, i64>("w1", "add", &(2i64, 3i64), None));
        assert!(call.as_mut().poll(&mut cx).is_pending());
        assert_eq!(waiting(a), 1);
        until(|| count.0.load(Ordering::SeqCst) > 0).await;
        match call.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(Ok(sum)) => assert_eq!(sum, 5),
            other => panic!(
                "the call's outcome was not ready: {:?}",
                other.map(|r| r.err())
            ),
        }
    }
    assert_eq!(waiting(a), 0);
    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}
