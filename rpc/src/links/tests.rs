//! A link's write turn: a direct write never overtakes a waiting one.

use std::sync::{Arc, Mutex};

use crate::tests::{pair_serving, until};
use crate::{Agent, Functions, RpcFuture, Shutdown};

async fn pair(seen: &Arc<Mutex<Vec<u32>>>) -> Vec<Agent> {
    let f = Functions::new();
    let seen = Arc::clone(seen);
    f.register("note", move |n: u32| {
        seen.lock().unwrap().push(n);
        async move { Ok::<_, String>(n) }
    })
    .unwrap();
    pair_serving(&f).await
}

/// While a write to a peer is under way (its write turn held), a call's request is queued
/// for the writer, which waits for the turn. Once the turn is free again, but before the writer has
/// run, the next call (alone, so written on the caller's task when it can) still finds the
/// queue not empty and queues behind it: never written directly ahead of it. Every request
/// arrives, in the order the calls were made.
#[tokio::test(start_paused = true)]
async fn a_direct_write_never_overtakes_a_waiting_one() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let agents = pair(&seen).await;
    let a = &agents[0];
    let note = |n: u32| -> RpcFuture<u32> { a.rpc_async("w1", "note", &n, None).unwrap() };
    let nothing_queued = || a.lock().peers[&1].queued.is_empty();

    // Nothing under way: written directly.
    assert_eq!(note(0).await.unwrap(), 0);

    let under_way = Arc::clone(&a.lock().peers[&1].write)
        .try_lock_owned()
        .unwrap();
    // Its reply finds no waiter: the next call is alone.
    drop(note(1));
    assert!(!nothing_queued(), "the turn is held: the request is queued");
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        *seen.lock().unwrap(),
        [0],
        "nothing passes a write under way"
    );
    // The turn free, the writer woken but not yet run.
    drop(under_way);
    let second = note(2);
    assert!(!nothing_queued());
    assert_eq!(second.await.unwrap(), 2);
    until(nothing_queued).await;
    assert_eq!(note(3).await.unwrap(), 3);
    assert_eq!(*seen.lock().unwrap(), [0, 1, 2, 3]);
    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}
