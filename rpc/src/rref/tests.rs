//! A reference whose last clone is dropped while the agent's lock is held: by this very
//! thread (under its guard, or where the agent drops something of the user's under it), or by
//! another thread that waits for this one. `Drop` never waits for the lock (it would deadlock
//! in both cases): the drop goes to the driver, which tells the endpoint on its next pass, and
//! the owner frees the value as it would have at once.
//!
//! The same for what [`Agent::spawn`] forgets of the agent's tasks that ended (a panic's
//! payload, whatever its `Drop` does): dropped after the lock.
//!
//! Each drop that could deadlock runs on a thread of its own, waited for within
//! [`DEADLOCK`] of real time, so that a drop that waits for the lock fails the test instead of
//! hanging it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use crate::tests::{pair_serving, until};
use crate::{Agent, Functions, RRef, Shutdown};

/// How long a drop may take before the test calls it a deadlock (real time: the drop itself
/// takes microseconds; the agents' clock is paused and nothing here waits on it).
const DEADLOCK: Duration = Duration::from_secs(30);

/// Runs `f` on a thread of its own (inside this runtime's context) and fails if it has not
/// returned within [`DEADLOCK`]; a thread that deadlocked is left behind.
fn returns(what: &str, f: impl FnOnce() + Send + 'static) {
    let runtime = tokio::runtime::Handle::current();
    let (done, returned) = mpsc::channel();
    std::thread::spawn(move || {
        let _entered = runtime.enter();
        f();
        let _ = done.send(());
    });
    match returned.recv_timeout(DEADLOCK) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: deadlocked (not returned after {DEADLOCK:?})")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}

/// Two agents, w0 and w1; w1 serves `make`, whose value `remote` keeps there.
async fn pair() -> Vec<Agent> {
    let f = Functions::new();
    f.register("make", |n: i64| async move { Ok::<_, String>(n) })
        .unwrap();
    pair_serving(&f).await
}

/// A reference of w0's to a value kept on w1, confirmed by w1 (so dropping it tells w1).
async fn remote_on_w1(agents: &[Agent]) -> RRef<i64> {
    let rref: RRef<i64> = agents[0].remote("w1", "make", &7i64, None).unwrap();
    rref.created().await.unwrap();
    until(|| rref.confirmed_by_owner()).await;
    assert_eq!(agents[1].owned_value_count(), 1);
    rref
}

#[tokio::test(start_paused = true)]
async fn a_reference_dropped_under_the_lock_never_waits_for_it() {
    let agents = pair().await;
    let (a, b) = (&agents[0], &agents[1]);

    // The lock free: the owner hears of it at once.
    drop(remote_on_w1(&agents).await);
    until(|| b.owned_value_count() == 0).await;

    // Dropped by the lock's holder, under its guard: left for the driver, which tells the
    // owner on its next pass.
    let rref = remote_on_w1(&agents).await;
    let holder = a.clone();
    returns("a reference dropped under its agent's lock", move || {
        let st = holder.lock();
        drop(rref);
        drop(st);
    });
    assert_eq!(b.owned_value_count(), 1, "not told yet");
    until(|| b.owned_value_count() == 0).await;

    // Dropped while another thread holds the lock and waits for this one to go on.
    let rref = remote_on_w1(&agents).await;
    let (held_tx, held_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let holder = a.clone();
    let other = std::thread::spawn(move || {
        let st = holder.lock();
        held_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        drop(st);
    });
    held_rx.recv().unwrap();
    returns(
        "a reference dropped while another thread holds the lock",
        move || {
            drop(rref);
            go_tx.send(()).unwrap();
        },
    );
    other.join().unwrap();
    until(|| b.owned_value_count() == 0).await;

    // A value this worker owns: its own last reference releases it, the same way.
    let mine = RRef::new(a, vec![1.0f32; 4]).unwrap();
    assert_eq!(a.owned_value_count(), 1);
    let holder = a.clone();
    returns("an owner's reference dropped under its lock", move || {
        let st = holder.lock();
        drop(mine);
        drop(st);
    });
    until(|| a.owned_value_count() == 0).await;

    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}

/// A real path to the lock: [`Agent::spawn`] forgets the agent's tasks that ended under the
/// agent's lock, and a task that panicked leaves its panic's payload (here the last clone of a reference) to be dropped there. A
/// payload that holds a reference dropped it under the lock, and the next `spawn` (any of
/// the agent's own, on any thread: a served call that waits, a fetch) deadlocked.
#[tokio::test(start_paused = true)]
async fn a_task_that_panicked_holding_a_reference_is_forgotten_without_deadlock() {
    let agents = pair().await;
    let (a, b) = (&agents[0], &agents[1]);
    let rref = remote_on_w1(&agents).await;
    let panicked = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&panicked);
    a.spawn(async move {
        flag.store(true, Ordering::SeqCst);
        std::panic::panic_any(rref);
    });
    until(|| panicked.load(Ordering::SeqCst)).await;
    let agent = a.clone();
    returns("a spawn that forgets a task which panicked", move || {
        agent.spawn(async {});
    });
    until(|| b.owned_value_count() == 0).await;
    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}

/// Takes the agent's lock when dropped, as every handle of the agent's did or does from its
/// `Drop` (a reference before it deferred, a call's `Reply`, a gather's end).
struct TakesTheLock(Agent, Arc<AtomicBool>);

impl Drop for TakesTheLock {
    fn drop(&mut self) {
        drop(self.0.lock());
        self.1.store(true, Ordering::SeqCst);
    }
}

/// [`Agent::spawn`] drops nothing of the user's under the agent's lock: a panic's payload
/// left by one of the agent's tasks is dropped after it, whatever its `Drop` does.
#[tokio::test(start_paused = true)]
async fn the_payload_of_a_task_that_panicked_is_dropped_after_the_lock() {
    let agents = pair().await;
    let a = &agents[0];
    let (panicked, dropped) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let payload = TakesTheLock(a.clone(), Arc::clone(&dropped));
    let flag = Arc::clone(&panicked);
    a.spawn(async move {
        flag.store(true, Ordering::SeqCst);
        std::panic::panic_any(payload);
    });
    until(|| panicked.load(Ordering::SeqCst)).await;
    assert!(!dropped.load(Ordering::SeqCst), "kept with the task's end");
    let agent = a.clone();
    returns("a spawn that forgets a task which panicked", move || {
        agent.spawn(async {});
    });
    assert!(dropped.load(Ordering::SeqCst));
    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}
