//! A process-group worker for the multi-process tests: one rank of an `env://` group.
//!
//! Usage: `tw-pg-worker check|kill` with `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`
//! and `TENSORWIRE_SECRET` set; `TW_TIMEOUT_MS` bounds every collective (default 20 000).
//! Rank 0 with `MASTER_PORT=0` serves the store on a free port and prints `PORT <port>` first.
//!
//! - `check`: runs barrier, all_gather (variable sizes), all_gather_object, broadcast and
//!   all_reduce (every op, every element type, small and large) and checks every result;
//!   prints `OK rank R` and exits 0, or prints `ERROR: ...` on stderr and exits 1.
//! - `nccl` (feature `nccl`): a group of the `nccl` backend on `TW_DEVICE` (default
//!   `cuda:RANK`): barrier, tensor all_reduce / all_gather / broadcast on the device, the byte
//!   collectives staged through it, and the typed errors (a CPU tensor, a bfloat16 reduction,
//!   use after shutdown); prints `OK nccl rank R`. When `new_group` fails it prints
//!   `SETUP-ERROR: ...` and exits 4 (what a machine without a GPU or NCCL does).
//! - `inflight`: issues `TW_INFLIGHT` (default 1000) all_gathers of `TW_ELEMS` (default 64)
//!   f32 elements per rank, every one first polled in the same order on every rank before any
//!   has finished, then checks that each returned its own blocks; prints `OK inflight rank R`,
//!   or `ERROR: N of M all_gathers returned other calls' blocks` and exits 1.
//! - `ops`: every element type with the ops gloo allows on it (and two it refuses), reduce,
//!   reduce_scatter (one tensor and blocks), gather and scatter (bytes and objects),
//!   all_to_all and all_to_all_single with uneven splits, send/recv with tags, isend/irecv
//!   and a monitored barrier, each checked against known values; prints `OK ops rank R`.
//! - `monitored`: the ranks in `TW_ABSENT` print `READY rank R` and stay away; the others run
//!   a monitored barrier (`TW_WAIT_ALL`, `TW_MB_MS`) and print its error on stderr; rank 0
//!   then exits (3 on an error), the others stay until ended.
//! - `groups` (world 4): a concrete [`Group`] and its subgroups: `new_group([3, 1])` (rank
//!   translation both ways on members, `None` on the non-members 0 and 2, refused bad rank
//!   lists), then rounds of an all_reduce on that subgroup while the world group runs a
//!   barrier and an all_reduce of the same shape, and `split_group([[0, 1], [2, 3]])` whose
//!   halves all_reduce at the same time; prints `OK groups rank R`.
//! - `work` (world 4): collectives issued as `Work` handles and never polled by rank 0 until
//!   every other rank has waited all of them out (so they progress on their own), then waited
//!   out of order; `is_completed()` turns true on rank 0 without polling; then a barrier rank
//!   3 never joins, whose `wait(300 ms)` times out on rank 0 naming rank 3 (printed as
//!   `TIMEOUT ...`) and breaks the group there; prints `OK work rank R`.
//! - `kill`: sets up, runs one barrier, prints `READY rank R`; rank `TW_VICTIM` then waits
//!   (to be killed; it ends when its stdin closes), the others run another barrier and report its error (exit 3), or exit 0
//!   if it unexpectedly succeeds.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_core::collective::{ElementType, ReduceOp};
use tensorwire_core::device::Device;
use tensorwire_core::ports::process_group::{Collectives, ProcessGroup, ProcessGroupError};
use tensorwire_core::ports::store::Store;
use tensorwire_process_group::{new_group, CollectivesExt, Group, GroupOptions};
use tensorwire_rendezvous::env_init::env_rendezvous;
use tensorwire_transport_tcp::{TcpConfig, TcpTransport};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn block(rank: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (rank * 13 + i * 3) as u8).collect()
}

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), Error> {
    if ok {
        Ok(())
    } else {
        Err(what().into())
    }
}

