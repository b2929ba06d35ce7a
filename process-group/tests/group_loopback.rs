//! Collectives of several ranks in one process, over real loopback TCP connections.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_core::collective::{DebugLevel, ElementType, ReduceOp};
use tensorwire_core::ports::process_group::{
    Collectives, ProcessGroup, ProcessGroupError, TensorCollectives,
};
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::TransportError;
use tensorwire_process_group::{CollectivesExt, Group, GroupOptions, InMemoryStore};
use tensorwire_transport_tcp::{ClusterSecret, TcpConfig, TcpTransport};

/// Every test finishes well within this, or fails.
const TEST_BOUND: Duration = Duration::from_secs(60);

fn transport() -> Arc<TcpTransport> {
    let secret = ClusterSecret::new(b"loopback test secret".to_vec()).unwrap();
    Arc::new(TcpTransport::new(TcpConfig::new(secret)).unwrap())
}

/// Sets up `world` ranks sharing one in-memory store.
async fn groups(world: usize, name: &str, timeout: Duration) -> Vec<Group> {
    groups_with(world, GroupOptions::new(name).with_timeout(timeout)).await
}

/// As [`groups`], on the link path: for the tests of what the links' messages carry (each
/// message's signature, so that ranks that disagree fail; zero-copy blocks; which round of a
/// collective a missing rank stalls), which the arena path does not do alike.
async fn link_groups(world: usize, name: &str, timeout: Duration) -> Vec<Group> {
    link_groups_with(world, GroupOptions::new(name).with_timeout(timeout)).await
}

/// As [`groups`], on `path`: for the tests of what both paths promise alike.
async fn path_groups(
    path: tensorwire_process_group::CollectivePath,
    world: usize,
    name: &str,
    timeout: Duration,
) -> Vec<Group> {
    let options = GroupOptions::new(format!("{name}-{path:?}")).with_timeout(timeout);
    let gs = groups_with(world, options.with_collectives(path)).await;
    let arena = path == tensorwire_process_group::CollectivePath::Arena;
    assert!(gs.iter().all(|g| g.uses_arena() == arena), "{path:?}");
    gs
}

/// As [`groups_with`], on the link path (see [`link_groups`]).
async fn link_groups_with(world: usize, options: GroupOptions) -> Vec<Group> {
    groups_with(
        world,
        options.with_collectives(tensorwire_process_group::CollectivePath::Links),
    )
    .await
}

