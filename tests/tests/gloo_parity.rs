//! The c10d calls tensorwire adds for PyTorch users, against real PyTorch with gloo: the same
//! inputs on the same world sizes, and the results compared.
//!
//! Needs a Python with torch: `$TENSORWIRE_TORCH_PYTHON` if set, else `python3` (the CI venv
//! is `~/.cache/tensorwire-ci/torch-venv/bin/python`). Without torch the tests print why and
//! pass without checking anything; `TENSORWIRE_REQUIRE_TORCH` turns the skip into a failure.

use std::collections::BTreeMap;
use std::future::Future;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tensorwire_tests::torch_python as python;

use tensorwire_core::ports::process_group::{
    Collectives, ProcessGroup, TensorCollectives, WorkHandle,
};
use tensorwire_core::ports::store::Store;
use tensorwire_process_group::{Group, GroupOptions, InMemoryStore};
use tensorwire_transport_tcp::{ClusterSecret, TcpConfig, TcpTransport};

const LIMIT: Duration = Duration::from_secs(120);

/// Runs `scenario` on `world` gloo ranks (forked processes over `tcp://`); prints one JSON
/// object mapping each rank to what its scenario returned.
const GLOO: &str = r#"
import json, socket, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

scenario, world = sys.argv[1], int(sys.argv[2])

def recv_any(rank):
    # Every other rank sends [rank, k] for k = 0, 1 with tag 7; rank 0 receives from any source.
    if rank != 0:
        for k in range(2):
            dist.send(torch.tensor([rank, k], dtype=torch.int64), 0, tag=7)
        return None
    got = {}
    for _ in range(2 * (world - 1)):
        t = torch.zeros(2, dtype=torch.int64)
        src = dist.recv(t, tag=7)
        got.setdefault(str(src), []).append(t.tolist())
    return got

def into_tensor(rank):
    r = float(rank)
    inp = torch.tensor([[r, r + 1, r + 2], [-r, 0.5, 2 * r]])
    out = torch.full((2 * world, 3), 9.0)
    dist.all_gather_into_tensor(out, inp)
    stacked = torch.arange(6 * world, dtype=torch.float32).reshape(2 * world, 3) * (r + 1)
    mine = torch.zeros(2, 3)
    dist.reduce_scatter_tensor(mine, stacked)
    errors = []
    for f in [lambda: dist.all_gather_into_tensor(torch.zeros(2 * world - 1, 3), inp),
              lambda: dist.all_gather_into_tensor(torch.zeros(6 * world), inp),
              lambda: dist.reduce_scatter_tensor(torch.zeros(2, 3, dtype=torch.int64), stacked),
              lambda: dist.reduce_scatter_tensor(torch.zeros(3, 3), stacked)]:
        try:
            f()
            errors.append(False)
        except Exception:
            errors.append(True)
    return {"gathered": out.flatten().tolist(), "mine": mine.flatten().tolist(),
            "errors": errors}

def rooted(rank):
    root, r = world - 1, float(rank)
    t = torch.tensor([r, 1.0])
    dist.reduce(t, root)
    mine = torch.tensor([r, -r])
    lst = [torch.zeros(2) for _ in range(world)]
    dist.gather(mine, lst if rank == root else None, root)
    parts = [torch.tensor([float(i), 10.0 * i]) for i in range(world)]
    out = torch.zeros(2)
    dist.scatter(out, parts if rank == root else None, root)
    def fails(f):
        try:
            f()
            return False
        except Exception:
            return True
    wrong = fails(lambda: dist.gather(mine, lst if rank != root else None, root))
    short = fails(lambda: dist.scatter(out.clone(), parts[1:], root)) if rank == root else None
    return {"reduced": t.tolist() if rank == root else None,
            "gathered": [x.tolist() for x in lst] if rank == root else None,
            "scattered": out.tolist(), "wrong": wrong, "short": short}

def a2a(rank):
    splits = [1 + (rank + j) % 2 for j in range(world)]
    rows = sum(splits)
    inp = torch.arange(2 * rows, dtype=torch.float32).reshape(rows, 2) + 100 * rank
    out = torch.zeros(rows, 2)
    dist.all_to_all_single(out, inp, splits, splits)
    even_out = torch.zeros(world)
    dist.all_to_all_single(even_out, torch.full((world,), float(rank)))
    def fails(f):
        try:
            f()
            return False
        except Exception:
            return True
    odd = torch.zeros(world + 1)
    uneven = fails(lambda: dist.all_to_all_single(odd.clone(), odd))
    wrong = fails(lambda: dist.all_to_all_single(out.clone(), inp, splits, [1]))
    return {"out": out.flatten().tolist(), "even": even_out.tolist(), "uneven": uneven,
            "wrong": wrong}