async fn check(pg: &dyn ProcessGroup) -> Result<(), Error> {
    let (rank, world) = (pg.rank(), pg.size());
    let t0 = Instant::now();
    let trace = |what: &str| {
        if std::env::var_os("TW_TRACE").is_some() {
            eprintln!("rank {rank}: {what} done at {:?}", t0.elapsed());
        }
    };
    pg.barrier().await?;

    let gathered = pg.all_gather(&block(rank, rank * 100 + 1)).await?;
    ensure(gathered.len() == world, || "all_gather: wrong count".into())?;
    for (peer, b) in gathered.iter().enumerate() {
        ensure(b[..] == block(peer, peer * 100 + 1)[..], || {
            format!("all_gather: block of rank {peer} is wrong")
        })?;
    }
    // Large enough in total for the ring (1.6 MB), small enough for 32 debug builds on 2 cores.
    let big_len = (1_600_000 / world).max(50_000);
    let big = pg.all_gather(&block(rank, big_len)).await?;
    for (peer, b) in big.iter().enumerate() {
        ensure(b[..] == block(peer, big_len)[..], || {
            format!("large all_gather: block of rank {peer} is wrong")
        })?;
    }

    trace("all_gather");
    let names: Vec<String> = pg.all_gather_object(&format!("worker{rank}")).await?;
    ensure(
        names == (0..world).map(|r| format!("worker{r}")).collect::<Vec<_>>(),
        || format!("all_gather_object: got {names:?}"),
    )?;

    trace("all_gather_object");
    let root = world - 1;
    for len in [1000usize, 300_000] {
        let mut data = if rank == root {
            block(root, len)
        } else {
            vec![0; len]
        };
        pg.broadcast(&mut data, root).await?;
        ensure(data == block(root, len), || {
            format!("broadcast of {len} bytes from {root}: wrong data")
        })?;
    }

    trace("broadcast");
    // 40 000 eight-byte elements (320 KB) take the ring from three ranks up.
    for count in [5usize, 40_000] {
        let value = |i: usize| ((i % 3) + rank + 1) as i64;
        // Values depend on i % 3 only: fold the three residues once (the check must stay
        // cheap next to the collective, 32 debug processes share two cores).
        let folded = |op: ReduceOp| -> [i64; 3] {
            std::array::from_fn(|m| {
                let vals = (0..world).map(|r| (m + r + 1) as i64);
                match op {
                    ReduceOp::Sum => vals.sum::<i64>(),
                    ReduceOp::Product => vals.fold(1i64, |a, b| a.wrapping_mul(b)),
                    ReduceOp::Min => vals.min().unwrap_or(0),
                    ReduceOp::Max => vals.max().unwrap_or(0),
                    ReduceOp::BAnd => vals.fold(-1i64, |a, b| a & b),
                    ReduceOp::BOr => vals.fold(0i64, |a, b| a | b),
                    ReduceOp::BXor => vals.fold(0i64, |a, b| a ^ b),
                    // Not defined on integers (gloo refuses it): never asked for.
                    ReduceOp::Avg => 0,
                }
            })
        };
        let table: Vec<[i64; 3]> = ReduceOp::ALL.iter().map(|op| folded(*op)).collect();
        let fold = |i: usize, op: ReduceOp| {
            let k = ReduceOp::ALL.iter().position(|o| *o == op).unwrap_or(0);
            table[k][i % 3]
        };
        for op in ReduceOp::ALL
            .into_iter()
            .filter(|op| op.supports(ElementType::I64))
        {
            let mut a: Vec<i64> = (0..count).map(value).collect();
            pg.all_reduce_typed(&mut a, op).await?;
            ensure(a.iter().enumerate().all(|(i, x)| *x == fold(i, op)), || {
                format!("all_reduce {op} i64 x{count}: wrong result")
            })?;
        }
        // Float and 32-bit types with ops whose results are exact.
        let mut b: Vec<f64> = (0..count).map(|i| value(i) as f64).collect();
        pg.all_reduce_typed(&mut b, ReduceOp::Sum).await?;
        ensure(
            b.iter()
                .enumerate()
                .all(|(i, x)| *x == fold(i, ReduceOp::Sum) as f64),
            || format!("all_reduce sum f64 x{count}: wrong result"),
        )?;
        let mut c: Vec<f32> = (0..count).map(|i| value(i) as f32).collect();
        pg.all_reduce_typed(&mut c, ReduceOp::Max).await?;
        ensure(
            c.iter()
                .enumerate()
                .all(|(i, x)| *x == fold(i, ReduceOp::Max) as f32),
            || format!("all_reduce max f32 x{count}: wrong result"),
        )?;
        let mut d: Vec<i32> = (0..count).map(|i| value(i) as i32).collect();
        pg.all_reduce_typed(&mut d, ReduceOp::Min).await?;
        ensure(
            d.iter()
                .enumerate()
                .all(|(i, x)| *x as i64 == fold(i, ReduceOp::Min)),
            || format!("all_reduce min i32 x{count}: wrong result"),
        )?;
        trace(&format!("all_reduce x{count}"));
    }
    pg.barrier().await?;
    Ok(())
}

/// Call `call`'s block on `rank`: `elems` f32 values no other (call, rank) shares.
fn call_block(call: usize, rank: usize, elems: usize) -> Vec<u8> {
    (0..elems)
        .flat_map(|i| ((call * 64 + rank) as f32 + i as f32 * 1e-3).to_le_bytes())
        .collect()
}

type Pending<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Polls every future until all are done, each first polled in index order: the issue order
/// the group sees, the same on every rank.
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
    out.into_iter().flatten().collect()
}

