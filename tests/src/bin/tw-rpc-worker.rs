//! A worker process for the multi-process RPC tests: `tw-rpc-worker SCENARIO`, with RANK,
//! WORLD_SIZE, MASTER_ADDR, MASTER_PORT and TENSORWIRE_SECRET in the environment.
//!
//! Each scenario prints `OK ...` lines the test checks, and exits 0 when everything it checked
//! held, 1 (with the error on stderr) otherwise.
//!
//! `TW_DEVICES` picks the device backend every scenario runs on: `simulated` (the default: two
//! simulated CUDA devices) or `cuda` (the real backend). With `cuda` and no usable GPU the
//! worker prints `SKIPPED: <reason>` and exits 0 before doing anything else.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire_core::ports::process_group::Collectives;

use std::sync::OnceLock;

use tensorwire_core::device::Device;
use tensorwire_core::devices_sim::SimulatedDevices;
use tensorwire_core::ports::device::{relocate, DeviceBackend};
use tensorwire_core::tensor::Tensor;
use tensorwire_rpc::{
    init_rpc, Agent, CallContext, Functions, RRef, RemoteErrorKind, RpcError, RpcOptions,
};

fn functions() -> Functions {
    let f = Functions::new();
    tensorwire_tests::workload::register(&f);
    f.register("fail", |(): ()| async move {
        Err::<(), _>("deliberate failure")
    })
    .expect("each name is registered once");
    f.register("tensor_where", |t: Tensor| async move {
        Ok::<_, String>((t.device().to_string(), t))
    })
    .expect("each name is registered once");
    register_chain_and_owner_functions(&f);
    f
}

/// Hops of fire-and-forget chains run on this worker (scenario `chains`).
static HOPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The functions of the `chains` and `owner-local` scenarios.
fn register_chain_and_owner_functions(f: &Functions) {
    // A hop of a chain: count it, start the next hop on the next worker without awaiting it
    // (fire and forget: PyTorch's `rpc_async` whose future is dropped), and return at once.
    f.register_with_context("hop", |ctx: CallContext, left: u32| async move {
        HOPS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if left > 0 {
            let agent = ctx.agent();
            let world = agent.worker_infos().len() as u32;
            let next = (agent.worker_info().id + 1) % world;
            let _unawaited = agent
                .rpc_async::<_, ()>(next, "hop", &(left - 1), None)
                .map_err(|e| e.to_string())?;
        }
        Ok::<_, String>(())
    })
    .expect("each name is registered once");
    // A value that takes a while to make: the owner runs it as the creation of a `remote()`.
    f.register("slow_value", |n: u64| async move {
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
        Ok::<_, String>(vec![n; 4])
    })
    .expect("each name is registered once");
    // Reads the value of a reference this worker owns (PyTorch's `rref.local_value()`).
    f.register("sum_local", |r: RRef<Vec<u64>>| async move {
        let v = r.local_value().await.map_err(|e| e.to_string())?;
        Ok::<_, String>(v.iter().sum::<u64>())
    })
    .expect("each name is registered once");
}

fn env(name: &str) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} must be set"))
}

static DEVICES: OnceLock<Arc<dyn DeviceBackend>> = OnceLock::new();

/// The device backend `TW_DEVICES` names, or why it cannot be used here.
fn choose_devices() -> Result<Arc<dyn DeviceBackend>, String> {
    match std::env::var("TW_DEVICES").as_deref() {
        Err(_) | Ok("simulated") => Ok(Arc::new(SimulatedDevices::new(2))),
        Ok("cuda") => {
            let cuda = tensorwire_devices_cuda::CudaDevices::new();
            match cuda.unavailable() {
                None => Ok(Arc::new(cuda)),
                Some(why) => Err(format!("no CUDA device for TW_DEVICES=cuda: {why}")),
            }
        }
        Ok(other) => {
            eprintln!("unknown TW_DEVICES={other:?}; use simulated or cuda");
            std::process::exit(2);
        }
    }
}

