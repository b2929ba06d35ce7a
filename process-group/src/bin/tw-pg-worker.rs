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
//! - `kill`: sets up, runs one barrier, prints `READY rank R`; rank `TW_VICTIM` then sleeps
//!   (to be killed), the others run another barrier and report its error (exit 3), or exit 0
//!   if it unexpectedly succeeds.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tensorwire_core::collective::{ElementType, ReduceOp};
use tensorwire_core::device::Device;
use tensorwire_core::ports::process_group::{ProcessGroup, ProcessGroupError};
use tensorwire_process_group::env_init::env_rendezvous;
use tensorwire_process_group::{new_group, CollectivesExt};

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
        "kill" => {
            pg.barrier().await?;
            println!("READY rank {rank}");
            std::io::stdout().flush()?;
            if rank == env_usize("TW_VICTIM", usize::MAX) {
                tokio::time::sleep(Duration::from_secs(120)).await;
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
        other => Err(format!("unknown scenario {other:?}; use check, inflight or kill").into()),
    }
}

#[cfg(not(feature = "nccl"))]
async fn nccl(_: usize, _: Duration) -> Result<ExitCode, Error> {
    Err("this tw-pg-worker was built without the nccl feature".into())
}

#[cfg(feature = "nccl")]
async fn nccl(rank: usize, timeout: Duration) -> Result<ExitCode, Error> {
    use tensorwire_core::ports::device::relocate;
    use tensorwire_core::ports::process_group::ProcessGroupError;
    use tensorwire_core::tensor::{DType, Storage, Tensor};
    use tensorwire_process_group::nccl::shared_devices;

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