def work(rank):
    # c10d's async_op=True on a group from new_group: issued in this order on every rank,
    # waited on afterwards.
    g = dist.new_group(list(range(world)))
    r = float(rank)
    summed = torch.tensor([r, 1.0])
    s = dist.all_reduce(summed, group=g, async_op=True)
    gathered = [torch.zeros(2) for _ in range(world)]
    a = dist.all_gather(gathered, torch.tensor([r, -r]), group=g, async_op=True)
    root = world - 1
    bcast = torch.tensor([r, 2 * r])
    b = dist.broadcast(bcast, root, group=g, async_op=True)
    bar = dist.barrier(group=g, async_op=True)
    for w in [s, a, b, bar]:
        w.wait()
    return {"sum": summed.tolist(), "gathered": [x.tolist() for x in gathered],
            "broadcast": bcast.tolist(),
            "completed": [w.is_completed() for w in [s, a, b, bar]]}

def work_all(rank):
    # Every tensor collective with async_op=True on a group from new_group, issued in this
    # order on every rank, waited on in the reverse order; then where a wrong argument raises
    # ("call": at the call, "wait": at wait, "none": nowhere).
    g = dist.new_group(list(range(world)))
    first, last, r = 0, world - 1, float(rank)
    reduced = torch.tensor([r, 1.0])
    works = [dist.reduce(reduced, last, group=g, async_op=True)]
    gathered = [torch.zeros(2) for _ in range(world)] if rank == first else None
    works.append(dist.gather(torch.tensor([r, -r]), gathered, first, group=g, async_op=True))
    parts = [torch.tensor([float(i), 10.0 * i]) for i in range(world)]
    scattered = torch.zeros(2)
    works.append(dist.scatter(scattered, parts if rank == last else None, last, group=g,
                              async_op=True))
    splits = [1 + (rank + j) % 2 for j in range(world)]
    rows = sum(splits)
    single = torch.zeros(rows, 2)
    inp = torch.arange(2 * rows, dtype=torch.float32).reshape(rows, 2) + 100 * rank
    works.append(dist.all_to_all_single(single, inp, splits, splits, group=g, async_op=True))
    listed = [torch.zeros(1) for _ in range(world)]
    works.append(dist.all_to_all(listed, [torch.tensor([100.0 * rank + j]) for j in range(world)],
                                 group=g, async_op=True))
    into = torch.zeros(2 * world)
    works.append(dist.all_gather_into_tensor(into, torch.tensor([r, r + 0.5]), group=g,
                                             async_op=True))
    mine = torch.zeros(2)
    stacked = torch.arange(2 * world, dtype=torch.float32) * (r + 1)
    works.append(dist.reduce_scatter_tensor(mine, stacked, group=g, async_op=True))
    for w in reversed(works):
        w.wait()
    def raises(f):
        try:
            w = f()
        except Exception:
            return "call"
        try:
            w.wait()
            return "none"
        except Exception:
            return "wait"
    z = lambda *shape: torch.zeros(*shape)
    wrong = {
        "reduce_root": raises(lambda: dist.reduce(z(2), world, group=g, async_op=True)),
        "gather_list": raises(lambda: dist.gather(z(2), [z(2)] * world if rank != first else None,
                                                  first, group=g, async_op=True)),
        "scatter_short": raises(lambda: dist.scatter(z(2), parts[1:], last, group=g,
                                                     async_op=True)) if rank == last else None,
        "single_uneven": raises(lambda: dist.all_to_all_single(z(world + 1), z(world + 1),
                                                               group=g, async_op=True)),
        "single_splits": raises(lambda: dist.all_to_all_single(z(rows, 2), inp, splits, [1],
                                                               group=g, async_op=True)),
        "list_short": raises(lambda: dist.all_to_all(listed[1:], [z(1)] * world, group=g,
                                                     async_op=True)),
        "into_size": raises(lambda: dist.all_gather_into_tensor(z(2 * world - 1), z(2), group=g,
                                                                async_op=True)),
        "scatter_type": raises(lambda: dist.reduce_scatter_tensor(
            torch.zeros(2, dtype=torch.int64), stacked, group=g, async_op=True)),
    }
    return {"reduced": reduced.tolist() if rank == last else None,
            "gathered": [x.tolist() for x in gathered] if rank == first else None,
            "scattered": scattered.tolist(), "single": single.flatten().tolist(),
            "listed": [x.tolist() for x in listed], "into": into.tolist(),
            "mine": mine.tolist(), "wrong": wrong}