/// Sets up `world` ranks sharing one in-memory store, each with `options`.
async fn groups_with(world: usize, options: GroupOptions) -> Vec<Group> {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let transport = transport();
    let mut tasks = Vec::new();
    for rank in 0..world {
        let store = store.clone();
        let transport = transport.clone();
        let options = options.clone();
        tasks.push(tokio::spawn(async move {
            Group::connect(store, transport, rank, world, options).await
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap().unwrap());
    }
    out
}

/// Runs `f` on every rank concurrently and returns the results in rank order.
async fn on_all<F, Fut, T>(groups: &[Group], f: F) -> Vec<T>
where
    F: Fn(Group) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let tasks: Vec<_> = groups.iter().map(|g| tokio::spawn(f(g.clone()))).collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn block(rank: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (rank * 31 + i * 7) as u8).collect()
}

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .expect("test took too long")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_gives_the_right_result_for_several_world_sizes() {
    bounded(async {
        for world in [1usize, 2, 3, 4, 5, 8] {
            let gs = groups(world, &format!("sizes{world}"), Duration::from_secs(20)).await;
            for (r, g) in gs.iter().enumerate() {
                assert_eq!((g.rank(), g.size()), (r, world));
            }
            on_all(&gs, |g| async move { g.barrier().await.unwrap() }).await;

            // all_gather: small (doubling/Bruck) and large (ring) blocks.
            for len in [0usize, 1, 8, 40_000, 300_000] {
                let results = on_all(&gs, move |g| async move {
                    g.all_gather(&block(g.rank(), len)).await.unwrap()
                })
                .await;
                for got in results {
                    assert_eq!(got.len(), world);
                    for (peer, b) in got.iter().enumerate() {
                        assert_eq!(&b[..], &block(peer, len)[..], "world {world} len {len}");
                    }
                }
            }

            // broadcast from every root.
            for root in 0..world {
                for len in [0usize, 5, 200_000] {
                    let results = on_all(&gs, move |g| async move {
                        let mut data = if g.rank() == root {
                            block(root, len)
                        } else {
                            vec![0u8; len]
                        };
                        g.broadcast(&mut data, root).await.unwrap();
                        data
                    })
                    .await;
                    for got in results {
                        assert_eq!(got, block(root, len), "world {world} root {root}");
                    }
                }
            }

            // all_reduce: small (recursive doubling) and large (ring) i64 sums.
            for count in [1usize, 3, 100, 70_000] {
                let results = on_all(&gs, move |g| async move {
                    let mut xs: Vec<i64> = (0..count)
                        .map(|i| (i as i64) * 10 + g.rank() as i64)
                        .collect();
                    g.all_reduce_typed(&mut xs, ReduceOp::Sum).await.unwrap();
                    xs
                })
                .await;
                let ranks: i64 = (0..world as i64).sum();
                let want: Vec<i64> = (0..count)
                    .map(|i| (i as i64) * 10 * world as i64 + ranks)
                    .collect();
                for got in results {
                    assert_eq!(got, want, "world {world} count {count}");
                }
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_reduce_every_op_and_type() {
    bounded(async {
        let world = 3;
        let gs = groups(world, "ops", Duration::from_secs(20)).await;
        for count in [4usize, 100_000] {
            for op in [
                ReduceOp::Sum,
                ReduceOp::Product,
                ReduceOp::Min,
                ReduceOp::Max,
            ] {
                let results = on_all(&gs, move |g| async move {
                    let r = g.rank();
                    let v = |i: usize| ((i % 5) + r + 1) as i64;
                    let mut a: Vec<f32> = (0..count).map(|i| v(i) as f32).collect();
                    let mut b: Vec<f64> = (0..count).map(|i| v(i) as f64).collect();
                    let mut c: Vec<i32> = (0..count).map(|i| v(i) as i32).collect();
                    let mut d: Vec<i64> = (0..count).map(v).collect();
                    g.all_reduce_typed(&mut a, op).await.unwrap();
                    g.all_reduce_typed(&mut b, op).await.unwrap();
                    g.all_reduce_typed(&mut c, op).await.unwrap();
                    g.all_reduce_typed(&mut d, op).await.unwrap();
                    (a, b, c, d)
                })
                .await;
                let want: Vec<i64> = (0..count)
                    .map(|i| {
                        let vals = (0..world).map(|r| ((i % 5) + r + 1) as i64);
                        match op {
                            ReduceOp::Sum => vals.sum(),
                            ReduceOp::Product => vals.product(),
                            ReduceOp::Min => vals.min().unwrap(),
                            ReduceOp::Max => vals.max().unwrap(),
                            other => unreachable!("{other} is not in this loop"),
                        }
                    })
                    .collect();
                for (a, b, c, d) in results {
                    assert!(
                        a.iter().zip(&want).all(|(x, w)| *x == *w as f32),
                        "{op} f32"
                    );
                    assert!(
                        b.iter().zip(&want).all(|(x, w)| *x == *w as f64),
                        "{op} f64"
                    );
                    assert!(
                        c.iter().zip(&want).all(|(x, w)| *x as i64 == *w),
                        "{op} i32"
                    );
                    assert_eq!(d, want, "{op} i64");
                }
            }
        }
        // A byte buffer that is not whole elements is refused before anything is sent.
        let err = gs[0]
            .all_reduce(&mut [0u8; 6], ElementType::F32, ReduceOp::Sum)
            .await
            .unwrap_err();
        assert!(matches!(err, ProcessGroupError::Arguments { .. }), "{err}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn float_sums_are_bitwise_identical_on_every_rank() {
    bounded(async {
        let gs = groups(5, "floats", Duration::from_secs(20)).await;
        for count in [7usize, 100_000] {
            let results = on_all(&gs, move |g| async move {
                let r = g.rank() as f32;
                let mut xs: Vec<f32> = (0..count).map(|i| 0.1 * i as f32 + r / 3.0).collect();
                g.all_reduce_typed(&mut xs, ReduceOp::Sum).await.unwrap();
                xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            })
            .await;
            for got in &results[1..] {
                assert_eq!(got, &results[0]);
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variable_blocks_and_objects() {
    bounded(async {
        let gs = groups(4, "objects", Duration::from_secs(20)).await;
        let results = on_all(&gs, |g| async move {
            let r = g.rank();
            let blocks = g.all_gather(&block(r, r * 1000)).await.unwrap();
            // Around the inline limit: all inline, and one rank just over it.
            let limit = tensorwire_process_group::INLINE_GATHER_BYTES;
            let inline = g.all_gather(&block(r, limit - r)).await.unwrap();
            for (p, b) in inline.iter().enumerate() {
                assert_eq!(&b[..], &block(p, limit - p)[..]);
            }
            let over = g
                .all_gather(&block(r, limit + usize::from(r == 3)))
                .await
                .unwrap();
            for (p, b) in over.iter().enumerate() {
                assert_eq!(&b[..], &block(p, limit + usize::from(p == 3))[..]);
            }
            let names: Vec<String> = g.all_gather_object(&format!("worker{r}")).await.unwrap();
            let config: Vec<u32> = g
                .broadcast_object((r == 2).then_some(&vec![7u32, 8, 9]), 2)
                .await
                .unwrap();
            (blocks, names, config)
        })
        .await;
        for (blocks, names, config) in results {
            let want: Vec<Bytes> = (0..4).map(|p| Bytes::from(block(p, p * 1000))).collect();
            assert_eq!(blocks, want);
            assert_eq!(names, ["worker0", "worker1", "worker2", "worker3"]);
            assert_eq!(config, [7, 8, 9]);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_collectives_in_flight_at_once() {
    bounded(async {
        let gs = groups(4, "inflight", Duration::from_secs(20)).await;
        let results = on_all(&gs, |g| async move {
            let r = g.rank();
            let mut xs = vec![r as i64; 1000];
            let mut ys = vec![1.0f64 + r as f64; 100_000];
            let input = block(r, 3000);
            let (a, b, c, d) = tokio::join!(
                g.barrier(),
                g.all_gather(&input),
                g.all_reduce_typed(&mut xs, ReduceOp::Max),
                g.all_reduce_typed(&mut ys, ReduceOp::Sum),
            );
            a.unwrap();
            c.unwrap();
            d.unwrap();
            (b.unwrap(), xs, ys)
        })
        .await;
        for (gathered, xs, ys) in results {
            for (p, b) in gathered.iter().enumerate() {
                assert_eq!(&b[..], &block(p, 3000)[..]);
            }
            assert!(xs.iter().all(|x| *x == 3));
            assert!(ys.iter().all(|y| *y == 10.0));
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_does_not_come_is_named_by_the_timeout() {
    bounded(async {
        let gs = groups(3, "late", Duration::from_millis(500)).await;
        let started = Instant::now();
        let results = on_all(&gs[..2], |g| async move { g.barrier().await }).await;
        assert!(started.elapsed() < Duration::from_secs(10));
        for err in results {
            let err = err.unwrap_err();
            match &err {
                ProcessGroupError::Timeout { waiting_on, .. } => {
                    assert_eq!(waiting_on, &[2], "{err}")
                }
                other => panic!("expected a timeout, got {other}"),
            }
            assert!(err.to_string().contains("waiting for rank(s) 2"), "{err}");
        }
        // The ranks are out of step now, so the group is broken on the ranks that timed out.
        let err = gs[0].barrier().await.unwrap_err();
        assert!(matches!(err, ProcessGroupError::Timeout { .. }), "{err}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_rank_is_named_before_the_timeout() {
    bounded(async {
        let mut gs = groups(4, "dead", Duration::from_secs(30)).await;
        on_all(&gs, |g| async move { g.barrier().await.unwrap() }).await;
        // Rank 2 disappears without a goodbye: its connections just close.
        let dead = gs.remove(2);
        drop(dead);
        let started = Instant::now();
        let results = on_all(&gs, |g| async move {
            let mut xs = vec![1i32; 10];
            g.all_reduce_typed(&mut xs, ReduceOp::Sum).await
        })
        .await;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "took {:?}",
            started.elapsed()
        );
        for err in results {
            let err = err.unwrap_err();
            // Each rank names rank 2: from its own connection, or from another rank's abort
            // (in that rank's own name: a rank's word about a third is never taken as proof,
            // so it is that rank that aborted, saying why).
            assert!(
                matches!(err, ProcessGroupError::PeerDied { rank: 2, .. })
                    || matches!(&err, ProcessGroupError::PeerAborted { rank, reason }
                        if *rank != 2 && reason.contains("rank 2 died")),
                "{err}"
            );
            assert!(err.to_string().contains("rank 2 died"), "{err}");
        }
        // The group is broken for good, for the same reason.
        let err = gs[0].barrier().await.unwrap_err();
        assert!(err.to_string().contains("rank 2 died"), "{err}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_shuts_down_is_named_as_having_left() {
    bounded(async {
        let gs = groups(2, "left", Duration::from_secs(30)).await;
        gs[1].shutdown().await;
        let err = gs[0].barrier().await.unwrap_err();
        assert!(
            matches!(err, ProcessGroupError::PeerLeft { rank: 1, .. }),
            "{err}"
        );
        let err = gs[1].barrier().await.unwrap_err();
        assert!(matches!(err, ProcessGroupError::ShutDown), "{err}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_running_different_collectives_are_told() {
    bounded(async {
        let gs = link_groups(2, "mismatch", Duration::from_secs(5)).await;
        let (a, b) = tokio::join!(gs[0].barrier(), async {
            let mut data = [0u8; 4];
            gs[1].broadcast(&mut data, 0).await
        });
        let b = b.unwrap_err();
        assert!(
            matches!(b, ProcessGroupError::Disagreement { peer: 0, here: true, .. }),
            "{b}"
        );
        assert_eq!(
            b.to_string(),
            "rank 0 ran barrier as collective #0, this rank (1) broadcast(root 0, 4 bytes)"
        );
        // Rank 0 waited for a barrier message rank 1 never sends; rank 1 told it why.
        let a = a.unwrap_err();
        assert_eq!(
            a.to_string(),
            "rank 0 ran barrier as collective #0, rank 1 broadcast(root 0, 4 bytes) (reported by rank 1)"
        );
        // The group is broken on both ranks, with that reason.
        for g in &gs {
            let e = g.barrier().await.unwrap_err();
            assert!(matches!(e, ProcessGroupError::Disagreement { .. }), "{e}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_names_the_ranks_that_never_arrive() {
    bounded(async {
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let t = transport();
        // Only rank 0 and 1 of 3 come.
        let (a, b) = tokio::join!(
            Group::connect(
                store.clone(),
                t.clone(),
                0,
                3,
                GroupOptions::new("missing").with_timeout(Duration::from_millis(500))
            ),
            Group::connect(
                store.clone(),
                t.clone(),
                1,
                3,
                GroupOptions::new("missing").with_timeout(Duration::from_millis(500))
            ),
        );
        let a = a.unwrap_err().to_string();
        let b = b.unwrap_err().to_string();
        assert!(a.contains("rank(s) 2"), "{a}");
        assert!(b.contains("rank(s) 2"), "{b}");
        let err = Group::connect(store, t, 3, 3, GroupOptions::new("x"))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
    })
    .await;
}

/// A rank that cannot listen where it is told to fails its setup with the transport's own
/// error as data (what it was doing, and the address in use), not the error's text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setup_that_cannot_listen_carries_the_transports_error() {
    bounded(async {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let options = GroupOptions::new("taken")
            .with_timeout(Duration::from_millis(500))
            .with_listen(addr);
        // Rank 1 of 2 accepts rank 0's connection, so it listens.
        let err = Group::connect(store, transport(), 1, 2, options)
            .await
            .unwrap_err();
        match &err {
            ProcessGroupError::SetupTransport {
                rank: 1,
                doing: "listening",
                source,
            } => assert!(
                matches!(
                    **source,
                    TransportError::Io {
                        kind: std::io::ErrorKind::AddrInUse,
                        ..
                    }
                ),
                "{source}"
            ),
            other => panic!("expected the transport's error, got {other}"),
        }
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_collectives_on_host_tensors() {
    use tensorwire_core::device::Device;
    use tensorwire_core::devices_sim::SimulatedDevices;
    use tensorwire_core::ports::device::relocate;
    use tensorwire_core::tensor::{DType, Storage, Tensor};

    let gs = bounded(groups(3, "tensors", Duration::from_secs(20))).await;
    let results = bounded(on_all(&gs, |g| async move {
        let rank = g.rank() as f32;
        let t = Tensor::from_f32(vec![2, 2], &[rank, rank + 1.0, 2.0 * rank, -rank]).unwrap();
        let summed = g.all_reduce_tensor(&t, ReduceOp::Sum).await.unwrap();
        let gathered = g.all_gather_tensor(&t).await.unwrap();
        let root = g.broadcast_tensor(&t, 2).await.unwrap();
        // Bytes reduce too (wrapping); an op gloo does not define on a dtype is refused
        // naming both, before anything is sent.
        let bytes = Tensor::new(
            DType::U8,
            vec![4],
            Storage::Host(Bytes::from_static(b"abc\xff")),
        )
        .unwrap();
        let bytes = g.all_reduce_tensor(&bytes, ReduceOp::Sum).await.unwrap();
        assert_eq!(
            bytes.host_bytes().unwrap()[..],
            [
                b'a'.wrapping_mul(3),
                b'b'.wrapping_mul(3),
                b'c'.wrapping_mul(3),
                0xfd
            ]
        );
        let e = g.all_reduce_tensor(&t, ReduceOp::BAnd).await.unwrap_err();
        // A tensor on a (simulated) CUDA device is refused by this CPU backend, before any
        // message is sent (the group stays usable).
        let on_gpu = relocate(&SimulatedDevices::new(1), &t, Device::Cuda(0))
            .await
            .unwrap();
        let w = g.broadcast_tensor(&on_gpu, 0).await.unwrap_err();
        g.barrier().await.unwrap();
        (summed, gathered, root, e, w)
    }))
    .await;
    for (summed, gathered, root, e, w) in results {
        assert_eq!(summed.shape(), &[2, 2]);
        assert_eq!(summed.to_f32_vec().unwrap(), vec![3.0, 6.0, 6.0, -3.0]);
        assert_eq!(gathered.len(), 3);
        for (r, t) in gathered.iter().enumerate() {
            let r = r as f32;
            assert_eq!(t.to_f32_vec().unwrap(), vec![r, r + 1.0, 2.0 * r, -r]);
        }
        assert_eq!(root.to_f32_vec().unwrap(), vec![2.0, 3.0, 4.0, -2.0]);
        assert_eq!(
            e.to_string(),
            "invalid all_reduce arguments: band is not defined on f32 elements (as in gloo: \
             band, bor and bxor take integers and bool, avg takes floating types)"
        );
        assert!(matches!(w, ProcessGroupError::WrongDevice { .. }), "{w}");
        assert_eq!(
            w.to_string(),
            "broadcast: the tensor is on cuda:0, but this tensorwire group works on cpu tensors (use an nccl group for CUDA tensors)"
        );
    }
}

type Pending<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Polls `futures` to completion, each first polled in index order (the issue order the group
/// sees), as `tokio::join!` does for a fixed number of futures.
async fn join_in_order<T>(futures: Vec<Pending<'_, T>>) -> Vec<T> {
    let mut futures: Vec<_> = futures.into_iter().map(Some).collect();
    let mut out: Vec<Option<T>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (slot, result) in futures.iter_mut().zip(out.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *result = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter()
        .map(|v| v.expect("every future finished"))
        .collect()
}

/// Issue 20, defect 1: all_gathers above the inline limit take two rounds; with many in
/// flight, each must still return its own blocks on every rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_two_round_all_gathers_in_flight_return_their_own_blocks() {
    bounded(async {
        let world = 3;
        let gs = groups(world, "inflight-gathers", Duration::from_secs(20)).await;
        let n = 1000;
        let results = on_all(&gs, move |g| async move {
            let r = g.rank();
            // 64 f32 elements: over the inline limit, so two rounds each.
            let inputs: Vec<Vec<u8>> = (0..n).map(|i| block(r * 1000 + i, 256)).collect();
            let futures: Vec<Pending<'_, Result<Vec<Bytes>, ProcessGroupError>>> = inputs
                .iter()
                .map(|input| Box::pin(g.all_gather(input)) as Pending<'_, _>)
                .collect();
            let got = join_in_order(futures).await;
            got.into_iter()
                .map(|blocks| blocks.unwrap())
                .collect::<Vec<_>>()
        })
        .await;
        for got in results {
            let wrong = (0..n)
                .filter(|i| {
                    got[*i]
                        .iter()
                        .enumerate()
                        .any(|(p, b)| b[..] != block(p * 1000 + i, 256)[..])
                })
                .count();
            assert_eq!(
                wrong, 0,
                "{wrong} of {n} all_gathers returned other calls' blocks"
            );
        }
    })
    .await;
}

/// The same for broadcast_object, whose length and data used to be two broadcasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_broadcast_objects_in_flight_return_their_own_values() {
    bounded(async {
        let world = 3;
        let gs = groups(world, "inflight-objects", Duration::from_secs(20)).await;
        let n = 300;
        let results = on_all(&gs, move |g| async move {
            let r = g.rank();
            let values: Vec<Vec<u32>> = (0..n).map(|i| vec![i as u32; 20 + i % 7]).collect();
            let futures: Vec<Pending<'_, Result<Vec<u32>, ProcessGroupError>>> = values
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let root = i % world;
                    Box::pin(g.broadcast_object((r == root).then_some(v), root)) as Pending<'_, _>
                })
                .collect();
            join_in_order(futures).await
        })
        .await;
        for got in results {
            for (i, v) in got.into_iter().enumerate() {
                let v: Vec<u32> = v.unwrap();
                assert_eq!(v, vec![i as u32; 20 + i % 7], "broadcast_object {i}");
            }
        }
    })
    .await;
}

/// Issue 20, defect 2: f32[2] against i64[1] (8 bytes each) fails on both ranks, naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dtype_mismatch_fails_naming_both_sides() {
    bounded(async {
        let gs = link_groups(2, "dtype", Duration::from_secs(5)).await;
        let (a, b) = tokio::join!(
            async {
                let mut xs = [1.0f32, 2.0];
                gs[0].all_reduce_typed(&mut xs, ReduceOp::Sum).await
            },
            async {
                let mut xs = [3i64];
                gs[1].all_reduce_typed(&mut xs, ReduceOp::Sum).await
            }
        );
        for (rank, e) in [(0, a.unwrap_err()), (1, b.unwrap_err())] {
            assert!(
                matches!(e, ProcessGroupError::Disagreement { .. }),
                "rank {rank}: {e}"
            );
            let text = e.to_string();
            assert!(text.contains("all_reduce(sum, f32 x2)"), "{text}");
            assert!(text.contains("all_reduce(sum, i64 x1)"), "{text}");
        }
        // An op mismatch of the same type and count, likewise.
        let gs = link_groups(2, "op", Duration::from_secs(5)).await;
        let (mut x, mut y) = ([0u8; 8], [0u8; 8]);
        let (a, b) = tokio::join!(
            gs[0].all_reduce(&mut x, ElementType::I32, ReduceOp::Max),
            gs[1].all_reduce(&mut y, ElementType::I32, ReduceOp::Min),
        );
        // Each rank names both sides, whether it found the mismatch itself or its peer's
        // notice came first (then the text is the reporter's: "... (reported by rank r)").
        for e in [a.unwrap_err(), b.unwrap_err()] {
            let text = e.to_string();
            assert!(
                matches!(e, ProcessGroupError::Disagreement { .. }),
                "{text}"
            );
            assert!(text.contains("all_reduce(max, i32 x2)"), "{text}");
            assert!(text.contains("all_reduce(min, i32 x2)"), "{text}");
        }
    })
    .await;
}

/// On the arena path, ranks that disagree only on an element type of the same size (i8 against
/// u8, u8 against bool) fail both: the arena's signature word told them apart by size and
/// float-ness alone, so these ranks reduced each other's bytes as their own type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_arena_tells_element_types_of_one_size_apart() {
    bounded(async {
        for (i, (x, y)) in [
            (ElementType::I8, ElementType::U8),
            (ElementType::U8, ElementType::Bool),
        ]
        .into_iter()
        .enumerate()
        {
            let gs = groups(2, &format!("same-size-{i}"), Duration::from_secs(5)).await;
            let (mut a, mut b) = ([1u8; 4], [1u8; 4]);
            let (ra, rb) = tokio::join!(
                gs[0].all_reduce(&mut a, x, ReduceOp::Max),
                gs[1].all_reduce(&mut b, y, ReduceOp::Max),
            );
            for (rank, r) in [(0, ra), (1, rb)] {
                let e = r.expect_err("ranks that disagree on the element type must fail");
                // The arena's account: the rank that found it names the other; a rank that
                // read its peer's report first names the reporter.
                assert!(
                    matches!(
                        e,
                        ProcessGroupError::Mismatch { peer, .. }
                            | ProcessGroupError::PeerAborted { rank: peer, .. } if peer == 1 - rank
                    ),
                    "{x:?}/{y:?} rank {rank}: {e}"
                );
            }
        }
    })
    .await;
}

/// Issue 20, defect 3: a call refused for its own arguments takes no place in the sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locally_refused_call_leaves_the_group_in_step() {
    bounded(async {
        let world = 3;
        let gs = groups(world, "refused", Duration::from_secs(5)).await;
        let results = on_all(&gs, move |g| async move {
            if g.rank() == 0 {
                let e = g.broadcast(&mut [0u8; 4], world).await.unwrap_err();
                assert!(matches!(e, ProcessGroupError::Arguments { .. }), "{e}");
                let e = g.all_gather_with_lens(b"abc", &[1, 2]).await.unwrap_err();
                assert!(matches!(e, ProcessGroupError::Arguments { .. }), "{e}");
                let e = g
                    .all_reduce(&mut [0u8; 6], ElementType::F32, ReduceOp::Sum)
                    .await
                    .unwrap_err();
                assert!(matches!(e, ProcessGroupError::Arguments { .. }), "{e}");
            }
            let mut xs = [g.rank() as i64];
            g.all_reduce_typed(&mut xs, ReduceOp::Sum).await?;
            Ok::<_, ProcessGroupError>(xs[0])
        })
        .await;
        for got in results {
            assert_eq!(got.unwrap(), 3);
        }
    })
    .await;
}

/// Issue 20, defect 4: a broadcast root only sends, yet it learns that the others ran
/// something else, at the latest in its next collective.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broadcast_root_learns_of_a_mismatch_by_its_next_collective() {
    bounded(async {
        let gs = link_groups(3, "root", Duration::from_secs(5)).await;
        let (root, others) = tokio::join!(
            async {
                let first = gs[0].broadcast(&mut [7u8; 8], 0).await;
                (first, gs[0].barrier().await)
            },
            async {
                let mut xs = [1.0f64];
                let (b, c) = tokio::join!(
                    async {
                        let mut ys = [2.0f64];
                        gs[1].all_reduce_typed(&mut ys, ReduceOp::Sum).await
                    },
                    gs[2].all_reduce_typed(&mut xs, ReduceOp::Sum),
                );
                (b, c)
            }
        );
        let (first, next) = root;
        let e = first.err().or(next.err()).expect("the root is told");
        assert!(
            matches!(e, ProcessGroupError::Disagreement { .. }),
            "root: {e}"
        );
        assert!(e.to_string().contains("broadcast(root 0, 8 bytes)"), "{e}");
        for e in [others.0.unwrap_err(), others.1.unwrap_err()] {
            assert!(matches!(e, ProcessGroupError::Disagreement { .. }), "{e}");
        }
    })
    .await;
}

/// Whether `e` names `other` as the rank that ran something else: the links' disagreement
/// (seen here, naming the sender; or reported by the other rank, naming it as the one that
/// saw it), or the arena's account (the rank that found it names the other; a rank that read
/// its peer's report first names the reporter).
fn names_the_disagreeing_rank(e: &ProcessGroupError, other: usize) -> bool {
    match e {
        ProcessGroupError::Disagreement {
            peer, rank, here, ..
        } => (*here && *peer == other) || (!*here && *rank == other),
        ProcessGroupError::Mismatch { peer: p, .. }
        | ProcessGroupError::PeerAborted { rank: p, .. } => *p == other,
        _ => false,
    }
}

/// Blocks of other lengths with the same total are a disagreement too, on both ranks and both
/// paths (given lengths run through the arena when the group has one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_gather_with_other_lengths_is_a_disagreement() {
    use tensorwire_process_group::CollectivePath;
    bounded(async {
        for path in [CollectivePath::Links, CollectivePath::Arena] {
            let gs = path_groups(path, 2, "lengths", Duration::from_secs(5)).await;
            let (a, b) = tokio::join!(
                gs[0].all_gather_with_lens(b"abc", &[3, 5]),
                gs[1].all_gather_with_lens(b"abc", &[5, 3]),
            );
            let (a, b) = (a.unwrap_err(), b.unwrap_err());
            for (rank, e) in [(0, &a), (1, &b)] {
                assert!(names_the_disagreeing_rank(e, 1 - rank), "{path:?}: {e}");
            }
            // Arguments wrong on one rank only: it is refused there (no place in the sequence).
            let e = gs[0]
                .all_gather_with_lens(b"abc", &[4, 5])
                .await
                .unwrap_err();
            assert!(matches!(e, ProcessGroupError::Arguments { .. }), "{e}");
        }
    })
    .await;
}

/// Given lengths run through the group arena (not the links) when the group has one, and
/// give every block; equal blocks (`all_gather_equal`, the tensor all_gathers) skip the
/// lengths round on both paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_gathers_of_known_lengths_give_every_block_on_both_paths() {
    use tensorwire_process_group::CollectivePath;
    bounded(async {
        for path in [CollectivePath::Links, CollectivePath::Arena] {
            let world = 3;
            let gs = path_groups(path, world, "known", Duration::from_secs(5)).await;
            // Inline-sized, slot-sized and larger than an arena slot.
            for len in [8, 4096, 3 << 20] {
                let results = on_all(&gs, move |g| async move {
                    let mine = block(g.rank(), len);
                    let equal = g.all_gather_equal(&mine).await?;
                    let lens: Vec<usize> = (0..g.size()).map(|r| len + r).collect();
                    let given = g
                        .all_gather_with_lens(&block(g.rank(), lens[g.rank()]), &lens)
                        .await?;
                    Ok::<_, ProcessGroupError>((equal, given, lens))
                })
                .await;
                for got in results {
                    let (equal, given, lens) = got.unwrap();
                    for r in 0..world {
                        assert_eq!(equal[r], block(r, len), "{path:?} {len}");
                        assert_eq!(given[r], block(r, lens[r]), "{path:?} {len}");
                    }
                }
            }
        }
    })
    .await;
}

/// A rank whose block is not as long as the others' (another shape, or a forged size) is
/// named by the ranks that skipped the lengths round, on both paths, for sizes within and
/// beyond a slot; and a rank that skips it never takes another's lengths round for its data
/// (were the skip not taken, these would all succeed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_of_another_size_is_named_when_lengths_are_not_exchanged() {
    use tensorwire_process_group::CollectivePath;
    bounded(async {
        for path in [CollectivePath::Links, CollectivePath::Arena] {
            for (i, (a, b)) in [(16, 24), (64, 3 << 20), (8, 8)].into_iter().enumerate() {
                let name = format!("forged-{i}");
                let gs = path_groups(path, 2, &name, Duration::from_secs(5)).await;
                let (x, y) = (block(0, a), block(1, b));
                let (ra, rb) = if a != b {
                    // Both skip: their signatures hold other lengths.
                    tokio::join!(gs[0].all_gather_equal(&x), gs[1].all_gather_equal(&y))
                } else {
                    // One skips, the other exchanges: the data round meets the lengths round.
                    tokio::join!(gs[0].all_gather_equal(&x), gs[1].all_gather(&y))
                };
                for (rank, r) in [(0, ra), (1, rb)] {
                    let e = r.expect_err("ranks that disagree on the lengths must fail");
                    assert!(
                        names_the_disagreeing_rank(&e, 1 - rank),
                        "{path:?} {a}/{b} rank {rank}: {e}"
                    );
                }
            }
        }
    })
    .await;
}

/// Issue 20: ranks that run different new collectives (or one with other arguments) under one
/// sequence number are told, naming both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_collectives_that_disagree_fail_naming_both_sides() {
    let gs = bounded(link_groups(2, "disagree20", Duration::from_secs(20))).await;
    let results = bounded(on_all(&gs, |g| async move {
        let op = if g.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        let reduced = g.reduce(&mut [0u8; 8], ElementType::I64, op, 1).await;
        // Rank 0 only sends in this reduce; it learns by its next collective at the latest.
        let next = g.barrier().await;
        (reduced, next)
    }))
    .await;
    let e = results[1].0.clone().unwrap_err();
    assert_eq!(
        e.to_string(),
        "rank 0 ran reduce(sum, i64 x1, root 1) as collective #0, this rank (1) reduce(max, i64 x1, root 1)"
    );
    let rank0 = match &results[0] {
        (Err(e), _) | (Ok(()), Err(e)) => e.clone(),
        (Ok(()), Ok(())) => panic!("rank 0 never learned of the disagreement"),
    };
    assert!(
        matches!(rank0, ProcessGroupError::Disagreement { here: false, .. }),
        "{rank0}"
    );
}

/// Issue 20: calls refused for their own arguments take no place in the sequence, so the
/// next collective still meets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_new_calls_leave_the_group_in_step() {
    let gs = bounded(groups(3, "refused20", Duration::from_secs(20))).await;
    let results = bounded(on_all(&gs, |g| async move {
        let rank = g.rank();
        let mut errors = Vec::new();
        let mut data = [1u8; 4];
        errors.push(
            g.reduce(&mut data, ElementType::F32, ReduceOp::Sum, 3)
                .await,
        );
        errors.push(
            g.reduce(&mut data, ElementType::F32, ReduceOp::BOr, 0)
                .await,
        );
        errors.push(
            g.reduce_scatter(&[0u8; 8], &[1, 1], ElementType::F32, ReduceOp::Sum)
                .await
                .map(drop),
        );
        errors.push(g.all_to_all(&[], &[0, 0, 0]).await.map(drop));
        errors.push(
            g.all_to_all_single(&[0u8; 3], &[1, 1, 0], &[1, 1, 1])
                .await
                .map(drop),
        );
        errors.push(g.send(b"x", rank, 0).await);
        errors.push(g.recv(7, 0).await.map(drop));
        let mut sum = [rank as i64 + 1];
        g.all_reduce_typed(&mut sum, ReduceOp::Sum).await.unwrap();
        (errors, sum[0])
    }))
    .await;
    for (rank, (errors, sum)) in results.into_iter().enumerate() {
        assert_eq!(sum, 6, "rank {rank}: the group stayed in step");
        let texts: Vec<String> = errors
            .iter()
            .filter_map(|e| e.as_ref().err().map(ToString::to_string))
            .collect();
        assert_eq!(texts.len(), 7, "rank {rank}: {texts:?}");
        assert!(texts[0].contains("root 3 is out of range"), "{}", texts[0]);
        assert!(
            texts[1].contains("bor is not defined on f32"),
            "{}",
            texts[1]
        );
        assert!(texts
            .iter()
            .any(|t| t.contains("cannot send to or receive from itself")));
        assert!(texts.iter().any(|t| t.contains("rank 7 is out of range")));
    }
}

/// Issue 20: the new collectives in flight together, issued in the same order everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_collectives_in_flight_at_once() {
    let gs = bounded(groups(3, "inflight20", Duration::from_secs(20))).await;
    let results = bounded(on_all(&gs, |g| async move {
        let rank = g.rank();
        let input: Vec<u8> = (0..6u8).map(|i| i + rank as u8).collect();
        let mine = block(rank, 100);
        let blocks: Vec<Bytes> = (0..3).map(|i| Bytes::from(block(10 + i, 70 + i))).collect();
        let sends: Vec<Bytes> = (0..3)
            .map(|p| Bytes::from(vec![rank as u8; p + 1]))
            .collect();
        let lens = vec![rank + 1; 3];
        let futures: Vec<Pending<'_, Result<Vec<Vec<u8>>, ProcessGroupError>>> = vec![
            Box::pin(async {
                g.reduce_scatter(&input, &[2, 2, 2], ElementType::U8, ReduceOp::BXor)
                    .await
                    .map(|b| vec![b])
            }),
            Box::pin(async {
                g.gather(&mine, 1)
                    .await
                    .map(|b| b.unwrap_or_default().iter().map(|b| b.to_vec()).collect())
            }),
            Box::pin(async { g.scatter(&blocks, 2).await.map(|b| vec![b.to_vec()]) }),
            Box::pin(async {
                g.all_to_all(&sends, &lens)
                    .await
                    .map(|b| b.iter().map(|b| b.to_vec()).collect())
            }),
        ];
        join_in_order(futures).await
    }))
    .await;
    for (rank, out) in results.into_iter().enumerate() {
        let out: Vec<Vec<Vec<u8>>> = out.into_iter().map(Result::unwrap).collect();
        let xor: Vec<u8> = (0..2)
            .map(|k| (0..3u8).fold(0, |a, r| a ^ (2 * rank as u8 + k + r)))
            .collect();
        assert_eq!(out[0], vec![xor], "reduce_scatter on rank {rank}");
        if rank == 1 {
            assert_eq!(out[1], (0..3).map(|r| block(r, 100)).collect::<Vec<_>>());
        } else {
            assert!(out[1].is_empty());
        }
        assert_eq!(out[2], vec![block(10 + rank, 70 + rank)]);
        let want: Vec<Vec<u8>> = (0..3).map(|p| vec![p as u8; rank + 1]).collect();
        assert_eq!(out[3], want, "all_to_all on rank {rank}");
    }
}

/// reduce_scatter_v, a collective that is a schedule in core, an `Op` variant and an extension
/// method (nothing in this crate names it): each rank gets its own uneven chunk of the
/// reduction, the same as the ring reduce_scatter's, whichever path the group's other
/// collectives take; counts that are not one per rank are refused in the call, and ranks
/// that pass other counts are told instead of reducing garbage (each rank that receives a
/// contribution; one whose chunk is empty receives none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduce_scatter_v_gives_each_rank_its_uneven_chunk() {
    use tensorwire_process_group::CollectivePath;
    let counts = vec![3usize, 0, 5, 1];
    let total: usize = counts.iter().sum();
    for path in [CollectivePath::Arena, CollectivePath::Links] {
        let options = GroupOptions::new(format!("rsv{path:?}"))
            .with_timeout(Duration::from_secs(5))
            .with_collectives(path);
        let gs = bounded(groups_with(counts.len(), options)).await;
        let each = counts.clone();
        let results = bounded(on_all(&gs, move |g| {
            let counts = each.clone();
            async move {
                let rank = g.rank();
                let xs: Vec<u8> = (0..total)
                    .flat_map(|i| ((i * (rank + 1)) as f32).to_le_bytes())
                    .collect();
                let sums = g
                    .reduce_scatter_v(&xs, &counts, ElementType::F32, ReduceOp::Sum)
                    .await
                    .unwrap();
                let ring = g
                    .reduce_scatter(&xs, &counts, ElementType::F32, ReduceOp::Sum)
                    .await
                    .unwrap();
                let ys: Vec<u8> = (0..total)
                    .flat_map(|i| ((i as i64 - 4) * (rank as i64 - 1)).to_le_bytes())
                    .collect();
                let maxes = g
                    .reduce_scatter_v(&ys, &counts, ElementType::I64, ReduceOp::Max)
                    .await
                    .unwrap();
                let refused = g
                    .reduce_scatter_v(&xs, &counts[1..], ElementType::F32, ReduceOp::Sum)
                    .await
                    .unwrap_err();
                // Rank 0 splits the same elements otherwise.
                let other = if rank == 0 { vec![2, 2, 4, 1] } else { counts };
                let disagreed = g
                    .reduce_scatter_v(&xs, &other, ElementType::F32, ReduceOp::Sum)
                    .await;
                (sums, ring, maxes, refused, disagreed)
            }
        }))
        .await;
        let mut offset = 0;
        for (rank, (sums, ring, maxes, refused, disagreed)) in results.into_iter().enumerate() {
            let chunk = offset..offset + counts[rank];
            offset += counts[rank];
            let want: Vec<u8> = chunk
                .clone()
                .flat_map(|i| ((i * 10) as f32).to_le_bytes())
                .collect();
            assert_eq!(sums, want, "{path:?}: rank {rank}'s sums");
            assert_eq!(ring, want, "{path:?}: the ring agrees on rank {rank}");
            let want: Vec<u8> = chunk
                .flat_map(|i| {
                    (0..4)
                        .map(|r| (i as i64 - 4) * (r - 1))
                        .max()
                        .unwrap()
                        .to_le_bytes()
                })
                .collect();
            assert_eq!(maxes, want, "{path:?}: rank {rank}'s maxima");
            assert!(
                matches!(
                    refused,
                    ProcessGroupError::Arguments {
                        collective: "reduce_scatter_v",
                        ..
                    }
                ),
                "{refused}"
            );
            // Rank 1's chunk is empty: it receives nothing, so it cannot hear of it.
            let e = match disagreed {
                Ok(chunk) if counts[rank] == 0 => {
                    assert!(chunk.is_empty());
                    continue;
                }
                other => other.expect_err("ranks that disagree fail"),
            };
            assert!(
                matches!(
                    e,
                    ProcessGroupError::Disagreement { .. } | ProcessGroupError::Mismatch { .. }
                ),
                "{path:?}: rank {rank}: {e}"
            );
        }
    }
}

/// all_to_all of blocks copies nothing on the rank: its own block comes back as the very
/// bytes it passed, and the others as they arrived; empty blocks (in either direction) and
/// uneven ones land where they belong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_returns_its_own_block_uncopied_and_every_other_in_place() {
    let gs = bounded(link_groups(3, "a2a-blocks", Duration::from_secs(20))).await;
    // Rank r sends rank p `(r + p) % 3` bytes of value 10r + p.
    let len = |r: usize, p: usize| (r + p) % 3;
    let results = bounded(on_all(&gs, |g| async move {
        let rank = g.rank();
        let inputs: Vec<Bytes> = (0..3)
            .map(|p| Bytes::from(vec![(10 * rank + p) as u8; len(rank, p)]))
            .collect();
        let lens: Vec<usize> = (0..3).map(|r| len(r, rank)).collect();
        let out = g.all_to_all(&inputs, &lens).await.unwrap();
        let own = out[rank].is_empty() || out[rank].as_ptr() == inputs[rank].as_ptr();
        (out, own)
    }))
    .await;
    for (rank, (out, own)) in results.into_iter().enumerate() {
        let want: Vec<Vec<u8>> = (0..3)
            .map(|r| vec![(10 * r + rank) as u8; len(r, rank)])
            .collect();
        let got: Vec<Vec<u8>> = out.iter().map(|b| b.to_vec()).collect();
        assert_eq!(got, want, "rank {rank}");
        assert!(own, "rank {rank}'s own block was copied");
    }
}

/// Issue 20: a receive that times out names its sender and leaves the group usable
/// (point-to-point messages take no place in the sequence of collectives). Rank 0 has a short
/// timeout, rank 1 a long one, so that rank 1 is still there when rank 0 comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_that_times_out_names_the_sender_and_the_group_goes_on() {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let transport = transport();
    let mut tasks = Vec::new();
    for (rank, timeout) in [
        (0, Duration::from_millis(300)),
        (1, Duration::from_secs(20)),
    ] {
        let (store, transport) = (store.clone(), transport.clone());
        let options = GroupOptions::new("lonely").with_timeout(timeout);
        tasks.push(tokio::spawn(async move {
            let g = Group::connect(store, transport, rank, 2, options).await?;
            if rank == 0 {
                let e = g.recv(1, 42).await.unwrap_err();
                g.send(b"go", 1, 1).await?;
                g.barrier().await?;
                Ok(Some(e))
            } else {
                assert_eq!(&g.recv(0, 1).await?[..], b"go");
                g.barrier().await?;
                Ok::<_, ProcessGroupError>(None)
            }
        }));
    }
    let mut errors = Vec::new();
    for t in tasks {
        errors.push(bounded(t).await.unwrap().unwrap());
    }
    assert_eq!(
        errors[0].as_ref().map(ToString::to_string).as_deref(),
        Some("recv #0 on rank 0 timed out after 300ms waiting for rank(s) 1")
    );
}

/// A sink that records the frames it is given and the peers whose connections ended; it
/// refuses a frame whose header is `bad`.
#[derive(Default)]
struct Recorder {
    frames: std::sync::Mutex<Vec<(usize, Vec<u8>)>>,
    closed: std::sync::Mutex<Vec<usize>>,
}

impl tensorwire_mesh::FrameSink for Recorder {
    fn on_frame(
        &self,
        peer: usize,
        _conn: &Arc<dyn tensorwire_core::ports::transport::Connection>,
        frame: tensorwire_core::wire::Frame,
    ) -> Result<(), tensorwire_core::protocol::ProtocolViolation> {
        if &frame.header[..] == b"bad" {
            return Err(tensorwire_core::protocol::ProtocolViolation::UnknownId {
                id: 7,
                what: "reply",
            });
        }
        self.frames
            .lock()
            .unwrap()
            .push((peer, frame.header.to_vec()));
        Ok(())
    }

    fn on_closed(&self, peer: usize, _end: &tensorwire_mesh::PeerEnd) {
        self.closed.lock().unwrap().push(peer);
    }
}

/// Frames of another layer, sent on a group's connections, reach the sink set on the world
/// group in order, on the same connections as the collectives running beside them; a frame
/// the sink refuses breaks the group naming the sender.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_frames_share_the_connections_with_the_collectives() {
    use tensorwire_core::wire::Frame;
    bounded(async {
        let gs = link_groups(3, "shared", Duration::from_secs(20)).await;
        let sinks: Vec<Arc<Recorder>> = (0..3).map(|_| Arc::new(Recorder::default())).collect();
        for (g, s) in gs.iter().zip(&sinks) {
            g.route_frames(s.clone()).unwrap();
            // Once only, and on the world group only.
            assert!(g.route_frames(s.clone()).is_err());
            assert_eq!(g.connections().len(), 2);
        }
        // Every rank sends each other rank 50 frames of its own, between collectives.
        let gathered = on_all(&gs, |g| async move {
            let mut all = Vec::new();
            for i in 0..50u8 {
                for (_, conn) in g.connections() {
                    conn.send(Frame::message(vec![g.rank() as u8, i], Vec::new()))
                        .await
                        .unwrap();
                }
                if i % 10 == 0 {
                    all.push(g.all_gather_object(&(g.rank(), i)).await.unwrap());
                }
            }
            g.barrier().await.unwrap();
            all
        })
        .await;
        for all in gathered {
            assert_eq!(all.len(), 5);
        }
        for (rank, s) in sinks.iter().enumerate() {
            let frames = s.frames.lock().unwrap().clone();
            for peer in (0..3).filter(|p| *p != rank) {
                let from: Vec<u8> = frames
                    .iter()
                    .filter(|(p, _)| *p == peer)
                    .map(|(_, h)| {
                        assert_eq!(h[0] as usize, peer);
                        h[1]
                    })
                    .collect();
                assert_eq!(
                    from,
                    (0..50).collect::<Vec<u8>>(),
                    "rank {rank} from {peer}"
                );
            }
        }
        // A frame the sink refuses drops that peer: the group breaks naming it.
        let (_, to_zero) = gs[1]
            .connections()
            .into_iter()
            .find(|(p, _)| *p == 0)
            .unwrap();
        to_zero
            .send(Frame::message(b"bad".to_vec(), Vec::new()))
            .await
            .unwrap();
        let e = gs[0].barrier().await.unwrap_err();
        assert_eq!(
            e,
            ProcessGroupError::RefusedFrame {
                rank: 1,
                kind: tensorwire_core::wire::FrameKind::Message
            },
            "{e}"
        );
        assert!(sinks[0].closed.lock().unwrap().contains(&1));
    })
    .await;
}

/// A group whose frames no other layer takes treats another layer's frame as its sender's
/// violation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_without_a_sink_takes_a_foreign_frame_as_a_violation() {
    use tensorwire_core::ports::process_group::MeshViolation;
    use tensorwire_core::wire::{Frame, FrameKind};
    bounded(async {
        let gs = groups(2, "nosink", Duration::from_secs(20)).await;
        let (_, conn) = gs[1].connections().pop().unwrap();
        conn.send(Frame::message(b"rpc?".to_vec(), Vec::new()))
            .await
            .unwrap();
        let e = gs[0].barrier().await.unwrap_err();
        assert_eq!(
            e,
            ProcessGroupError::Misbehaved {
                rank: 1,
                violation: MeshViolation::NotAGroupFrame {
                    kind: FrameKind::Message
                }
            }
        );
    })
    .await;
}

/// A connection that says nothing holds up no other rank's: setup completes with it open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_does_not_hold_up_setup() {
    use tensorwire_core::ports::transport::Transport;
    bounded(async {
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let t = transport();
        let options = || GroupOptions::new("silent").with_timeout(Duration::from_secs(20));
        let one = tokio::spawn(Group::connect(store.clone(), t.clone(), 1, 2, options()));
        let key = tensorwire_mesh::address_key("silent", 1);
        store.wait(&[&key], Duration::from_secs(20)).await.unwrap();
        let addr: std::net::SocketAddr = String::from_utf8(store.get(&key).await.unwrap())
            .unwrap()
            .parse()
            .unwrap();
        // Authenticated (it has the secret), then silent.
        let _silent = t.connect(addr).await.unwrap();
        // Read in turn, the silent one would keep rank 1 from rank 0's hello until the setup
        // deadline, and both would fail.
        let zero = Group::connect(store.clone(), t.clone(), 0, 2, options())
            .await
            .unwrap();
        let one = one.await.unwrap().unwrap();
        on_all(&[zero, one], |g| async move { g.barrier().await.unwrap() }).await;
        // Its address is gone from the store once every lower rank connected.
        assert!(!store.check(&[&key]).await.unwrap());
    })
    .await;
}

/// Issue 26, item 4: under `TENSORWIRE_DEBUG=detail` a rank that only sends fails the
/// mismatched collective itself (not just its next one), naming what the others ran; today's
/// default returns `Ok` on the broadcast's root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_detail_every_rank_of_a_mismatched_collective_fails() {
    let detail = |name: &str| {
        GroupOptions::new(name)
            .with_timeout(Duration::from_secs(30))
            .with_debug(DebugLevel::Detail)
    };
    // Rank 0 broadcasts from root 0, rank 1 runs all_gather: both fail, the root included.
    let gs = bounded(link_groups_with(2, detail("detail-bcast"))).await;
    let mut data = [7u8; 8];
    let (a, b) =
        bounded(async { tokio::join!(gs[0].broadcast(&mut data, 0), gs[1].all_gather(b"abcd")) })
            .await;
    let a = a.expect_err("the root of a mismatched broadcast fails it");
    let b = b.expect_err("the all_gather fails");
    for e in [&a, &b] {
        assert!(matches!(e, ProcessGroupError::Disagreement { .. }), "{e}");
        let text = e.to_string();
        assert!(text.contains("broadcast(root 0, 8 bytes)"), "{text}");
        assert!(text.contains("all_gather"), "{text}");
    }
    // Even ranks reduce to root 0, odd ones to root 1 (their trees wait on each other in a
    // cycle): every rank fails with the disagreement, none times out, none returns Ok.
    for world in [2usize, 3, 4] {
        let gs = bounded(link_groups_with(
            world,
            detail(&format!("detail-reduce{world}")),
        ))
        .await;
        let results = bounded(on_all(&gs, |g| async move {
            let root = g.rank() % 2;
            g.reduce(&mut [0u8; 8], ElementType::I64, ReduceOp::Sum, root)
                .await
        }))
        .await;
        for (rank, r) in results.into_iter().enumerate() {
            let e = r.expect_err("every rank fails");
            assert!(
                matches!(e, ProcessGroupError::Disagreement { .. }),
                "world {world} rank {rank}: {e}"
            );
            let text = e.to_string();
            assert!(text.contains("root 0") && text.contains("root 1"), "{text}");
        }
    }
    // Agreeing ranks run every checked collective to its right result.
    let gs = bounded(link_groups_with(3, detail("detail-ok"))).await;
    let results = bounded(on_all(&gs, |g| async move {
        let mut data = if g.rank() == 1 { [5u8; 4] } else { [0u8; 4] };
        g.broadcast(&mut data, 1).await.unwrap();
        let mut sum = (g.rank() as i64 + 1).to_le_bytes();
        g.reduce(&mut sum, ElementType::I64, ReduceOp::Sum, 2)
            .await
            .unwrap();
        let gathered = g.gather(&[g.rank() as u8; 3], 0).await.unwrap();
        let blocks = g.all_gather(&[g.rank() as u8]).await.unwrap();
        (data, i64::from_le_bytes(sum), gathered, blocks)
    }))
    .await;
    for (rank, (data, sum, gathered, blocks)) in results.into_iter().enumerate() {
        assert_eq!(data, [5u8; 4]);
        if rank == 2 {
            assert_eq!(sum, 6);
        }
        if rank == 0 {
            let gathered = gathered.expect("the root gets the blocks");
            for (r, b) in gathered.iter().enumerate() {
                assert_eq!(&b[..], &[r as u8; 3]);
            }
        }
        assert_eq!(blocks.len(), 3);
    }
}

/// Issue 26, item 5: `recv` from any source returns the sender, takes every message once, in
/// each sender's order, and counts as that sender's next message for a later `recv`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_from_any_source_names_the_sender() {
    for world in [2usize, 3, 4] {
        let gs = bounded(groups(
            world,
            &format!("any{world}"),
            Duration::from_secs(20),
        ))
        .await;
        let results = bounded(on_all(&gs, move |g| async move {
            let rank = g.rank();
            if rank != 0 {
                for k in 0..2u8 {
                    g.send(&[rank as u8, k], 0, 7).await.unwrap();
                }
                // The third only once rank 0 has taken the first two of every sender.
                g.barrier().await.unwrap();
                g.send(&[rank as u8, 2], 0, 7).await.unwrap();
                return Vec::new();
            }
            let mut got = Vec::new();
            for _ in 0..2 * (world - 1) {
                let (src, bytes) = g.recv_any(7).await.unwrap();
                got.push((src, bytes.to_vec()));
            }
            g.barrier().await.unwrap();
            // The third message of each sender is what a plain recv from it gets now.
            for src in 1..world {
                got.push((src, g.recv(src, 7).await.unwrap().to_vec()));
            }
            got
        }))
        .await;
        let got = &results[0];
        for src in 1..world {
            let from: Vec<&Vec<u8>> = got
                .iter()
                .filter(|(s, _)| *s == src)
                .map(|(_, b)| b)
                .collect();
            let expected: Vec<Vec<u8>> = (0..3u8).map(|k| vec![src as u8, k]).collect();
            assert_eq!(
                from,
                expected.iter().collect::<Vec<_>>(),
                "world {world}, sender {src}"
            );
        }
    }
    // Nobody sends: the receive times out naming every other rank, and the group goes on.
    let gs = bounded(groups(3, "any-timeout", Duration::from_millis(300))).await;
    let e = bounded(gs[1].recv_any(9)).await.unwrap_err();
    assert!(
        matches!(&e, ProcessGroupError::Timeout { waiting_on, .. } if waiting_on == &[0, 2]),
        "{e}"
    );
    let (a, b, c) =
        bounded(async { tokio::join!(gs[0].barrier(), gs[1].barrier(), gs[2].barrier()) }).await;
    a.and(b).and(c).unwrap();
    // A group of one has no other source.
    let solo = bounded(groups(1, "any-solo", Duration::from_secs(5))).await;
    let e = solo[0].recv_any(0).await.unwrap_err();
    assert!(matches!(e, ProcessGroupError::Arguments { .. }), "{e}");
}

/// Issue 26, item 5: `all_gather_into_tensor` and `reduce_scatter_tensor` fill the caller's
/// output tensor, and refuse gloo's wrong sizes and types before taking a place in the
/// sequence (the barrier after them still meets).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn into_tensor_collectives_fill_the_callers_output() {
    use tensorwire_core::collective::CollectiveError;
    use tensorwire_core::tensor::{DType, Tensor};

    for world in [2usize, 3, 4] {
        let gs = bounded(groups(
            world,
            &format!("into{world}"),
            Duration::from_secs(20),
        ))
        .await;
        let results = bounded(on_all(&gs, move |g| async move {
            let r = g.rank() as f32;
            let input =
                Tensor::from_f32(vec![2, 3], &[r, r + 1.0, r + 2.0, -r, 0.5, 2.0 * r]).unwrap();
            let mut gathered = Tensor::from_f32(vec![2 * world, 3], &vec![9.0; 6 * world]).unwrap();
            g.all_gather_into_tensor(&mut gathered, &input)
                .await
                .unwrap();
            let values: Vec<f32> = (0..6 * world).map(|i| i as f32 * (r + 1.0)).collect();
            let stacked = Tensor::from_f32(vec![2 * world, 3], &values).unwrap();
            let mut mine = Tensor::from_f32(vec![2, 3], &[0.0; 6]).unwrap();
            g.reduce_scatter_tensor(&mut mine, &stacked, ReduceOp::Sum)
                .await
                .unwrap();
            // Wrong sizes and types: refused here, nothing sent.
            let mut short =
                Tensor::from_f32(vec![2 * world - 1, 3], &vec![0.0; 6 * world - 3]).unwrap();
            let size = g
                .all_gather_into_tensor(&mut short, &input)
                .await
                .unwrap_err();
            let mut flat = Tensor::from_f32(vec![6 * world], &vec![0.0; 6 * world]).unwrap();
            let flat = g
                .all_gather_into_tensor(&mut flat, &input)
                .await
                .unwrap_err();
            let mut ints = Tensor::new(
                DType::I64,
                vec![2, 3],
                tensorwire_core::tensor::Storage::Host(Bytes::from(vec![0u8; 48])),
            )
            .unwrap();
            let kind = g
                .reduce_scatter_tensor(&mut ints, &stacked, ReduceOp::Sum)
                .await
                .unwrap_err();
            let mut wide = Tensor::from_f32(vec![3, 3], &[0.0; 9]).unwrap();
            let rs_size = g
                .reduce_scatter_tensor(&mut wide, &stacked, ReduceOp::Sum)
                .await
                .unwrap_err();
            g.barrier().await.unwrap();
            (
                gathered.to_f32_vec().unwrap(),
                mine.to_f32_vec().unwrap(),
                [size, flat, kind, rs_size],
            )
        }))
        .await;
        for (rank, (gathered, mine, errors)) in results.into_iter().enumerate() {
            let expected: Vec<f32> = (0..world)
                .flat_map(|s| {
                    let s = s as f32;
                    [s, s + 1.0, s + 2.0, -s, 0.5, 2.0 * s]
                })
                .collect();
            assert_eq!(gathered, expected, "world {world} rank {rank}");
            // Sum over ranks of i * (r + 1) for this rank's chunk.
            let factor: f32 = (1..=world).map(|x| x as f32).sum();
            let chunk: Vec<f32> = (6 * rank..6 * rank + 6)
                .map(|i| i as f32 * factor)
                .collect();
            assert_eq!(mine, chunk, "world {world} rank {rank}");
            let texts: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
            for e in &errors {
                assert!(
                    matches!(
                        e,
                        ProcessGroupError::Arguments {
                            source: CollectiveError::TensorSize { .. }
                                | CollectiveError::TensorType { .. },
                            ..
                        }
                    ),
                    "{e}"
                );
            }
            assert!(
                texts[0].contains(&format!(
                    "invalid output tensor size (expected [{}, 3], got [{}, 3])",
                    2 * world,
                    2 * world - 1
                )),
                "{}",
                texts[0]
            );
            assert!(
                texts[2].contains("invalid input tensor type"),
                "{}",
                texts[2]
            );
            assert!(
                texts[3].contains("invalid input tensor size"),
                "{}",
                texts[3]
            );
        }
    }
}

/// Issue 26, item 5: the tensor forms of reduce, gather and scatter, with PyTorch's list
/// rules (the list on the root only, one tensor per rank of the same dtype and shape).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooted_tensor_collectives_follow_pytorchs_rules() {
    use tensorwire_core::collective::CollectiveError;
    use tensorwire_core::tensor::Tensor;

    for world in [2usize, 3, 4] {
        let gs = bounded(groups(
            world,
            &format!("rooted{world}"),
            Duration::from_secs(20),
        ))
        .await;
        let root = world - 1;
        let results = bounded(on_all(&gs, move |g| async move {
            let r = g.rank() as f32;
            let mut t = Tensor::from_f32(vec![2], &[r, 1.0]).unwrap();
            g.reduce_tensor(&mut t, ReduceOp::Sum, root).await.unwrap();
            let mine = Tensor::from_f32(vec![2], &[r, -r]).unwrap();
            let mut list: Vec<Tensor> = (0..world)
                .map(|_| Tensor::from_f32(vec![2], &[0.0; 2]).unwrap())
                .collect();
            let on_root = g.rank() == root;
            g.gather_tensor(&mine, on_root.then_some(&mut list[..]), root)
                .await
                .unwrap();
            let parts: Vec<Tensor> = (0..world)
                .map(|i| Tensor::from_f32(vec![2], &[i as f32, 10.0 * i as f32]).unwrap())
                .collect();
            let mut out = Tensor::from_f32(vec![2], &[0.0; 2]).unwrap();
            g.scatter_tensor(&mut out, on_root.then_some(&parts[..]), root)
                .await
                .unwrap();
            // The list where it must not be, or missing where it must: refused here.
            let wrong = g
                .gather_tensor(&mine, (!on_root).then_some(&mut list[..]), root)
                .await
                .unwrap_err();
            let short = if on_root {
                Some(
                    g.scatter_tensor(&mut out.clone(), Some(&parts[1..]), root)
                        .await
                        .unwrap_err(),
                )
            } else {
                None
            };
            g.barrier().await.unwrap();
            let gathered: Vec<Vec<f32>> = list.iter().map(|t| t.to_f32_vec().unwrap()).collect();
            (
                t.to_f32_vec().unwrap(),
                gathered,
                out.to_f32_vec().unwrap(),
                wrong,
                short,
            )
        }))
        .await;
        let total: f32 = (0..world).map(|r| r as f32).sum();
        for (rank, (reduced, gathered, scattered, wrong, short)) in results.into_iter().enumerate()
        {
            let r = rank as f32;
            if rank == root {
                assert_eq!(reduced, vec![total, world as f32]);
                let expected: Vec<Vec<f32>> =
                    (0..world).map(|s| vec![s as f32, -(s as f32)]).collect();
                assert_eq!(gathered, expected);
                let e = short.expect("the root tried");
                assert!(
                    matches!(
                        e,
                        ProcessGroupError::Arguments {
                            source: CollectiveError::LengthsCount { .. },
                            ..
                        }
                    ),
                    "{e}"
                );
            } else {
                assert_eq!(reduced, vec![r, 1.0], "untouched off the root");
            }
            assert_eq!(scattered, vec![r, 10.0 * r]);
            let on_root = rank == root;
            assert!(
                matches!(
                    &wrong,
                    ProcessGroupError::Arguments {
                        source: CollectiveError::TensorList { on_root: o, .. },
                        ..
                    } if *o == on_root
                ),
                "{wrong}"
            );
        }
    }
}

/// Issue 26, item 5: `new_group(ranks)` on the group a user holds as `dyn ProcessGroup` (what
/// `new_group` of the backend registry returns): the members get a working subgroup, the
/// others `None`, and bad ranks are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_group_works_on_the_dyn_group() {
    for world in [2usize, 3, 4] {
        let gs = bounded(groups(
            world,
            &format!("dynsub{world}"),
            Duration::from_secs(20),
        ))
        .await;
        let results = bounded(on_all(&gs, move |g| async move {
            let pg: Arc<dyn ProcessGroup> = Arc::new(g);
            let even: Vec<usize> = (0..world).step_by(2).collect();
            let bad = pg.new_group(&[0, world]).map(|_| ()).unwrap_err();
            let sub = pg.new_group(&even).unwrap();
            let sum = match &sub {
                Some(sub) => {
                    let mut x = (pg.rank() as i64 + 1).to_le_bytes();
                    sub.all_reduce(&mut x, ElementType::I64, ReduceOp::Sum)
                        .await
                        .unwrap();
                    Some((sub.rank(), sub.size(), i64::from_le_bytes(x)))
                }
                None => None,
            };
            pg.barrier().await.unwrap();
            (sum, bad)
        }))
        .await;
        let even: Vec<usize> = (0..world).step_by(2).collect();
        let total: i64 = even.iter().map(|r| *r as i64 + 1).sum();
        for (rank, (sum, bad)) in results.into_iter().enumerate() {
            if rank % 2 == 0 {
                assert_eq!(sum, Some((rank / 2, even.len(), total)), "world {world}");
            } else {
                assert_eq!(sum, None, "world {world} rank {rank}");
            }
            assert!(matches!(bad, ProcessGroupError::Setup { .. }), "{bad}");
        }
    }
}

/// Issue 26, item 5: the tensor form of all_to_all_single, with uneven and even splits, and
/// PyTorch's refusals (splits not summing to the rows, rows that do not divide evenly).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_single_tensor_moves_rows() {
    use tensorwire_core::collective::CollectiveError;
    use tensorwire_core::tensor::Tensor;

    for world in [2usize, 3, 4] {
        let gs = bounded(groups(
            world,
            &format!("a2a{world}"),
            Duration::from_secs(20),
        ))
        .await;
        let results = bounded(on_all(&gs, move |g| async move {
            let r = g.rank();
            // Rank r sends 1 + (r + j) % 2 rows of two columns to rank j.
            let splits: Vec<usize> = (0..world).map(|j| 1 + (r + j) % 2).collect();
            let rows: usize = splits.iter().sum();
            let values: Vec<f32> = (0..2 * rows).map(|i| (100 * r + i) as f32).collect();
            let input = Tensor::from_f32(vec![rows, 2], &values).unwrap();
            let mut output = Tensor::from_f32(vec![rows, 2], &vec![0.0; 2 * rows]).unwrap();
            g.all_to_all_single_tensor(&mut output, &input, Some(&splits), Some(&splits))
                .await
                .unwrap();
            let even_in = Tensor::from_f32(vec![world], &vec![r as f32; world]).unwrap();
            let mut even_out = Tensor::from_f32(vec![world], &vec![0.0; world]).unwrap();
            g.all_to_all_single_tensor(&mut even_out, &even_in, None, None)
                .await
                .unwrap();
            let odd = Tensor::from_f32(vec![world + 1], &vec![0.0; world + 1]).unwrap();
            let uneven = g
                .all_to_all_single_tensor(&mut odd.clone(), &odd, None, None)
                .await
                .unwrap_err();
            let wrong_sum = g
                .all_to_all_single_tensor(&mut output.clone(), &input, Some(&splits), Some(&[1]))
                .await
                .unwrap_err();
            g.barrier().await.unwrap();
            (
                output.to_f32_vec().unwrap(),
                even_out.to_f32_vec().unwrap(),
                uneven,
                wrong_sum,
            )
        }))
        .await;
        for (rank, (out, even, uneven, wrong)) in results.into_iter().enumerate() {
            // From rank s: its rows for `rank`, which start after the rows it sent to lower ranks.
            let mut expected = Vec::new();
            for s in 0..world {
                let start: usize = (0..rank).map(|j| 1 + (s + j) % 2).sum();
                let n = 1 + (s + rank) % 2;
                expected.extend((2 * start..2 * (start + n)).map(|i| (100 * s + i) as f32));
            }
            assert_eq!(out, expected, "world {world} rank {rank}");
            assert_eq!(even, (0..world).map(|s| s as f32).collect::<Vec<_>>());
            for e in [uneven, wrong] {
                assert!(
                    matches!(
                        e,
                        ProcessGroupError::Arguments {
                            source: CollectiveError::SplitsSum { .. }
                                | CollectiveError::LengthsCount { .. },
                            ..
                        }
                    ),
                    "{e}"
                );
            }
        }
    }
}

/// Issue 26, item 5: the list form of the tensor all_to_all (NCCL's and MPI's; gloo has
/// none), with sizes that differ between ranks, and its refusals: a list of the wrong length
/// or of mixed dtypes before anything is sent, an output of the wrong size naming the rank
/// whose tensor did not fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_tensor_list_form_moves_tensors() {
    use tensorwire_core::collective::CollectiveError;
    use tensorwire_core::tensor::Tensor;

    // What rank `from` sends rank `to`: 1 + (from + to) % 2 rows of two columns.
    fn block(from: usize, to: usize) -> Tensor {
        let rows = 1 + (from + to) % 2;
        let values: Vec<f32> = (0..2 * rows)
            .map(|k| (100 * from + 10 * to + k) as f32)
            .collect();
        Tensor::from_f32(vec![rows, 2], &values).unwrap()
    }
    for world in [2usize, 3, 4] {
        let gs = bounded(groups(
            world,
            &format!("a2alist{world}"),
            Duration::from_secs(20),
        ))
        .await;
        let results = bounded(on_all(&gs, move |g| async move {
            let r = g.rank();
            let inputs: Vec<Tensor> = (0..world).map(|j| block(r, j)).collect();
            let mut outputs: Vec<Tensor> = (0..world)
                .map(|i| {
                    let rows = 1 + (i + r) % 2;
                    Tensor::from_f32(vec![rows, 2], &vec![0.0; 2 * rows]).unwrap()
                })
                .collect();
            g.all_to_all_tensor(&mut outputs, &inputs).await.unwrap();
            let short = g
                .all_to_all_tensor(&mut outputs.clone()[1..], &inputs)
                .await
                .unwrap_err();
            let mut mixed = inputs.clone();
            mixed[0] = Tensor::from_f64(vec![1], &[1.0]).unwrap();
            let mixed = g
                .all_to_all_tensor(&mut outputs.clone(), &mixed)
                .await
                .unwrap_err();
            // The slot for the next rank is one row too long.
            let next = (r + 1) % world;
            let mut wrong = outputs.clone();
            wrong[next] = Tensor::from_f32(vec![3, 2], &[0.0; 6]).unwrap();
            let wrong = g.all_to_all_tensor(&mut wrong, &inputs).await.unwrap_err();
            g.barrier().await.unwrap();
            let got: Vec<Vec<f32>> = outputs.iter().map(|t| t.to_f32_vec().unwrap()).collect();
            (got, short, mixed, wrong)
        }))
        .await;
        for (rank, (got, short, mixed, wrong)) in results.into_iter().enumerate() {
            let expected: Vec<Vec<f32>> = (0..world)
                .map(|i| block(i, rank).to_f32_vec().unwrap())
                .collect();
            assert_eq!(got, expected, "world {world} rank {rank}");
            assert!(
                matches!(
                    short,
                    ProcessGroupError::Arguments {
                        source: CollectiveError::LengthsCount { .. },
                        ..
                    }
                ),
                "{short}"
            );
            assert!(
                matches!(
                    mixed,
                    ProcessGroupError::Arguments {
                        source: CollectiveError::TensorType { .. },
                        ..
                    }
                ),
                "{mixed}"
            );
            let next = (rank + 1) % world;
            assert!(
                matches!(wrong, ProcessGroupError::Mismatch { peer, .. } if peer == next),
                "world {world} rank {rank}: {wrong}"
            );
        }
    }
}

/// Issue 26, item 5: work handles on the `dyn ProcessGroup` a user gets from `new_group`
/// (c10d's `async_op=True`): issued in the call, they make progress without being waited on;
/// `is_completed`, `error` and `wait` read as c10d's `Work`; a wait whose timeout passes first
/// fails naming the rank that never came, and `error` then says so too.
/// On both paths: the group arena and the links.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_handles_on_the_dyn_group() {
    use tensorwire_process_group::CollectivePath;
    for path in [CollectivePath::Arena, CollectivePath::Links] {
        work_handles_on_the_dyn_group_on(path).await;
    }
}

async fn work_handles_on_the_dyn_group_on(path: tensorwire_process_group::CollectivePath) {
    use tensorwire_core::tensor::Tensor;

    let world = 3usize;
    let gs = bounded(path_groups(path, world, "dynwork", Duration::from_secs(20))).await;
    let results = bounded(on_all(&gs, move |g| async move {
        let r = g.rank();
        let world_pg: Arc<dyn ProcessGroup> = Arc::new(g);
        let sub = world_pg.new_group(&[0, 1, 2]).unwrap().expect("a member");
        let mine = Tensor::from_f32(vec![2], &[r as f32, 1.0]).unwrap();
        // Issued in this order on every rank, before anything is awaited.
        let mut sum = sub.issue_all_reduce_tensor(mine.clone(), ReduceOp::Sum);
        let mut gathered = sub.issue_all_gather_tensor(mine.clone());
        let from_one = sub.issue_broadcast_tensor(mine.clone(), 1);
        let mut barrier = sub.issue_barrier();
        // Nobody waits: they finish on their own tasks.
        while !(sum.is_completed() && gathered.is_completed() && barrier.is_completed()) {
            tokio::task::yield_now().await;
        }
        assert_eq!(sum.error(), None);
        let sum = sum.wait(Duration::from_secs(10)).await.unwrap();
        let gathered = gathered.wait(Duration::from_secs(10)).await.unwrap();
        let from_one = from_one.wait(Duration::from_secs(10)).await.unwrap();
        barrier.wait(Duration::from_secs(10)).await.unwrap();
        // Rank 2 does not come to the last barrier.
        let late = if r < 2 {
            let b = sub.issue_barrier();
            let e = b.wait(Duration::from_millis(300)).await.unwrap_err();
            // The group is broken here now: the next collective fails with the same error,
            // which its handle reports without being waited on.
            let mut next = sub.issue_barrier();
            while !next.is_completed() {
                tokio::task::yield_now().await;
            }
            assert_eq!(next.error().map(|n| n.to_string()), Some(e.to_string()));
            Some(e.to_string())
        } else {
            None
        };
        (
            sum.to_f32_vec().unwrap(),
            gathered
                .iter()
                .map(|t| t.to_f32_vec().unwrap())
                .collect::<Vec<_>>(),
            from_one.to_f32_vec().unwrap(),
            late,
        )
    }))
    .await;
    for (rank, (sum, gathered, from_one, late)) in results.into_iter().enumerate() {
        assert_eq!(sum, vec![3.0, 3.0]);
        assert_eq!(
            gathered,
            (0..world).map(|r| vec![r as f32, 1.0]).collect::<Vec<_>>()
        );
        assert_eq!(from_one, vec![1.0, 1.0]);
        match late {
            Some(e) => assert!(
                e.contains("timed out after 300ms waiting for rank(s) 2"),
                "rank {rank}: {e}"
            ),
            None => assert_eq!(rank, 2),
        }
    }
}

/// Issue 26, item 5, last part: every tensor collective's work handle on the `dyn
/// ProcessGroup`, all issued in one order on every rank before any is waited on, then waited
/// in the reverse order: each gives its own collective's result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tensor_work_handle_issued_before_any_wait_gives_its_result_waited_in_reverse() {
    use tensorwire_core::tensor::Tensor;

    fn f32s(values: &[f32]) -> Tensor {
        Tensor::from_f32(vec![values.len()], values).unwrap()
    }
    let wait = Duration::from_secs(20);
    for world in [2usize, 3, 4] {
        let gs = bounded(groups(
            world,
            &format!("revwork{world}"),
            Duration::from_secs(20),
        ))
        .await;
        let results = bounded(on_all(&gs, move |g| async move {
            let r = g.rank();
            let rf = r as f32;
            let pg: Arc<dyn ProcessGroup> = Arc::new(g);
            let (first, last) = (0, world - 1);
            let zeros = |n: usize| f32s(&vec![0.0; n]);
            let reduce = pg.issue_reduce_tensor(f32s(&[rf, 1.0]), ReduceOp::Sum, last);
            let gather = pg.issue_gather_tensor(
                f32s(&[rf, -rf]),
                (r == first).then(|| (0..world).map(|_| zeros(2)).collect()),
                first,
            );
            let scatter = pg.issue_scatter_tensor(
                zeros(2),
                (r == last).then(|| {
                    (0..world)
                        .map(|i| f32s(&[i as f32, 10.0 * i as f32]))
                        .collect()
                }),
                last,
            );
            let single = pg.issue_all_to_all_single_tensor(
                zeros(world),
                f32s(&(0..world).map(|j| (10 * r + j) as f32).collect::<Vec<_>>()),
                None,
                None,
            );
            let list = pg.issue_all_to_all_tensor(
                (0..world).map(|_| zeros(1)).collect(),
                (0..world).map(|j| f32s(&[(100 * r + j) as f32])).collect(),
            );
            let into = pg.issue_all_gather_into_tensor(zeros(2 * world), f32s(&[rf, rf + 0.5]));
            let stacked: Vec<f32> = (0..2 * world).map(|k| k as f32 * (rf + 1.0)).collect();
            let scattered = pg.issue_reduce_scatter_tensor(zeros(2), f32s(&stacked), ReduceOp::Sum);
            // Waited in the reverse of the issue order.
            let v = |t: Tensor| t.to_f32_vec().unwrap();
            let scattered = v(scattered.wait(wait).await.unwrap());
            let into = v(into.wait(wait).await.unwrap());
            let list: Vec<Vec<f32>> = list.wait(wait).await.unwrap().into_iter().map(v).collect();
            let single = v(single.wait(wait).await.unwrap());
            let scatter = v(scatter.wait(wait).await.unwrap());
            let gather: Option<Vec<Vec<f32>>> = gather
                .wait(wait)
                .await
                .unwrap()
                .map(|l| l.into_iter().map(v).collect());
            let reduce = v(reduce.wait(wait).await.unwrap());
            (reduce, gather, scatter, single, list, into, scattered)
        }))
        .await;
        let sum_of_ranks = (world * (world - 1) / 2) as f32;
        let weights = (world * (world + 1) / 2) as f32; // sum of (r + 1)
        for (r, (reduce, gather, scatter, single, list, into, scattered)) in
            results.into_iter().enumerate()
        {
            let rf = r as f32;
            let at = format!("world {world} rank {r}");
            if r == world - 1 {
                assert_eq!(reduce, [sum_of_ranks, world as f32], "{at}");
            } else {
                assert_eq!(reduce, [rf, 1.0], "{at}: not the root, left as it was");
            }
            let expected_gather = (r == 0).then(|| {
                (0..world)
                    .map(|i| vec![i as f32, -(i as f32)])
                    .collect::<Vec<_>>()
            });
            assert_eq!(gather, expected_gather, "{at}");
            assert_eq!(scatter, [rf, 10.0 * rf], "{at}");
            let from_each: Vec<f32> = (0..world).map(|j| (10 * j + r) as f32).collect();
            assert_eq!(single, from_each, "{at}");
            let from_each: Vec<Vec<f32>> = (0..world).map(|i| vec![(100 * i + r) as f32]).collect();
            assert_eq!(list, from_each, "{at}");
            let all: Vec<f32> = (0..world)
                .flat_map(|i| [i as f32, i as f32 + 0.5])
                .collect();
            assert_eq!(into, all, "{at}");
            assert_eq!(
                scattered,
                [(2 * r) as f32 * weights, (2 * r + 1) as f32 * weights],
                "{at}"
            );
        }
    }
}

/// Work handles whose collectives fail: `error` reports the typed error once the handle has
/// finished (without waiting), and `wait` gives the same error. A call refused for its
/// arguments has finished in the call and leaves the group in step; a peer that sends
/// another size than this rank's output says is a `Mismatch` naming it; a rank that does not
/// come makes the others time out, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_tensor_work_handles_report_the_typed_error_by_error_and_wait() {
    use tensorwire_core::collective::CollectiveError;
    use tensorwire_core::tensor::Tensor;

    fn f32s(values: &[f32]) -> Tensor {
        Tensor::from_f32(vec![values.len()], values).unwrap()
    }
    async fn finished<'a, T: Send + 'a>(
        w: &mut Box<dyn WorkHandle<'a, T> + 'a>,
    ) -> ProcessGroupError {
        while !w.is_completed() {
            tokio::task::yield_now().await;
        }
        w.error().expect("it failed")
    }
    use tensorwire_core::ports::process_group::WorkHandle;
    let wait = Duration::from_secs(20);

    let world = 3usize;
    // On both paths.
    for path in [
        tensorwire_process_group::CollectivePath::Arena,
        tensorwire_process_group::CollectivePath::Links,
    ] {
        let gs = bounded(path_groups(
            path,
            world,
            "failwork",
            Duration::from_secs(20),
        ))
        .await;
        let results = bounded(on_all(&gs, move |g| async move {
            let r = g.rank();
            let pg: Arc<dyn ProcessGroup> = Arc::new(g);
            // Refused in the call on the root only (its list is short): the others do not issue it.
            let refused = if r == 0 {
                let mut w = pg.issue_scatter_tensor(f32s(&[0.0]), Some(vec![f32s(&[1.0])]), 0);
                assert!(w.is_completed(), "refused in the call");
                let e = w.error().expect("refused");
                assert_eq!(w.wait(wait).await.unwrap_err(), e);
                Some(e)
            } else {
                None
            };
            // The slot for the next rank is one element too long.
            let next = (r + 1) % world;
            let outputs = (0..world)
                .map(|i| f32s(&vec![0.0; if i == next { 2 } else { 1 }]))
                .collect();
            let inputs = (0..world).map(|j| f32s(&[j as f32])).collect();
            let mut mismatched = pg.issue_all_to_all_tensor(outputs, inputs);
            let seen = finished(&mut mismatched).await;
            assert_eq!(mismatched.wait(wait).await.unwrap_err(), seen);
            // The group is still in step: a good collective issued after it works.
            let sum = pg
                .issue_all_reduce_tensor(f32s(&[1.0]), ReduceOp::Sum)
                .wait(wait)
                .await
                .unwrap();
            (refused, seen, sum.to_f32_vec().unwrap())
        }))
        .await;
        for (r, (refused, seen, sum)) in results.into_iter().enumerate() {
            if r == 0 {
                let refused = refused.expect("the root's scatter was refused");
                assert!(
                    matches!(
                        refused,
                        ProcessGroupError::Arguments {
                            collective: "scatter",
                            source: CollectiveError::LengthsCount { lens: 1, world: 3 }
                        }
                    ),
                    "{refused}"
                );
            }
            let next = (r + 1) % world;
            assert!(
                matches!(&seen, ProcessGroupError::Mismatch { peer, collective: "all_to_all", .. } if *peer == next),
                "rank {r}: {seen}"
            );
            assert_eq!(sum, [3.0]);
        }
    }

    // Rank 2 never comes to the reduce_scatter: ranks 0 and 1 give up waiting after 300ms
    // (the group's own timeout is 20s), which makes the collective time out with that
    // timeout; between them they name rank 2. Their group is broken then: the next handle
    // reports the same error by `error`, without being waited on. On both paths.
    for path in [
        tensorwire_process_group::CollectivePath::Arena,
        tensorwire_process_group::CollectivePath::Links,
    ] {
        late_work_times_out_naming_the_missing_rank(path, world).await;
    }
}

/// The timed-out part of [`failing_tensor_work_handles_report_the_typed_error_by_error_and_wait`].
async fn late_work_times_out_naming_the_missing_rank(
    path: tensorwire_process_group::CollectivePath,
    world: usize,
) {
    use tensorwire_core::ports::process_group::WorkHandle;
    use tensorwire_core::tensor::Tensor;

    fn f32s(values: &[f32]) -> Tensor {
        Tensor::from_f32(vec![values.len()], values).unwrap()
    }
    async fn finished<'a, T: Send + 'a>(
        w: &mut Box<dyn WorkHandle<'a, T> + 'a>,
    ) -> ProcessGroupError {
        while !w.is_completed() {
            tokio::task::yield_now().await;
        }
        w.error().expect("it failed")
    }
    let gs = bounded(path_groups(
        path,
        world,
        "latework",
        Duration::from_secs(20),
    ))
    .await;
    let results = bounded(on_all(&gs[..2], move |g| async move {
        let pg: Arc<dyn ProcessGroup> = Arc::new(g);
        let w = pg.issue_reduce_scatter_tensor(f32s(&[0.0]), f32s(&[1.0; 3]), ReduceOp::Sum);
        let timed_out = w.wait(Duration::from_millis(300)).await.unwrap_err();
        let mut next = pg.issue_reduce_tensor(f32s(&[1.0]), ReduceOp::Sum, 0);
        assert_eq!(finished(&mut next).await, timed_out);
        timed_out
    }))
    .await;
    let mut named = Vec::new();
    for (r, e) in results.into_iter().enumerate() {
        match &e {
            ProcessGroupError::Timeout {
                collective,
                rank,
                waiting_on,
                timeout,
                ..
            } => {
                assert_eq!((*rank, *timeout), (r, Duration::from_millis(300)), "{e}");
                assert!(collective.contains("reduce_scatter"), "{e}");
                named.extend(waiting_on.iter().copied());
            }
            other => panic!("rank {r}: expected a timeout, got {other}"),
        }
    }
    assert!(named.contains(&2), "rank 2 is named: {named:?}");
}

/// The tensor forms of `isend`/`irecv` as work handles: each rank issues two receives from
/// its left neighbour and two sends to its right, then waits in the reverse order; the n-th
/// receive gets the n-th message (numbered in the call). Rank 0 then takes one message from
/// every other rank by `issue_recv_any_tensor`, naming each sender. A send to itself is
/// refused in the call; a message of another length than the receiving tensor is a
/// `Mismatch` naming its sender, by `error` and by `wait`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point_to_point_tensor_work_handles() {
    use tensorwire_core::collective::CollectiveError;
    use tensorwire_core::ports::process_group::WorkHandle;
    use tensorwire_core::tensor::Tensor;

    fn f32s(values: &[f32]) -> Tensor {
        Tensor::from_f32(vec![values.len()], values).unwrap()
    }
    let wait = Duration::from_secs(20);
    let world = 3usize;
    let gs = bounded(groups(world, "p2pwork", Duration::from_secs(20))).await;
    let results = bounded(on_all(&gs, move |g| async move {
        let r = g.rank();
        let (left, right) = ((r + world - 1) % world, (r + 1) % world);
        let pg: Arc<dyn ProcessGroup> = Arc::new(g);
        let first = pg.issue_recv_tensor(f32s(&[0.0; 2]), left, 5);
        let second = pg.issue_recv_tensor(f32s(&[0.0; 2]), left, 5);
        let sent: Vec<Box<dyn WorkHandle<'_, ()> + '_>> = (0..2)
            .map(|k| pg.issue_send_tensor(f32s(&[r as f32, k as f32]), right, 5))
            .collect();
        for s in sent.into_iter().rev() {
            s.wait(wait).await.unwrap();
        }
        let second = second.wait(wait).await.unwrap().to_f32_vec().unwrap();
        let first = first.wait(wait).await.unwrap().to_f32_vec().unwrap();

        let mut self_send = pg.issue_send_tensor(f32s(&[1.0]), r, 6);
        assert!(self_send.is_completed(), "refused in the call");
        let self_send = self_send.error();

        let any = if r == 0 {
            let mut from = Vec::new();
            for _ in 1..world {
                let (src, t) = pg
                    .issue_recv_any_tensor(f32s(&[0.0]), 8)
                    .wait(wait)
                    .await
                    .unwrap();
                from.push((src, t.to_f32_vec().unwrap()));
            }
            from.sort_by_key(|(src, _)| *src);
            from
        } else {
            pg.issue_send_tensor(f32s(&[10.0 * r as f32]), 0, 8)
                .wait(wait)
                .await
                .unwrap();
            Vec::new()
        };

        // Rank 1 sends rank 0 three elements where rank 0 expects two.
        let mismatch = match r {
            0 => {
                let mut w = pg.issue_recv_tensor(f32s(&[0.0; 2]), 1, 9);
                while !w.is_completed() {
                    tokio::task::yield_now().await;
                }
                let seen = w.error();
                assert_eq!(w.wait(wait).await.err(), seen);
                seen
            }
            1 => {
                pg.issue_send_tensor(f32s(&[1.0; 3]), 0, 9)
                    .wait(wait)
                    .await
                    .unwrap();
                None
            }
            _ => None,
        };
        (first, second, self_send, any, mismatch)
    }))
    .await;
    for (r, (first, second, self_send, any, mismatch)) in results.into_iter().enumerate() {
        let left = ((r + world - 1) % world) as f32;
        assert_eq!(
            (first, second),
            (vec![left, 0.0], vec![left, 1.0]),
            "rank {r}"
        );
        assert!(
            matches!(
                self_send,
                Some(ProcessGroupError::Arguments {
                    collective: "send",
                    source: CollectiveError::PeerIsSelf { .. }
                })
            ),
            "rank {r}: {self_send:?}"
        );
        if r == 0 {
            assert_eq!(any, [(1, vec![10.0]), (2, vec![20.0])]);
            assert!(
                matches!(
                    mismatch,
                    Some(ProcessGroupError::Mismatch {
                        peer: 1,
                        collective: "recv",
                        ..
                    })
                ),
                "{mismatch:?}"
            );
        }
    }
}

/// Issue 47: a world whose rank 0 cannot make the arena (one too small for the world) runs on
/// its links, and leaves no key of the arena in the store: as many keys as a world on the
/// link path leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_world_without_its_arena_leaves_no_key_behind() {
    use tensorwire_process_group::CollectivePath;
    let world = 3;
    let keys_after = |path: CollectivePath, name: &'static str| async move {
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let transport = transport();
        let options = GroupOptions::new(name)
            .with_timeout(Duration::from_secs(20))
            .with_collectives(path)
            .with_arena_bytes(64);
        let tasks: Vec<_> = (0..world)
            .map(|rank| {
                let (store, transport, options) =
                    (store.clone(), transport.clone(), options.clone());
                tokio::spawn(Group::connect(store, transport, rank, world, options))
            })
            .collect();
        let mut gs = Vec::new();
        for t in tasks {
            gs.push(t.await.unwrap().unwrap());
        }
        assert!(gs.iter().all(|g| !g.uses_arena()), "{path:?}");
        on_all(&gs, |g| async move { g.barrier().await.unwrap() }).await;
        store.num_keys().await.unwrap()
    };
    let fallback = bounded(keys_after(CollectivePath::Arena, "no-arena")).await;
    let links = bounded(keys_after(CollectivePath::Links, "no-arena")).await;
    assert_eq!(fallback, links);
}

/// Issue 47: a subgroup's arena whose accepting fails (rank 1 never takes part, so rank 0's
/// listener waits for it until the deadline) leaves no name of it in the store: rank 0 deletes
/// the key on that path too, and says why the collective failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_accept_deletes_the_arena_name_from_the_store() {
    let world = 2;
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let transport = transport();
    let options = GroupOptions::new("failed-accept").with_timeout(Duration::from_secs(1));
    let tasks: Vec<_> = (0..world)
        .map(|rank| {
            let (store, transport, options) = (store.clone(), transport.clone(), options.clone());
            tokio::spawn(Group::connect(store, transport, rank, world, options))
        })
        .collect();
    let mut gs = Vec::new();
    for t in tasks {
        gs.push(bounded(t).await.unwrap().unwrap());
    }
    assert!(gs.iter().all(Group::uses_arena));
    let before = store.num_keys().await.unwrap();
    // Both ranks make the subgroup (no collective: nothing is sent); only rank 0 uses it.
    let sub = gs[0].new_group(&[0, 1]).unwrap().expect("a member");
    let _idle = gs[1].new_group(&[0, 1]).unwrap().expect("a member");
    let key = format!("tensorwire/pg/{}/arena", sub.name());
    let error = bounded(sub.barrier()).await.unwrap_err();
    assert!(
        matches!(error, ProcessGroupError::Setup { rank: 0, .. }),
        "{error}"
    );
    assert!(
        !store.check(&[key.as_str()]).await.unwrap(),
        "{key} is still in the store after {error}"
    );
    assert_eq!(store.num_keys().await.unwrap(), before);
}

/// Issue 47: the same collectives through a (tiny, so that every message is chunked) group
/// arena and through the links give the same results, and a subgroup makes its own arena.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_arena_and_the_links_give_the_same_results() {
    use tensorwire_process_group::CollectivePath;
    let world = 3;
    let run = |path: CollectivePath, name: &'static str| async move {
        let options = GroupOptions::new(name)
            .with_timeout(Duration::from_secs(20))
            .with_collectives(path)
            .with_arena_bytes(2 * 64 * world * world);
        let gs = groups_with(world, options).await;
        let tasks: Vec<_> = gs
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                tokio::spawn(async move {
                    let mut out: Vec<Vec<u8>> = Vec::new();
                    assert_eq!(g.uses_arena(), path == CollectivePath::Arena);
                    g.barrier().await.unwrap();
                    let mut xs: Vec<f32> =
                        (0..1000).map(|i| (i * (rank + 1)) as f32 / 3.0).collect();
                    g.all_reduce_typed(&mut xs, ReduceOp::Sum).await.unwrap();
                    out.push(xs.iter().flat_map(|x| x.to_le_bytes()).collect());
                    let mut ys: Vec<i64> = (0..700).map(|i| i * rank as i64 - 5).collect();
                    g.all_reduce_typed(&mut ys, ReduceOp::Max).await.unwrap();
                    out.push(ys.iter().flat_map(|x| x.to_le_bytes()).collect());
                    let block = vec![rank as u8 + 1; 500 * (rank + 1)];
                    for b in g.all_gather(&block).await.unwrap() {
                        out.push(b.to_vec());
                    }
                    let mut data = vec![rank as u8; 1500];
                    g.broadcast(&mut data, 2).await.unwrap();
                    out.push(data);
                    let mut red = vec![rank as u8 + 3; 900];
                    g.reduce(&mut red, ElementType::U8, ReduceOp::Product, 1)
                        .await
                        .unwrap();
                    if rank == 1 {
                        out.push(red);
                    }
                    let input: Vec<u8> = (0..600).map(|i| (i + rank) as u8).collect();
                    out.push(
                        g.reduce_scatter(&input, &[100, 300, 200], ElementType::U8, ReduceOp::Sum)
                            .await
                            .unwrap(),
                    );
                    let inputs: Vec<Bytes> = (0..world)
                        .map(|d| Bytes::from(vec![(rank * 10 + d) as u8; 100 * (d + rank + 1)]))
                        .collect();
                    let lens: Vec<usize> = (0..world).map(|s| 100 * (rank + s + 1)).collect();
                    for b in g.all_to_all(&inputs, &lens).await.unwrap() {
                        out.push(b.to_vec());
                    }
                    if let Some(blocks) = g.gather(&block, 0).await.unwrap() {
                        out.extend(blocks.iter().map(|b| b.to_vec()));
                    }
                    let blocks: Vec<Bytes> = (0..world)
                        .map(|d| Bytes::from(vec![d as u8; 300 * d]))
                        .collect();
                    out.push(g.scatter(&blocks, 0).await.unwrap().to_vec());
                    let sub = g.new_group(&[0, 2]).unwrap();
                    if let Some(sub) = sub {
                        assert_eq!(sub.uses_arena(), path == CollectivePath::Arena);
                        let mut zs = vec![rank as i32 + 1; 2000];
                        sub.all_reduce_typed(&mut zs, ReduceOp::Sum).await.unwrap();
                        out.push(zs.iter().flat_map(|x| x.to_le_bytes()).collect());
                    }
                    // Kept until every rank is done: a dropped group looks dead to the others.
                    (out, g)
                })
            })
            .collect();
        let mut results = Vec::new();
        let mut keep = Vec::new();
        for t in tasks {
            let (out, g) = t.await.unwrap();
            results.push(out);
            keep.push(g);
        }
        results
    };
    let arena = bounded(run(CollectivePath::Arena, "arena-parity")).await;
    let links = bounded(run(CollectivePath::Links, "links-parity")).await;
    assert_eq!(arena, links);
    // The sums are what they should be, not only equal.
    let expected: f32 = 999.0 * 6.0 / 3.0;
    let last = f32::from_le_bytes(arena[0][0][3996..4000].try_into().unwrap());
    assert!((last - expected).abs() < 1e-2, "{last}");
}

