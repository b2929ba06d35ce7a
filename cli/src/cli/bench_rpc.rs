//! `tensorwire bench rpc`: the RPC agent between two processes on loopback, against the raw TCP
//! baseline measured in the same run.
//!
//! This process is worker 0 (the caller); it starts worker 1 (the callee) as a child process of
//! the same binary. Keys: `rpc_sync_p50_us`, `rpc_sync_p99_us`, `rpc_async_calls_per_s` (many
//! calls in flight), `rpc_tensor_1MiB_MBps`, `rpc_tensor_64MiB_MBps` (a tensor argument, a small
//! result), `remote_to_here_p50_us`, `raw_tcp_pingpong_p50_us`, `raw_tcp_bulk_64MiB_MBps` (plain TCP to an echo process, `bench raw-echo`, in blocks that
//! alternate with the agent's), `raw_baseline` (`"process"`) and `ratios`; and what an idle
//! agent costs: `idle_cpu_us_per_s_caller` and `idle_cpu_us_per_s_callee`, CPU time each
//! process used per second of a pause with the agents connected and no calls (`--idle-ms`;
//! from `/proc/PID/task/*/schedstat`, nanosecond figures of what `getrusage` sums up).
//!
//! With `--transport shm` or `auto`, also the same-host floor: `raw_shm_pingpong_p50_us` and
//! `_p99_us`, 64-byte round trips through one shared page to an echo process that busy-polls
//! it (`bench raw-shm-echo`, see `bench_raw_shm`), in blocks alternating with the raw TCP ones
//! and the agent's `rpc_sync`; `ratios` gains `rpc_sync_p50_over_raw_shm_pingpong_p50` and
//! `targets` the goal (at most 2x). A one-line text summary of `rpc_sync` against each
//! raw baseline goes to standard error.
//!
//! With `--rrefs 0,1000,100000`, also `with_rrefs`: for each count N (ascending), the caller
//! holds N remote references (values kept by the callee, made by `remote()` in batches of
//! 1,000, each batch timed until every creation is confirmed), then measures `rpc_sync` p50
//! and p99 with them held, in blocks that alternate with raw ping-pongs; `ratios` gains
//! `rpc_sync_p50_with_N_rrefs_over_with_FIRST` (the cost of live references on every call).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use tensorwire_core::tensor::Tensor;
use tensorwire_rpc::{init_rpc, Functions, RRef, RpcOptions};

use super::bench_common::{blocking, mbps, median, percentile, progress, runtime, write_json, MIB};
use super::bench_raw_shm::RawShm;
use super::bench_raw_tcp::Raw;

/// Arguments of `tensorwire bench rpc`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RpcArgs {
    /// The transport the agent uses: `tcp` and `shm` force that transport
    /// (`TENSORWIRE_TRANSPORT`), `auto` lets the agent choose (shared memory on one host), `quic`
    /// runs the QUIC backend (feature `quic`; a throw-away cluster CA).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "shm", "auto", "quic"])]
    transport: String,
    /// The folder of the throw-away QUIC cluster CA (set by the benchmark for its callee).
    #[arg(long, hide = true)]
    tls_dir: Option<PathBuf>,
    /// Write the results as one JSON object to this file (else to standard output).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Sequential `rpc_sync` calls measured (after a warm-up of a tenth as many).
    #[arg(long, default_value_t = 5_000)]
    calls: usize,
    /// `rpc_async` calls for the throughput measurement.
    #[arg(long, default_value_t = 100_000)]
    async_calls: usize,
    /// Calls kept in flight during the throughput measurement.
    #[arg(long, default_value_t = 512)]
    in_flight: usize,
    /// Calls with a 64 MiB tensor (the median is reported).
    #[arg(long, default_value_t = 8)]
    tensor_64mib: usize,
    /// Runtime worker threads in each process (1, the default: tokio's current-thread runtime,
    /// which keeps every task of the agent on one thread and gives the lowest latency).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Live remote references to hold while measuring `rpc_sync` again, one measurement per
    /// count (comma-separated, e.g. `0,1000,100000`).
    #[arg(long, value_delimiter = ',')]
    rrefs: Vec<usize>,
    /// Milliseconds of the idle pause whose CPU time is measured (0: none).
    #[arg(long, default_value_t = 1_000)]
    idle_ms: u64,
    /// Measure `rpc_sync` (and its raw baselines) only, nothing else: a run to profile
    /// (`strace -c`, `perf stat`) whose system calls are those of the calls.
    #[arg(long)]
    sync_only: bool,
    /// Run as the callee (set by the benchmark itself).
    #[arg(long, hide = true)]
    serve: Option<u16>,
}

