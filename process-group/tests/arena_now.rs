//! Issue 47: the synchronous arena path (`ProcessGroup::run_now`). Two ranks of one process
//! on one thread (a current-thread runtime), so which rank has come is decided by the order of
//! the calls: a rank whose peer has not come spins its budget and hands the rest to a future;
//! a rank whose peer is there finishes in the call.

use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Duration;

use tensorwire_core::collective::varlen::BlockLens;
use tensorwire_core::collective::{ElementType, ReduceOp};
use tensorwire_core::ports::process_group::{
    Buf, Collectives, Done, Now, Op, ProcessGroup, ProcessGroupError,
};
use tensorwire_core::ports::store::Store;
use tensorwire_core::tensor::Storage;
use tensorwire_process_group::{CollectivePath, Group, GroupOptions, InMemoryStore};
use tensorwire_transport_tcp::{ClusterSecret, TcpConfig, TcpTransport};

/// Two ranks on their arena, with `timeout`.
async fn pair(name: &str, timeout: Duration) -> Vec<Group> {
    let secret = ClusterSecret::new(b"arena now test secret".to_vec()).unwrap();
    let transport = Arc::new(TcpTransport::new(TcpConfig::new(secret)).unwrap());
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let options = GroupOptions::new(name)
        .with_timeout(timeout)
        .with_collectives(CollectivePath::Arena);
    let connect = |rank| Group::connect(store.clone(), transport.clone(), rank, 2, options.clone());
    let (a, b) = tokio::join!(connect(0), connect(1));
    let gs = vec![a.unwrap(), b.unwrap()];
    assert!(gs.iter().all(Group::uses_arena));
    // The first collective through the arena (its plans made and kept).
    let (a, b) = tokio::join!(gs[0].barrier(), gs[1].barrier());
    a.unwrap();
    b.unwrap();
    gs
}

fn all_reduce(data: &mut [u8]) -> Op<'_> {
    Op::AllReduce {
        data: Buf::Mut(data),
        element: ElementType::I64,
        op: ReduceOp::Sum,
    }
}