async fn inflight(pg: &dyn ProcessGroup) -> Result<(), Error> {
    let (rank, world) = (pg.rank(), pg.size());
    let n = env_usize("TW_INFLIGHT", 1000);
    let elems = env_usize("TW_ELEMS", 64);
    let inputs: Vec<Vec<u8>> = (0..n).map(|i| call_block(i, rank, elems)).collect();
    pg.barrier().await?;
    let futures: Vec<Pending<'_, Result<Vec<bytes::Bytes>, ProcessGroupError>>> = inputs
        .iter()
        .map(|input| Box::pin(pg.all_gather(input)) as Pending<'_, _>)
        .collect();
    let results = join_in_order(futures).await;
    let mut wrong = 0;
    for (i, result) in results.into_iter().enumerate() {
        let blocks = result?;
        let ok = blocks.len() == world
            && blocks
                .iter()
                .enumerate()
                .all(|(peer, b)| b[..] == call_block(i, peer, elems)[..]);
        if !ok {
            wrong += 1;
        }
    }
    ensure(wrong == 0, || {
        format!("{wrong} of {n} all_gathers returned other calls' blocks")
    })?;
    pg.barrier().await?;
    Ok(())
}

/// Issue 20, items 3 and 4: every element type with the ops gloo allows on it, and every
/// operation of the port, against values computed here independently.
async fn ops(pg: &dyn ProcessGroup) -> Result<(), Error> {
    use half::{bf16, f16};
    let (rank, world) = (pg.rank(), pg.size());
    let w = world as i64;
    let tri = w * (w - 1) / 2;

    // --- types and ops of all_reduce
    let mut a = [f16::from_f32(rank as f32 + 1.0), f16::from_f32(0.5)];
    pg.all_reduce_typed(&mut a, ReduceOp::Sum).await?;
    ensure(
        a == [
            f16::from_f32((tri + w) as f32),
            f16::from_f32(0.5 * w as f32),
        ],
        || format!("f16 sum: {a:?}"),
    )?;
    let mut a = [f16::from_f32(rank as f32 + 1.0)];
    pg.all_reduce_typed(&mut a, ReduceOp::Avg).await?;
    ensure(a == [f16::from_f32((w + 1) as f32 / 2.0)], || {
        format!("f16 avg: {a:?}")
    })?;
    let mut b = [bf16::from_f32(rank as f32), bf16::from_f32(-(rank as f32))];
    pg.all_reduce_typed(&mut b, ReduceOp::Max).await?;
    ensure(
        b == [bf16::from_f32((w - 1) as f32), bf16::from_f32(0.0)],
        || format!("bf16 max: {b:?}"),
    )?;
    let mut b = [bf16::from_f32(rank as f32 + 1.0)];
    pg.all_reduce_typed(&mut b, ReduceOp::Avg).await?;
    ensure(b == [bf16::from_f32((w + 1) as f32 / 2.0)], || {
        format!("bf16 avg: {b:?}")
    })?;
    let mut c = [2.0 * rank as f32];
    pg.all_reduce_typed(&mut c, ReduceOp::Avg).await?;
    ensure(c == [(w - 1) as f32], || format!("f32 avg: {c:?}"))?;
    let mut u = [200u8, rank as u8];
    pg.all_reduce_typed(&mut u, ReduceOp::Sum).await?;
    ensure(u == [(200 * w) as u8, tri as u8], || {
        format!("u8 sum: {u:?}")
    })?;
    let all_bits = ((1u32 << world) - 1) as u8;
    let mut u = [1u8 << rank];
    pg.all_reduce_typed(&mut u, ReduceOp::BOr).await?;
    ensure(u == [all_bits], || format!("u8 bor: {u:?}"))?;
    let mut u = [0xffu8 ^ (1 << rank)];
    pg.all_reduce_typed(&mut u, ReduceOp::BAnd).await?;
    ensure(u == [0xff ^ all_bits], || format!("u8 band: {u:?}"))?;
    let mut u = [rank as u8 + 1];
    pg.all_reduce_typed(&mut u, ReduceOp::BXor).await?;
    let xor = (1..=world as u8).fold(0, |a, b| a ^ b);
    ensure(u == [xor], || format!("u8 bxor: {u:?}"))?;
    let mut i = [-(rank as i8), -1, 100];
    pg.all_reduce_typed(&mut i, ReduceOp::Min).await?;
    ensure(i == [-(w as i8 - 1), -1, 100], || format!("i8 min: {i:?}"))?;
    let mut i = [-1i8, 100];
    pg.all_reduce_typed(&mut i, ReduceOp::Product).await?;
    let sign = if world % 2 == 0 { 1 } else { -1 };
    ensure(i[0] == sign, || format!("i8 product: {i:?}"))?;
    let mut i = [100i8];
    pg.all_reduce_typed(&mut i, ReduceOp::Sum).await?;
    ensure(i == [(100 * w) as i8], || format!("i8 sum wraps: {i:?}"))?;
    let mut t = [rank == 0, false, true];
    pg.all_reduce_typed(&mut t, ReduceOp::Sum).await?;
    ensure(t == [true, false, true], || format!("bool sum: {t:?}"))?;
    let mut t = [rank == 0, true];
    pg.all_reduce_typed(&mut t, ReduceOp::BAnd).await?;
    ensure(t == [world == 1, true], || format!("bool band: {t:?}"))?;
    let mut t = [true];
    pg.all_reduce_typed(&mut t, ReduceOp::BXor).await?;
    ensure(t == [world % 2 == 1], || format!("bool bxor: {t:?}"))?;
    let mut x = [rank as i32 * 3];
    pg.all_reduce_typed(&mut x, ReduceOp::BXor).await?;
    let want = (0..world as i32).fold(0, |a, r| a ^ (r * 3));
    ensure(x == [want], || format!("i32 bxor: {x:?}"))?;
    // Refused locally, naming op and type, taking no place in the sequence.
    let e = pg
        .all_reduce_typed(&mut [1.0f32], ReduceOp::BXor)
        .await
        .err();
    ensure(
        e.as_ref().is_some_and(|e| {
            let s = e.to_string();
            matches!(e, ProcessGroupError::Arguments { .. })
                && s.contains("bxor")
                && s.contains("f32")
        }),
        || format!("f32 bxor: {e:?}"),
    )?;
    let e = pg.reduce_typed(&mut [1i64], ReduceOp::Avg, 0).await.err();
    ensure(
        e.as_ref()
            .is_some_and(|e| e.to_string().contains("avg is not defined on i64")),
        || format!("i64 avg: {e:?}"),
    )?;
    pg.barrier().await?;

    // --- reduce
    let root = world - 1;
    let mut r = [rank as i64, 10];
    pg.reduce_typed(&mut r, ReduceOp::Sum, root).await?;
    let want = if rank == root {
        [tri, 10 * w]
    } else {
        [rank as i64, 10]
    };
    ensure(r == want, || format!("reduce i64 sum to {root}: {r:?}"))?;
    let mut h = [f16::from_f32(rank as f32 + 1.0)];
    pg.reduce_typed(&mut h, ReduceOp::Avg, 0).await?;
    if rank == 0 {
        ensure(h == [f16::from_f32((w + 1) as f32 / 2.0)], || {
            format!("reduce f16 avg: {h:?}")
        })?;
    }

    // --- reduce_scatter: one tensor with uneven chunks, and the list form
    let counts: Vec<usize> = (0..world).map(|i| i + 1).collect();
    let total: usize = counts.iter().sum();
    let input: Vec<i64> = (0..total as i64).map(|j| rank as i64 * 100 + j).collect();
    let mine = pg
        .reduce_scatter_typed(&input, &counts, ReduceOp::Sum)
        .await?;
    let start: usize = counts[..rank].iter().sum();
    let want: Vec<i64> = (start..start + counts[rank])
        .map(|j| 100 * tri + w * j as i64)
        .collect();
    ensure(mine == want, || {
        format!("reduce_scatter: {mine:?}, want {want:?}")
    })?;
    let blocks: Vec<Vec<f32>> = (0..world).map(|i| vec![(rank + i) as f32; i + 2]).collect();
    let mine = pg
        .reduce_scatter_blocks_typed(&blocks, ReduceOp::Max)
        .await?;
    ensure(mine == vec![(world - 1 + rank) as f32; rank + 2], || {
        format!("reduce_scatter blocks: {mine:?}")
    })?;

    // --- gather and scatter, bytes (blocks over 56 bytes take a second round) and objects
    let gathered = pg.gather(&block(rank, rank * 40 + 1), 0).await?;
    if rank == 0 {
        let blocks = gathered.ok_or("gather: no blocks on the root")?;
        ensure(blocks.len() == world, || "gather count".into())?;
        for (peer, b) in blocks.iter().enumerate() {
            ensure(b[..] == block(peer, peer * 40 + 1)[..], || {
                format!("gather: block of rank {peer}")
            })?;
        }
    } else {
        ensure(gathered.is_none(), || "gather: blocks off the root".into())?;
    }
    let names = pg.gather_object(&format!("worker{rank}"), root).await?;
    if rank == root {
        ensure(
            names == Some((0..world).map(|r| format!("worker{r}")).collect()),
            || format!("gather_object: {names:?}"),
        )?;
    }
    let sroot = 1 % world;
    let blocks: Vec<bytes::Bytes> = if rank == sroot {
        (0..world)
            .map(|i| block(100 + i, i * 50 + 3).into())
            .collect()
    } else {
        Vec::new()
    };
    let got = pg.scatter(&blocks, sroot).await?;
    ensure(got[..] == block(100 + rank, rank * 50 + 3)[..], || {
        "scatter".into()
    })?;
    let values: Vec<(usize, String)> = (0..world).map(|i| (i, "x".repeat(i * 30))).collect();
    let got: (usize, String) = pg
        .scatter_object((rank == 0).then_some(&values[..]), 0)
        .await?;
    ensure(got == values[rank], || format!("scatter_object: {got:?}"))?;

    // --- all_to_all with uneven (and empty) blocks, and all_to_all_single with uneven splits
    let piece = |from: usize, to: usize| block(from * 10 + to, (from + to) % 3 * 30);
    let inputs: Vec<bytes::Bytes> = (0..world).map(|p| piece(rank, p).into()).collect();
    let lens: Vec<usize> = (0..world).map(|p| (p + rank) % 3 * 30).collect();
    let out = pg.all_to_all(&inputs, &lens).await?;
    for (p, b) in out.iter().enumerate() {
        ensure(b[..] == piece(p, rank)[..], || {
            format!("all_to_all: block from {p}")
        })?;
    }
    let splits: Vec<usize> = (0..world).map(|p| rank + p + 1).collect();
    let input: Vec<i32> = (0..world)
        .flat_map(|p| (0..rank + p + 1).map(move |k| (rank * 1000 + p * 10 + k) as i32))
        .collect();
    let out = pg.all_to_all_single_typed(&input, &splits, &splits).await?;
    let want: Vec<i32> = (0..world)
        .flat_map(|p| (0..rank + p + 1).map(move |k| (p * 1000 + rank * 10 + k) as i32))
        .collect();
    ensure(out == want, || format!("all_to_all_single: {out:?}"))?;

    // --- send / recv with tags, and their non-blocking forms
    if world > 1 {
        let (right, left) = ((rank + 1) % world, (rank + world - 1) % world);
        pg.send(format!("a{rank}").as_bytes(), right, 7).await?;
        pg.send(format!("b{rank}").as_bytes(), right, 7).await?;
        pg.send(format!("c{rank}").as_bytes(), right, 3).await?;
        // Tags are matched: tag 3 first although it was sent last.
        let c = pg.recv(left, 3).await?;
        let a = pg.recv(left, 7).await?;
        let b = pg.recv(left, 7).await?;
        ensure(
            [&a[..], &b[..], &c[..]]
                == [
                    format!("a{left}").as_bytes(),
                    format!("b{left}").as_bytes(),
                    format!("c{left}").as_bytes(),
                ],
            || "send/recv with tags".into(),
        )?;
        // Receives posted before the sends, each getting the message of its place.
        let first = pg.irecv(left, 9);
        let second = pg.irecv(left, 9);
        let s1 = pg.isend(format!("x{rank}").into(), right, 9);
        let s2 = pg.isend(format!("y{rank}").into(), right, 9);
        let (second, first) = (second.await?, first.await?);
        s2.await?;
        s1.await?;
        ensure(
            first[..] == *format!("x{left}").as_bytes()
                && second[..] == *format!("y{left}").as_bytes(),
            || "isend/irecv order".into(),
        )?;
    }
    let e = pg.send(b"me", rank, 1).await.err();
    ensure(
        matches!(e, Some(ProcessGroupError::Arguments { .. })),
        || format!("send to self: {e:?}"),
    )?;

    // --- everyone arrives at a monitored barrier
    pg.monitored_barrier(Some(Duration::from_secs(10)), true)
        .await?;
    pg.barrier().await?;
    Ok(())
}

/// Ranks in `TW_ABSENT` (comma-separated) never come to the monitored barrier; the others
/// call it with `TW_WAIT_ALL` (1 or 0) and a timeout of `TW_MB_MS`.
/// A concrete [`Group`] of the `env://` world (what the `tensorwire` backend builds, without
/// the trait object), for the scenarios that use its own methods.
async fn connect_group(name: &str, timeout: Duration) -> Result<(Group, Arc<dyn Store>), Error> {
    let rv = env_rendezvous(timeout).await?;
    let transport = Arc::new(TcpTransport::new(TcpConfig::resolve(None, false)?)?);
    let options = GroupOptions::new(name).with_timeout(timeout);
    let store = rv.store.clone();
    let group = Group::connect(rv.store, transport, rv.rank, rv.world_size, options).await?;
    Ok((group, store))
}

/// The `work` scenario: see the crate docs.
async fn work(world: &Group, store: &dyn Store) -> Result<(), Error> {
    let rank = world.rank();
    let size = world.size();
    ensure(size == 4, || "the work scenario runs at world 4".into())?;
    // The path asked for is the path taken (the ranks share this host).
    let arena = tensorwire_process_group::CollectivePath::from_env()?
        == tensorwire_process_group::CollectivePath::Arena;
    ensure(world.uses_arena() == arena, || {
        format!("the arena in use: {}, asked: {arena}", world.uses_arena())
    })?;
    let long = Duration::from_secs(30);
    // Issued without being polled: the calls are the ordering point.
    let mut sums = Vec::new();
    for i in 0..6i64 {
        sums.push(world.all_reduce_typed_work(vec![rank as i64 * 10 + i; 3], ReduceOp::Sum));
    }
    let barrier = world.barrier_work();
    let gathered = world.all_gather_work(vec![rank as u8; rank + 1]);
    let root = world.broadcast_work(if rank == 2 { vec![7; 5] } else { vec![0; 5] }, 2);
    let last = world.all_reduce_typed_work(vec![1i64], ReduceOp::Sum);
    let expected = |i: i64| [60 + 4 * i; 3];
    if rank == 0 {
        // Rank 0 waits on nothing until every other rank has waited out all of its Works,
        // which needed rank 0's part: its Works made progress on their own.
        for peer in 1..size {
            world.recv(peer, 99).await?;
        }
    }
    // Out of order: the last first.
    ensure(last.wait(long).await? == [4], || "last all_reduce".into())?;
    if rank == 0 {
        // Done without ever being polled; their tasks may still be finishing up locally.
        let deadline = tokio::time::Instant::now() + long;
        while !(sums.iter().all(|w| w.is_completed())
            && barrier.is_completed()
            && gathered.is_completed()
            && root.is_completed())
        {
            ensure(tokio::time::Instant::now() < deadline, || {
                "Works still not completed 30 s after the peers finished them".into()
            })?;
            tokio::task::yield_now().await;
        }
    }
    ensure(root.wait(long).await? == [7; 5], || "broadcast".into())?;
    let blocks = gathered.wait(long).await?;
    ensure(
        blocks
            .iter()
            .enumerate()
            .all(|(r, b)| b[..] == vec![r as u8; r + 1][..]),
        || format!("all_gather gave {blocks:?}"),
    )?;
    barrier.wait(long).await?;
    for (i, w) in sums.into_iter().enumerate().rev() {
        let got = w.wait(long).await?;
        ensure(got == expected(i as i64), || {
            format!("all_reduce {i} gave {got:?}")
        })?;
    }
    if rank != 0 {
        world.send(b"done", 0, 99).await?;
    }
    world.barrier().await?;

    // Rank 3 never joins this barrier: the others' waits time out, rank 0's naming rank 3
    // (its first message in a dissemination barrier comes from rank 3).
    if rank == 3 {
        // Staying away until every other rank has timed out: a goodbye earlier would fail
        // their waits with `PeerLeft` instead.
        store
            .wait(
                &["work/timed-out/0", "work/timed-out/1", "work/timed-out/2"],
                long,
            )
            .await
            .map_err(|e| format!("waiting for rank 0's timeout: {e}"))?;
        // Rank 0 serves the store: it stays until this rank is done with it, and the others
        // leave no earlier (a goodbye must not reach a rank still waiting on its barrier).
        store.set("work/released", b"1").await?;
        done_with_store(store, rank).await;
        return Ok(());
    }
    let short = Duration::from_millis(300);
    let missed = world.barrier_work();
    let err = missed.wait(short).await.err();
    let Some(err) = err else {
        return Err("a barrier rank 3 never joined completed".into());
    };
    ensure(
        matches!(err, ProcessGroupError::Timeout { timeout, .. } if timeout == short),
        || format!("the wait gave {err}"),
    )?;
    if rank == 0 {
        ensure(err.to_string().contains("waiting for rank(s) 3"), || {
            format!("rank 0's timeout names rank 3: {err}")
        })?;
        println!("TIMEOUT {err}");
    }
    store.set(&format!("work/timed-out/{rank}"), b"1").await?;
    // The timed-out collective broke the group here: later ones fail saying so.
    let later = world.barrier().await.err();
    ensure(later.as_ref() == Some(&err), || {
        format!("a barrier after the timeout gave {later:?}, not {err}")
    })?;
    store.wait(&["work/released"], long).await?;
    if rank == 0 {
        // Rank 0 serves the store: it leaves only once every other rank is done with it.
        store
            .wait(&["work/done/1", "work/done/2", "work/done/3"], long)
            .await?;
    } else {
        done_with_store(store, rank).await;
    }
    Ok(())
}

/// The last store operation of a rank other than 0: rank 0 (the store's host) may leave as
/// soon as the key is set, before this rank reads the reply, so a lost reply is no error.
async fn done_with_store(store: &dyn Store, rank: usize) {
    let _ = store.set(&format!("work/done/{rank}"), b"1").await;
}

async fn groups(world: &Group) -> Result<(), Error> {
    let rank = world.rank();
    ensure(world.size() == 4, || {
        "the groups scenario runs at world 4".into()
    })?;
    // Refused lists take no subgroup id, so the ids below still agree on every rank.
    for bad in [&[1usize, 1][..], &[0, 4][..]] {
        let err = world.new_group(bad).err();
        ensure(
            err.as_ref().is_some_and(|e| e.to_string().contains("rank")),
            || format!("new_group({bad:?}) gave {err:?}"),
        )?;
    }
    let odd = world.new_group(&[3, 1])?;
    match (&odd, rank) {
        (None, 0 | 2) => {}
        (Some(g), 1 | 3) => {
            ensure(g.size() == 2 && g.rank() == rank / 2, || {
                format!("rank {rank} is rank {} of {} in [1, 3]", g.rank(), g.size())
            })?;
            ensure(
                g.group_rank(3) == Some(1) && g.group_rank(1) == Some(0),
                || "group ranks of 1 and 3".into(),
            )?;
            ensure(
                g.group_rank(0).is_none() && g.group_rank(2).is_none(),
                || "0 and 2 have no group rank in [1, 3]".into(),
            )?;
            ensure(
                g.global_rank(0) == Some(1) && g.global_rank(1) == Some(3),
                || "global ranks of [1, 3]".into(),
            )?;
            ensure(g.global_rank(2).is_none(), || "no group rank 2".into())?;
            ensure(g.global_ranks() == [1, 3], || "global_ranks".into())?;
            let err = g.new_group(&[0]).err();
            ensure(err.is_some(), || {
                "new_group on a subgroup is refused".into()
            })?;
        }
        (odd, _) => return Err(format!("rank {rank} got {odd:?} from new_group([3, 1])").into()),
    }
    let halves = world.split_group(&[vec![0, 1], vec![2, 3]])?;
    let Some(half) = halves else {
        return Err(format!("rank {rank} is in no half").into());
    };
    ensure(half.global_ranks() == [rank & !1, rank | 1], || {
        format!("rank {rank} is in half {:?}", half.global_ranks())
    })?;
    ensure(half.group_rank(rank) == Some(rank % 2), || {
        "half rank".into()
    })?;
    let me = rank as i64 + 1;
    for round in 0..20i64 {
        // The same signature in every group: were their messages mixed, the sums would be
        // wrong rather than refused.
        let mut in_world = [me * 100 + round; 4];
        let mut in_odd = [me * 10 + round; 4];
        let mut in_half = [me + round; 4];
        let odd_sum = async {
            match &odd {
                Some(g) => g.all_reduce_typed(&mut in_odd, ReduceOp::Sum).await,
                None => Ok(()),
            }
        };
        let (b, w, o, h) = tokio::join!(
            world.barrier(),
            world.all_reduce_typed(&mut in_world, ReduceOp::Sum),
            odd_sum,
            half.all_reduce_typed(&mut in_half, ReduceOp::Sum),
        );
        b?;
        w?;
        o?;
        h?;
        ensure(in_world == [1000 + 4 * round; 4], || {
            format!("world all_reduce round {round}: {in_world:?}")
        })?;
        if odd.is_some() {
            ensure(in_odd == [60 + 2 * round; 4], || {
                format!("[1, 3] all_reduce round {round}: {in_odd:?}")
            })?;
        }
        let pair = if rank < 2 { 3 } else { 7 };
        ensure(in_half == [pair + 2 * round; 4], || {
            format!("half all_reduce round {round}: {in_half:?}")
        })?;
    }
    half.shutdown().await;
    ensure(half.barrier().await.is_err(), || {
        "a shut-down subgroup refuses collectives".into()
    })?;
    // The world and the other subgroup go on.
    world.barrier().await?;
    if let Some(g) = &odd {
        g.barrier().await?;
    }
    Ok(())
}

async fn monitored(pg: &dyn ProcessGroup) -> Result<ExitCode, Error> {
    let rank = pg.rank();
    let absent: Vec<usize> = std::env::var("TW_ABSENT")
        .unwrap_or_default()
        .split(',')
        .filter_map(|r| r.parse().ok())
        .collect();
    pg.barrier().await?;
    println!("READY rank {rank}");
    std::io::stdout().flush()?;
    if absent.contains(&rank) {
        // Not coming: the test ends this process once rank 0 has reported.
        tensorwire_tests::hold_until_stdin_closes_async().await;
        return Ok(ExitCode::SUCCESS);
    }
    let timeout = Duration::from_millis(env_usize("TW_MB_MS", 2000) as u64);
    let wait_all = env_usize("TW_WAIT_ALL", 1) == 1;
    let result = pg.monitored_barrier(Some(timeout), wait_all).await;
    if let Err(e) = &result {
        eprintln!("FAILED: {e}");
    }
    if rank != 0 {
        // Rank 0's report is what is checked: the others stay until the test ends them, so
        // that their exit (a closed connection, which the ranks still up would report as an
        // abort) cannot race rank 0's own timeout. They time out at about the same moment.
        tensorwire_tests::hold_until_stdin_closes_async().await;
    }
    Ok(match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::from(3),
    })
}