/// Issue 47: the arena keeps the plans of small collectives between calls; a kept plan serves
/// only the arguments it was made for. Ten kinds of call (more than the cache holds), twice
/// over, with the same byte length where the plans would be easiest to mix up: signed against
/// unsigned bytes (a byte that is -1 for one and 255 for the other), other roots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_arena_plans_serve_only_their_own_arguments() {
    let world = 3;
    let gs = bounded(groups(world, "arena-kept-plans", Duration::from_secs(20))).await;
    assert!(gs.iter().all(|g| g.uses_arena()));
    let tasks: Vec<_> = gs
        .into_iter()
        .enumerate()
        .map(|(rank, g)| {
            tokio::spawn(async move {
                // Rank 0 holds 0xFF (-1 as I8), the others their rank.
                let byte = if rank == 0 { 0xFF } else { rank as u8 };
                for round in 0..2u8 {
                    g.barrier().await.unwrap();
                    let mut max_u8 = [byte; 8];
                    g.all_reduce(&mut max_u8, ElementType::U8, ReduceOp::Max)
                        .await
                        .unwrap();
                    assert_eq!(max_u8, [0xFF; 8], "round {round}");
                    let mut max_i8 = [byte; 8];
                    g.all_reduce(&mut max_i8, ElementType::I8, ReduceOp::Max)
                        .await
                        .unwrap();
                    assert_eq!(max_i8, [2; 8], "round {round}");
                    let mut min_i8 = [byte; 8];
                    g.all_reduce(&mut min_i8, ElementType::I8, ReduceOp::Min)
                        .await
                        .unwrap();
                    assert_eq!(min_i8, [0xFF; 8], "round {round}");
                    let mut sum_i64 = (rank as i64 + 10).to_le_bytes();
                    g.all_reduce(&mut sum_i64, ElementType::I64, ReduceOp::Sum)
                        .await
                        .unwrap();
                    assert_eq!(i64::from_le_bytes(sum_i64), 33, "round {round}");
                    for root in [0, 2] {
                        let mut sum = [rank as u8 + round; 8];
                        g.reduce(&mut sum, ElementType::U8, ReduceOp::Sum, root)
                            .await
                            .unwrap();
                        if rank == root {
                            assert_eq!(sum, [3 + 3 * round; 8], "round {round}, root {root}");
                        }
                    }
                    for root in [1, 2] {
                        let mut data = [rank as u8 * 10 + round; 8];
                        g.broadcast(&mut data, root).await.unwrap();
                        assert_eq!(data, [root as u8 * 10 + round; 8], "round {round}");
                    }
                    let blocks = g.all_gather(&[rank as u8 + round; 8]).await.unwrap();
                    for (q, b) in blocks.iter().enumerate() {
                        assert_eq!(&b[..], &[q as u8 + round; 8], "round {round}");
                    }
                }
                g
            })
        })
        .collect();
    let mut keep = Vec::new();
    for t in tasks {
        keep.push(bounded(t).await.unwrap());
    }
}