def p2p(rank):
    # isend/irecv of tensors: two receives from the left issued before two sends to the
    # right, waited in the reverse order; rank 0 receives from any source (irecv, src=None);
    # where a send to this rank itself raises.
    left, right = (rank - 1) % world, (rank + 1) % world
    first, second = torch.zeros(2), torch.zeros(2)
    works = [dist.irecv(first, left, tag=5), dist.irecv(second, left, tag=5)]
    works += [dist.isend(torch.tensor([float(rank), float(k)]), right, tag=5) for k in range(2)]
    for w in reversed(works):
        w.wait()
    got = None
    if rank == 0:
        got = {}
        for _ in range(world - 1):
            t = torch.zeros(1)
            w = dist.irecv(t, tag=8)
            w.wait()
            got[str(w.source_rank())] = t.tolist()
    else:
        dist.isend(torch.tensor([10.0 * rank]), 0, tag=8).wait()
    try:
        dist.isend(torch.zeros(1), rank, tag=6)
        self_send = "none"
    except Exception:
        self_send = "call"
    return {"first": first.tolist(), "second": second.tolist(), "any": got,
            "self_send": self_send}

def run(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        out = globals()[scenario](rank)
    except Exception as e:
        out = {"error": type(e).__name__ + ": " + str(e)}
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=100) for _ in range(world))
    for p in procs:
        p.join(timeout=100)
    print(json.dumps({str(r): results[r] for r in range(world)}))
"#;

/// gloo's results of `scenario` on `world` ranks.
async fn gloo(scenario: &str, world: usize) -> serde_json::Value {
    let out = tokio::time::timeout(
        LIMIT,
        tokio::process::Command::new(python())
            .env("PYTHONWARNINGS", "ignore")
            .args(["-c", GLOO, scenario, &world.to_string()])
            .stderr(Stdio::inherit())
            .output(),
    )
    .await
    .expect("gloo finished in time")
    .expect("python runs");
    assert!(
        out.status.success(),
        "gloo {scenario} w{world}: {}",
        out.status
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("gloo printed {text:?}: {e}"))
}