/// The backend every scenario's agent uses (and makes its device tensors with).
fn devices() -> Arc<dyn DeviceBackend> {
    DEVICES.get().expect("chosen in main").clone()
}

/// The device a `cpu` map entry sends to: `cuda:1` when there are two devices, else `cuda:0`.
fn target_device() -> Device {
    Device::Cuda(devices().device_count().min(2).saturating_sub(1) as u8)
}

/// Why a scenario failed: the agent's error, or a check of the scenario's own (free text: what
/// it expected).
type Failure = Box<dyn std::error::Error + Send + Sync>;

/// A scenario's outcome.
type Outcome = Result<(), Failure>;

async fn start(
    tweak: impl FnOnce(usize, &mut RpcOptions),
) -> Result<(Agent, usize, usize), RpcError> {
    let (rank, world) = (env("RANK"), env("WORLD_SIZE"));
    let mut options = RpcOptions {
        functions: functions(),
        init_timeout: Duration::from_secs(60),
        device_backend: devices(),
        ..RpcOptions::default()
    };
    tweak(rank, &mut options);
    let agent = init_rpc(&format!("w{rank}"), rank, Some(world), options).await?;
    Ok((agent, rank, world))
}

fn check(cond: bool, what: &str) -> Outcome {
    if cond {
        Ok(())
    } else {
        Err(format!("check failed: {what}").into())
    }
}