/// The functions the benchmark's callees serve: `noop` and `value` (a `u64` back), `nbytes`
/// (a tensor's size).
pub(crate) fn functions() -> Functions {
    let f = Functions::new();
    f.register("noop", |x: u64| async move { Ok::<_, String>(x) })
        .expect("each name is registered once");
    f.register("nbytes", |t: Tensor| async move {
        Ok::<_, String>(t.nbytes() as u64)
    })
    .expect("each name is registered once");
    f.register("value", |x: u64| async move { Ok::<_, String>(x) })
        .expect("each name is registered once");
    f
}

fn options(port: u16, rank: usize, secret: &[u8], args: &RpcArgs) -> RpcOptions {
    let mut options = RpcOptions {
        init_method: format!("tcp://127.0.0.1:{port}?rank={rank}&world_size=2"),
        init_timeout: Duration::from_secs(30),
        secret: Some(secret.to_vec()),
        functions: functions(),
        ..RpcOptions::default()
    };
    if args.transport == "quic" {
        options.backend = "QUIC".into();
        options.tls_dir = args.tls_dir.clone();
    }
    options
}

/// Makes the agent of this process use the transport `args` asks for: `TENSORWIRE_TRANSPORT`
/// for the TCP backend's selection (the callee inherits it), a fresh cluster CA for QUIC.
fn choose_transport(args: &mut RpcArgs) -> Result<()> {
    match args.transport.as_str() {
        // Set before any runtime or thread exists.
        "tcp" | "shm" | "auto" => std::env::set_var("TENSORWIRE_TRANSPORT", &args.transport),
        #[cfg(feature = "quic")]
        _ => {
            let dir =
                std::env::temp_dir().join(format!("tensorwire-bench-quic-{}", std::process::id()));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            tensorwire_transport_quic::certs::ClusterCa::load_or_generate(&dir)?;
            args.tls_dir = Some(dir);
        }
        #[cfg(not(feature = "quic"))]
        _ => bail!(super::Usage(
            "QUIC not built in: this tensorwire was built without the `quic` feature; rebuild \
             with `--features quic` or use --transport tcp"
                .into()
        )),
    }
    Ok(())
}

