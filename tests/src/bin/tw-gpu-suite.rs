//! The GPU bundle's checks and benches on the real CUDA backend (`cargo xtask gpu-bundle`): one
//! rank of a group started by `tensorwire launch` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
//! TENSORWIRE_SECRET), `tw-gpu-suite SCENARIO`.
//!
//! Every scenario prints `SKIPPED: <reason>` and exits 0 where it cannot run (no driver, no
//! GPU, no NCCL, too few GPUs), `OK <what>` lines for what it checked, and on rank 0 one
//! `RESULT {json}` line with its figures; a failed check prints `FAIL: ...` on stderr and exits 1.
//!
//! - `ipc` (world 2, both ranks on `cuda:0`, maps `cuda:0 -> cuda:0`): a 4 MiB tensor's round
//!   trip by device maps and by `remote()` + `to_here()`, checked byte for byte, and which path
//!   the agent reports for the peer:
//!   by CUDA IPC handle, or staged with `TENSORWIRE_CUDA_IPC=0` (the run is then the staged
//!   path's). Then the benches: the RPC of a 256 MiB device tensor to the other process (the
//!   callee sees it on its device), a device-to-device copy of 256 MiB in one process (the
//!   limit), and a small call with one CUDA tensor against the same call with a CPU tensor.
//! - `nccl-bench` (world = GPUs, rank r on `cuda:r`): an `nccl` group's all_reduce of 256 MiB
//!   (f32, sum), checked, median time (compare `torch_allreduce.py` in the bundle).
//! - `nccl-timeout` (world 2, two GPUs): rank 1 hangs on purpose after the group is set up;
//!   rank 0's all_reduce fails by the group's timeout (5 s) and the group is broken after it.
//! - `nccl-async-error` (world 2, two GPUs): rank 1 exits after setup; rank 0's all_reduce
//!   fails from NCCL's asynchronous error well before the group's timeout (60 s).
//!
//! NCCL refuses two ranks on one GPU, so the two `nccl-*` fault scenarios skip on a machine
//! with one GPU, saying so.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire_core::ports::process_group::TensorCollectives;

use tensorwire_core::collective::ReduceOp;
use tensorwire_core::device::Device;
use tensorwire_core::ports::device::{relocate, DeviceBackend, DeviceIpc};
use tensorwire_core::tensor::{Storage, Tensor};
use tensorwire_devices_cuda::CudaDevices;
use tensorwire_rpc::{init_rpc, Agent, Functions, RpcOptions, Shutdown};

type Error = Box<dyn std::error::Error + Send + Sync>;

fn env(name: &str) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} must be set"))
}

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<(), Error> {
    if cond {
        Ok(())
    } else {
        Err(format!("check failed: {}", what()).into())
    }
}

/// The median of `n` timed runs of `f` (after `warmup` untimed ones), in seconds.
async fn median<F, Fut>(warmup: usize, n: usize, mut f: F) -> Result<f64, Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), Error>>,
{
    for _ in 0..warmup {
        f().await?;
    }
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        f().await?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[n / 2])
}

fn functions(cuda: &CudaDevices) -> Functions {
    let f = Functions::new();
    // The IPC path's parts, apart: the backend's import of a descriptor the caller exported,
    // timed inside the callee (nanoseconds), and the same call's bytes without an import.
    let importer = cuda.clone();
    f.register("import_ns", move |(descriptor, len): (Vec<u8>, u64)| {
        let cuda = importer.clone();
        async move {
            let t = Instant::now();
            let buffer = cuda
                .import(&descriptor, len as usize, Device::Cuda(0))
                .await
                .map_err(|e| e.to_string())?;
            let ns = t.elapsed().as_nanos() as u64;
            drop(buffer);
            Ok::<_, String>(ns)
        }
    })
    .expect("each name once");
    f.register(
        "bytes_len",
        |(descriptor, len): (Vec<u8>, u64)| async move {
            Ok::<_, String>(descriptor.len() as u64 + len)
        },
    )
    .expect("each name once");
    f.register("where", |t: Tensor| async move {
        Ok::<_, String>((t.device().to_string(), t))
    })
    .expect("each name once");
    // The callee has the tensor on its device; only its size comes back.
    f.register("nbytes", |t: Tensor| async move {
        Ok::<_, String>((t.device().to_string(), t.nbytes() as u64))
    })
    .expect("each name once");
    f
}

const MIB: usize = 1 << 20;

