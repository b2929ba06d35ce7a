//! A process-group worker for the multi-process tests: one rank of an `env://` group.
//!
//! Usage: `tw-pg-worker check|kill` with `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`
//! and `TENSORWIRE_SECRET` set; `TW_TIMEOUT_MS` bounds every collective (default 20 000).
//! Rank 0 with `MASTER_PORT=0` serves the store on a free port and prints `PORT <port>` first.
//!
//! - `check`: runs barrier, all_gather (variable sizes), all_gather_object, broadcast and
//!   all_reduce (every op, every element type, small and large) and checks every result;
//!   prints `OK rank R` and exits 0, or prints `ERROR: ...` on stderr and exits 1.
//! - `kill`: sets up, runs one barrier, prints `READY rank R`; rank `TW_VICTIM` then sleeps
//!   (to be killed), the others run another barrier and report its error (exit 3), or exit 0
//!   if it unexpectedly succeeds.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tensorwire_core::collective::ReduceOp;
use tensorwire_core::device::Device;
use tensorwire_core::ports::process_group::ProcessGroup;
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
                }
            })
        };
        let table: Vec<[i64; 3]> = ReduceOp::ALL.iter().map(|op| folded(*op)).collect();
        let fold = |i: usize, op: ReduceOp| {
            let k = ReduceOp::ALL.iter().position(|o| *o == op).unwrap_or(0);
            table[k][i % 3]
        };
        for op in ReduceOp::ALL {
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
    let pg = new_group("tensorwire", timeout, Device::Cpu, Vec::new()).await?;
    match scenario {
        "check" => {
            check(pg.as_ref()).await?;
            pg.shutdown().await;
            println!("OK rank {rank} in {:?}", started.elapsed());
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
        other => Err(format!("unknown scenario {other:?}; use check or kill").into()),
    }
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
