//! `tw-gpu-check`: the GPU checks of the CUDA backend, as one self-contained binary.
//!
//! Built by `cargo xtask gpu` on any machine (no CUDA needed to build) and run on a machine with
//! an NVIDIA GPU. It checks device count and names; host→device→host round trips of 0 B, 1 B,
//! 4 KiB and 64 MiB with byte comparison; device→device copies (same device, and between every
//! pair of devices when there are two or more); device maps between `cpu` and `cuda:0` through
//! `placement`, `reverse` and `relocate`; an RPC agent calling itself with a device map
//! (`cpu` to `cuda:0`, the reply back by the reverse map); with the feature `nccl`, a 1-rank
//! NCCL all_reduce through the wrapper and a 1-rank `nccl` process group running every
//! collective; and measures staging throughput host↔device for 256 MiB through the backend
//! against raw cudarc copies from pinned memory in the same run.
//! It prints PASS/FAIL per check and a summary, and exits non-zero when a check fails (2 when
//! there is no device at all).
//!
//! Options: `--no-bench` skips the throughput measurements; `--bench-mib N` changes their size.

use std::fmt::Write as _;
use std::future::Future;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_core::device::{Device, DeviceMap, DeviceMaps};
use tensorwire_core::placement::{placements, Direction};
use tensorwire_core::ports::device::{relocate, DeviceBackend};
use tensorwire_core::reverse::reverse_device_maps;
use tensorwire_core::tensor::{Storage, Tensor};
use tensorwire_core::validate::{
    validate_device_maps, DeviceMapErrorKind, GroupKind, WorkerDeviceInfo,
};
use tensorwire_devices_cuda::cudarc::driver::{sys, CudaContext};
use tensorwire_devices_cuda::{CudaDevices, StagingOptions, STAGING_CHUNK};

const MIB: usize = 1 << 20;

/// Passed and failed checks.
#[derive(Default)]
struct Report {
    passed: usize,
    failed: Vec<String>,
}

impl Report {
    fn record(&mut self, name: &str, outcome: Result<String, String>) {
        match outcome {
            Ok(detail) => {
                self.passed += 1;
                if detail.is_empty() {
                    println!("PASS {name}");
                } else {
                    println!("PASS {name}: {detail}");
                }
            }
            Err(e) => {
                println!("FAIL {name}: {e}");
                self.failed.push(name.to_owned());
            }
        }
    }
}

/// Bounds every GPU step: a hang is a failure, not a stuck binary.
async fn within<T>(what: &str, f: impl Future<Output = T>) -> Result<T, String> {
    tokio::time::timeout(Duration::from_secs(120), f)
        .await
        .map_err(|_| format!("{what} did not finish within 120 s"))
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect::<Vec<u8>>()
        .into()
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= 1024 && b % 1024 == 0 => format!("{} KiB", b / 1024),
        b => format!("{b} B"),
    }
}

fn first_difference(a: &[u8], b: &[u8]) -> String {
    if a.len() != b.len() {
        return format!("length {} != {}", a.len(), b.len());
    }
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => format!("bytes differ first at offset {i} ({} != {})", a[i], b[i]),
        None => "equal".into(),
    }
}

fn main() -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            println!("FAIL: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(run())
}