async fn on_gpu(cuda: &CudaDevices, bytes: usize) -> Result<Tensor, Error> {
    let values: Vec<f32> = (0..bytes / 4).map(|i| (i % 9973) as f32).collect();
    let host = Tensor::from_f32(vec![values.len()], &values)?;
    Ok(relocate(cuda, &host, Device::Cuda(0)).await?)
}

async fn ipc(cuda: CudaDevices) -> Result<(), Error> {
    let (rank, world) = (env("RANK"), env("WORLD_SIZE"));
    check(world == 2, || "the ipc scenario runs at world 2".into())?;
    let peer = 1 - rank;
    let mut options = RpcOptions {
        functions: functions(&cuda),
        init_timeout: Duration::from_secs(60),
        device_backend: Arc::new(cuda.clone()),
        ..RpcOptions::default()
    };
    options.set_device_map(&format!("w{peer}"), &[("cuda:0", "cuda:0")])?;
    let agent = init_rpc(&format!("w{rank}"), rank, Some(world), options).await?;
    let staged_run = std::env::var("TENSORWIRE_CUDA_IPC").is_ok_and(|v| v == "0");
    let path = if staged_run { "staged" } else { "ipc" };
    if rank == 0 {
        let result = ipc_rank0(&agent, &cuda, staged_run, path).await;
        agent
            .barrier("benches-done", Duration::from_secs(300))
            .await?;
        agent
            .shutdown(Shutdown::graceful(Duration::from_secs(60)))
            .await?;
        result?;
    } else {
        agent
            .barrier("benches-done", Duration::from_secs(300))
            .await?;
        agent
            .shutdown(Shutdown::graceful(Duration::from_secs(60)))
            .await?;
        println!("OK ipc rank 1");
    }
    Ok(())
}

async fn ipc_rank0(
    agent: &Agent,
    cuda: &CudaDevices,
    staged_run: bool,
    path: &str,
) -> Result<(), Error> {
    // Correctness, both ways (the reply comes back by the reverse map).
    let t = on_gpu(cuda, 4 * MIB).await?;
    let want = relocate(cuda, &t, Device::Cpu).await?.to_f32_vec();
    for _ in 0..3 {
        let (landed, back): (String, Tensor) = agent.rpc_sync("w1", "where", &t, None).await?;
        check(
            landed == "cuda:0" && back.device() == Device::Cuda(0),
            || format!("landed on {landed}, back on {}", back.device()),
        )?;
        let got = relocate(cuda, &back, Device::Cpu).await?.to_f32_vec();
        check(got == want, || "4 MiB changed on the way".into())?;
    }
    // remote() with a CUDA tensor in its arguments, then to_here() at once: the value (with
    // the tensor on w1's cuda:0) comes back by w1's reverse map.
    let rref: tensorwire_rpc::RRef<(String, Tensor)> = agent.remote("w1", "where", &t, None)?;
    let (landed, back) = rref.to_here(None).await?;
    let got = relocate(cuda, &back, Device::Cpu).await?.to_f32_vec();
    check(
        landed == "cuda:0" && back.device() == Device::Cuda(0) && got == want,
        || format!("remote(): landed on {landed}, back on {}", back.device()),
    )?;
    drop(rref);
    println!("OK remote() with a CUDA tensor and to_here()");
    let paths = agent.device_paths();
    let p = paths.first().ok_or("no path reported for w1")?;
    println!("PATHS {p:?}");
    if staged_run {
        check(p.sent_ipc == 0 && p.received_ipc == 0, || {
            format!("IPC turned off, yet used: {p:?}")
        })?;
    } else {
        check(p.sent_ipc >= 1 && p.received_ipc >= 1, || {
            format!("same host, same GPU, yet not by IPC: {p:?}")
        })?;
    }
    println!("OK ipc correctness over the {path} path");

    // 256 MiB to the other process.
    let big = on_gpu(cuda, 256 * MIB).await?;
    let rpc_s = median(2, 10, || async {
        let (landed, n): (String, u64) = agent.rpc_sync("w1", "nbytes", &big, None).await?;
        check(landed == "cuda:0" && n == (256 * MIB) as u64, || {
            format!("{n} bytes on {landed}")
        })
    })
    .await?;
    // The limit: a device-to-device copy of the same size in this process.
    let Storage::Device(buffer) = big.storage() else {
        return Err("the tensor is not on a device".into());
    };
    let memcpy_s = median(2, 10, || async {
        // Another buffer on the same device: a stream-ordered device-to-device copy, waited for.
        cuda.between(buffer, Device::Cuda(0)).await?;
        Ok(())
    })
    .await?;
    // Small calls: one CUDA tensor against one CPU tensor of the same size.
    let small_gpu = on_gpu(cuda, 1024).await?;
    let small_cpu = relocate(cuda, &small_gpu, Device::Cpu).await?;
    let cuda_call_s = median(20, 200, || async {
        let _: (String, u64) = agent.rpc_sync("w1", "nbytes", &small_gpu, None).await?;
        Ok(())
    })
    .await?;
    let cpu_call_s = median(20, 200, || async {
        let _: (String, u64) = agent.rpc_sync("w1", "nbytes", &small_cpu, None).await?;
        Ok(())
    })
    .await?;
    let parts = if staged_run {
        String::new()
    } else {
        ipc_parts(agent, cuda, &small_gpu, &big).await?
    };
    let paths = agent.device_paths();
    println!(
        "RESULT {{{parts}\"path\": \"{path}\", \"rpc_256mib_s\": {rpc_s:.6}, \"memcpy_256mib_s\": \
         {memcpy_s:.6}, \"rpc_over_memcpy_throughput\": {:.3}, \"small_call_cuda_s\": \
         {cuda_call_s:.7}, \"small_call_cpu_s\": {cpu_call_s:.7}, \"cuda_over_cpu_latency\": \
         {:.3}, \"sent_ipc\": {}, \"sent_staged\": {}, \"last_staged\": \"{}\"}}",
        memcpy_s / rpc_s,
        cuda_call_s / cpu_call_s,
        paths[0].sent_ipc,
        paths[0].sent_staged,
        paths[0]
            .last_staged
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default()
            .replace('"', "'"),
    );
    Ok(())
}