async fn run(scenario: &str) -> Result<ExitCode, Error> {
    let timeout = Duration::from_millis(env_usize("TW_TIMEOUT_MS", 20_000) as u64);
    let rank = env_usize("RANK", 0);
    // Rank 0 with port 0 learns its store's port first, for the launcher; new_group then
    // reuses that store.
    let _rendezvous = if rank == 0 && std::env::var("MASTER_PORT").as_deref() == Ok("0") {
        let rv = env_rendezvous(timeout).await?;
        println!("PORT {}", rv.master_port);
        std::io::stdout().flush()?;
        Some(rv)
    } else {
        None
    };
    let started = Instant::now();
    if scenario == "nccl" {
        return nccl(rank, timeout).await;
    }
    if scenario == "groups" {
        let (world, _store) = connect_group("groups", timeout).await?;
        groups(&world).await?;
        world.shutdown().await;
        println!("OK groups rank {rank} in {:?}", started.elapsed());
        return Ok(ExitCode::SUCCESS);
    }
    if scenario == "work" {
        let (world, store) = connect_group("work", timeout).await?;
        work(&world, store.as_ref()).await?;
        world.shutdown().await;
        println!("OK work rank {rank} in {:?}", started.elapsed());
        return Ok(ExitCode::SUCCESS);
    }
    let pg = new_group("tensorwire", timeout, Device::Cpu, Vec::new()).await?;
    match scenario {
        "check" => {
            check(pg.as_ref()).await?;
            pg.shutdown().await;
            println!("OK rank {rank} in {:?}", started.elapsed());
            Ok(ExitCode::SUCCESS)
        }
        "inflight" => {
            inflight(pg.as_ref()).await?;
            pg.shutdown().await;
            println!("OK inflight rank {rank} in {:?}", started.elapsed());
            Ok(ExitCode::SUCCESS)
        }
        "ops" => {
            ops(pg.as_ref()).await?;
            pg.shutdown().await;
            println!("OK ops rank {rank} in {:?}", started.elapsed());
            Ok(ExitCode::SUCCESS)
        }
        "monitored" => monitored(pg.as_ref()).await,
        "kill" => {
            pg.barrier().await?;
            println!("READY rank {rank}");
            std::io::stdout().flush()?;
            if rank == env_usize("TW_VICTIM", usize::MAX) {
                tensorwire_tests::hold_until_stdin_closes_async().await;
                return Ok(ExitCode::SUCCESS);
            }
            let waited = Instant::now();
            match pg.barrier().await {
                Ok(()) => Ok(ExitCode::SUCCESS),
                Err(e) => {
                    eprintln!("FAILED after {} ms: {e}", waited.elapsed().as_millis());
                    Ok(ExitCode::from(3))
                }
            }
        }
        other => Err(format!(
            "unknown scenario {other:?}; use check, ops, groups, work, monitored, inflight or kill"
        )
        .into()),
    }
}