/// A runtime with `threads` workers; 1 means tokio's current-thread runtime (every task of the
/// agent on one thread: no wake-ups across cores).
pub(crate) fn bench_rpc(args: &RpcArgs) -> Result<()> {
    let secret = std::env::var("TENSORWIRE_BENCH_SECRET").ok();
    if let Some(port) = args.serve {
        let secret = secret.context("the callee needs TENSORWIRE_BENCH_SECRET")?;
        return runtime(args.threads)?.block_on(async move {
            let agent = init_rpc(
                "callee",
                1,
                Some(2),
                options(port, 1, secret.as_bytes(), args),
            )
            .await?;
            agent
                .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(600)))
                .await?;
            Ok(())
        });
    }
    if args.calls < 10 || args.async_calls == 0 || args.in_flight == 0 || args.tensor_64mib == 0 {
        bail!(super::Usage(
            "--calls must be at least 10; --async-calls, --in-flight and --tensor-64mib at least 1"
                .into()
        ));
    }

    let mut args = args.clone();
    choose_transport(&mut args)?;
    let args = &args;
    // The raw baseline: blocking sockets to an echo *process* (the shape of the agent's two
    // processes), in blocks that alternate with the agent's, so that both see the same load.
    let mut raw = Raw::start_process(&[64 * MIB]).context("raw TCP baseline")?;
    // The same-host floor, where the agent runs over shared memory.
    let raw_shm = if matches!(args.transport.as_str(), "shm" | "auto") {
        Some(RawShm::start_process().context("raw shared-memory baseline")?)
    } else {
        None
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let secret: [u8; 16] = rand::random();
    let secret: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().context("cannot find this program's path")?;
    let mut callee = Command::new(exe)
        .args([
            "bench",
            "rpc",
            "--threads",
            &args.threads.to_string(),
            "--transport",
            &args.transport,
            "--serve",
            &port.to_string(),
        ])
        .args(
            args.tls_dir
                .iter()
                .flat_map(|d| [std::ffi::OsStr::new("--tls-dir"), d.as_os_str()]),
        )
        .env("TENSORWIRE_BENCH_SECRET", &secret)
        .stdin(Stdio::null())
        .spawn()
        .context("cannot start the callee process")?;
    let callee_pid = callee.id();

    // The caller runs in a task of the runtime, as an application's code does: the future of
    // `block_on` itself pays a poll of the I/O driver (a system call) each time a task wakes it,
    // which is tokio's cost, not the agent's.
    let (result, raw, raw_shm) = runtime(args.threads)?.block_on({
        let args = args.clone();
        let secret = secret.clone();
        let mut raw_shm = raw_shm;
        async move {
            tokio::spawn(async move {
                let mut raws = Raws {
                    tcp: &mut raw,
                    shm: raw_shm.as_mut(),
                };
                let result = measure(&args, port, secret.as_bytes(), &mut raws, callee_pid).await;
                (result, raw, raw_shm)
            })
            .await
        }
    })?;
    let status = callee.wait()?;
    raw.finish()?;
    if let Some(raw_shm) = raw_shm {
        raw_shm.finish()?;
    }
    if let Some(dir) = &args.tls_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    let (mut out, mut raw_ping, raw_bulk, mut shm_ping) = result?;
    if !status.success() {
        bail!("the callee process failed ({status})");
    }
    raw_ping.sort();
    let raw_p50 = percentile(&raw_ping, 0.5);
    out.insert("raw_tcp_pingpong_p50_us".into(), json!(raw_p50));
    out.insert("raw_tcp_bulk_64MiB_MBps".into(), json!(raw_bulk));
    let get = |k: &str| out.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let ratios = json!({
        "rpc_sync_p50_over_raw_pingpong_p50": get("rpc_sync_p50_us") / raw_p50,
        "rpc_tensor_64MiB_over_raw_bulk_64MiB": get("rpc_tensor_64MiB_MBps") / raw_bulk,
        "remote_to_here_p50_over_raw_pingpong_p50": get("remote_to_here_p50_us") / raw_p50,
    });
    let mut ratios = ratios;
    if !shm_ping.is_empty() {
        shm_ping.sort();
        let shm_p50 = percentile(&shm_ping, 0.5);
        let ratio = get("rpc_sync_p50_us") / shm_p50;
        out.insert("raw_shm_pingpong_p50_us".into(), json!(shm_p50));
        out.insert(
            "raw_shm_pingpong_p99_us".into(),
            json!(percentile(&shm_ping, 0.99)),
        );
        if let Some(map) = ratios.as_object_mut() {
            map.insert(
                "rpc_sync_p50_over_raw_shm_pingpong_p50".into(),
                json!(ratio),
            );
        }
        out.insert(
            "targets".into(),
            json!({ "shm: rpc_sync p50 <= 2x raw shm ping-pong": ratio <= 2.0 }),
        );
    }
    if let (Some(rows), Some(map)) = (
        out.get("with_rrefs").and_then(Value::as_array).cloned(),
        ratios.as_object_mut(),
    ) {
        let p50 = |row: &Value| row.get("rpc_sync_p50_us").and_then(Value::as_f64);
        if let Some(first) = rows.first().and_then(p50) {
            let first_n = rows[0].get("held").and_then(Value::as_u64).unwrap_or(0);
            for row in &rows[1..] {
                let n = row.get("held").and_then(Value::as_u64).unwrap_or(0);
                map.insert(
                    format!("rpc_sync_p50_with_{n}_rrefs_over_with_{first_n}"),
                    json!(p50(row).unwrap_or(f64::NAN) / first),
                );
            }
        }
    }
    out.insert("ratios".into(), ratios);
    out.insert("transport".into(), json!(args.transport));
    out.insert("raw_baseline".into(), json!("process"));
    out.insert("runtime_threads".into(), json!(args.threads));
    eprintln!("{}", summary(&out));
    write_json(&out, args.json.as_ref())
}

/// The text summary of a run: `rpc_sync` p50 and its ratios over the raw baselines.
fn summary(out: &Map<String, Value>) -> String {
    let get = |k: &str| out.get(k).and_then(Value::as_f64);
    let mut text = format!(
        "bench rpc ({}): rpc_sync p50 {:.1} µs",
        out.get("transport").and_then(Value::as_str).unwrap_or("?"),
        get("rpc_sync_p50_us").unwrap_or(f64::NAN)
    );
    for (what, key) in [
        ("raw TCP ping-pong", "raw_tcp_pingpong_p50_us"),
        ("raw shm ping-pong", "raw_shm_pingpong_p50_us"),
    ] {
        if let (Some(ours), Some(raw)) = (get("rpc_sync_p50_us"), get(key)) {
            text.push_str(&format!("; {:.2}x {what} ({raw:.2} µs)", ours / raw));
        }
    }
    text
}