/// The IPC path's parts for a small and a 256 MiB tensor, as JSON fields (microseconds,
/// medians): the sender's `export`, the receiver's `import` (timed inside the callee), and a call
/// carrying the same descriptor without an import (what the agent adds).
async fn ipc_parts(
    agent: &Agent,
    cuda: &CudaDevices,
    small: &Tensor,
    big: &Tensor,
) -> Result<String, Error> {
    let mut out = String::new();
    for (name, t) in [("small", small), ("big", big)] {
        let Storage::Device(buffer) = t.storage() else {
            return Err("the tensor is not on a device".into());
        };
        let len = t.nbytes() as u64;
        let (mut export_s, mut import_s, mut call_s) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..30 {
            let t0 = Instant::now();
            let export = cuda.export(buffer).await?;
            let exported = t0.elapsed().as_secs_f64();
            let descriptor = export.descriptor.to_vec();
            let ns: u64 = agent
                .rpc_sync("w1", "import_ns", &(descriptor.clone(), len), None)
                .await?;
            let t1 = Instant::now();
            let _: u64 = agent
                .rpc_sync("w1", "bytes_len", &(descriptor, len), None)
                .await?;
            let called = t1.elapsed().as_secs_f64();
            drop(export);
            if i >= 5 {
                export_s.push(exported);
                import_s.push(ns as f64 / 1e9);
                call_s.push(called);
            }
        }
        for (what, v) in [
            ("export", &mut export_s),
            ("import", &mut import_s),
            ("call_without_import", &mut call_s),
        ] {
            v.sort_by(f64::total_cmp);
            out.push_str(&format!(
                "\"{what}_{name}_us\": {:.1}, ",
                v[v.len() / 2] * 1e6
            ));
        }
    }
    Ok(out)
}

/// The device this rank's NCCL group uses: `cuda:RANK`.
fn nccl_device(cuda: &CudaDevices, rank: usize, needed: usize) -> Result<Device, String> {
    let count = cuda.device_count() as usize;
    if count < needed {
        return Err(format!(
            "needs {needed} GPUs, this machine has {count} (NCCL refuses two ranks on one GPU)"
        ));
    }
    Ok(Device::Cuda(rank as u8))
}

async fn nccl_group(
    device: Device,
    timeout: Duration,
) -> Result<Arc<dyn tensorwire_core::ports::process_group::ProcessGroup>, String> {
    tensorwire_process_group::new_group("nccl", timeout, device, Vec::new())
        .await
        .map_err(|e| e.to_string())
}