#[cfg(not(feature = "nccl"))]
async fn nccl(_: usize, _: Duration) -> Result<ExitCode, Error> {
    Err("this tw-pg-worker was built without the nccl feature".into())
}

#[cfg(feature = "nccl")]
async fn nccl(rank: usize, timeout: Duration) -> Result<ExitCode, Error> {
    use tensorwire_core::ports::device::relocate;
    use tensorwire_core::ports::process_group::{ProcessGroupError, TensorCollectives};
    use tensorwire_core::tensor::{DType, Storage, Tensor};
    use tensorwire_devices_cuda::nccl_group::shared_devices;

    let device: Device = match std::env::var("TW_DEVICE") {
        Ok(d) => d.parse()?,
        Err(_) => format!("cuda:{rank}").parse()?,
    };
    let started = Instant::now();
    let pg = match new_group("nccl", timeout, device, Vec::new()).await {
        Ok(pg) => pg,
        Err(e) => {
            println!(
                "SETUP-ERROR after {} ms: {e}",
                started.elapsed().as_millis()
            );
            return Ok(ExitCode::from(4));
        }
    };
    let setup = started.elapsed();
    let cuda = shared_devices();
    let world = pg.size();
    let on_device = |t: Tensor| async move { relocate(cuda, &t, device).await };
    let values = |t: &Tensor| {
        let t = t.clone();
        async move {
            let host = relocate(cuda, &t, Device::Cpu).await?;
            Ok::<_, Error>(host.to_f32_vec().ok_or("not f32")?)
        }
    };
    ensure(pg.device() == device && pg.backend() == "nccl", || {
        "the group's device and backend".into()
    })?;
    pg.barrier().await?;

    let n = 1 << 20;
    let mine = on_device(Tensor::from_f32(vec![n], &vec![rank as f32 + 1.0; n])?).await?;
    let sum = pg.all_reduce_tensor(&mine, ReduceOp::Sum).await?;
    ensure(sum.device() == device, || {
        "all_reduce result on the device".into()
    })?;
    let want = (world * (world + 1) / 2) as f32;
    ensure(values(&sum).await?.iter().all(|v| *v == want), || {
        format!("all_reduce sum of 4 MiB is not {want} everywhere")
    })?;
    let max = pg.all_reduce_tensor(&mine, ReduceOp::Max).await?;
    ensure(
        values(&max).await?.iter().all(|v| *v == world as f32),
        || "all_reduce max".into(),
    )?;
    let ints = Tensor::new(
        DType::I64,
        vec![3],
        Storage::Host(
            [rank as i64 + 2, -1, 1 << 40]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>()
                .into(),
        ),
    )?;
    let prod = pg
        .all_reduce_tensor(&on_device(ints).await?, ReduceOp::Product)
        .await?;
    let prod = relocate(cuda, &prod, Device::Cpu).await?;
    let got: Vec<i64> = prod
        .host_bytes()
        .ok_or("host")?
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let want_first: i64 = (0..world as i64).map(|r| r + 2).product();
    ensure(got[0] == want_first, || format!("i64 product: {got:?}"))?;

    let row = on_device(Tensor::from_f32(vec![1000], &vec![rank as f32; 1000])?).await?;
    let parts = pg.all_gather_tensor(&row).await?;
    ensure(parts.len() == world, || "all_gather count".into())?;
    for (r, p) in parts.iter().enumerate() {
        ensure(values(p).await? == vec![r as f32; 1000], || {
            format!("all_gather part {r}")
        })?;
    }
    let root = world - 1;
    let b = pg.broadcast_tensor(&row, root).await?;
    ensure(values(&b).await? == vec![root as f32; 1000], || {
        "broadcast".into()
    })?;

    // The byte collectives, staged through the device.
    let blocks = pg.all_gather(&block(rank, rank * 100 + 1)).await?;
    for (peer, got) in blocks.iter().enumerate() {
        ensure(got[..] == block(peer, peer * 100 + 1)[..], || {
            format!("byte all_gather block {peer}")
        })?;
    }
    let mut data = if rank == 0 {
        block(7, 4096)
    } else {
        vec![0; 4096]
    };
    pg.broadcast(&mut data, 0).await?;
    ensure(data == block(7, 4096), || "byte broadcast".into())?;
    let mut v = [rank as f64, 0.5];
    pg.all_reduce_typed(&mut v, ReduceOp::Sum).await?;
    ensure(
        v == [(world * (world - 1) / 2) as f64, 0.5 * world as f64],
        || format!("byte all_reduce f64: {v:?}"),
    )?;

    // Typed errors, the group still usable after them.
    let host = Tensor::from_f32(vec![2], &[1.0, 2.0])?;
    let e = pg.all_reduce_tensor(&host, ReduceOp::Sum).await.err();
    ensure(
        matches!(e, Some(ProcessGroupError::WrongDevice { .. })),
        || format!("a cpu tensor: {e:?}"),
    )?;
    let bf = Tensor::new(DType::BF16, vec![2], Storage::Host(vec![0u8; 4].into()))?;
    let e = pg
        .all_reduce_tensor(&on_device(bf).await?, ReduceOp::Sum)
        .await
        .err();
    ensure(
        matches!(e, Some(ProcessGroupError::UnsupportedType { .. })),
        || format!("bfloat16: {e:?}"),
    )?;
    pg.barrier().await?;
    let t = Instant::now();
    for _ in 0..100 {
        pg.all_reduce_tensor(&mine, ReduceOp::Sum).await?;
    }
    let per_call = t.elapsed() / 100;
    pg.shutdown().await;
    let e = pg.barrier().await.err();
    ensure(matches!(e, Some(ProcessGroupError::ShutDown)), || {
        format!("after shutdown: {e:?}")
    })?;
    println!(
        "OK nccl rank {rank} on {device}: setup {} ms, 4 MiB all_reduce {:.1} us per call",
        setup.as_millis(),
        per_call.as_secs_f64() * 1e6
    );
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ERROR: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&scenario)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ERROR: {e}");
            ExitCode::FAILURE
        }
    }
}
