//! A link's write turn: its list lent to one writer at a time, the waiting writer woken when
//! it comes back, and a direct write that never overtakes a waiting one.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use crate::tests::{pair_serving, until};
use crate::{Agent, Functions, RpcFuture, Shutdown};

use super::*;

/// Counts its wake-ups.
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn the_turn_lends_its_list_to_one_writer_at_a_time_and_wakes_the_waiting_one() {
    let turn = Arc::new(WriteTurn(Mutex::new((Some(Vec::new()), None))));
    let mut direct = turn
        .try_take()
        .expect("no one writes: a direct write takes the list");
    direct.push(Frame::message(
        bytes::Bytes::from_static(b"h"),
        Vec::<bytes::Bytes>::new(),
    ));
    assert!(turn.try_take().is_none(), "one writer at a time");

    // The writer task waits while the list is out, and is woken once when it comes back.
    let count = Arc::new(Count(AtomicUsize::new(0)));
    let waker = Waker::from(Arc::clone(&count));
    let mut cx = Context::from_waker(&waker);
    let mut waiting = Box::pin(std::future::poll_fn(|cx| turn.poll_take(cx)));
    assert!(waiting.as_mut().poll(&mut cx).is_pending());
    assert_eq!(count.0.load(Ordering::SeqCst), 0);
    drop(direct);
    assert_eq!(count.0.load(Ordering::SeqCst), 1);
    let Poll::Ready(writer) = waiting.as_mut().poll(&mut cx) else {
        panic!("the list came back: the waiting writer has it");
    };
    assert_eq!(writer.len(), 1, "the list comes back as its holder left it");
    assert!(
        turn.try_take().is_none(),
        "no direct write while the writer writes"
    );
    drop(writer);
    assert!(turn.try_take().is_some());
}

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

/// While a write to a peer is under way (its turn's list lent out), a call's request is queued
/// for the writer, which waits for the list. Once the list is back, but before the writer has
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

    let under_way = a.lock().peers[&1].write.try_take().unwrap();
    // Its reply finds no waiter: the next call is alone.
    drop(note(1));
    assert!(!nothing_queued(), "the list is out: the request is queued");
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        *seen.lock().unwrap(),
        [0],
        "nothing passes a write under way"
    );
    // The list back, the writer woken but not yet run.
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
