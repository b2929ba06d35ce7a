//! A worker process for the hierarchical-collective tests across simulated hosts
//! (`tests/tests/hosts_hierarchy.rs`): `tw-hosts-worker SCENARIO`, with RANK, WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT and TENSORWIRE_SECRET in the environment.
//!
//! - `collectives`: the world group (and a subgroup across hosts) runs barrier, all_reduce and
//!   reduce of every element type and operation, broadcast from every root and all_gather, and
//!   a second world group on the links runs the same; the results must be equal, and equal to
//!   values computed here, and the hierarchical group must have run each of them through its
//!   hierarchy (`TW_EXPECT_HIERARCHY=1`). Prints `OK collectives rank R runs=N ...
//!   arenas_at_connect=A` (A: the arena segments this process made while connecting).
//! - `kill`: three all_reduces, then rank `TW_VICTIM` ends its process while every other rank
//!   waits for it in the fourth; every other rank prints `OK failed rank R after_ms=T: ERROR`
//!   (T from the start of its call, which began about 500 ms before the death).
//!
//! - `stall`: as `kill`, but rank `TW_VICTIM` stays alive and never calls the fourth
//!   all_reduce (a stalled rank: its process and connections live on), with the group's
//!   timeout `TW_TIMEOUT_MS`; every other rank prints `OK failed rank R after_ms=T: ERROR`,
//!   and the victim exits once the test closes its stdin.
//!
//! Exits 0 when everything checked held, 1 (with the error on stderr) otherwise.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use tensorwire_core::collective::{ElementType, ReduceOp};
use tensorwire_core::ports::process_group::{Collectives, ProcessGroup};
use tensorwire_process_group::{Group, TensorwireFactory};

type Outcome = Result<(), Box<dyn std::error::Error>>;

fn check(cond: bool, what: &str) -> Outcome {
    if cond {
        Ok(())
    } else {
        Err(format!("check failed: {what}").into())
    }
}

async fn connect(
    name: &str,
    links: bool,
    timeout: Duration,
) -> Result<Group, Box<dyn std::error::Error>> {
    let rv = tensorwire_rendezvous::env_init::env_rendezvous(timeout).await?;
    let mut options = vec![("group_name".to_owned(), name.to_owned())];
    if links {
        options.push(("collectives".to_owned(), "links".to_owned()));
    }
    Ok(TensorwireFactory::connect(rv.store, rv.rank, rv.world_size, timeout, options).await?)
}

/// Rank `rank`'s input of `count` elements of `element`: small integers (exact in every float
/// type, whatever the order of the sum or product), in that type's little-endian bytes.
fn input(element: ElementType, rank: usize, count: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * element.size());
    for i in 0..count {
        let small = ((rank + i) % 2 + 1) as f32;
        let wide = (rank * 37 + i * 11) as u64;
        match element {
            ElementType::F32 => out.extend(small.to_le_bytes()),
            ElementType::F64 => out.extend(f64::from(small).to_le_bytes()),
            ElementType::F16 => out.extend(half::f16::from_f32(small).to_le_bytes()),
            ElementType::BF16 => out.extend(half::bf16::from_f32(small).to_le_bytes()),
            ElementType::Bool => out.push(u8::from((rank + i) % 3 == 0)),
            _ => out.extend(&wide.to_le_bytes()[..element.size()]),
        }
    }
    out
}

/// The i64 sum every rank must reach (computed here, not by either path).
fn i64_sum(world: usize, count: usize) -> Vec<u8> {
    (0..count)
        .flat_map(|i| {
            (0..world)
                .map(|r| (r * 37 + i * 11) as i64)
                .sum::<i64>()
                .to_le_bytes()
        })
        .collect()
}

fn block(rank: usize, round: usize) -> Vec<u8> {
    let len = (rank * 37 + round * 5) % 11 + if rank == 1 { 70_000 } else { 0 };
    (0..len).map(|i| (i + rank + round) as u8).collect()
}