/// Issue 47: ranks that disagree about a collective on the arena path are told, naming the
/// other rank (each phase carries a signature of the collective and its arguments).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_disagree_on_the_arena_path_are_told() {
    let gs = bounded(groups(2, "arena-mismatch", Duration::from_secs(20))).await;
    assert!(gs[0].uses_arena());
    let (a, b) = bounded(async {
        let mut x = vec![1.0f32; 2];
        let mut y = vec![1.0f32; 3];
        tokio::join!(
            gs[0].all_reduce_typed(&mut x, ReduceOp::Sum),
            gs[1].all_reduce_typed(&mut y, ReduceOp::Sum)
        )
    })
    .await;
    for (rank, result) in [a, b].into_iter().enumerate() {
        let e = result.unwrap_err();
        assert!(
            matches!(&e, ProcessGroupError::Mismatch { peer, .. } if *peer == 1 - rank),
            "{e}"
        );
    }
}

/// Issue 47: a broadcast's root waits for nobody, so on the arena path it finished a broadcast
/// the others disagreed about, and learnt nothing until its next collective timed out. The rank
/// that saw the disagreement now says so in the arena, and the root's next collective fails at
/// once, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broadcast_root_learns_of_a_disagreement_on_the_arena_path_at_its_next_collective() {
    // A timeout far beyond the test's bound: only the report can end the root's barrier.
    let gs = bounded(groups(3, "arena-root-told", Duration::from_secs(3600))).await;
    assert!(gs[0].uses_arena());
    let (root, one, two) = bounded(async {
        let mut a = vec![1u8; 8];
        let mut b = vec![0u8; 8];
        let mut c = vec![0u8; 12];
        let (x, y, z) = tokio::join!(
            gs[0].broadcast(&mut a, 0),
            gs[1].broadcast(&mut b, 0),
            gs[2].broadcast(&mut c, 0)
        );
        (x, y.map(|()| b), z)
    })
    .await;
    // The root published and went on; rank 1 ran what the root ran.
    root.unwrap();
    assert_eq!(one.unwrap(), vec![1u8; 8]);
    let e = two.unwrap_err();
    assert!(
        matches!(&e, ProcessGroupError::Mismatch { peer: 0, .. }),
        "{e}"
    );
    // Ranks 0 and 1 run a barrier: rank 2's report fails it on both, naming rank 2.
    let (a, b) = bounded(async { tokio::join!(gs[0].barrier(), gs[1].barrier()) }).await;
    for (rank, result) in [a, b].into_iter().enumerate() {
        let e = result.unwrap_err();
        assert!(
            matches!(&e, ProcessGroupError::PeerAborted { rank: 2, reason } if reason.contains("different collectives")),
            "rank {rank}: {e}"
        );
    }
}