async fn nccl_bench(cuda: CudaDevices) -> Result<(), Error> {
    let (rank, world) = (env("RANK"), env("WORLD_SIZE"));
    let device = match nccl_device(&cuda, rank, world) {
        Ok(d) => d,
        Err(why) => {
            println!("SKIPPED: {why}");
            return Ok(());
        }
    };
    let pg = match nccl_group(device, Duration::from_secs(120)).await {
        Ok(pg) => pg,
        Err(why) => {
            println!("SKIPPED: the nccl group cannot be set up here: {why}");
            return Ok(());
        }
    };
    let n = 64 * MIB; // f32: 256 MiB
    let host = Tensor::from_f32(vec![n], &vec![rank as f32 + 1.0; n])?;
    let mine = relocate(&cuda, &host, device).await?;
    let sum = pg.all_reduce_tensor(&mine, ReduceOp::Sum).await?;
    let want = (world * (world + 1) / 2) as f32;
    let got = relocate(&cuda, &sum, Device::Cpu).await?.to_f32_vec();
    check(got.is_some_and(|v| v.iter().all(|x| *x == want)), || {
        format!("all_reduce of 256 MiB is not {want} everywhere")
    })?;
    let s = median(3, 10, || async {
        pg.all_reduce_tensor(&mine, ReduceOp::Sum).await?;
        Ok(())
    })
    .await?;
    pg.shutdown().await;
    println!("OK nccl all_reduce 256 MiB rank {rank}");
    if rank == 0 {
        println!(
            "RESULT {{\"world\": {world}, \"nccl_all_reduce_256mib_s\": {s:.6}, \
             \"algbw_gb_s\": {:.2}}}",
            (256 * MIB) as f64 / s / 1e9
        );
    }
    Ok(())
}

async fn nccl_fault(cuda: CudaDevices, hang: bool) -> Result<(), Error> {
    let (rank, world) = (env("RANK"), env("WORLD_SIZE"));
    check(world == 2, || {
        "the nccl fault scenarios run at world 2".into()
    })?;
    let device = match nccl_device(&cuda, rank, 2) {
        Ok(d) => d,
        Err(why) => {
            println!("SKIPPED: {why}");
            return Ok(());
        }
    };
    let timeout = if hang {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(60)
    };
    let pg = match nccl_group(device, timeout).await {
        Ok(pg) => pg,
        Err(why) => {
            println!("SKIPPED: the nccl group cannot be set up here: {why}");
            return Ok(());
        }
    };
    let t = relocate(&cuda, &Tensor::from_f32(vec![1024], &[1.0; 1024])?, device).await?;
    pg.all_reduce_tensor(&t, ReduceOp::Sum).await?;
    if rank == 1 {
        if hang {
            // Hang on purpose: never join the next collective.
            println!("OK rank 1 hangs");
            tokio::time::sleep(Duration::from_secs(25)).await;
        } else {
            println!("OK rank 1 exits");
        }
        std::process::exit(0);
    }
    let started = Instant::now();
    let e = pg
        .all_reduce_tensor(&t, ReduceOp::Sum)
        .await
        .err()
        .ok_or("the all_reduce succeeded without its peer")?;
    let took = started.elapsed();
    println!("OK rank 0's all_reduce failed after {took:?}: {e}");
    if hang {
        check(took >= timeout && took < timeout * 3, || {
            format!("the timeout abort took {took:?} (timeout {timeout:?})")
        })?;
    } else {
        check(took < Duration::from_secs(30), || {
            format!("NCCL's asynchronous error took {took:?} (timeout {timeout:?})")
        })?;
    }
    let again = pg.all_reduce_tensor(&t, ReduceOp::Sum).await;
    check(again.is_err(), || {
        "the group still works after an abort".into()
    })?;
    println!(
        "RESULT {{\"scenario\": \"{}\", \"detected_after_s\": {:.3}}}",
        if hang { "timeout-abort" } else { "async-error" },
        took.as_secs_f64()
    );
    // The peer is gone or hung: leave without the group's shutdown handshake.
    std::process::exit(0);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> ExitCode {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    tensorwire_tests::announce_store_addr();
    // The process's shared backend: the `nccl` group's factory allocates and checks buffers
    // with it, and a tensor of another `CudaDevices` is refused as another backend's.
    let cuda = CudaDevices::shared().clone();
    if let Some(why) = cuda.unavailable() {
        println!("SKIPPED: no usable CUDA device: {why}");
        return ExitCode::SUCCESS;
    }
    let result = match scenario.as_str() {
        "ipc" => ipc(cuda).await,
        "nccl-bench" => nccl_bench(cuda).await,
        "nccl-timeout" => nccl_fault(cuda, true).await,
        "nccl-async-error" => nccl_fault(cuda, false).await,
        other => Err(format!(
            "unknown scenario {other:?}; use ipc, nccl-bench, nccl-timeout or nccl-async-error"
        )
        .into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "FAIL: rank {}: {e}",
                std::env::var("RANK").unwrap_or_default()
            );
            ExitCode::FAILURE
        }
    }
}
