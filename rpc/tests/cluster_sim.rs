//! A seeded simulation of whole clusters of real agents: the agents, their drivers and the
//! endpoint's protocol as users run them, over the in-memory network in virtual time (tokio's
//! paused clock), with a workload and slow links drawn from a seed.
//!
//! Each seed draws a world of 2–4 workers, a delay for every frame of the network, and on each
//! rank delays of the first messages of some kinds (PyTorch's faulty agent; a delayed message
//! holds back the ones after it, as a slow link would). Every worker then runs, all at once, a
//! random mix of:
//! - calls (`rpc_sync`) whose results are checked;
//! - `remote()` of a value that takes a while to make, then `to_here` — the value must be the
//!   one made;
//! - `remote()` and at once a call to the owner with that reference, where the function reads it
//!   with `local_value()` (the owner must wait for a value still being created);
//! - `remote()` and a call to a third worker that fetches the value through the reference it
//!   was given (a fork);
//! - fire-and-forget chains of `rpc_async` hops (each hop starts the next without awaiting it);
//!
//! and, as soon as its own operations have returned, a graceful shutdown — while other
//! workers' chains may still be running. The invariants: every result is the right value (no
//! error at all: the links are slow, never lossy), every hop of every chain runs (shutdown
//! refuses no work started before every worker called it), and every shutdown succeeds.
//!
//! `TW_SIM_SEEDS=N` runs seeds `0..N` (default 200); `TW_SIM_SEED=S` replays seed `S` alone (a
//! failure names its seed and prints its plan). The world, the faults and the workload are the
//! seed's; the interleaving is tokio's single-threaded scheduler's over the in-memory network in
//! virtual time, which repeats it, save for the orders of hash maps inside the agent.
//!
//! It finds the two races of PyTorch's suites (issue 26): with the owner's wait for a value
//! still being created taken out of `Endpoint::wait_confirmed`, 60 of 60 seeds fail ("the value
//! is gone"); with a graceful shutdown refusing requests from its start (the old behaviour), 53
//! of 60 fail ("callee shutting down").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::sim::SimRng;
use tensorwire_rpc::{Agent, CallContext, Functions, RRef, RpcError, Shutdown};
use tensorwire_testkit::faults::{Fault, FaultAction, FaultyBackend, MessageKind};
use tensorwire_testkit::MemoryCluster;

/// The message kinds a seed may slow down.
const KINDS: [MessageKind; 8] = [
    MessageKind::Call,
    MessageKind::Remote,
    MessageKind::Fetch,
    MessageKind::Reply,
    MessageKind::ForkRequest,
    MessageKind::ChildAccept,
    MessageKind::UserDelete,
    MessageKind::Ack,
];