async fn basic() -> Outcome {
    let target = target_device();
    let (agent, rank, world) = start(|rank, o| {
        let next = (rank + 1) % env("WORLD_SIZE");
        o.set_device_map(&format!("w{next}"), &[("cpu", &target.to_string())])
            .expect("valid map");
    })
    .await?;
    // The agent says which transport it chose for each peer (a static group connects to all).
    let connections = agent.connections();
    check(
        connections.len() == world - 1,
        "one connection per other worker",
    )?;
    for c in &connections {
        println!("PEER-TRANSPORT {rank} {} {}", c.peer.name, c.transport);
    }
    // Everyone calls everyone, by name and by rank.
    for peer in 0..world {
        let got: String = agent.rpc_sync(peer as u32, "whoami", &(), None).await?;
        check(
            got == peer.to_string(),
            "whoami answers with the callee's rank",
        )?;
        let sum: i64 = agent
            .rpc_sync(format!("w{peer}"), "add", &(rank as i64, peer as i64), None)
            .await?;
        check(sum == (rank + peer) as i64, "add")?;
    }
    // Many calls in flight.
    let next = (rank + 1) % world;
    let futs: Vec<_> = (0..500i64)
        .map(|i| agent.rpc_async::<_, i64>(next as u32, "add", &(i, 1i64), None))
        .collect::<Result<_, _>>()?;
    for (i, f) in futs.into_iter().enumerate() {
        check(f.await? == i as i64 + 1, "async results in order")?;
    }
    // Remote errors.
    let e = agent
        .rpc_sync::<_, ()>(next as u32, "fail", &(), None)
        .await
        .expect_err("fail fails");
    check(
        e.remote().map(|r| r.kind) == Some(RemoteErrorKind::Failed),
        "remote failure kind",
    )?;
    // RRefs: a value on the next worker, passed to the one after, methods on the owner's value.
    let v: RRef<Vec<i64>> = agent.remote(next as u32, "make_vec", &5i64, None)?;
    let third = (rank + 2) % world;
    let s: i64 = agent.rpc_sync(third as u32, "sum_rref", &v, None).await?;
    check(s == 10, "a forked RRef fetched by a third worker")?;
    let c: RRef<tensorwire_tests::workload::Counter> =
        agent.remote(next as u32, "make_counter", &100i64, None)?;
    check(
        c.rpc_sync::<_, i64>("increment", &1i64, None).await? == 101,
        "method on the owner's value",
    )?;
    check(
        c.rpc_sync::<_, i64>("increment", &1i64, None).await? == 102,
        "the owner's value keeps its state",
    )?;
    drop((v, c));
    // Tensors: CPU tensors to the next worker land on its target device (cuda:1 with two
    // devices); replies come back to cpu.
    let t = Tensor::from_f32(vec![4], &[1.0, 2.0, 3.0, 4.0]).expect("tensor");
    let (landed, back): (String, Tensor) = agent
        .rpc_sync(next as u32, "tensor_where", &t, None)
        .await?;
    check(
        landed == target.to_string() && back.device() == Device::Cpu,
        "device map and reverse map",
    )?;
    check(
        back.to_f32_vec() == Some(vec![1.0, 2.0, 3.0, 4.0]),
        "tensor bytes survive",
    )?;
    // A CUDA tensor to a worker this one has no map for fails at once; the agent stays usable.
    let prev = ((rank + world - 1) % world) as u32;
    if prev != next as u32 {
        let on_gpu = relocate(&*devices(), &t, Device::Cuda(0)).await?;
        let e = agent
            .rpc_async::<_, (String, Tensor)>(prev, "tensor_where", &on_gpu, None)
            .err();
        let wanted = format!("cannot send a tensor on cuda:0 to worker w{prev}");
        check(
            e.is_some_and(|e| e.to_string().contains(&wanted)),
            "no map, no send",
        )?;
    }
    // A call that outlives its timeout fails saying so; the callee keeps serving.
    let e = agent
        .rpc_sync::<_, u64>(
            next as u32,
            "sleep_ms",
            &1_000u64,
            Some(Duration::from_millis(50)),
        )
        .await
        .expect_err("times out");
    check(
        e.is_timeout() && e.to_string().contains("timed out"),
        "per-call timeout",
    )?;
    let all: Vec<usize> = agent
        .all_gather("ranks", &rank, Duration::from_secs(30))
        .await?;
    check(
        all == (0..world).collect::<Vec<_>>(),
        "all_gather in rank order",
    )?;
    agent.barrier("basic-done", Duration::from_secs(30)).await?;
    let t0 = Instant::now();
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(30)))
        .await?;
    println!(
        "OK basic rank {rank} shutdown_ms={}",
        t0.elapsed().as_millis()
    );
    let e = agent
        .rpc_sync::<_, i64>(next as u32, "add", &(1i64, 1i64), None)
        .await
        .expect_err("after shutdown");
    check(
        e.to_string().contains("no longer running"),
        "calls after shutdown fail clearly",
    )?;
    Ok(())
}

/// Rank `WORLD_SIZE - 1` is killed by the test after READY; the others then call it and shut
/// down, and must get errors naming it.
async fn dead_peer() -> Outcome {
    let (agent, rank, world) = start(|_, _| {}).await?;
    let victim = (world - 1) as u32;
    println!("READY {rank}");
    if rank == world - 1 {
        tokio::time::sleep(Duration::from_secs(60)).await;
        return Ok(());
    }
    // Wait for the test to kill the victim: our connection to it breaks.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match agent
            .rpc_sync::<_, String>(victim, "whoami", &(), Some(Duration::from_secs(2)))
            .await
        {
            Ok(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Ok(_) => return Err("the victim never died".into()),
            Err(e) => {
                println!("OK call-error rank {rank}: {e}");
                break;
            }
        }
    }
    let t0 = Instant::now();
    match agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(3)))
        .await
    {
        Ok(()) => Err("graceful shutdown with a dead peer succeeded".into()),
        Err(e) => {
            println!(
                "OK shutdown-error rank {rank} after_ms={}: {e}",
                t0.elapsed().as_millis()
            );
            Ok(())
        }
    }
}