/// Blocks of a measurement that alternate between the raw baseline and the agent.
const BLOCKS: usize = 10;

/// The agent's figures, the raw ping-pong times, the raw 64 MiB bulk rate (MB/s) and the raw
/// shared-memory ping-pong times (none without that baseline).
type Measured = (Map<String, Value>, Vec<Duration>, f64, Vec<Duration>);

/// The raw baselines a run measures: TCP always, shared memory with `--transport shm|auto`.
struct Raws<'a> {
    tcp: &'a mut Raw,
    shm: Option<&'a mut RawShm>,
}

/// CPU time process `pid` has used so far, all its threads together (Linux's
/// `/proc/PID/task/*/schedstat`, in nanoseconds); `None` where that cannot be read.
fn cpu_time(pid: u32) -> Option<Duration> {
    let mut total = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(Duration::from_nanos(total))
}

/// CPU µs per second that this process and the callee use over `pause` with nothing to do.
async fn idle_cpu(pause: Duration, callee: u32, out: &mut Map<String, Value>) {
    let me = std::process::id();
    let before = (cpu_time(me), cpu_time(callee));
    tokio::time::sleep(pause).await;
    let after = (cpu_time(me), cpu_time(callee));
    let per_s = |b: Option<Duration>, a: Option<Duration>| match (b, a) {
        (Some(b), Some(a)) => json!(a.saturating_sub(b).as_secs_f64() * 1e6 / pause.as_secs_f64()),
        _ => Value::Null,
    };
    out.insert("idle_cpu_us_per_s_caller".into(), per_s(before.0, after.0));
    out.insert("idle_cpu_us_per_s_callee".into(), per_s(before.1, after.1));
}

async fn measure(
    args: &RpcArgs,
    port: u16,
    secret: &[u8],
    raws: &mut Raws<'_>,
    callee: u32,
) -> Result<Measured> {
    let raw = &mut *raws.tcp;
    let agent = init_rpc("caller", 0, Some(2), options(port, 0, secret, args)).await?;
    let mut out = Map::new();

    let bar = progress(5, "rpc_sync / raw ping-pong");
    let block = (args.calls / BLOCKS).max(1);
    blocking(|| raw.pingpong(block))?;
    for i in 0..block {
        let _: u64 = agent.rpc_sync(1u32, "noop", &(i as u64), None).await?;
    }
    let mut times = Vec::with_capacity(args.calls);
    let mut raw_ping = Vec::with_capacity(args.calls);
    let mut shm_ping = Vec::new();
    if let Some(shm) = raws.shm.as_deref_mut() {
        blocking(|| shm.pingpong(block))?;
    }
    for _ in 0..BLOCKS {
        raw_ping.extend(blocking(|| raw.pingpong(block))?);
        if let Some(shm) = raws.shm.as_deref_mut() {
            shm_ping.extend(blocking(|| shm.pingpong(block))?);
        }
        for i in 0..block {
            let t = Instant::now();
            let _: u64 = agent.rpc_sync(1u32, "noop", &(i as u64), None).await?;
            times.push(t.elapsed());
        }
    }
    times.sort();
    out.insert("rpc_sync_p50_us".into(), json!(percentile(&times, 0.5)));
    out.insert("rpc_sync_p99_us".into(), json!(percentile(&times, 0.99)));
    bar.inc(1);
    if args.sync_only {
        bar.finish_and_clear();
        agent
            .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(60)))
            .await?;
        return Ok((out, raw_ping, f64::NAN, shm_ping));
    }

    bar.set_message("rpc_async in flight");
    let t = Instant::now();
    let mut pending = std::collections::VecDeque::with_capacity(args.in_flight);
    for i in 0..args.async_calls {
        if pending.len() == args.in_flight {
            let f: tensorwire_rpc::RpcFuture<u64> =
                pending.pop_front().context("a call is in flight")?;
            f.await?;
        }
        pending.push_back(agent.rpc_async::<_, u64>(1u32, "noop", &(i as u64), None)?);
    }
    for f in pending {
        f.await?;
    }
    out.insert(
        "rpc_async_calls_per_s".into(),
        json!(args.async_calls as f64 / t.elapsed().as_secs_f64()),
    );
    bar.inc(1);

    let raw_data = vec![7u8; 64 * MIB];
    let mut raw_rates = Vec::with_capacity(args.tensor_64mib);
    for (size, rounds, key) in [
        (MIB, 100, "rpc_tensor_1MiB_MBps"),
        (64 * MIB, args.tensor_64mib, "rpc_tensor_64MiB_MBps"),
    ] {
        bar.set_message(key.to_owned());
        let floats = vec![1.0f32; size / 4];
        let t = Tensor::from_f32(vec![floats.len()], &floats)?;
        let _: u64 = agent.rpc_sync(1u32, "nbytes", &t, None).await?;
        let mut rates = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            if size == 64 * MIB {
                let took = blocking(|| raw.bulk(&raw_data))?;
                raw_rates.push(mbps(raw_data.len(), took));
            }
            let start = Instant::now();
            let n: u64 = agent.rpc_sync(1u32, "nbytes", &t, None).await?;
            rates.push(mbps(size, start.elapsed()));
            if n as usize != size {
                bail!("the callee saw {n} bytes instead of {size}");
            }
        }
        out.insert(key.into(), json!(median(rates)));
        bar.inc(1);
    }

    bar.set_message("remote + to_here");
    let mut times = Vec::with_capacity(args.calls / 5);
    for i in 0..args.calls / 5 {
        let t = Instant::now();
        let r: RRef<u64> = agent.remote(1u32, "value", &(i as u64), None)?;
        let v = r.to_here(None).await?;
        times.push(t.elapsed());
        if v != i as u64 {
            bail!("to_here returned {v}, expected {i}");
        }
    }
    times.sort();
    out.insert(
        "remote_to_here_p50_us".into(),
        json!(percentile(&times, 0.5)),
    );
    bar.inc(1);
    bar.finish_and_clear();
    if !args.rrefs.is_empty() {
        let rows = measure_with_rrefs(&agent, 1, &args.rrefs, args.calls, raw, &mut raw_ping)
            .await?
            .into_iter()
            .map(|(row, _)| row)
            .collect();
        out.insert("with_rrefs".into(), Value::Array(rows));
    }
    if args.idle_ms > 0 {
        idle_cpu(Duration::from_millis(args.idle_ms), callee, &mut out).await;
    }
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(60)))
        .await?;
    Ok((out, raw_ping, median(raw_rates), shm_ping))
}