/// `world` ranks of our group over loopback TCP, in this process.
async fn groups(world: usize, name: &str) -> Vec<Group> {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let secret = ClusterSecret::new(b"gloo parity secret".to_vec()).unwrap();
    let transport = Arc::new(TcpTransport::new(TcpConfig::new(secret)).unwrap());
    let mut tasks = Vec::new();
    for rank in 0..world {
        let (store, transport) = (store.clone(), transport.clone());
        let options = GroupOptions::new(name).with_timeout(Duration::from_secs(30));
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

/// For world sizes 2, 3 and 4: runs gloo's `scenario`, then `ours(group, world)` on every
/// rank of our group at once, and asserts that each rank's result equals gloo's.
async fn matches_gloo<F, Fut>(scenario: &str, ours: F)
where
    F: Fn(Group, usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = serde_json::Value> + Send + 'static,
{
    for world in [2usize, 3, 4] {
        let theirs = gloo(scenario, world).await;
        let gs = groups(world, &format!("{scenario}{world}")).await;
        let tasks: Vec<_> = gs
            .iter()
            .map(|g| tokio::spawn(ours.clone()(g.clone(), world)))
            .collect();
        let results = tokio::time::timeout(LIMIT, async {
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        })
        .await
        .expect("ours finished in time");
        for (rank, ours) in results.iter().enumerate() {
            assert_eq!(
                ours,
                &theirs[rank.to_string()],
                "{scenario}: world {world} rank {rank}"
            );
        }
    }
}

fn i64s(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `recv` from any source: per sender, the same messages in the same order as gloo's
/// `dist.recv(t, src=None)`, which returns the sender.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_from_any_source_matches_gloo() {
    tensorwire_tests::require_torch!("gloo parity test");
    matches_gloo("recv_any", |g, world| async move {
        let rank = g.rank();
        let mut got: BTreeMap<String, Vec<Vec<i64>>> = BTreeMap::new();
        if rank != 0 {
            for k in 0..2i64 {
                let bytes: Vec<u8> = [rank as i64, k]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                g.send(&bytes, 0, 7).await.unwrap();
            }
        } else {
            for _ in 0..2 * (world - 1) {
                let (src, bytes) = g.recv_any(7).await.unwrap();
                got.entry(src.to_string()).or_default().push(i64s(&bytes));
            }
        }
        g.barrier().await.unwrap();
        if rank == 0 {
            serde_json::to_value(&got).unwrap()
        } else {
            serde_json::Value::Null
        }
    })
    .await;
}

/// `all_gather_into_tensor` and `reduce_scatter_tensor` into the caller's output: the same
/// values as gloo, and an error wherever gloo raises one for a wrong size or type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn into_tensor_collectives_match_gloo() {
    use tensorwire_core::collective::ReduceOp;
    use tensorwire_core::tensor::{DType, Storage, Tensor};
    tensorwire_tests::require_torch!("gloo parity test");
    matches_gloo("into_tensor", |g, world| async move {
        let r = g.rank() as f32;
        let input = Tensor::from_f32(vec![2, 3], &[r, r + 1.0, r + 2.0, -r, 0.5, 2.0 * r]).unwrap();
        let mut out = Tensor::from_f32(vec![2 * world, 3], &vec![9.0; 6 * world]).unwrap();
        g.all_gather_into_tensor(&mut out, &input).await.unwrap();
        let values: Vec<f32> = (0..6 * world).map(|i| i as f32 * (r + 1.0)).collect();
        let stacked = Tensor::from_f32(vec![2 * world, 3], &values).unwrap();
        let mut mine = Tensor::from_f32(vec![2, 3], &[0.0; 6]).unwrap();
        g.reduce_scatter_tensor(&mut mine, &stacked, ReduceOp::Sum)
            .await
            .unwrap();
        let zeros = |shape: Vec<usize>| {
            let n: usize = shape.iter().product();
            Tensor::from_f32(shape, &vec![0.0; n]).unwrap()
        };
        let mut ints = Tensor::new(
            DType::I64,
            vec![2, 3],
            Storage::Host(bytes::Bytes::from(vec![0u8; 48])),
        )
        .unwrap();
        let errors = vec![
            g.all_gather_into_tensor(&mut zeros(vec![2 * world - 1, 3]), &input)
                .await
                .is_err(),
            g.all_gather_into_tensor(&mut zeros(vec![6 * world]), &input)
                .await
                .is_err(),
            g.reduce_scatter_tensor(&mut ints, &stacked, ReduceOp::Sum)
                .await
                .is_err(),
            g.reduce_scatter_tensor(&mut zeros(vec![3, 3]), &stacked, ReduceOp::Sum)
                .await
                .is_err(),
        ];
        g.barrier().await.unwrap();
        serde_json::json!({
            "gathered": out.to_f32_vec().unwrap(),
            "mine": mine.to_f32_vec().unwrap(),
            "errors": errors,
        })
    })
    .await;
}

/// The tensor forms of reduce, gather and scatter: gloo's values on the root and every rank,
/// and an error wherever gloo raises one for a list given or missing, or too short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooted_tensor_collectives_match_gloo() {
    use tensorwire_core::collective::ReduceOp;
    use tensorwire_core::tensor::Tensor;
    tensorwire_tests::require_torch!("gloo parity test");
    matches_gloo("rooted", |g, world| async move {
        let root = world - 1;
        let r = g.rank() as f32;
        let on_root = g.rank() == root;
        let mut t = Tensor::from_f32(vec![2], &[r, 1.0]).unwrap();
        g.reduce_tensor(&mut t, ReduceOp::Sum, root).await.unwrap();
        let mine = Tensor::from_f32(vec![2], &[r, -r]).unwrap();
        let mut list: Vec<Tensor> = (0..world)
            .map(|_| Tensor::from_f32(vec![2], &[0.0; 2]).unwrap())
            .collect();
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
        let wrong = g
            .gather_tensor(&mine, (!on_root).then_some(&mut list[..]), root)
            .await
            .is_err();
        let short = if on_root {
            Some(
                g.scatter_tensor(&mut out.clone(), Some(&parts[1..]), root)
                    .await
                    .is_err(),
            )
        } else {
            None
        };
        g.barrier().await.unwrap();
        let gathered: Vec<Vec<f32>> = list.iter().map(|t| t.to_f32_vec().unwrap()).collect();
        serde_json::json!({
            "reduced": on_root.then(|| t.to_f32_vec().unwrap()),
            "gathered": on_root.then_some(gathered),
            "scattered": out.to_f32_vec().unwrap(),
            "wrong": wrong,
            "short": short,
        })
    })
    .await;
}

/// The tensor form of all_to_all_single: gloo's rows with uneven and even splits, and an
/// error wherever gloo raises one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_single_tensor_matches_gloo() {
    use tensorwire_core::tensor::Tensor;
    tensorwire_tests::require_torch!("gloo parity test");
    matches_gloo("a2a", |g, world| async move {
        let r = g.rank();
        let splits: Vec<usize> = (0..world).map(|j| 1 + (r + j) % 2).collect();
        let rows: usize = splits.iter().sum();
        let values: Vec<f32> = (0..2 * rows).map(|i| (100 * r + i) as f32).collect();
        let input = Tensor::from_f32(vec![rows, 2], &values).unwrap();
        let mut out = Tensor::from_f32(vec![rows, 2], &vec![0.0; 2 * rows]).unwrap();
        g.all_to_all_single_tensor(&mut out, &input, Some(&splits), Some(&splits))
            .await
            .unwrap();
        let even_in = Tensor::from_f32(vec![world], &vec![r as f32; world]).unwrap();
        let mut even = Tensor::from_f32(vec![world], &vec![0.0; world]).unwrap();
        g.all_to_all_single_tensor(&mut even, &even_in, None, None)
            .await
            .unwrap();
        let odd = Tensor::from_f32(vec![world + 1], &vec![0.0; world + 1]).unwrap();
        let uneven = g
            .all_to_all_single_tensor(&mut odd.clone(), &odd, None, None)
            .await
            .is_err();
        let wrong = g
            .all_to_all_single_tensor(&mut out.clone(), &input, Some(&splits), Some(&[1]))
            .await
            .is_err();
        g.barrier().await.unwrap();
        serde_json::json!({
            "out": out.to_f32_vec().unwrap(),
            "even": even.to_f32_vec().unwrap(),
            "uneven": uneven,
            "wrong": wrong,
        })
    })
    .await;
}