/// Every hierarchical collective on `hier`, against `flat` (the same ranks on the links) and
/// values computed here; returns how many collectives ran.
async fn every_collective(hier: &Group, flat: &Group) -> Result<u64, Box<dyn std::error::Error>> {
    let (rank, world) = (hier.rank(), hier.size());
    let mut n = 0u64;
    hier.barrier().await?;
    n += 1;
    for element in ElementType::ALL {
        for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(element)) {
            for count in [1, 7, 5000] {
                let what = format!("all_reduce {op} of {count} {element:?}");
                let mut a = input(element, rank, count);
                let mut b = a.clone();
                hier.all_reduce(&mut a, element, op).await?;
                flat.all_reduce(&mut b, element, op).await?;
                n += 1;
                check(a == b, &what)?;
                if element == ElementType::I64 && op == ReduceOp::Sum {
                    check(a == i64_sum(world, count), &format!("{what}: the sum"))?;
                }
            }
            for root in 0..world {
                let what = format!("reduce {op} of {element:?} to {root}");
                let mine = input(element, rank, 9);
                let (mut a, mut b) = (mine.clone(), mine.clone());
                hier.reduce(&mut a, element, op, root).await?;
                flat.reduce(&mut b, element, op, root).await?;
                n += 1;
                if rank == root {
                    check(a == b, &what)?;
                } else {
                    check(
                        a == mine,
                        &format!("{what}: a non-root's data is left as it was"),
                    )?;
                }
            }
        }
    }
    for root in 0..world {
        for len in [0, 3, 100_000] {
            let mut a = if rank == root {
                (0..len).map(|i| (i * 7 + root) as u8).collect()
            } else {
                vec![0xEE; len]
            };
            let want: Vec<u8> = (0..len).map(|i| (i * 7 + root) as u8).collect();
            hier.broadcast(&mut a, root).await?;
            n += 1;
            check(a == want, &format!("broadcast of {len} bytes from {root}"))?;
        }
    }
    for round in 0..3 {
        let blocks = hier.all_gather(&block(rank, round)).await?;
        let flat_blocks = flat.all_gather(&block(rank, round)).await?;
        n += 1;
        check(blocks == flat_blocks, "all_gather: as on the links")?;
        let want: Vec<Vec<u8>> = (0..world).map(|r| block(r, round)).collect();
        let got: Vec<Vec<u8>> = blocks.iter().map(|b| b.to_vec()).collect();
        check(got == want, "all_gather: every rank's block, in rank order")?;
    }
    // Several in flight at once, issued in one order on every rank: each runs in its turn.
    let root = world - 1;
    let barrier = hier.barrier_work();
    let sum = hier.all_reduce_typed_work(vec![rank as i64 + 1; 3], ReduceOp::Sum);
    let mine = if rank == root {
        vec![7u8; 5]
    } else {
        vec![0; 5]
    };
    let broadcast = hier.broadcast_work(mine, root);
    let gathered = hier.all_gather_work(block(rank, 9));
    let wait = Duration::from_secs(60);
    barrier.wait(wait).await?;
    let total = (world * (world + 1) / 2) as i64;
    check(
        sum.wait(wait).await? == vec![total; 3],
        "all_reduce in flight",
    )?;
    check(
        broadcast.wait(wait).await? == vec![7u8; 5],
        "broadcast in flight",
    )?;
    let got: Vec<Vec<u8>> = gathered
        .wait(wait)
        .await?
        .iter()
        .map(|b| b.to_vec())
        .collect();
    let want: Vec<Vec<u8>> = (0..world).map(|r| block(r, 9)).collect();
    check(got == want, "all_gather in flight")?;
    n += 4;
    hier.barrier().await?;
    n += 1;
    Ok(n)
}