/// Issue 47: an error from a subgroup's arena names a rank as the links would, not by its
/// place in the arena (the subgroup's numbering). In the subgroup of world ranks 1, 2, 3 the
/// rank that saw a disagreement is group rank 2 (arena slot 2): the abort it reports names
/// world rank 3, as an abort over the links names its sender, and as a death in the arena
/// already does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_in_a_subgroup_arena_names_the_world_rank() {
    // A timeout far beyond the test's bound: only the report can end the barrier.
    let gs = bounded(groups(4, "sub-arena-abort", Duration::from_secs(3600))).await;
    let subs: Vec<Group> = gs
        .iter()
        .filter_map(|g| g.new_group(&[1, 2, 3]).unwrap())
        .collect();
    assert_eq!(subs.len(), 3);
    assert!(subs.iter().all(|s| s.uses_arena()));
    assert_eq!(subs[2].global_rank(2), Some(3));
    // The subgroup's arena is made on its first collective.
    let (a, b, c) =
        bounded(async { tokio::join!(subs[0].barrier(), subs[1].barrier(), subs[2].barrier()) })
            .await;
    a.unwrap();
    b.unwrap();
    c.unwrap();
    let (root, one, two) = bounded(async {
        let mut a = vec![1u8; 8];
        let mut b = vec![0u8; 8];
        let mut c = vec![0u8; 12];
        let (x, y, z) = tokio::join!(
            subs[0].broadcast(&mut a, 0),
            subs[1].broadcast(&mut b, 0),
            subs[2].broadcast(&mut c, 0)
        );
        (x, y.map(|()| b), z)
    })
    .await;
    root.unwrap();
    assert_eq!(one.unwrap(), vec![1u8; 8]);
    // A disagreement names the peer in the group's ranks, as on the links.
    let e = two.unwrap_err();
    assert!(
        matches!(&e, ProcessGroupError::Mismatch { peer: 0, .. }),
        "{e}"
    );
    let (a, b) = bounded(async { tokio::join!(subs[0].barrier(), subs[1].barrier()) }).await;
    for (rank, result) in [a, b].into_iter().enumerate() {
        let e = result.unwrap_err();
        assert!(
            matches!(&e, ProcessGroupError::PeerAborted { rank: 3, reason } if reason.contains("different collectives")),
            "group rank {rank}: {e}"
        );
    }
    drop(gs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_that_does_not_decode_and_a_root_without_a_value_are_typed_errors() {
    bounded(async {
        let gs = groups(2, "object-errors", Duration::from_secs(20)).await;
        // Rank 0 sends a byte that is no `bool`: rank 1's decode of it fails naming rank 0,
        // with the codec's error as its source.
        let (zero, one) = tokio::join!(
            gs[0].all_gather_object(&7u8),
            gs[1].all_gather_object(&true)
        );
        assert_eq!(zero.unwrap(), [7, 1]);
        match one.unwrap_err() {
            ProcessGroupError::Object {
                rank: 0,
                op: "decoded",
                source,
            } => assert!(!source.to_string().is_empty()),
            other => panic!("{other}"),
        }
        // A root with nothing to send fails before the collective starts.
        let err = gs[0].broadcast_object::<u32>(None, 0).await.unwrap_err();
        assert_eq!(
            err,
            ProcessGroupError::NoRootValue {
                collective: "broadcast_object",
                root: 0
            }
        );
        let err = gs[1].scatter_object::<u32>(None, 1).await.unwrap_err();
        assert!(
            matches!(
                err,
                ProcessGroupError::NoRootValue {
                    collective: "scatter_object",
                    root: 1
                }
            ),
            "{err}"
        );
    })
    .await;
}