/// Work handles (c10d's `async_op=True`) on the `dyn ProcessGroup` a user gets from
/// `new_group`: all_reduce, all_gather, broadcast and barrier issued in order before any is
/// waited on give gloo's values, and every handle reads completed once waited on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_handles_on_a_new_group_match_gloo() {
    use tensorwire_core::collective::ReduceOp;
    use tensorwire_core::tensor::Tensor;
    tensorwire_tests::require_torch!("gloo parity test");
    let wait = Duration::from_secs(30);
    matches_gloo("work", move |g, world| async move {
        let r = g.rank() as f32;
        let world_pg: Arc<dyn ProcessGroup> = Arc::new(g.clone());
        let sub = world_pg
            .new_group(&(0..world).collect::<Vec<_>>())
            .unwrap()
            .expect("every rank is a member");
        let mut s = sub
            .issue_all_reduce_tensor(Tensor::from_f32(vec![2], &[r, 1.0]).unwrap(), ReduceOp::Sum);
        let mut a = sub.issue_all_gather_tensor(Tensor::from_f32(vec![2], &[r, -r]).unwrap());
        let mut b = sub
            .issue_broadcast_tensor(Tensor::from_f32(vec![2], &[r, 2.0 * r]).unwrap(), world - 1);
        let mut bar = sub.issue_barrier();
        // They finish without being waited on (gloo's is_completed after wait is true; ours
        // turns true on its own), then each gives its result.
        let mut completed = Vec::new();
        for _ in 0..100_000 {
            if s.is_completed() && a.is_completed() && b.is_completed() && bar.is_completed() {
                break;
            }
            tokio::task::yield_now().await;
        }
        completed.extend([
            s.is_completed() && s.error().is_none(),
            a.is_completed() && a.error().is_none(),
            b.is_completed() && b.error().is_none(),
            bar.is_completed() && bar.error().is_none(),
        ]);
        let summed = s.wait(wait).await.unwrap();
        let gathered = a.wait(wait).await.unwrap();
        let bcast = b.wait(wait).await.unwrap();
        bar.wait(wait).await.unwrap();
        drop(sub);
        g.barrier().await.unwrap();
        serde_json::json!({
            "sum": summed.to_f32_vec().unwrap(),
            "gathered": gathered
                .iter()
                .map(|t| t.to_f32_vec().unwrap())
                .collect::<Vec<_>>(),
            "broadcast": bcast.to_f32_vec().unwrap(),
            "completed": completed,
        })
    })
    .await;
}