async fn run() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bench = !args.iter().any(|a| a == "--no-bench");
    let bench_mib = args
        .iter()
        .position(|a| a == "--bench-mib")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(256);

    println!("tw-gpu-check {}", env!("CARGO_PKG_VERSION"));
    let cuda = CudaDevices::new();
    if let Some(why) = cuda.unavailable() {
        println!("FAIL no CUDA device: {why}");
        println!("SUMMARY: FAIL (no device; nothing else was checked)");
        return ExitCode::from(2);
    }
    let n = cuda.device_count();
    let (major, minor) = cuda.driver_version().unwrap_or_default();
    println!("driver supports CUDA {major}.{minor}; {n} device(s)");
    let mut report = Report::default();
    for i in 0..n {
        let d = Device::Cuda(i as u8);
        let name = cuda.device_name(d);
        let mem = cuda.total_memory(d);
        report.record(
            &format!("device {d}"),
            match (name, mem) {
                (Ok(name), Ok(mem)) => Ok(format!("{name}, {:.1} GiB", mem as f64 / 1073741824.0)),
                (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
            },
        );
    }

    round_trips(&cuda, &mut report).await;
    device_to_device(&cuda, &mut report).await;
    device_maps(&cuda, &mut report).await;
    if bench {
        throughput(&cuda, bench_mib * MIB, &mut report).await;
    } else {
        println!("(throughput skipped: --no-bench)");
    }
    report.record(
        "self-RPC with a device map",
        self_rpc(std::sync::Arc::new(cuda.clone())).await,
    );
    #[cfg(feature = "nccl")]
    {
        report.record(
            "nccl 1-rank all_reduce",
            tensorwire_devices_cuda::nccl::self_check(&cuda).await,
        );
        report.record("nccl process group, 1 rank", nccl_group(&cuda).await);
    }
    #[cfg(not(feature = "nccl"))]
    println!("(NCCL check not built: build with --features nccl, or `cargo xtask gpu --nccl`)");

    println!(
        "SUMMARY: {} — {} passed, {} failed{}",
        if report.failed.is_empty() {
            "PASS"
        } else {
            "FAIL"
        },
        report.passed,
        report.failed.len(),
        if report.failed.is_empty() {
            String::new()
        } else {
            format!(" ({})", report.failed.join(", "))
        }
    );
    if report.failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

async fn round_trip(cuda: &CudaDevices, data: &Bytes, d: Device) -> Result<String, String> {
    let buf = within("to_device", cuda.to_device(data.clone(), d))
        .await?
        .map_err(|e| e.to_string())?;
    if (buf.device(), buf.len()) != (d, data.len()) {
        return Err(format!("buffer is {} bytes on {}", buf.len(), buf.device()));
    }
    let back = within("to_host", cuda.to_host(&buf))
        .await?
        .map_err(|e| e.to_string())?;
    if back != *data {
        return Err(first_difference(data, &back));
    }
    // The returned bytes (pooled pinned memory when large) go back up without staging.
    let again = within("to_device", cuda.to_device(back.clone(), d))
        .await?
        .map_err(|e| e.to_string())?;
    drop(back);
    let back = within("to_host", cuda.to_host(&again))
        .await?
        .map_err(|e| e.to_string())?;
    if back != *data {
        return Err(format!(
            "second round trip: {}",
            first_difference(data, &back)
        ));
    }
    Ok(String::new())
}

async fn round_trips(cuda: &CudaDevices, report: &mut Report) {
    for (k, size) in [0, 1, 4096, 64 * MIB].into_iter().enumerate() {
        let data = pattern(size, k as u8 + 1);
        let r = round_trip(cuda, &data, Device::Cuda(0)).await;
        report.record(&format!("round trip cpu→cuda:0→cpu {}", human(size)), r);
    }
    // Sizes around the staging chunk (partial last chunk, exact multiple).
    for size in [STAGING_CHUNK - 1, 3 * STAGING_CHUNK, 3 * STAGING_CHUNK + 5] {
        let data = pattern(size, 9);
        let r = round_trip(cuda, &data, Device::Cuda(0)).await;
        report.record(&format!("round trip cpu→cuda:0→cpu {size} B"), r);
    }
}

async fn copy_between(
    cuda: &CudaDevices,
    data: &Bytes,
    from: Device,
    to: Device,
) -> Result<String, String> {
    let src = within("to_device", cuda.to_device(data.clone(), from))
        .await?
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let dst = within("between", cuda.between(&src, to))
        .await?
        .map_err(|e| e.to_string())?;
    let secs = start.elapsed().as_secs_f64();
    if dst.device() != to {
        return Err(format!("landed on {}", dst.device()));
    }
    drop(src);
    let back = within("to_host", cuda.to_host(&dst))
        .await?
        .map_err(|e| e.to_string())?;
    if back != *data {
        return Err(first_difference(data, &back));
    }
    Ok(format!("{:.1} GB/s", data.len() as f64 / secs / 1e9))
}

async fn device_to_device(cuda: &CudaDevices, report: &mut Report) {
    let data = pattern(64 * MIB, 3);
    for size in [0, 1, 64 * MIB] {
        let r = copy_between(cuda, &data.slice(..size), Device::Cuda(0), Device::Cuda(0)).await;
        report.record(&format!("copy cuda:0→cuda:0 {}", human(size)), r);
    }
    let n = cuda.device_count();
    if n < 2 {
        println!("(peer copies skipped: this machine has {n} device)");
        return;
    }
    for a in 0..n as u8 {
        for b in 0..n as u8 {
            if a == b {
                continue;
            }
            let (from, to) = (Device::Cuda(a), Device::Cuda(b));
            let how = match cuda.can_access_peer(to, from) {
                Ok(true) => "peer",
                Ok(false) => "staged through host",
                Err(e) => {
                    report.record(&format!("peer capability {from}→{to}"), Err(e.to_string()));
                    continue;
                }
            };
            let r = copy_between(cuda, &data, from, to).await;
            report.record(&format!("copy {from}→{to} 64 MiB ({how})"), r);
        }
    }
}

async fn device_maps(cuda: &CudaDevices, report: &mut Report) {
    let n = cuda.device_count();
    // The group: the trainer sends its CPU tensors to the parameter server's cuda:0.
    let mut maps = DeviceMaps::new();
    maps.insert(
        "ps",
        [(Device::Cpu, Device::Cuda(0))]
            .into_iter()
            .collect::<DeviceMap>(),
    );
    let trainer = WorkerDeviceInfo {
        name: "trainer".into(),
        device_count: n,
        devices: vec![],
        device_maps: maps,
    };
    let ps = WorkerDeviceInfo {
        name: "ps".into(),
        device_count: n,
        devices: vec![Device::Cuda(0)],
        ..Default::default()
    };
    let group = [trainer.clone(), ps.clone()];
    report.record(
        "device map cpu→cuda:0 validates",
        validate_device_maps(&group, GroupKind::Static)
            .map(|()| String::new())
            .map_err(|e| e.to_string()),
    );
    // A map naming a device index this machine lacks fails with the invalid-index error.
    let mut bad = trainer.clone();
    let beyond = Device::Cuda(n as u8);
    bad.device_maps.insert(
        "ps",
        [(Device::Cpu, beyond)].into_iter().collect::<DeviceMap>(),
    );
    // (ps declares no device list here: with one, PyTorch's earlier "unexpected target
    // devices" rule fires first.)
    let ps_any = WorkerDeviceInfo {
        devices: vec![],
        ..ps.clone()
    };
    report.record(
        &format!("device map naming {beyond} is refused"),
        match validate_device_maps(&[bad, ps_any], GroupKind::Static) {
            Err(e) if e.kind() == DeviceMapErrorKind::InvalidTargetDeviceIndices => {
                Ok(e.to_string().replace('\n', "; "))
            }
            Err(e) => Err(format!("wrong error: {e}")),
            Ok(()) => Err("accepted".into()),
        },
    );

    let outcome = async {
        let values: Vec<f32> = (0..4096).map(|i| i as f32 * 0.25 - 3.0).collect();
        let t = Tensor::from_f32(vec![64, 64], &values).map_err(|e| e.to_string())?;
        // Request: the trainer's map for ps.
        let to = placements(
            "ps",
            trainer.device_maps.get("ps"),
            [t.device()],
            Direction::Request,
        )
        .map_err(|e| e.to_string())?;
        let on_ps = within("relocate", relocate(cuda, &t, to[0]))
            .await?
            .map_err(|e| e.to_string())?;
        if on_ps.device() != Device::Cuda(0) {
            return Err(format!("request landed on {}", on_ps.device()));
        }
        // Response: ps's reverse map for the trainer.
        let reverse = reverse_device_maps("ps", &group);
        let back_to = placements(
            "trainer",
            reverse.get("trainer"),
            [on_ps.device()],
            Direction::Response,
        )
        .map_err(|e| e.to_string())?;
        let back = within("relocate", relocate(cuda, &on_ps, back_to[0]))
            .await?
            .map_err(|e| e.to_string())?;
        if back.device() != Device::Cpu || back.to_f32_vec().as_deref() != Some(&values[..]) {
            return Err(format!("response on {} has other values", back.device()));
        }
        // Already on the target device: no copy, the same buffer.
        let same = within("relocate", relocate(cuda, &on_ps, Device::Cuda(0)))
            .await?
            .map_err(|e| e.to_string())?;
        let same_buffer = match (same.storage(), on_ps.storage()) {
            (Storage::Device(a), Storage::Device(b)) => std::ptr::eq(
                a.handle::<tensorwire_devices_cuda::CudaBuffer>().unwrap(),
                b.handle::<tensorwire_devices_cuda::CudaBuffer>().unwrap(),
            ),
            _ => false,
        };
        if !same_buffer {
            return Err("relocating to the same device copied".into());
        }
        // A CUDA tensor with no map entry cannot be sent.
        let Err(e) = placements("trainer", None, [on_ps.device()], Direction::Response) else {
            return Err("a cuda:0 tensor was placed without a map".into());
        };
        Ok(format!(
            "64×64 f32 cpu→cuda:0→cpu equal; unmapped cuda:0 refused ({e})"
        ))
    }
    .await;
    report.record("device maps cpu↔cuda:0 with relocate", outcome);
}

/// Median of timings in seconds.
/// An agent of one worker calls itself: a 4 MiB `cpu` tensor lands on `cuda:0` by the map (the
/// handler sees it there, on the real backend) and the reply comes back to `cpu` by the reverse
/// map, bytes intact.
async fn self_rpc(backend: std::sync::Arc<dyn DeviceBackend>) -> Result<String, String> {
    use tensorwire_rpc::{init_rpc, Functions, RpcOptions};

    let functions = Functions::new();
    functions
        .register("where", |t: Tensor| async move {
            Ok::<_, String>((t.device().to_string(), t))
        })
        .expect("each name is registered once");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let mut options = RpcOptions {
        functions,
        init_method: format!("tcp://127.0.0.1:{port}"),
        init_timeout: Duration::from_secs(30),
        secret: Some(b"tw-gpu-check".to_vec()),
        device_backend: backend,
        ..RpcOptions::default()
    };
    options
        .set_device_map("self", &[("cpu", "cuda:0")])
        .map_err(|e| e.to_string())?;
    let agent = within("init_rpc", init_rpc("self", 0, Some(1), options))
        .await?
        .map_err(|e| e.to_string())?;
    let values: Vec<f32> = (0..MIB).map(|i| i as f32 * 0.5).collect();
    let t = Tensor::from_f32(vec![values.len()], &values).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let reply = within(
        "rpc_sync",
        agent.rpc_sync::<_, (String, Tensor)>("self", "where", &t, None),
    )
    .await?
    .map_err(|e| e.to_string());
    let took = t0.elapsed();
    let _ = within(
        "shutdown",
        agent.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10))),
    )
    .await;
    let (landed, back) = reply?;
    if landed != "cuda:0" {
        return Err(format!(
            "the handler saw the tensor on {landed}, not cuda:0"
        ));
    }
    if back.device() != Device::Cpu || back.to_f32_vec() != Some(values) {
        return Err(format!(
            "the reply came back on {} or changed",
            back.device()
        ));
    }
    Ok(format!(
        "4 MiB cpu -> cuda:0 -> cpu in {:.1} ms",
        took.as_secs_f64() * 1e3
    ))
}