/// The functions every simulated worker serves; `hops` counts the chain hops run on it.
fn functions(hops: Arc<AtomicU64>) -> Functions {
    let f = Functions::new();
    f.register(
        "add",
        |(a, b): (u64, u64)| async move { Ok::<_, String>(a + b) },
    )
    .expect("registered once");
    // A value that takes a while to make (a few scheduler turns and a moment of virtual time).
    f.register("slow_value", |(n, ms): (u64, u64)| async move {
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, String>(vec![n; 4])
    })
    .expect("registered once");
    // The owner reads a value it owns (PyTorch's `rref.local_value()`).
    f.register("sum_local", |r: RRef<Vec<u64>>| async move {
        let v = r.local_value().await.map_err(|e| e.to_string())?;
        Ok::<_, String>(v.iter().sum::<u64>())
    })
    .expect("registered once");
    // A worker given a reference fetches its value from the owner.
    f.register("sum_fetched", |r: RRef<Vec<u64>>| async move {
        let v = r.to_here(None).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(v.iter().sum::<u64>())
    })
    .expect("registered once");
    // A hop of a fire-and-forget chain: counted, and the next hop started, not awaited.
    f.register_with_context("hop", move |ctx: CallContext, left: u32| {
        let hops = hops.clone();
        async move {
            hops.fetch_add(1, Ordering::SeqCst);
            if left > 0 {
                let agent = ctx.agent();
                let world = agent.worker_infos().len() as u32;
                let next = (agent.worker_info().id + 1) % world;
                let _unawaited = agent
                    .rpc_async::<_, ()>(next, "hop", &(left - 1), None)
                    .map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(())
        }
    })
    .expect("registered once");
    f
}

/// One operation of the workload, drawn from the seed.
#[derive(Debug, Clone, Copy)]
enum Op {
    Call {
        to: u32,
        a: u64,
        b: u64,
    },
    RemoteToHere {
        owner: u32,
        n: u64,
        ms: u64,
    },
    OwnerReads {
        owner: u32,
        n: u64,
        ms: u64,
    },
    ForkFetch {
        owner: u32,
        via: u32,
        n: u64,
        ms: u64,
    },
    Chain {
        to: u32,
        hops: u32,
    },
}

/// What one seed runs: the world, the network's delay, the faults per rank and each worker's
/// operations.
#[derive(Debug)]
struct Plan {
    world: usize,
    frame_delay: Duration,
    faults: Vec<(usize, Fault)>,
    ops: Vec<Vec<Op>>,
}

impl Plan {
    fn draw(seed: u64) -> Plan {
        let mut rng = SimRng::new(seed);
        let world = 2 + rng.below(3);
        let frame_delay = Duration::from_micros(rng.below(2_000) as u64);
        let mut faults = Vec::new();
        for rank in 0..world {
            for _ in 0..rng.below(3) {
                let kind = *rng.pick(&KINDS).expect("not empty");
                let delay = rng.duration(Duration::from_millis(1), Duration::from_millis(80));
                let count = 1 + rng.below(12);
                faults.push((rank, Fault::new(kind, FaultAction::Delay(delay), count)));
            }
        }
        let ops = (0..world)
            .map(|_| {
                (0..4 + rng.below(12))
                    .map(|_| {
                        let peer = |rng: &mut SimRng| rng.below(world) as u32;
                        let n = rng.next_u64() % 1_000_000;
                        let ms = rng.below(30) as u64;
                        match rng.below(5) {
                            0 => Op::Call {
                                to: peer(&mut rng),
                                a: n,
                                b: rng.next_u64() % 1_000,
                            },
                            1 => Op::RemoteToHere {
                                owner: peer(&mut rng),
                                n,
                                ms,
                            },
                            2 => Op::OwnerReads {
                                owner: peer(&mut rng),
                                n,
                                ms,
                            },
                            3 => Op::ForkFetch {
                                owner: peer(&mut rng),
                                via: peer(&mut rng),
                                n,
                                ms,
                            },
                            _ => Op::Chain {
                                to: peer(&mut rng),
                                hops: rng.below(12) as u32,
                            },
                        }
                    })
                    .collect()
            })
            .collect();
        Plan {
            world,
            frame_delay,
            faults,
            ops,
        }
    }

    /// Hops every chain of the plan runs (a chain of `hops` runs `hops + 1` of them).
    fn expected_hops(&self) -> u64 {
        self.ops
            .iter()
            .flatten()
            .map(|op| match op {
                Op::Chain { hops, .. } => u64::from(*hops) + 1,
                _ => 0,
            })
            .sum()
    }
}

/// Runs `op` on `agent`; an error names the operation and what went wrong.
async fn run_op(agent: &Agent, op: Op) -> Result<(), String> {
    let wrong = |what: &str, got: String| Err(format!("{op:?}: {what}, got {got}"));
    let failed = |e: RpcError| format!("{op:?} failed: {e}");
    match op {
        Op::Call { to, a, b } => {
            let sum: u64 = agent
                .rpc_sync(to, "add", &(a, b), None)
                .await
                .map_err(failed)?;
            if sum != a + b {
                return wrong("the sum", sum.to_string());
            }
        }
        Op::RemoteToHere { owner, n, ms } => {
            let r: RRef<Vec<u64>> = agent
                .remote(owner, "slow_value", &(n, ms), None)
                .map_err(failed)?;
            let v = r.to_here(None).await.map_err(failed)?;
            if v != vec![n; 4] {
                return wrong("the value made", format!("{v:?}"));
            }
        }
        Op::OwnerReads { owner, n, ms } => {
            let r: RRef<Vec<u64>> = agent
                .remote(owner, "slow_value", &(n, ms), None)
                .map_err(failed)?;
            let sum: u64 = agent
                .rpc_sync(owner, "sum_local", &r, None)
                .await
                .map_err(failed)?;
            if sum != 4 * n {
                return wrong("the owner's sum", sum.to_string());
            }
        }
        Op::ForkFetch { owner, via, n, ms } => {
            let r: RRef<Vec<u64>> = agent
                .remote(owner, "slow_value", &(n, ms), None)
                .map_err(failed)?;
            let sum: u64 = agent
                .rpc_sync(via, "sum_fetched", &r, None)
                .await
                .map_err(failed)?;
            if sum != 4 * n {
                return wrong("the fetched sum", sum.to_string());
            }
        }
        Op::Chain { to, hops } => {
            // Fire and forget: the chain goes on after this returns.
            let _unawaited = agent
                .rpc_async::<_, ()>(to, "hop", &hops, None)
                .map_err(failed)?;
        }
    }
    Ok(())
}

/// Runs seed `seed`: `Err` names the seed and the first invariant it broke.
fn run_seed(seed: u64) -> Result<(), String> {
    let plan = Plan::draw(seed);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .map_err(|e| e.to_string())?;
    let outcome = runtime.block_on(async {
        let hops = Arc::new(AtomicU64::new(0));
        let mut backend = FaultyBackend::new();
        for (rank, fault) in &plan.faults {
            backend = backend.with_fault(*rank, *fault);
        }
        let cluster = MemoryCluster::on(tensorwire_transport_memory::MemoryNetwork::with_delay(
            plan.frame_delay,
        ))
        .with_faults(Arc::new(backend));
        let serving = hops.clone();
        let agents = cluster
            .group(plan.world, move |_, options| {
                options.functions = functions(serving.clone());
            })
            .await
            .map_err(|e| format!("the group did not start: {e:?}"))?;
        let workers: Vec<_> = agents
            .into_iter()
            .zip(plan.ops.iter().cloned())
            .map(|(agent, ops)| {
                tokio::spawn(async move {
                    let runs: Vec<_> = ops
                        .iter()
                        .map(|&op| {
                            let agent = agent.clone();
                            tokio::spawn(async move { run_op(&agent, op).await })
                        })
                        .collect();
                    let mut results = Vec::with_capacity(runs.len());
                    for run in runs {
                        results.push(run.await.unwrap_or_else(|e| Err(e.to_string())));
                    }
                    let shutdown = agent
                        .shutdown(Shutdown::graceful(Duration::from_secs(120)))
                        .await
                        .map_err(|e| format!("the graceful shutdown failed: {e}"));
                    (results, shutdown)
                })
            })
            .collect();
        let mut first_error = None;
        for (rank, worker) in workers.into_iter().enumerate() {
            let (results, shutdown) = worker.await.map_err(|e| e.to_string())?;
            for e in results
                .into_iter()
                .filter_map(Result::err)
                .chain(shutdown.err())
            {
                first_error.get_or_insert(format!("w{rank}: {e}"));
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        let ran = hops.load(Ordering::SeqCst);
        if ran != plan.expected_hops() {
            return Err(format!("{ran} of {} chain hops ran", plan.expected_hops()));
        }
        Ok(())
    });
    outcome.map_err(|e| format!("seed {seed} (replay with TW_SIM_SEED={seed}): {e}\n{plan:#?}"))
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.parse()
            .unwrap_or_else(|_| panic!("{name} must be a number, not {v:?}")),
    )
}

#[test]
fn clusters_of_real_agents_keep_every_invariant_across_seeds() {
    let seeds: Vec<u64> = match env_u64("TW_SIM_SEED") {
        Some(seed) => vec![seed],
        None => (0..env_u64("TW_SIM_SEEDS").unwrap_or(200)).collect(),
    };
    let failures: Vec<String> = seeds
        .iter()
        .filter_map(|&seed| run_seed(seed).err())
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} seeds failed; the first: {}",
        failures.len(),
        seeds.len(),
        failures[0]
    );
}

/// The plan is the seed's: the same seed draws the same world, faults and operations.
#[test]
fn a_seed_draws_the_same_plan_every_time() {
    for seed in [0, 7, 12345] {
        assert_eq!(
            format!("{:?}", Plan::draw(seed)),
            format!("{:?}", Plan::draw(seed))
        );
    }
    assert_ne!(
        format!("{:?}", Plan::draw(1)),
        format!("{:?}", Plan::draw(2))
    );
}