/// Where a handle's wrong argument shows, as gloo's `raises` in `work_all` reads it: `"call"`
/// when the handle has already finished with an error when it is returned (c10d raises in
/// the call), `"wait"` when its `wait` fails, `"none"` when it succeeds.
async fn raises<'a, T: Send + 'a>(mut work: Box<dyn WorkHandle<'a, T> + 'a>) -> &'static str {
    if work.is_completed() && work.error().is_some() {
        return "call";
    }
    match work.wait(Duration::from_secs(30)).await {
        Ok(_) => "none",
        Err(_) => "wait",
    }
}

/// The work handles of every other tensor collective (reduce, gather, scatter,
/// all_to_all_single, all_to_all, all_gather_into_tensor, reduce_scatter_tensor) on the `dyn
/// ProcessGroup` of `new_group`, issued in one order before any is waited on and waited in
/// the reverse order, give gloo's values; and a wrong argument is refused where gloo raises
/// it: in the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tensor_work_handle_matches_gloo() {
    use tensorwire_core::collective::ReduceOp;
    use tensorwire_core::tensor::{DType, Storage, Tensor};
    tensorwire_tests::require_torch!("gloo parity test");
    let wait = Duration::from_secs(30);
    matches_gloo("work_all", move |g, world| async move {
        let f32s = |shape: Vec<usize>, values: &[f32]| Tensor::from_f32(shape, values).unwrap();
        let z = |n: usize| f32s(vec![n], &vec![0.0; n]);
        let rank = g.rank();
        let (first, last, r) = (0, world - 1, rank as f32);
        let world_pg: Arc<dyn ProcessGroup> = Arc::new(g.clone());
        let sub = world_pg
            .new_group(&(0..world).collect::<Vec<_>>())
            .unwrap()
            .expect("every rank is a member");
        let reduced = sub.issue_reduce_tensor(f32s(vec![2], &[r, 1.0]), ReduceOp::Sum, last);
        let gathered = sub.issue_gather_tensor(
            f32s(vec![2], &[r, -r]),
            (rank == first).then(|| (0..world).map(|_| z(2)).collect()),
            first,
        );
        let parts: Vec<Tensor> = (0..world)
            .map(|i| f32s(vec![2], &[i as f32, 10.0 * i as f32]))
            .collect();
        let scattered = sub.issue_scatter_tensor(z(2), (rank == last).then(|| parts.clone()), last);
        let splits: Vec<usize> = (0..world).map(|j| 1 + (rank + j) % 2).collect();
        let rows: usize = splits.iter().sum();
        let values: Vec<f32> = (0..2 * rows).map(|i| (100 * rank + i) as f32).collect();
        let input = f32s(vec![rows, 2], &values);
        let single = sub.issue_all_to_all_single_tensor(
            f32s(vec![rows, 2], &vec![0.0; 2 * rows]),
            input.clone(),
            Some(splits.clone()),
            Some(splits.clone()),
        );
        let listed = sub.issue_all_to_all_tensor(
            (0..world).map(|_| z(1)).collect(),
            (0..world)
                .map(|j| f32s(vec![1], &[(100 * rank + j) as f32]))
                .collect(),
        );
        let into = sub.issue_all_gather_into_tensor(z(2 * world), f32s(vec![2], &[r, r + 0.5]));
        let stacked: Vec<f32> = (0..2 * world).map(|k| k as f32 * (r + 1.0)).collect();
        let stacked = f32s(vec![2 * world], &stacked);
        let mine = sub.issue_reduce_scatter_tensor(z(2), stacked.clone(), ReduceOp::Sum);
        // Waited in the reverse of the issue order, as gloo's are.
        let v = |t: Tensor| t.to_f32_vec().unwrap();
        let vs = |l: Vec<Tensor>| l.into_iter().map(v).collect::<Vec<_>>();
        let mine = v(mine.wait(wait).await.unwrap());
        let into = v(into.wait(wait).await.unwrap());
        let listed = vs(listed.wait(wait).await.unwrap());
        let single = v(single.wait(wait).await.unwrap());
        let scattered = v(scattered.wait(wait).await.unwrap());
        let gathered = gathered.wait(wait).await.unwrap().map(vs);
        let reduced = v(reduced.wait(wait).await.unwrap());

        let ints = Tensor::new(
            DType::I64,
            vec![2],
            Storage::Host(bytes::Bytes::from(vec![0u8; 16])),
        )
        .unwrap();
        let wrong = serde_json::json!({
            "reduce_root": raises(sub.issue_reduce_tensor(z(2), ReduceOp::Sum, world)).await,
            "gather_list": raises(sub.issue_gather_tensor(
                z(2),
                (rank != first).then(|| vec![z(2); world]),
                first,
            ))
            .await,
            "scatter_short": if rank == last {
                Some(raises(sub.issue_scatter_tensor(z(2), Some(parts[1..].to_vec()), last)).await)
            } else {
                None
            },
            "single_uneven": raises(sub.issue_all_to_all_single_tensor(
                z(world + 1),
                z(world + 1),
                None,
                None,
            ))
            .await,
            "single_splits": raises(sub.issue_all_to_all_single_tensor(
                f32s(vec![rows, 2], &vec![0.0; 2 * rows]),
                input,
                Some(splits),
                Some(vec![1]),
            ))
            .await,
            "list_short": raises(sub.issue_all_to_all_tensor(
                vec![z(1); world - 1],
                vec![z(1); world],
            ))
            .await,
            "into_size": raises(sub.issue_all_gather_into_tensor(z(2 * world - 1), z(2))).await,
            "scatter_type": raises(sub.issue_reduce_scatter_tensor(ints, stacked, ReduceOp::Sum))
                .await,
        });
        drop(sub);
        g.barrier().await.unwrap();
        serde_json::json!({
            "reduced": (rank == last).then_some(reduced),
            "gathered": gathered,
            "scattered": scattered,
            "single": single,
            "listed": listed,
            "into": into,
            "mine": mine,
            "wrong": wrong,
        })
    })
    .await;
}