/// Device tensors between processes: a tensor on this worker's `cuda:0` lands on the next
/// worker's `cuda:0` by the map and comes back by the reverse map (4 MiB, bytes checked); one
/// without a map entry fails before sending. On the simulated or the real backend
/// (`TW_DEVICES`).
async fn device_tensors() -> Outcome {
    let backend = devices();
    let (agent, rank, world) = start(|rank, o| {
        let next = (rank + 1) % env("WORLD_SIZE");
        o.set_device_map(&format!("w{next}"), &[("cuda:0", "cuda:0")])
            .expect("valid map");
    })
    .await?;
    let next = ((rank + 1) % world) as u32;
    let values: Vec<f32> = (0..1 << 20).map(|i| i as f32).collect();
    let host = Tensor::from_f32(vec![values.len()], &values).expect("tensor");
    let on_gpu = relocate(&*backend, &host, Device::Cuda(0)).await?;
    let (landed, back): (String, Tensor) =
        agent.rpc_sync(next, "tensor_where", &on_gpu, None).await?;
    check(
        landed == "cuda:0" && back.device() == Device::Cuda(0),
        "the map and the reverse map on real GPUs",
    )?;
    let back_host = relocate(&*backend, &back, Device::Cpu).await?;
    check(
        back_host.to_f32_vec() == Some(values),
        "4 MiB survive cuda:0 -> peer cuda:0 -> cuda:0",
    )?;
    // A worker without a map for its destination cannot send a CUDA tensor.
    let prev = ((rank + world - 1) % world) as u32;
    if prev != next {
        let e = agent
            .rpc_async::<_, (String, Tensor)>(prev, "tensor_where", &on_gpu, None)
            .err();
        check(
            e.is_some_and(|e| e.to_string().contains("cannot send a tensor on cuda:0")),
            "no map, no send",
        )?;
    }
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(30)))
        .await?;
    println!("OK device-tensors rank {rank} on {}", backend.name());
    Ok(())
}

/// One worker calling itself with a device map to itself (`cpu` to its target device): the
/// request's tensor lands on the device, the response comes back to `cpu` by the reverse map.
/// Run with `WORLD_SIZE=1`; the GPU check of the CUDA backend.
async fn self_rpc() -> Outcome {
    let target = target_device();
    let (agent, rank, _) = start(|rank, o| {
        o.set_device_map(&format!("w{rank}"), &[("cpu", &target.to_string())])
            .expect("valid map");
    })
    .await?;
    let values: Vec<f32> = (0..1 << 20).map(|i| i as f32 * 0.25).collect();
    let t = Tensor::from_f32(vec![values.len()], &values).expect("tensor");
    let (landed, back): (String, Tensor) = agent
        .rpc_sync(format!("w{rank}"), "tensor_where", &t, None)
        .await?;
    check(
        landed == target.to_string(),
        "a self call's tensor lands by the map",
    )?;
    check(
        back.device() == Device::Cpu && back.to_f32_vec() == Some(values),
        "4 MiB come back to cpu by the reverse map",
    )?;
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(30)))
        .await?;
    println!("OK self-rpc rank {rank} landed on {landed}");
    Ok(())
}

/// A dynamic group (`world_size = None`): everyone joins, waits to see the others, calls each by
/// name, then the higher ranks leave one by one and rank 0 (the store's host) goes last.
async fn dynamic() -> Outcome {
    let (rank, world) = (env("RANK"), env("WORLD_SIZE"));
    let options = RpcOptions {
        functions: functions(),
        init_timeout: Duration::from_secs(60),
        ..RpcOptions::default()
    };
    let agent = init_rpc(&format!("w{rank}"), rank, None, options).await?;
    let members = |a: &Agent| a.worker_infos().len();
    let deadline = Instant::now() + Duration::from_secs(30);
    while members(&agent) < world {
        check(Instant::now() < deadline, "every worker joins")?;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for peer in (0..world).filter(|p| *p != rank) {
        let got: String = agent
            .rpc_sync(format!("w{peer}"), "whoami", &(), None)
            .await?;
        check(got == peer.to_string(), "calls by name in a dynamic group")?;
    }
    println!("OK dynamic-joined rank {rank}");
    // Nobody leaves before everyone has made its calls.
    agent
        .barrier("dynamic-called", Duration::from_secs(30))
        .await?;
    // Leave from the highest rank down: each waits until the ones above it are gone.
    let deadline = Instant::now() + Duration::from_secs(30);
    while members(&agent) > rank + 1 {
        check(Instant::now() < deadline, "the higher ranks leave")?;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(30)))
        .await?;
    println!("OK dynamic rank {rank}");
    Ok(())
}