async fn collectives() -> Outcome {
    let timeout = Duration::from_secs(60);
    let hier = connect("hier", false, timeout).await?;
    let flat = connect("flat", true, timeout).await?;
    // Segments this process made while the groups connected (before any collective): a world
    // across hosts makes none (its hosts' arenas come with their first collective).
    let arenas_at_connect = tensorwire_transport_shm::arena::arenas_made();
    let (rank, world) = (hier.rank(), hier.size());
    let expect = std::env::var("TW_EXPECT_HIERARCHY").is_ok_and(|v| v == "1");
    check(
        hier.is_hierarchical() == expect,
        "the world is hierarchical",
    )?;
    check(!flat.is_hierarchical(), "the links group is flat")?;
    let n = every_collective(&hier, &flat).await?;
    let runs = hier.hierarchical_runs();
    check(
        runs == if expect { n } else { 0 },
        &format!("{runs} of {n} collectives ran through the hierarchy"),
    )?;
    // A subgroup across hosts (every rank but the last) runs hierarchically too, when it still
    // has two ranks on a host.
    let members: Vec<usize> = (0..world - 1).collect();
    let sub = hier.new_group(&members)?;
    let flat_sub = flat.new_group(&members)?;
    let mut sub_runs = 0;
    if let (Some(sub), Some(flat_sub)) = (&sub, &flat_sub) {
        let n = every_collective(sub, flat_sub).await?;
        sub_runs = sub.hierarchical_runs();
        check(
            sub_runs == if sub.is_hierarchical() { n } else { 0 },
            "the subgroup's collectives ran through its hierarchy",
        )?;
    }
    // Not checked (a shared machine): the median of 50 all_reduces of 8 bytes and of 1 MiB
    // on each path, for the report.
    let mut timings = String::new();
    for len in [8usize, 1 << 20] {
        for (path, group) in [("hierarchical", &hier), ("links", &flat)] {
            let mut times = Vec::new();
            let mut data = vec![0u8; len];
            for _ in 0..50 {
                let t = Instant::now();
                group
                    .all_reduce(&mut data, ElementType::F32, ReduceOp::Sum)
                    .await?;
                times.push(t.elapsed());
            }
            times.sort();
            timings.push_str(&format!(" {path}_{len}B_us={}", times[25].as_micros()));
        }
    }
    hier.barrier().await?;
    flat.barrier().await?;
    if rank == 0 {
        println!("TIMING world={world}{timings}");
    }
    println!(
        "OK collectives rank {rank} runs={runs} sub_runs={sub_runs} hosts={} arenas_at_connect={arenas_at_connect}",
        hier.host_plan().map_or(0, |p| p.hosts().len())
    );
    hier.shutdown().await;
    flat.shutdown().await;
    Ok(())
}

async fn kill() -> Outcome {
    fail_with(Duration::from_secs(20), true).await
}

async fn stall() -> Outcome {
    let ms: u64 = std::env::var("TW_TIMEOUT_MS")?.parse()?;
    fail_with(Duration::from_millis(ms), false).await
}

/// Three all_reduces, then rank `TW_VICTIM` ends its process (`kill`) or stays out of the
/// fourth (else) once the test closes its stdin; every other rank reports how the fourth
/// failed.
async fn fail_with(timeout: Duration, kill: bool) -> Outcome {
    let hier = connect("hier", false, timeout).await?;
    let rank = hier.rank();
    let victim: usize = std::env::var("TW_VICTIM")?.parse()?;
    check(hier.is_hierarchical(), "the world is hierarchical")?;
    for _ in 0..3 {
        let mut x = [1i64];
        tensorwire_process_group::CollectivesExt::all_reduce_typed(&hier, &mut x, ReduceOp::Sum)
            .await?;
        check(x[0] == hier.size() as i64, "all_reduce before the kill")?;
    }
    if rank == victim && kill {
        // Gone once the test saw every peer about to wait for it in the next all_reduce (the
        // test closes this rank's stdin then).
        stdin_closed().await;
        std::process::exit(9);
    }
    if rank == victim {
        // Alive, connections open, but never in the next all_reduce, until every peer has
        // failed (the test closes this rank's stdin then).
        println!("STALLING rank {rank}");
        stdin_closed().await;
        std::process::exit(3);
    }
    println!("WAITING rank {rank}");
    let start = Instant::now();
    let mut x = vec![0u8; 8 * 1024];
    let result = hier
        .all_reduce(&mut x, ElementType::I64, ReduceOp::Sum)
        .await;
    let after = start.elapsed().as_millis();
    match result {
        Ok(()) => Err("all_reduce with a dead rank succeeded".into()),
        Err(e) => {
            println!("OK failed rank {rank} after_ms={after}: {e}");
            // Alive until every peer has failed too (the test then closes stdin), so that a
            // slower peer's error names the victim rather than this rank's exit.
            stdin_closed().await;
            Ok(())
        }
    }
}

/// Returns once the test has closed this worker's stdin.
async fn stdin_closed() {
    let _ =
        tokio::task::spawn_blocking(|| std::io::copy(&mut std::io::stdin(), &mut std::io::sink()))
            .await;
}

#[tokio::main]
async fn main() -> ExitCode {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    let result = match scenario.as_str() {
        "collectives" => collectives().await,
        "kill" => kill().await,
        "stall" => stall().await,
        other => Err(format!("unknown scenario {other:?}").into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rank {}: {e}", std::env::var("RANK").unwrap_or_default());
            ExitCode::FAILURE
        }
    }
}