/// A 1-rank `nccl` process group on `cuda:0` (the setup exchange through an in-memory store):
/// every tensor collective, the staged byte collectives and the typed errors.
#[cfg(feature = "nccl")]
async fn nccl_group(cuda: &CudaDevices) -> Result<String, String> {
    use std::sync::Arc;
    use tensorwire_core::collective::ReduceOp;
    use tensorwire_core::ports::process_group::{
        Collectives, ProcessGroupError, TensorCollectives,
    };
    use tensorwire_core::ports::store::Store;
    use tensorwire_core::registry::ProcessGroupFactory;
    use tensorwire_devices_cuda::nccl_group::NcclFactory;
    use tensorwire_store::InMemoryStore;

    let d = Device::Cuda(0);
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let t0 = Instant::now();
    let pg = within(
        "new nccl group",
        NcclFactory::with_devices(cuda.clone()).create(
            store,
            0,
            1,
            Duration::from_secs(60),
            d,
            Vec::new(),
        ),
    )
    .await?
    .map_err(|e| e.to_string())?;
    let setup = t0.elapsed();
    let e = |e: ProcessGroupError| e.to_string();
    let values: Vec<f32> = (0..MIB).map(|i| (i % 777) as f32).collect();
    let host = Tensor::from_f32(vec![values.len()], &values).map_err(|e| e.to_string())?;
    let on = relocate(cuda, &host, d).await.map_err(|e| e.to_string())?;
    let back = |t: Tensor| async move {
        relocate(cuda, &t, Device::Cpu)
            .await
            .map_err(|e| e.to_string())
            .map(|t| t.to_f32_vec())
    };
    within("barrier", pg.barrier()).await?.map_err(e)?;
    let t1 = Instant::now();
    let sum = within("all_reduce", pg.all_reduce_tensor(&on, ReduceOp::Sum))
        .await?
        .map_err(e)?;
    let reduce = t1.elapsed();
    if sum.device() != d || back(sum).await? != Some(values.clone()) {
        return Err("all_reduce over one rank changed the tensor".into());
    }
    let parts = within("all_gather", pg.all_gather_tensor(&on))
        .await?
        .map_err(e)?;
    if parts.len() != 1 || back(parts[0].clone()).await? != Some(values.clone()) {
        return Err("all_gather over one rank is not the input".into());
    }
    let b = within("broadcast", pg.broadcast_tensor(&on, 0))
        .await?
        .map_err(e)?;
    if back(b).await? != Some(values) {
        return Err("broadcast over one rank is not the input".into());
    }
    let blocks = within("byte all_gather", pg.all_gather(b"bytes"))
        .await?
        .map_err(e)?;
    if blocks.len() != 1 || &blocks[0][..] != b"bytes" {
        return Err(format!("byte all_gather gave {blocks:?}"));
    }
    match pg.all_reduce_tensor(&host, ReduceOp::Sum).await {
        Err(ProcessGroupError::WrongDevice { .. }) => {}
        other => return Err(format!("a cpu tensor was not refused: {other:?}")),
    }
    pg.shutdown().await;
    Ok(format!(
        "setup {:.0} ms; 4 MiB all_reduce {:.2} ms; all_gather, broadcast, byte all_gather, cpu tensor refused",
        setup.as_secs_f64() * 1e3,
        reduce.as_secs_f64() * 1e3
    ))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

const ITERS: usize = 5;

/// Raw cudarc copies from and to pinned memory: the baseline. Returns (htod, dtoh) GB/s.
fn raw_baseline(ctx: &std::sync::Arc<CudaContext>, data: &[u8]) -> Result<(f64, f64, f64), String> {
    let len = data.len();
    let e = |e: tensorwire_devices_cuda::cudarc::driver::DriverError| e.to_string();
    let stream = ctx.new_stream().map_err(e)?;
    // SAFETY: filled right below before any use.
    let mut pinned =
        unsafe { ctx.alloc_pinned_with_flags::<u8>(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(e)?;
    pinned.as_mut_slice().map_err(e)?.copy_from_slice(data);
    let mut dev = stream.alloc_zeros::<u8>(len).map_err(e)?;
    let mut up = Vec::new();
    let mut down = Vec::new();
    let mut pageable_up = Vec::new();
    let pageable = data.to_vec();
    for i in 0..=ITERS {
        let t = Instant::now();
        stream.memcpy_htod(&pinned, &mut dev).map_err(e)?;
        stream.synchronize().map_err(e)?;
        let s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        stream.memcpy_dtoh(&dev, &mut pinned).map_err(e)?;
        stream.synchronize().map_err(e)?;
        let s2 = t.elapsed().as_secs_f64();
        let t = Instant::now();
        stream.memcpy_htod(&pageable, &mut dev).map_err(e)?;
        stream.synchronize().map_err(e)?;
        let s3 = t.elapsed().as_secs_f64();
        if i > 0 {
            up.push(s);
            down.push(s2);
            pageable_up.push(s3);
        }
    }
    if pinned.as_slice().map_err(e)? != data {
        return Err("raw round trip changed the bytes".into());
    }
    let gbs = |s: f64| len as f64 / s / 1e9;
    Ok((gbs(median(up)), gbs(median(down)), gbs(median(pageable_up))))
}

/// Backend copies with `staging`. Returns GB/s of (htod from pageable, dtoh, htod from the
/// `Bytes` a dtoh returned, first htod, first dtoh).
async fn backend_throughput(
    staging: StagingOptions,
    data: &Bytes,
) -> Result<(f64, f64, f64, f64, f64), String> {
    let cuda = CudaDevices::with_staging(staging);
    let d = Device::Cuda(0);
    let mut up = Vec::new();
    let mut down = Vec::new();
    let mut again = Vec::new();
    let mut cold = (0.0, 0.0);
    for i in 0..=ITERS {
        let t = Instant::now();
        let buf = within("to_device", cuda.to_device(data.clone(), d))
            .await?
            .map_err(|e| e.to_string())?;
        let s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let back = within("to_host", cuda.to_host(&buf))
            .await?
            .map_err(|e| e.to_string())?;
        let s2 = t.elapsed().as_secs_f64();
        if i == 0 && back != *data {
            return Err(first_difference(data, &back));
        }
        drop(buf);
        let t = Instant::now();
        let buf2 = within("to_device", cuda.to_device(back.clone(), d))
            .await?
            .map_err(|e| e.to_string())?;
        let s3 = t.elapsed().as_secs_f64();
        drop(buf2);
        if i > 0 {
            up.push(s);
            down.push(s2);
            again.push(s3);
        } else {
            cold = (s, s2);
        }
    }
    let gbs = |s: f64| data.len() as f64 / s / 1e9;
    Ok((
        gbs(median(up)),
        gbs(median(down)),
        gbs(median(again)),
        gbs(cold.0),
        gbs(cold.1),
    ))
}

async fn throughput(cuda: &CudaDevices, len: usize, report: &mut Report) {
    println!(
        "throughput: {} host↔cuda:0, median of {ITERS} after a warm-up",
        human(len)
    );
    let data = pattern(len, 5);
    let ctx = match cuda.context(Device::Cuda(0)) {
        Ok(c) => c,
        Err(e) => return report.record("throughput", Err(e.to_string())),
    };
    let raw = {
        let data = data.clone();
        tokio::task::spawn_blocking(move || raw_baseline(&ctx, &data))
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r)
    };
    let (raw_up, raw_down, raw_pageable) = match raw {
        Ok(r) => r,
        Err(e) => return report.record("raw pinned baseline", Err(e)),
    };
    println!(
        "  raw cudarc, pinned:   htod {raw_up:6.2} GB/s   dtoh {raw_down:6.2} GB/s   (pageable htod {raw_pageable:.2} GB/s)"
    );
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let configs = [
        StagingOptions::default(),
        StagingOptions {
            chunk: 8 * MIB,
            copy_threads: 4,
            ..Default::default()
        },
        StagingOptions {
            chunk: 16 * MIB,
            copy_threads: 8,
            ..Default::default()
        },
        StagingOptions {
            chunk: 8 * MIB,
            copy_threads: 1,
            ..Default::default()
        },
        StagingOptions {
            chunk: 64 * MIB,
            copy_threads: cores.min(16),
            ..Default::default()
        },
        StagingOptions {
            pinned_pool: 0,
            ..Default::default()
        },
    ];
    let mut table = String::new();
    for (k, staging) in configs.into_iter().enumerate() {
        let label = format!(
            "staging {} × {} thread(s){}{}",
            human(staging.chunk),
            staging.copy_threads,
            if staging.pinned_pool == 0 {
                ", no pinned outputs"
            } else {
                ""
            },
            if k == 0 { " [default]" } else { "" }
        );
        match backend_throughput(staging, &data).await {
            Ok((up, down, again, cold_up, cold_down)) => {
                let _ = writeln!(
                    table,
                    "  backend, {label:<50} htod {up:6.2} GB/s ({:.2}× raw)   dtoh {down:6.2} GB/s ({:.2}× raw)   htod of a dtoh result {again:6.2} GB/s ({:.2}× raw)   first call: htod {cold_up:.2}, dtoh {cold_down:.2} GB/s",
                    up / raw_up,
                    down / raw_down,
                    again / raw_up,
                );
                report.record(
                    &format!("throughput {label}"),
                    Ok(format!(
                        "htod ratio {:.2}, dtoh ratio {:.2}",
                        up / raw_up,
                        down / raw_down
                    )),
                );
            }
            Err(e) => report.record(&format!("throughput {label}"), Err(e)),
        }
    }
    print!("{table}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The self-RPC check's logic on the simulated backend (the GPU machine runs it on CUDA).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn self_rpc_on_simulated_devices() {
        let sim = std::sync::Arc::new(tensorwire_core::devices_sim::SimulatedDevices::new(1));
        let line = self_rpc(sim).await.unwrap();
        assert!(line.starts_with("4 MiB cpu -> cuda:0 -> cpu"), "{line}");
    }
}