/// The agent over the QUIC backend (mutual TLS under a cluster CA kept in `TW_TLS_DIR`, which
/// the first worker creates): calls and a remote reference across the group.
async fn quic() -> Outcome {
    let dir = std::env::var("TW_TLS_DIR").map_err(|_| "TW_TLS_DIR must be set")?;
    let (agent, rank, world) = start(|_, o| {
        o.backend = "QUIC".into();
        o.tls_dir = Some(dir.into());
    })
    .await?;
    let next = ((rank + 1) % world) as u32;
    let sum: i64 = agent
        .rpc_sync(next, "add", &(rank as i64, 100i64), None)
        .await?;
    check(sum == rank as i64 + 100, "add over QUIC")?;
    let v: RRef<Vec<i64>> = agent.remote(next, "make_vec", &4i64, None)?;
    check(
        v.to_here(None).await? == vec![0, 1, 2, 3],
        "to_here over QUIC",
    )?;
    drop(v);
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(30)))
        .await?;
    println!("OK quic rank {rank}");
    Ok(())
}

async fn bad_map() -> Outcome {
    // A target index past every worker's devices.
    let bad = format!("cuda:{}", devices().device_count() + 3);
    let r = start(|rank, o| {
        if rank == 0 {
            o.set_device_map("w1", &[("cuda:0", &bad)])
                .expect("syntactically fine");
        }
    })
    .await;
    match r {
        Ok(_) => Err("init succeeded with a bad device map".into()),
        Err(e) => {
            println!("OK init-error: {e}");
            Ok(())
        }
    }
}

async fn scale() -> Outcome {
    let t0 = Instant::now();
    let (agent, rank, world) = start(|_, _| {}).await?;
    let init = t0.elapsed();
    let next = ((rank + 1) % world) as u32;
    let sum: i64 = agent.rpc_sync(next, "add", &(1i64, 2i64), None).await?;
    check(sum == 3, "add")?;
    let t1 = Instant::now();
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(60)))
        .await?;
    println!(
        "OK scale rank {rank} init_ms={} shutdown_ms={}",
        init.as_millis(),
        t1.elapsed().as_millis()
    );
    Ok(())
}

async fn inflight() -> Outcome {
    let (agent, rank, _) = start(|_, _| {}).await?;
    if rank == 0 {
        // Slow calls in flight while shutting down gracefully: they finish first.
        let slow: Vec<_> = (0..5)
            .map(|_| agent.rpc_async::<_, u64>(1u32, "sleep_ms", &300u64, None))
            .collect::<Result<_, _>>()?;
        let shut = {
            let agent = agent.clone();
            tokio::spawn(async move {
                agent
                    .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(30)))
                    .await
            })
        };
        for f in slow {
            check(
                f.await? == 300,
                "in-flight calls complete during a graceful shutdown",
            )?;
        }
        shut.await??;
    } else {
        agent
            .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(30)))
            .await?;
    }
    println!("OK inflight rank {rank}");
    Ok(())
}

/// Init, then an immediate shutdown, then exit: rank 0 (the store's host) leaves as early as it
/// can, which must not fail anyone's init.
async fn init_shutdown() -> Outcome {
    let (agent, rank, _) = start(|_, _| {}).await?;
    agent.shutdown(tensorwire_rpc::Shutdown::Immediate).await?;
    println!("OK init-shutdown rank {rank}");
    Ok(())
}