#[tokio::test]
async fn a_rank_whose_peer_is_there_finishes_in_the_call_and_the_other_in_its_future() {
    let gs = tokio::time::timeout(
        Duration::from_secs(60),
        pair("now", Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    for round in 0..3u64 {
        // Rank 1 has not come (it runs on this thread, after): rank 0's spin ends.
        let Now::Later(rest) = gs[0].run_now(Op::Barrier, &mut cx) else {
            panic!("rank 0 finished a barrier its peer had not come to");
        };
        // Rank 0 is there: rank 1 finishes in its call.
        match gs[1].run_now(Op::Barrier, &mut cx) {
            Now::Done(Ok(Done::Unit)) => {}
            other => panic!("rank 1's barrier in round {round}: {other:?}"),
        }
        rest.await.unwrap();

        let mut mine = [(10 + round as i64).to_le_bytes(), 5i64.to_le_bytes()];
        let (m0, m1) = mine.split_at_mut(1);
        let Now::Later(rest) = gs[0].run_now(all_reduce(&mut m0[0]), &mut cx) else {
            panic!("rank 0 finished an all_reduce its peer had not come to");
        };
        match gs[1].run_now(all_reduce(&mut m1[0]), &mut cx) {
            Now::Done(Ok(Done::Unit)) => {}
            other => panic!("rank 1's all_reduce in round {round}: {other:?}"),
        }
        rest.await.unwrap();
        let sum = (15 + round as i64).to_le_bytes();
        assert_eq!(mine, [sum, sum]);
    }
    // Awaited, both ranks alike (each through `run_now`): the same results.
    let mut a = 3i64.to_le_bytes();
    let mut b = 4i64.to_le_bytes();
    let (ra, rb) = tokio::join!(
        gs[0].all_reduce(&mut a, ElementType::I64, ReduceOp::Sum),
        gs[1].all_reduce(&mut b, ElementType::I64, ReduceOp::Sum)
    );
    ra.unwrap();
    rb.unwrap();
    assert_eq!((a, b), (7i64.to_le_bytes(), 7i64.to_le_bytes()));
    // Arguments that do not fit are the caller's error, in the call.
    let mut odd = [0u8; 5];
    match gs[0].run_now(all_reduce(&mut odd), &mut cx) {
        Now::Done(Err(ProcessGroupError::Arguments { .. })) => {}
        other => panic!("an all_reduce of 5 bytes of i64: {other:?}"),
    };
}

/// A rank that never comes: the rest of the other's barrier, after its spin, fails within the
/// group's timeout naming it, and so does every later collective.
#[tokio::test]
async fn the_rest_of_a_barrier_whose_peer_never_comes_times_out_naming_it() {
    let timeout = Duration::from_millis(300);
    let gs = tokio::time::timeout(Duration::from_secs(60), pair("now-late", timeout))
        .await
        .unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    let Now::Later(rest) = gs[0].run_now(Op::Barrier, &mut cx) else {
        panic!("rank 0 finished a barrier its peer never came to");
    };
    let e = tokio::time::timeout(Duration::from_secs(30), rest)
        .await
        .expect("the group's timeout bounds the rest")
        .unwrap_err();
    match &e {
        ProcessGroupError::Timeout {
            waiting_on,
            timeout: t,
            ..
        } => assert_eq!((waiting_on.as_slice(), *t), (&[1][..], timeout)),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        gs[0].barrier().await.unwrap_err().to_string(),
        e.to_string()
    );
}

/// What a rank's `run_now` gives, finished: at once, or through the rest's future.
async fn finished(now: Now<'_>) -> Result<Done, ProcessGroupError> {
    match now {
        Now::Done(result) => result,
        Now::Later(rest) => rest.await,
    }
}

/// A broadcast and a reduce take the same path, from either root and whichever rank comes
/// first: the results the future path gives (a reduce's root holds the sum; the other rank's
/// tensor stays as it was).
#[tokio::test]
async fn broadcasts_and_reduces_run_now_with_the_futures_results() {
    let gs = tokio::time::timeout(
        Duration::from_secs(60),
        pair("now-rooted", Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    for root in [0usize, 1] {
        let other = 1 - root;
        // Broadcast: the rank that is not the root comes first.
        let mut data = [[0u8; 16], [0u8; 16]];
        data[root] = [root as u8 + 7; 16];
        let (d0, d1) = data.split_at_mut(1);
        let mut bufs = [&mut d0[0], &mut d1[0]];
        let [b0, b1] = &mut bufs;
        let (first, second) = if root == 0 { (b1, b0) } else { (b0, b1) };
        let a = gs[other].run_now(
            Op::Broadcast {
                data: Buf::Mut(&mut first[..]),
                root,
            },
            &mut cx,
        );
        let b = gs[root].run_now(
            Op::Broadcast {
                data: Buf::Mut(&mut second[..]),
                root,
            },
            &mut cx,
        );
        let (a, b) = tokio::join!(finished(a), finished(b));
        a.unwrap();
        b.unwrap();
        assert_eq!(
            data,
            [[root as u8 + 7; 16], [root as u8 + 7; 16]],
            "root {root}"
        );

        // Reduce: the root comes first.
        let mut mine = [3i64.to_le_bytes(), 4i64.to_le_bytes()];
        let (m0, m1) = mine.split_at_mut(1);
        fn reduce(data: &mut [u8], root: usize) -> Op<'_> {
            Op::Reduce {
                data: Buf::Mut(data),
                element: ElementType::I64,
                op: ReduceOp::Sum,
                root,
            }
        }
        let (at_root, at_other) = if root == 0 {
            (&mut m0[0], &mut m1[0])
        } else {
            (&mut m1[0], &mut m0[0])
        };
        let a = gs[root].run_now(reduce(&mut at_root[..], root), &mut cx);
        let b = gs[other].run_now(reduce(&mut at_other[..], root), &mut cx);
        let (a, b) = tokio::join!(finished(a), finished(b));
        a.unwrap();
        b.unwrap();
        let mut want = [3i64.to_le_bytes(), 4i64.to_le_bytes()];
        want[root] = 7i64.to_le_bytes();
        assert_eq!(mine, want, "root {root}");
    }
}

fn all_gather(input: &[u8]) -> Op<'_> {
    Op::AllGather {
        input: Buf::Ref(input),
        lens: BlockLens::Equal,
    }
}

/// The blocks of a finished all_gather.
fn blocks(done: Result<Done, ProcessGroupError>) -> Vec<Vec<u8>> {
    match done.unwrap() {
        Done::Buffers(blocks) => blocks
            .into_iter()
            .map(|b| match b {
                Storage::Host(b) => b.to_vec(),
                other => panic!("a block not on the host: {other:?}"),
            })
            .collect(),
        other => panic!("an all_gather gave {other:?}"),
    }
}

/// An all_gather of equal blocks (its lengths known: no round of lengths) takes the same path,
/// whichever rank comes first: the rank whose peer is there finishes in its call, and both get
/// the blocks the future path gives (awaited after, the same group).
#[tokio::test]
async fn all_gathers_of_known_lengths_run_now_with_the_futures_results() {
    let gs = tokio::time::timeout(
        Duration::from_secs(60),
        pair("now-gather", Duration::from_secs(30)),
    )
    .await
    .unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    for (round, first) in [0usize, 1, 0, 1].into_iter().enumerate() {
        let second = 1 - first;
        let inputs: Vec<Vec<u8>> = (0..2u8).map(|r| vec![r * 10 + round as u8; 8]).collect();
        let a = gs[first].run_now(all_gather(&inputs[first]), &mut cx);
        assert!(
            matches!(a, Now::Later(_)),
            "rank {first} finished an all_gather its peer had not come to"
        );
        let b = gs[second].run_now(all_gather(&inputs[second]), &mut cx);
        let Now::Done(b) = b else {
            panic!("rank {second}, whose peer was there, did not finish in its call");
        };
        let a = finished(a).await;
        let want = inputs.clone();
        assert_eq!(blocks(a), want, "round {round}");
        assert_eq!(blocks(b), want, "round {round}");
        // The future path (each rank awaited through `all_gather_equal`): the same blocks.
        let (fa, fb) = tokio::join!(
            gs[0].all_gather_equal(&inputs[0]),
            gs[1].all_gather_equal(&inputs[1])
        );
        for got in [fa.unwrap(), fb.unwrap()] {
            let got: Vec<Vec<u8>> = got.iter().map(|b| b.to_vec()).collect();
            assert_eq!(got, want, "round {round}, awaited");
        }
    }
    // A block of another length than the peer's is told apart (each names the other), in
    // the call or its rest.
    let (short, long) = ([1u8; 4], [2u8; 8]);
    let a = gs[0].run_now(all_gather(&short), &mut cx);
    let b = gs[1].run_now(all_gather(&long), &mut cx);
    let (a, b) = tokio::join!(finished(a), finished(b));
    assert!(
        matches!(b, Err(ProcessGroupError::Mismatch { peer: 0, .. })),
        "{b:?}"
    );
    assert!(
        matches!(
            a,
            Err(ProcessGroupError::Mismatch { peer: 1, .. }
                | ProcessGroupError::PeerAborted { rank: 1, .. })
        ),
        "{a:?}"
    );
}