/// `rpc_sync` latency to rank `callee` with growing numbers of live remote references held
/// (see the module docs), `calls` calls per count; raw ping-pongs alternate with it and join
/// `raw_ping`. Each row comes with the raw ping-pong p50 measured in its own blocks.
pub(crate) async fn measure_with_rrefs(
    agent: &tensorwire_rpc::Agent,
    callee: u32,
    counts: &[usize],
    calls: usize,
    raw: &mut Raw,
    raw_ping: &mut Vec<Duration>,
) -> Result<Vec<(Value, f64)>> {
    const BATCH: usize = 1_000;
    let mut counts = counts.to_vec();
    counts.sort_unstable();
    counts.dedup();
    let bar = progress(counts.len() as u64, "rpc_sync with live references");
    let mut held: Vec<RRef<u64>> = Vec::with_capacity(counts.last().copied().unwrap_or(0));
    let mut rows = Vec::new();
    let block = (calls / BLOCKS).max(1);
    for n in counts {
        bar.set_message(format!("making {n} references"));
        let mut batches = Vec::new();
        while held.len() < n {
            let size = BATCH.min(n - held.len());
            let t = Instant::now();
            let batch = (0..size)
                .map(|i| agent.remote::<_, u64>(callee, "value", &(i as u64), None))
                .collect::<Result<Vec<RRef<u64>>, _>>()?;
            for r in &batch {
                r.created().await?;
            }
            batches.push(t.elapsed());
            held.extend(batch);
        }
        bar.set_message(format!("rpc_sync with {n} references"));
        let mut times = Vec::with_capacity(calls);
        let mut raw_times = Vec::with_capacity(calls);
        for _ in 0..BLOCKS {
            raw_times.extend(blocking(|| raw.pingpong(block))?);
            for i in 0..block {
                let t = Instant::now();
                let _: u64 = agent.rpc_sync(callee, "noop", &(i as u64), None).await?;
                times.push(t.elapsed());
            }
        }
        times.sort();
        raw_ping.extend_from_slice(&raw_times);
        raw_times.sort();
        let batch_ms = (!batches.is_empty())
            .then(|| median(batches.iter().map(|d| d.as_secs_f64() * 1e3).collect()));
        rows.push((
            json!({
                "held": n,
                "rpc_sync_p50_us": percentile(&times, 0.5),
                "rpc_sync_p99_us": percentile(&times, 0.99),
                "remote_batch_of_1000_median_ms": batch_ms,
            }),
            percentile(&raw_times, 0.5),
        ));
        bar.inc(1);
    }
    bar.finish_and_clear();
    drop(held);
    Ok(rows)
}