/// Every worker starts a 20-hop chain of fire-and-forget calls (each hop calls the next
/// worker with `rpc_async` and returns without awaiting it) and shuts down gracefully at once;
/// prints `HOPS R N`, the hops that ran here. The test checks they add up to 20 per worker.
async fn chains() -> Outcome {
    let (agent, rank, world) = start(|_, _| {}).await?;
    let next = ((rank + 1) % world) as u32;
    let first = agent.rpc_async::<_, ()>(next, "hop", &19u32, None)?;
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(60)))
        .await?;
    first.await?;
    println!(
        "HOPS {rank} {}",
        HOPS.load(std::sync::atomic::Ordering::SeqCst)
    );
    println!("OK chains rank {rank}");
    Ok(())
}

/// The owner's reference while its value is being created: rank 0 makes a value on rank 1
/// with `remote()` and at once calls rank 1 with that reference, where the function reads it
/// with `local_value()`; `TW_REPEAT` times (default 200). Every call must see the value.
async fn owner_local() -> Outcome {
    let (agent, rank, _) = start(|_, _| {}).await?;
    if rank == 0 {
        let repeat = std::env::var("TW_REPEAT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200u64);
        for i in 0..repeat {
            let r: RRef<Vec<u64>> = agent.remote(1u32, "slow_value", &i, None)?;
            let sum: u64 = agent.rpc_sync(1u32, "sum_local", &r, None).await?;
            check(sum == 4 * i, "the owner read the value it created")?;
        }
        println!("OK owner-local rank 0 repeat={repeat}");
    } else {
        println!("OK owner-local rank {rank}");
    }
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(60)))
        .await?;
    Ok(())
}

/// The test stops (SIGSTOP) rank `WORLD_SIZE - 1` after READY and then says `GO` on the
/// others' standard input; they shut down gracefully with a 2 s timeout, which must fail by
/// then naming the frozen worker.
async fn frozen_peer() -> Outcome {
    let (agent, rank, world) = start(|_, _| {}).await?;
    println!("READY {rank}");
    let line = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await?
    .map_err(|e| format!("reading stdin: {e}"))?;
    if rank == world - 1 {
        return Ok(());
    }
    check(line.trim() == "GO", "the test says GO")?;
    let t0 = Instant::now();
    match agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(2)))
        .await
    {
        Ok(()) => Err("graceful shutdown with a frozen peer succeeded".into()),
        Err(e) => {
            println!(
                "OK shutdown-error rank {rank} after_ms={}: {e}",
                t0.elapsed().as_millis()
            );
            Ok(())
        }
    }
}