/// The point-to-point work handles (c10d's `isend`/`irecv` of tensors): two receives from
/// the left neighbour issued before two sends to the right, waited in the reverse order, get
/// gloo's messages in gloo's order; rank 0's receives from any source name gloo's senders;
/// a send to this rank itself is refused in the call, where gloo raises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point_to_point_work_handles_match_gloo() {
    use tensorwire_core::tensor::Tensor;
    tensorwire_tests::require_torch!("gloo parity test");
    let wait = Duration::from_secs(30);
    matches_gloo("p2p", move |g, world| async move {
        let f32s = |values: &[f32]| Tensor::from_f32(vec![values.len()], values).unwrap();
        let v = |t: Tensor| t.to_f32_vec().unwrap();
        let rank = g.rank();
        let (left, right) = ((rank + world - 1) % world, (rank + 1) % world);
        let pg: Arc<dyn ProcessGroup> = Arc::new(g.clone());
        let first = pg.issue_recv_tensor(f32s(&[0.0; 2]), left, 5);
        let second = pg.issue_recv_tensor(f32s(&[0.0; 2]), left, 5);
        let sends: Vec<_> = (0..2)
            .map(|k| pg.issue_send_tensor(f32s(&[rank as f32, k as f32]), right, 5))
            .collect();
        for s in sends.into_iter().rev() {
            s.wait(wait).await.unwrap();
        }
        let second = v(second.wait(wait).await.unwrap());
        let first = v(first.wait(wait).await.unwrap());
        let any = if rank == 0 {
            let mut got = BTreeMap::new();
            for _ in 1..world {
                let (src, t) = pg
                    .issue_recv_any_tensor(f32s(&[0.0]), 8)
                    .wait(wait)
                    .await
                    .unwrap();
                got.insert(src.to_string(), v(t));
            }
            Some(got)
        } else {
            pg.issue_send_tensor(f32s(&[10.0 * rank as f32]), 0, 8)
                .wait(wait)
                .await
                .unwrap();
            None
        };
        let self_send = raises(pg.issue_send_tensor(f32s(&[0.0]), rank, 6)).await;
        drop(pg);
        g.barrier().await.unwrap();
        serde_json::json!({
            "first": first,
            "second": second,
            "any": any,
            "self_send": self_send,
        })
    })
    .await;
}