/// A process group and the store across hosts: `new_group` (env://), each rank publishes the
/// address it advertises in the group's store and checks everyone's (rank `r` must be on
/// `10.77.0.<r / TW_PER_HOST + 1>` when `TW_PER_HOST` is set), then all_reduce, all_gather_object
/// and barrier. Prints `OK pg rank R init_ms=...`.
async fn pg_store() -> Outcome {
    use tensorwire_core::collective::ReduceOp;
    use tensorwire_process_group::{new_group, CollectivesExt};
    use tensorwire_rendezvous::env_init::env_rendezvous;
    // Explicit variables or Slurm's, as the rendezvous reads them.
    let dist = tensorwire_rendezvous::DistEnv::from_env()?;
    let (rank, world) = (dist.rank, dist.world_size);
    let timeout = Duration::from_secs(30);
    let fail = |what: &str, e: &dyn std::fmt::Display| -> Failure { format!("{what}: {e}").into() };
    let t0 = Instant::now();
    let pg = new_group("tensorwire", timeout, Device::Cpu, Vec::new())
        .await
        .map_err(|e| fail("new_group", &e))?;
    let init = t0.elapsed();
    // The group's own store (the rendezvous is reused within the process).
    let store = env_rendezvous(timeout)
        .await
        .map_err(|e| fail("env_rendezvous", &e))?
        .store;
    let me = tensorwire_rendezvous::advertise_ip(None)?;
    store
        .set(&format!("hosts/ip/{rank}"), me.to_string().as_bytes())
        .await?;
    pg.barrier().await.map_err(|e| fail("barrier", &e))?;
    let keys: Vec<String> = (0..world).map(|r| format!("hosts/ip/{r}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let ips = store.multi_get(&keys).await?;
    if let Ok(per_host) = std::env::var("TW_PER_HOST") {
        let per_host: usize = per_host.parse().expect("TW_PER_HOST is a number");
        for (r, ip) in ips.iter().enumerate() {
            let want = format!("10.77.0.{}", r / per_host + 1);
            check(
                *ip == want.as_bytes(),
                &format!(
                    "rank {r} advertises {} (want {want})",
                    String::from_utf8_lossy(ip)
                ),
            )?;
        }
    }
    let mut sum = [rank as i64];
    pg.all_reduce_typed(&mut sum, ReduceOp::Sum)
        .await
        .map_err(|e| fail("all_reduce", &e))?;
    check(
        sum[0] == (world * (world - 1) / 2) as i64,
        "all_reduce across hosts",
    )?;
    let ranks: Vec<usize> = pg
        .all_gather_object(&rank)
        .await
        .map_err(|e| fail("all_gather_object", &e))?;
    check(
        ranks == (0..world).collect::<Vec<_>>(),
        "all_gather_object across hosts",
    )?;
    pg.barrier().await.map_err(|e| fail("barrier", &e))?;
    pg.shutdown().await;
    println!(
        "OK pg rank {rank} local {} init_ms={} me={me}",
        dist.local_rank,
        init.as_millis()
    );
    Ok(())
}

/// A link cut mid-run: everyone starts and prints `READY R`, then waits for a line on stdin.
/// Rank 0, once it reads one (the test cuts a host's link first), calls every other worker at
/// once with a `TW_CALL_TIMEOUT_MS` bound (default 1000) and prints `OK reached wN` or
/// `OK failed wN after_ms=T: ERROR` for each, then exits.
async fn cut() -> Outcome {
    let (agent, rank, world) = start(|_, _| {}).await?;
    println!("READY {rank}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)
    })
    .await;
    if rank != 0 {
        return Ok(());
    }
    let bound = Duration::from_millis(
        std::env::var("TW_CALL_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000),
    );
    let t0 = Instant::now();
    let calls = (1..world)
        .map(|peer| {
            agent
                .rpc_async::<_, String>(peer as u32, "whoami", &(), Some(bound))
                .map(|f| (peer, f))
        })
        .collect::<Result<Vec<_>, _>>()?;
    for (peer, call) in calls {
        match call.await {
            Ok(_) => println!("OK reached w{peer}"),
            Err(e) => println!(
                "OK failed w{peer} after_ms={}: {e}",
                t0.elapsed().as_millis()
            ),
        }
    }
    let _ = std::io::stdout().flush();
    std::process::exit(0);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    tensorwire_tests::announce_store_addr();
    match choose_devices() {
        Ok(d) => {
            let _ = DEVICES.set(d);
        }
        Err(why) => {
            println!("SKIPPED: {why}");
            return ExitCode::SUCCESS;
        }
    }
    let result = match scenario.as_str() {
        "basic" => basic().await,
        "dead-peer" => dead_peer().await,
        "bad-map" => bad_map().await,
        "scale" => scale().await,
        "inflight" => inflight().await,
        "device-tensors" => device_tensors().await,
        "self-rpc" => self_rpc().await,
        "dynamic" => dynamic().await,
        "quic" => quic().await,
        "init-shutdown" => init_shutdown().await,
        "frozen-peer" => frozen_peer().await,
        "pg" => pg_store().await,
        "cut" => cut().await,
        "chains" => chains().await,
        "owner-local" => owner_local().await,
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
