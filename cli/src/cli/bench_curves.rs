//! `tensorwire bench curve ...`: how costs grow, each curve against a raw baseline measured in
//! the same run, written as JSON (`--json FILE`, else standard output) and drawn as a PNG
//! (`--png FILE`, log-log axes).
//!
//! - `rrefs`: `rpc_sync` p50 to one peer against the number of live remote references held
//!   (0 to 100,000), against raw TCP ping-pong to an echo process in alternating blocks.
//! - `peers`: `rpc_sync` p50 (calls to each peer in turn) and `rpc_async` calls/s (calls in
//!   flight spread over the peers) against the number of peers, 1 to 63 (worlds 2 to 64 on
//!   this host), against raw TCP ping-pong over as many connections, used in turn.
//! - `init`: the wall time from starting the processes of a world (2 to 64) until every one of
//!   them has returned from `init_rpc`, against the same processes meeting raw: each dials the
//!   benchmark over plain TCP and waits for the word that all have (a star, no secret).
//! - `payload`: `rpc_sync` with a tensor of 8 B to 256 MiB over TCP and over shared memory,
//!   against a raw TCP transfer of the same bytes to an echo process and a `memcpy`; the JSON and
//!   the plot mark where each transport changes how it moves bytes.
//! - `collectives`: barrier, broadcast, all_reduce and all_gather against world size (2 to 16)
//!   and message size, against a raw dissemination barrier among threads and a raw TCP transfer
//!   of the same bytes.
//!
//! Every point of every curve has `x` and `ratio` (tensorwire over its raw baseline: a time
//! ratio, above 1 is slower; for rates, tensorwire's rate over raw, above 1 is faster, as named
//! by `ratio_is`). The benchmark is rank 0 of every group it starts (the store is served by
//! it too); the other ranks are processes of this binary (`bench curve-worker`, hidden).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use tensorwire_core::tensor::Tensor;
use tensorwire_rpc::{init_rpc, Agent, RpcOptions};

use super::bench::{mbps, percentile, progress, Raw};
use super::bench_rpc::{blocking, functions, runtime};
use super::Usage;

/// Arguments of `tensorwire bench curve`.
#[derive(Debug, clap::Args)]
pub(crate) struct CurveArgs {
    #[command(subcommand)]
    curve: Curve,
}

/// Which curve to measure.
#[derive(Debug, clap::Subcommand)]
enum Curve {
    /// `rpc_sync` latency against the number of live remote references held.
    Rrefs(RrefsArgs),
    /// `rpc_sync` latency and `rpc_async` calls/s against the number of peers called.
    Peers(PeersArgs),
    /// `init_rpc` wall time against world size (processes on this host).
    Init(InitArgs),
    /// `rpc_sync` with a tensor against raw TCP and memcpy, 8 B to 256 MiB, TCP and shm.
    Payload(PayloadArgs),
    /// Barrier, broadcast, all_reduce and all_gather against world size and message size.
    Collectives(CollectivesCurveArgs),
}

/// Where a curve goes.
#[derive(Debug, Clone, clap::Args)]
struct Output {
    /// Write the results as one JSON object to this file (else to standard output).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw the curve into this PNG file (default `tensorwire-curve-<name>.png` here).
    #[arg(long)]
    png: Option<PathBuf>,
    /// Bound on starting each group of processes and on each of its steps, in seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
}

/// Arguments of `bench curve rrefs`.
#[derive(Debug, clap::Args)]
struct RrefsArgs {
    /// Live references held, one point per count (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "0,1000,10000,100000")]
    counts: Vec<usize>,
    /// `rpc_sync` calls per point.
    #[arg(long, default_value_t = 2_000)]
    calls: usize,
    #[command(flatten)]
    out: Output,
}

/// Arguments of `bench curve peers`.
#[derive(Debug, clap::Args)]
struct PeersArgs {
    /// World sizes (the benchmark is rank 0 and calls the other ranks), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16,32,64")]
    world: Vec<usize>,
    /// `rpc_sync` calls per point.
    #[arg(long, default_value_t = 2_000)]
    calls: usize,
    /// `rpc_async` calls per point for calls/s.
    #[arg(long, default_value_t = 10_000)]
    async_calls: usize,
    /// Calls kept in flight for calls/s.
    #[arg(long, default_value_t = 128)]
    in_flight: usize,
    /// `tcp`, `shm` or `auto` (`TENSORWIRE_TRANSPORT`).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "shm", "auto"])]
    transport: String,
    #[command(flatten)]
    out: Output,
}

/// Arguments of `bench curve init`.
#[derive(Debug, clap::Args)]
struct InitArgs {
    /// World sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16,32,64")]
    world: Vec<usize>,
    /// `tcp`, `shm` or `auto` (`TENSORWIRE_TRANSPORT`).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "shm", "auto"])]
    transport: String,
    #[command(flatten)]
    out: Output,
}

/// Arguments of `bench curve payload`.
#[derive(Debug, clap::Args)]
struct PayloadArgs {
    /// Tensor sizes in bytes (multiples of 4, at least 8), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8,64,512,4096,32768,262144,1048576,4194304,16777216,67108864,268435456"
    )]
    sizes: Vec<usize>,
    /// Transports to measure the agent over, comma-separated (`tcp`, `shm`).
    #[arg(long, value_delimiter = ',', default_value = "tcp,shm")]
    transports: Vec<String>,
    /// Calls per size at most (fewer for large sizes: about 64 MiB moved per size, at least 3).
    #[arg(long, default_value_t = 200)]
    rounds: usize,
    #[command(flatten)]
    out: Output,
}

/// Arguments of `bench curve collectives`.
#[derive(Debug, clap::Args)]
struct CollectivesCurveArgs {
    /// World sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16")]
    world: Vec<usize>,
    /// Message sizes in bytes (per rank; all_reduce rounds down to whole f32), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,1024,65536,1048576")]
    sizes: Vec<usize>,
    /// Iterations of the barrier and of messages up to 64 KiB (fewer for larger ones).
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// `tcp`, `shm` or `auto` (`TENSORWIRE_TRANSPORT`).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "shm", "auto"])]
    transport: String,
    #[command(flatten)]
    out: Output,
}

/// Arguments of the hidden `bench curve-worker`: one rank of a group, or one process of the
/// raw rendezvous.
#[derive(Debug, clap::Args)]
pub(crate) struct CurveWorkerArgs {
    #[arg(long, default_value_t = 0)]
    rank: usize,
    #[arg(long, default_value_t = 0)]
    world: usize,
    /// The store's port on 127.0.0.1 (served by the benchmark).
    #[arg(long, default_value_t = 0)]
    port: u16,
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// Only meet the benchmark raw at this address: dial, send a byte, wait for one, exit.
    #[arg(long)]
    raw_rendezvous: Option<SocketAddr>,
    /// Serve `bench autograd`'s function after init (see `bench_autograd`).
    #[arg(long)]
    autograd: bool,
}

/// `tensorwire bench curve ...`.
pub(crate) fn run(args: &CurveArgs) -> Result<()> {
    // In the groups of `start_group`, rank 0 (this process) connects to the store it serves, as
    // every other rank does. Set before any runtime or thread exists; the ranks inherit it. (The
    // collectives' ranks are all children, and their rank 0 serves the store.)
    if !matches!(args.curve, Curve::Collectives(_)) {
        std::env::set_var(tensorwire_rendezvous::LAUNCHER_STORE_ENV, "1");
    }
    match &args.curve {
        Curve::Rrefs(a) => rrefs(a),
        Curve::Peers(a) => peers(a),
        Curve::Init(a) => init(a),
        Curve::Payload(a) => payload(a),
        Curve::Collectives(a) => collectives(a),
    }
}

// ---------------------------------------------------------------------------------------------
// Groups of processes with this one as rank 0.

/// A group whose rank 0 is this process: the store it serves, the other ranks' processes.
pub(crate) struct Group {
    pub(crate) agent: Agent,
    children: Vec<Child>,
    /// Wall time from starting the first process until every rank returned from `init_rpc`.
    init_wall: Duration,
    /// How long `init_rpc` took in this process (rank 0).
    init_rank0: Duration,
    /// The longest `init_rpc` of the other ranks, each timed in its own process.
    init_slowest_other: Duration,
    _store: tensorwire_store::TcpStoreServer,
}

impl Drop for Group {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Sets the transport of this process's next group and of the ranks it starts. Called while
/// no group is up; the environment is read when an agent listens and dials.
fn set_transport(transport: &str) {
    std::env::set_var("TENSORWIRE_TRANSPORT", transport);
}

/// Starts a group of `world` processes on 127.0.0.1 (this one rank 0) with a fresh secret.
async fn start_group(world: usize, timeout: Duration) -> Result<Group> {
    start_group_with(world, timeout, &[]).await
}

/// [`start_group`], with `extra` arguments for the other ranks' `bench curve-worker`.
pub(crate) async fn start_group_with(
    world: usize,
    timeout: Duration,
    extra: &[&str],
) -> Result<Group> {
    use tensorwire_store::{ClusterSecret, ServerConfig, TcpStoreServer};
    let secret = format!("{:032x}", rand::random::<u128>());
    let store = TcpStoreServer::bind(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        ServerConfig {
            secret: Some(ClusterSecret::new(secret.as_bytes().to_vec())?),
            ..ServerConfig::default()
        },
    )
    .await
    .context("serving the store")?;
    let port = store.local_addr().port();
    let exe = std::env::current_exe().context("finding this executable")?;
    let started = Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Result<Duration, String>)>();
    let mut children = Vec::with_capacity(world - 1);
    for rank in 1..world {
        let mut child = Command::new(&exe)
            .args(["bench", "curve-worker"])
            .args(["--rank", &rank.to_string(), "--world", &world.to_string()])
            .args(["--port", &port.to_string()])
            .args(["--timeout", &timeout.as_secs().to_string()])
            .args(extra)
            .env("TENSORWIRE_BENCH_SECRET", &secret)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a rank")?;
        let out = child.stdout.take().context("a rank's output")?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut said = None;
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(us) = line.strip_prefix("INIT ").and_then(|s| s.parse().ok()) {
                    said = Some(Duration::from_micros(us));
                    break;
                }
            }
            let _ = tx.send((
                rank,
                said.ok_or_else(|| format!("rank {rank} ended before its init finished")),
            ));
        });
        children.push(child);
    }
    drop(tx);
    let t = Instant::now();
    let agent = init_rpc(
        "w0",
        0,
        Some(world),
        options(port, 0, world, secret.as_bytes(), timeout),
    )
    .await
    .with_context(|| format!("init_rpc of rank 0 of {world}"))?;
    let init_rank0 = t.elapsed();
    let mut slowest = Duration::ZERO;
    let deadline = Instant::now() + timeout;
    // Waited for on the runtime: rank 0's agent keeps serving the others meanwhile.
    for _ in 1..world {
        let left = deadline.saturating_duration_since(Instant::now());
        let (_, took) = tokio::time::timeout(left, rx.recv())
            .await
            .ok()
            .flatten()
            .context("a rank did not say its init finished in time")?;
        slowest = slowest.max(took.map_err(anyhow::Error::msg)?);
    }
    Ok(Group {
        agent,
        children,
        init_wall: started.elapsed(),
        init_rank0,
        init_slowest_other: slowest,
        _store: store,
    })
}

impl Group {
    /// Shuts the group down gracefully and checks that every rank exited successfully.
    pub(crate) async fn finish(mut self, timeout: Duration) -> Result<()> {
        self.agent
            .shutdown(tensorwire_rpc::Shutdown::graceful(timeout))
            .await?;
        let deadline = Instant::now() + timeout;
        // Each exit is waited for on a blocking thread (a process gives no future to await);
        // a rank still running at the deadline is killed by its pid.
        let waits: Vec<_> = std::mem::take(&mut self.children)
            .into_iter()
            .map(|mut child| {
                let pid = rustix::process::Pid::from_child(&child);
                (pid, tokio::task::spawn_blocking(move || child.wait()))
            })
            .collect();
        let mut failure = None;
        for (i, (pid, wait)) in waits.into_iter().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, wait).await {
                Ok(status) => {
                    let status = status??;
                    if !status.success() && failure.is_none() {
                        failure = Some(format!("rank {} failed ({status})", i + 1));
                    }
                }
                Err(_) => {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    failure.get_or_insert(format!("rank {} did not exit", i + 1));
                }
            }
        }
        if let Some(failure) = failure {
            bail!(failure);
        }
        self.children.clear();
        Ok(())
    }
}

fn options(port: u16, rank: usize, world: usize, secret: &[u8], timeout: Duration) -> RpcOptions {
    RpcOptions {
        init_method: format!("tcp://127.0.0.1:{port}?rank={rank}&world_size={world}"),
        init_timeout: timeout,
        secret: Some(secret.to_vec()),
        functions: functions(),
        ..RpcOptions::default()
    }
}

/// `bench curve-worker`: a rank that serves calls until the group shuts down, or a process of
/// the raw rendezvous.
pub(crate) fn worker(args: &CurveWorkerArgs) -> Result<()> {
    if let Some(addr) = args.raw_rendezvous {
        let mut s = TcpStream::connect(addr)?;
        s.write_all(&[1])?;
        let mut go = [0u8; 1];
        s.read_exact(&mut go)?;
        return Ok(());
    }
    let secret =
        std::env::var("TENSORWIRE_BENCH_SECRET").context("a rank needs TENSORWIRE_BENCH_SECRET")?;
    let timeout = Duration::from_secs(args.timeout);
    runtime(1)?.block_on(async move {
        let t = Instant::now();
        let agent = init_rpc(
            &format!("w{}", args.rank),
            args.rank,
            Some(args.world),
            options(args.port, args.rank, args.world, secret.as_bytes(), timeout),
        )
        .await?;
        println!("INIT {}", t.elapsed().as_micros());
        std::io::stdout().flush()?;
        #[cfg(feature = "autograd-candle")]
        let _dist = if args.autograd {
            let dist = super::bench_autograd::serve(&agent, args.rank)?;
            agent
                .barrier(super::bench_autograd::READY_BARRIER, timeout)
                .await?;
            Some(dist)
        } else {
            None
        };
        #[cfg(not(feature = "autograd-candle"))]
        if args.autograd {
            bail!("built without the `autograd-candle` feature");
        }
        agent
            .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(
                3600,
            )))
            .await?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Output.

/// One line of a plot.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
}

impl Series {
    fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series {
            name: name.into(),
            points,
        }
    }
}

/// One panel of a plot (log-log axes).
struct Panel {
    title: String,
    x_desc: String,
    y_desc: String,
    series: Vec<Series>,
    /// Vertical marks: (x, label).
    marks: Vec<(f64, String)>,
}

/// A TTF font from the system for the plot's text, if there is one (without one the plot has
/// lines and no text).
fn font() -> Option<&'static [u8]> {
    static FONT: std::sync::OnceLock<Option<&'static [u8]>> = std::sync::OnceLock::new();
    *FONT.get_or_init(|| {
        let candidates = [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        ];
        let bytes = candidates.iter().find_map(|p| std::fs::read(p).ok())?;
        Some(&*Box::leak(bytes.into_boxed_slice()))
    })
}

/// Draws `panels` one above the other into `path`.
fn plot(path: &Path, panels: &[Panel]) -> Result<()> {
    use plotters::prelude::*;
    let text = font().is_some_and(|f| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, f).is_ok()
    });
    let height = 420 * panels.len().max(1) as u32;
    let root = BitMapBackend::new(path, (1100, height)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("drawing {}: {e:?}", path.display());
    root.fill(&WHITE).map_err(err)?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    let colors = [
        RGBColor(200, 30, 30),
        RGBColor(30, 30, 200),
        RGBColor(20, 140, 20),
        RGBColor(180, 0, 180),
        RGBColor(0, 150, 150),
        RGBColor(0, 0, 0),
        RGBColor(220, 120, 0),
        RGBColor(120, 120, 120),
    ];
    for (area, panel) in areas.iter().zip(panels) {
        let all = || {
            panel
                .series
                .iter()
                .flat_map(|s| s.points.iter().copied())
                .filter(|(x, y)| *x > 0.0 && *y > 0.0 && x.is_finite() && y.is_finite())
        };
        let (x0, x1) = all().fold((f64::MAX, f64::MIN), |(a, b), (x, _)| (a.min(x), b.max(x)));
        let (y0, y1) = all().fold((f64::MAX, f64::MIN), |(a, b), (_, y)| (a.min(y), b.max(y)));
        if x0 > x1 {
            continue;
        }
        let (x0, x1) = (x0 / 1.5, x1 * 1.5);
        let (y0, y1) = (y0 / 2.0, y1 * 2.0);
        let mut builder = ChartBuilder::on(area);
        builder
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(70);
        if text {
            builder.caption(&panel.title, ("sans-serif", 20));
        }
        let mut chart = builder
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
            .map_err(|e| anyhow::anyhow!("drawing {}: {e:?}", path.display()))?;
        let mut mesh = chart.configure_mesh();
        if text {
            mesh.x_desc(panel.x_desc.as_str())
                .y_desc(panel.y_desc.as_str());
        } else {
            mesh.disable_x_axis().disable_y_axis();
        }
        mesh.draw().map_err(err)?;
        for (x, label) in &panel.marks {
            let line = chart
                .draw_series(LineSeries::new(
                    [(*x, y0), (*x, y1)],
                    RGBColor(150, 150, 150).stroke_width(1),
                ))
                .map_err(err)?;
            if text {
                let grey = RGBColor(110, 110, 110);
                line.label(label.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey));
            }
        }
        for (i, s) in panel.series.iter().enumerate() {
            let color = colors[i % colors.len()];
            let points: Vec<(f64, f64)> = s
                .points
                .iter()
                .copied()
                .filter(|(x, y)| *x > 0.0 && *y > 0.0 && x.is_finite() && y.is_finite())
                .collect();
            let drawn = chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(err)?;
            if text {
                drawn
                    .label(s.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            }
            chart
                .draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
                .map_err(err)?;
        }
        if text {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(err)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Writes the curve's JSON (with its plot's path) and draws the plot.
fn finish(name: &str, out: &Output, mut json: Map<String, Value>, panels: &[Panel]) -> Result<()> {
    let png = out
        .png
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("tensorwire-curve-{name}.png")));
    plot(&png, panels)?;
    json.insert("curve".into(), json!(name));
    json.insert("png".into(), json!(png.display().to_string()));
    json.insert(
        "cores".into(),
        json!(std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)),
    );
    super::bench::write_json(&json, out.json.as_ref())?;
    eprintln!("tensorwire bench: drew {}", png.display());
    Ok(())
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The x and a named field of every point, for a plot.
fn xy(points: &[Value], field: &str) -> Vec<(f64, f64)> {
    points
        .iter()
        .filter_map(|p| Some((p["x"].as_f64()?, p[field].as_f64()?)))
        .collect()
}

fn check_worlds(world: &[usize], max: usize) -> Result<()> {
    if world.is_empty() || world.iter().any(|w| *w < 2 || *w > max) {
        bail!(Usage(format!(
            "--world sizes must be between 2 and {max} (got {world:?})"
        )));
    }
    Ok(())
}

/// Blocks of a measurement that alternate between the raw baseline and the agent.
const BLOCKS: usize = 10;

// ---------------------------------------------------------------------------------------------
// The curves.

fn rrefs(args: &RrefsArgs) -> Result<()> {
    if args.counts.is_empty() || args.calls < BLOCKS {
        bail!(Usage(format!(
            "--counts needs at least one count and --calls at least {BLOCKS}"
        )));
    }
    let timeout = Duration::from_secs(args.out.timeout);
    set_transport("tcp");
    let mut raw = Raw::start_process(&[]).context("raw TCP baseline")?;
    let rows = runtime(1)?.block_on(async {
        let group = start_group(2, timeout).await?;
        let mut pooled = Vec::new();
        let rows = super::bench_rpc::measure_with_rrefs(
            &group.agent,
            1,
            &args.counts,
            args.calls,
            &mut raw,
            &mut pooled,
        )
        .await?;
        group.finish(timeout).await?;
        anyhow::Ok(rows)
    })?;
    raw.finish()?;
    let points: Vec<Value> = rows
        .into_iter()
        .map(|(row, raw_p50)| {
            let p50 = row["rpc_sync_p50_us"].as_f64().unwrap_or(f64::NAN);
            json!({
                "x": row["held"],
                "held": row["held"],
                "rpc_sync_p50_us": p50,
                "rpc_sync_p99_us": row["rpc_sync_p99_us"],
                "remote_batch_of_1000_median_ms": row["remote_batch_of_1000_median_ms"],
                "raw_tcp_pingpong_p50_us": raw_p50,
                "ratio": p50 / raw_p50,
            })
        })
        .collect();
    let held_as_x = |field: &str| -> Vec<(f64, f64)> {
        xy(&points, field)
            .into_iter()
            .map(|(x, y)| (x.max(1.0), y))
            .collect()
    };
    let panels = [Panel {
        title: "rpc_sync against live references held (0 drawn at 1)".into(),
        x_desc: "remote references held".into(),
        y_desc: "microseconds".into(),
        series: vec![
            Series::new("rpc_sync p50", held_as_x("rpc_sync_p50_us")),
            Series::new("rpc_sync p99", held_as_x("rpc_sync_p99_us")),
            Series::new(
                "raw TCP ping-pong p50",
                held_as_x("raw_tcp_pingpong_p50_us"),
            ),
        ],
        marks: vec![],
    }];
    let mut json = Map::new();
    json.insert("x".into(), json!("remote references held by the caller"));
    json.insert(
        "ratio_is".into(),
        json!("rpc_sync p50 over raw ping-pong p50"),
    );
    json.insert(
        "raw_baseline".into(),
        json!("64-byte ping-pong over plain TCP to an echo process, in blocks alternating with the calls"),
    );
    json.insert("transport".into(), json!("tcp"));
    json.insert("calls_per_point".into(), json!(args.calls));
    json.insert("points".into(), Value::Array(points));
    finish("rrefs", &args.out, json, &panels)
}

fn peers(args: &PeersArgs) -> Result<()> {
    check_worlds(&args.world, 1024)?;
    if args.calls < BLOCKS || args.async_calls == 0 || args.in_flight == 0 {
        bail!(Usage(format!(
            "--calls must be at least {BLOCKS}; --async-calls and --in-flight at least 1"
        )));
    }
    let timeout = Duration::from_secs(args.out.timeout);
    set_transport(&args.transport);
    let mut points = Vec::new();
    let bar = progress(args.world.len() as u64, "peers");
    let rt = runtime(1)?;
    for &world in &args.world {
        bar.set_message(format!("{} peers", world - 1));
        let mut raw = Raw::start_process_pings(world - 1, &[]).context("raw TCP baseline")?;
        let point = rt.block_on(async {
            let group = start_group(world, timeout).await?;
            let agent = &group.agent;
            let peers = (world - 1) as u32;
            // Warm-up: a call to each peer, a raw round trip on each connection.
            for to in 1..=peers {
                let _: u64 = agent.rpc_sync(to, "noop", &0u64, None).await?;
            }
            blocking(|| raw.pingpong_round_robin(world - 1))?;
            let block = args.calls / BLOCKS;
            let (mut times, mut raw_times) = (Vec::new(), Vec::new());
            for _ in 0..BLOCKS {
                raw_times.extend(blocking(|| raw.pingpong_round_robin(block))?);
                for i in 0..block {
                    let to = 1 + (i as u32 % peers);
                    let t = Instant::now();
                    let _: u64 = agent.rpc_sync(to, "noop", &(i as u64), None).await?;
                    times.push(t.elapsed());
                }
            }
            times.sort();
            raw_times.sort();
            let t = Instant::now();
            let mut pending = std::collections::VecDeque::with_capacity(args.in_flight);
            for i in 0..args.async_calls {
                if pending.len() == args.in_flight {
                    let f: tensorwire_rpc::RpcFuture<u64> =
                        pending.pop_front().context("a call is in flight")?;
                    f.await?;
                }
                let to = 1 + (i as u32 % peers);
                pending.push_back(agent.rpc_async::<_, u64>(to, "noop", &(i as u64), None)?);
            }
            for f in pending {
                f.await?;
            }
            let per_s = args.async_calls as f64 / t.elapsed().as_secs_f64();
            group.finish(timeout).await?;
            let p50 = percentile(&times, 0.5);
            let raw_p50 = percentile(&raw_times, 0.5);
            anyhow::Ok(json!({
                "x": world - 1,
                "peers": world - 1,
                "world": world,
                "rpc_sync_p50_us": p50,
                "rpc_sync_p99_us": percentile(&times, 0.99),
                "raw_tcp_pingpong_p50_us": raw_p50,
                "ratio": p50 / raw_p50,
                "rpc_async_calls_per_s": per_s,
                "raw_round_trips_per_s": 1e6 / raw_p50,
            }))
        })?;
        raw.finish()?;
        points.push(point);
        bar.inc(1);
    }
    bar.finish_and_clear();
    if let Some(first) = points
        .first()
        .and_then(|p| p["rpc_async_calls_per_s"].as_f64())
    {
        for p in &mut points {
            let rate = p["rpc_async_calls_per_s"].as_f64().unwrap_or(f64::NAN);
            p["calls_per_s_over_first"] = json!(rate / first);
        }
    }
    let panels = [
        Panel {
            title: "rpc_sync to each peer in turn, against peers".into(),
            x_desc: "peers called (world - 1)".into(),
            y_desc: "microseconds".into(),
            series: vec![
                Series::new("rpc_sync p50", xy(&points, "rpc_sync_p50_us")),
                Series::new("rpc_sync p99", xy(&points, "rpc_sync_p99_us")),
                Series::new(
                    "raw TCP ping-pong p50",
                    xy(&points, "raw_tcp_pingpong_p50_us"),
                ),
            ],
            marks: vec![],
        },
        Panel {
            title: format!(
                "rpc_async calls/s, {} in flight over the peers",
                args.in_flight
            ),
            x_desc: "peers called (world - 1)".into(),
            y_desc: "calls per second".into(),
            series: vec![
                Series::new("rpc_async calls/s", xy(&points, "rpc_async_calls_per_s")),
                Series::new(
                    "raw sequential round trips/s",
                    xy(&points, "raw_round_trips_per_s"),
                ),
            ],
            marks: vec![],
        },
    ];
    let mut json = Map::new();
    json.insert("x".into(), json!("peers the caller calls in turn"));
    json.insert(
        "ratio_is".into(),
        json!("rpc_sync p50 over raw ping-pong p50"),
    );
    json.insert(
        "raw_baseline".into(),
        json!("64-byte ping-pong over plain TCP to an echo process, one connection per peer used in turn, in blocks alternating with the calls; calls/s is also given over the first point's (calls_per_s_over_first)"),
    );
    json.insert("transport".into(), json!(args.transport));
    json.insert(
        "settings".into(),
        json!({"calls": args.calls, "async_calls": args.async_calls, "in_flight": args.in_flight}),
    );
    json.insert("points".into(), Value::Array(points));
    finish("peers", &args.out, json, &panels)
}

/// The raw rendezvous of `world` processes: the wall time from starting the first until each
/// has dialled this one and been told that all have.
fn raw_rendezvous(world: usize, timeout: Duration) -> Result<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let mut children = Vec::with_capacity(world - 1);
    for _ in 1..world {
        children.push(
            Command::new(&exe)
                .args([
                    "bench",
                    "curve-worker",
                    "--raw-rendezvous",
                    &addr.to_string(),
                ])
                .stdin(Stdio::null())
                .spawn()
                .context("starting a raw rendezvous process")?,
        );
    }
    let mut conns = Vec::with_capacity(world - 1);
    listener.set_nonblocking(false)?;
    let deadline = Instant::now() + timeout;
    while conns.len() < world - 1 {
        if Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
                let _ = c.wait();
            }
            bail!("the raw rendezvous of {world} did not finish within {timeout:?}");
        }
        let (mut s, _) = listener.accept()?;
        let mut hello = [0u8; 1];
        s.read_exact(&mut hello)?;
        conns.push(s);
    }
    for s in &mut conns {
        s.write_all(&[1])?;
    }
    let took = started.elapsed();
    drop(conns);
    for (i, mut c) in children.into_iter().enumerate() {
        let status = c.wait()?;
        if !status.success() {
            bail!("raw rendezvous process {} failed ({status})", i + 1);
        }
    }
    Ok(took)
}

/// The world size whose init `bench curve init` holds to a goal, and the goal.
const INIT_GOAL: (usize, Duration) = (64, Duration::from_secs(5));

fn init(args: &InitArgs) -> Result<()> {
    check_worlds(&args.world, 1024)?;
    let timeout = Duration::from_secs(args.out.timeout);
    set_transport(&args.transport);
    let rt = runtime(1)?;
    let bar = progress(args.world.len() as u64, "init");
    // The first processes started pay for a cold binary: a throw-away raw round first.
    raw_rendezvous(2, timeout)?;
    let mut points = Vec::new();
    for &world in &args.world {
        bar.set_message(format!("init of {world}"));
        let raw = raw_rendezvous(world, timeout)?;
        let point = rt.block_on(async {
            let group = start_group(world, timeout).await?;
            let point = json!({
                "x": world,
                "world": world,
                "init_wall_ms": ms(group.init_wall),
                "init_rpc_rank0_ms": ms(group.init_rank0),
                "init_rpc_slowest_other_ms": ms(group.init_slowest_other),
                "raw_rendezvous_ms": ms(raw),
                "ratio": group.init_wall.as_secs_f64() / raw.as_secs_f64(),
            });
            group.finish(timeout).await?;
            anyhow::Ok(point)
        })?;
        points.push(point);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mut json = Map::new();
    let (goal_world, goal) = INIT_GOAL;
    if let Some(p) = points.iter().find(|p| p["world"] == goal_world) {
        let wall = p["init_wall_ms"].as_f64().unwrap_or(f64::NAN);
        json.insert(
            "targets_met".into(),
            json!({ format!("init_rpc w{goal_world} < {} s", goal.as_secs()): wall < ms(goal) }),
        );
    }
    let panels = [Panel {
        title: "init_rpc against world size (processes on this host)".into(),
        x_desc: "world size".into(),
        y_desc: "milliseconds".into(),
        series: vec![
            Series::new(
                "start to every init_rpc returned",
                xy(&points, "init_wall_ms"),
            ),
            Series::new("init_rpc on rank 0", xy(&points, "init_rpc_rank0_ms")),
            Series::new(
                "raw rendezvous (star, plain TCP)",
                xy(&points, "raw_rendezvous_ms"),
            ),
        ],
        marks: vec![],
    }];
    json.insert("x".into(), json!("world size"));
    json.insert(
        "ratio_is".into(),
        json!("init_wall_ms over raw_rendezvous_ms"),
    );
    json.insert(
        "raw_baseline".into(),
        json!("the same number of processes of this binary started the same way, each dialling the benchmark over plain TCP and waiting until all have (a star, no secret, no mesh)"),
    );
    json.insert("transport".into(), json!(args.transport));
    json.insert("points".into(), Value::Array(points));
    finish("init", &args.out, json, &panels)
}

/// Where each transport changes how it moves a frame, in bytes, with what changes.
fn strategy_switches() -> Vec<(&'static str, usize, &'static str)> {
    let mut v = vec![(
        "tcp",
        // transport-tcp/src/connection.rs, DIRECT_READ_MIN.
        64 << 10,
        "payloads of 64 KiB and more are read straight into their buffer, smaller ones through the 64 KiB read buffer",
    )];
    // transport-shm/src/connection.rs, DIRECT_MIN.
    v.push((
        "shm",
        4096,
        "from 4 KiB the receiver copies out of the ring straight into the payload's buffer",
    ));
    #[cfg(feature = "shm")]
    v.push((
        "shm",
        tensorwire_transport_shm::ShmConfig::new(
            tensorwire_transport_shm::ClusterSecret::new(vec![0; 32]).expect("32 bytes"),
        )
        .slab_min,
        "frames from here on are copied once into a reused sealed slab instead of the ring",
    ));
    v
}

fn payload(args: &PayloadArgs) -> Result<()> {
    if args.sizes.is_empty() || args.sizes.iter().any(|s| *s < 8 || s % 4 != 0) {
        bail!(Usage(format!(
            "--sizes must be multiples of 4 of at least 8 bytes (got {:?})",
            args.sizes
        )));
    }
    if let Some(t) = args
        .transports
        .iter()
        .find(|t| !["tcp", "shm"].contains(&t.as_str()))
    {
        bail!(Usage(format!("--transports takes tcp and shm, not {t:?}")));
    }
    if args.rounds == 0 {
        bail!(Usage("--rounds must be at least 1".into()));
    }
    let timeout = Duration::from_secs(args.out.timeout);
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let rounds_for = |size: usize| (((64 << 20) / size).min(args.rounds)).max(3);
    let mut raw = Raw::start_process(&sizes).context("raw TCP baseline")?;
    let largest = sizes.last().copied().unwrap_or(8);
    let raw_data = vec![7u8; largest];
    // memcpy between buffers faulted in beforehand: the limit of any transfer on one host.
    let mut src = vec![5u8; largest];
    let mut dst = vec![0u8; largest];
    let rt = runtime(1)?;
    let bar = progress((sizes.len() * args.transports.len()) as u64, "payload");
    let mut points = Vec::new();
    for transport in &args.transports {
        set_transport(transport);
        let rows = rt.block_on(async {
            let group = start_group(2, timeout).await?;
            let mut rows = Vec::new();
            for &size in &sizes {
                bar.set_message(format!("{transport} {size} B"));
                let floats = vec![1.0f32; size / 4];
                let tensor = Tensor::from_f32(vec![floats.len()], &floats)?;
                drop(floats);
                let rounds = rounds_for(size);
                let (mut tw, mut rw, mut mc) = (Vec::new(), Vec::new(), Vec::new());
                for round in 0..=rounds {
                    src[round % size] = round as u8;
                    let t = Instant::now();
                    dst[..size].copy_from_slice(std::hint::black_box(&src[..size]));
                    let copy = t.elapsed();
                    std::hint::black_box(&dst);
                    let r = blocking(|| raw.bulk(&raw_data[..size]))?;
                    let t = Instant::now();
                    let n: u64 = group.agent.rpc_sync(1u32, "nbytes", &tensor, None).await?;
                    let took = t.elapsed();
                    if n as usize != size {
                        bail!("the callee saw {n} bytes instead of {size}");
                    }
                    // Round 0 warms up buffers and pages.
                    if round > 0 {
                        tw.push(took);
                        rw.push(r);
                        mc.push(copy);
                    }
                }
                tw.sort();
                rw.sort();
                mc.sort();
                let (t50, r50, m50) = (tw[tw.len() / 2], rw[rw.len() / 2], mc[mc.len() / 2]);
                rows.push(json!({
                    "x": size,
                    "bytes": size,
                    "transport": transport,
                    "rpc_sync_p50_us": us(t50),
                    "raw_tcp_p50_us": us(r50),
                    "memcpy_p50_us": us(m50),
                    "rpc_MBps": mbps(size, t50),
                    "raw_tcp_MBps": mbps(size, r50),
                    "memcpy_MBps": mbps(size, m50.max(Duration::from_nanos(1))),
                    "ratio": us(t50) / us(r50),
                    "rounds": rounds,
                }));
                bar.inc(1);
            }
            group.finish(timeout).await?;
            anyhow::Ok(rows)
        })?;
        points.extend(rows);
    }
    bar.finish_and_clear();
    raw.finish()?;
    let switches = strategy_switches();
    let of = |transport: &str, field: &str| -> Vec<(f64, f64)> {
        points
            .iter()
            .filter(|p| p["transport"] == transport)
            .filter_map(|p| Some((p["x"].as_f64()?, p[field].as_f64()?)))
            .collect()
    };
    let mut series = Vec::new();
    for t in &args.transports {
        series.push(Series::new(format!("rpc_sync, {t}"), of(t, "rpc_MBps")));
    }
    let first = args.transports.first().map(String::as_str).unwrap_or("tcp");
    series.push(Series::new("raw TCP transfer", of(first, "raw_tcp_MBps")));
    series.push(Series::new("memcpy", of(first, "memcpy_MBps")));
    let marks = switches
        .iter()
        .filter(|(t, ..)| args.transports.iter().any(|x| x == t))
        .map(|(t, at, _)| (*at as f64, format!("{t} switches at {} KiB", at >> 10)))
        .collect();
    let panels = [Panel {
        title: "payload size: rpc_sync with a tensor against raw TCP and memcpy".into(),
        x_desc: "bytes".into(),
        y_desc: "MB/s (10^6 bytes per second, round trip)".into(),
        series,
        marks,
    }];
    let mut json = Map::new();
    json.insert("x".into(), json!("tensor bytes per call"));
    json.insert(
        "ratio_is".into(),
        json!("rpc_sync p50 over raw TCP transfer p50 of the same bytes (time; above 1 is slower)"),
    );
    json.insert(
        "raw_baseline".into(),
        json!("the same bytes over plain TCP to an echo process that acknowledges each transfer with one byte, alternating with the calls; memcpy of the same bytes"),
    );
    json.insert(
        "strategy_switches".into(),
        Value::Array(
            switches
                .iter()
                .map(|(t, at, what)| json!({"transport": t, "bytes": at, "what": what}))
                .collect(),
        ),
    );
    json.insert("points".into(), Value::Array(points));
    finish("payload", &args.out, json, &panels)
}

fn collectives(args: &CollectivesCurveArgs) -> Result<()> {
    check_worlds(&args.world, 256)?;
    if args.sizes.is_empty() || args.sizes.contains(&0) || args.iters == 0 {
        bail!(Usage(
            "--sizes needs sizes of at least 1 byte and --iters at least 1".into()
        ));
    }
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let bar = progress(args.world.len() as u64 + 1, "collectives");
    // Raw bulk transfers of each size, before and after the groups.
    let mut raw = Raw::start_process(&sizes).context("raw TCP baseline")?;
    let data = vec![3u8; sizes.last().copied().unwrap_or(1)];
    let mut raw_times: Vec<Vec<Duration>> = vec![Vec::new(); sizes.len()];
    let mut raw_round = |raw: &mut Raw| -> Result<()> {
        for (i, &size) in sizes.iter().enumerate() {
            let n = super::bench_collectives::iters_for(args.iters, size).div_ceil(4);
            for _ in 0..n {
                raw_times[i].push(raw.bulk(&data[..size])?);
            }
        }
        Ok(())
    };
    raw.bulk(&data[..sizes[0]])?;
    raw_round(&mut raw)?;
    let mut groups = Vec::new();
    for &world in &args.world {
        bar.set_message(format!("collectives, {world} processes"));
        let got = super::bench_collectives::run_curve_group(
            world,
            &sizes,
            args.iters,
            args.out.timeout,
            &args.transport,
        )
        .with_context(|| format!("world {world}"))?;
        let raw_barrier = super::bench_collectives::raw_barrier(world, args.iters)?;
        groups.push((world, got, raw_barrier));
        raw_round(&mut raw)?;
        bar.inc(1);
    }
    raw.finish()?;
    bar.finish_and_clear();
    let raw_us: Vec<f64> = raw_times
        .into_iter()
        .map(super::bench_collectives::median_us)
        .collect();
    let mut points = Vec::new();
    for (world, got, raw_barrier) in &groups {
        let barrier = got
            .get("barrier_us")
            .and_then(Value::as_f64)
            .unwrap_or(f64::NAN);
        points.push(json!({
            "x": world, "op": "barrier", "world": world, "bytes": 0,
            "us": barrier, "raw_us": raw_barrier, "ratio": barrier / raw_barrier,
        }));
        for op in ["broadcast", "all_reduce", "all_gather"] {
            for (i, &size) in sizes.iter().enumerate() {
                let t = got
                    .get(&format!("{op}_{size}_us"))
                    .and_then(Value::as_f64)
                    .unwrap_or(f64::NAN);
                points.push(json!({
                    "x": world, "op": op, "world": world, "bytes": size,
                    "us": t, "raw_us": raw_us[i], "ratio": t / raw_us[i],
                }));
            }
        }
    }
    let of = |op: &str, bytes: usize, field: &str| -> Vec<(f64, f64)> {
        points
            .iter()
            .filter(|p| p["op"] == op && p["bytes"] == bytes)
            .filter_map(|p| Some((p["x"].as_f64()?, p[field].as_f64()?)))
            .collect()
    };
    let mut panels = vec![Panel {
        title: "barrier against world size".into(),
        x_desc: "world size".into(),
        y_desc: "microseconds (median)".into(),
        series: vec![
            Series::new("barrier", of("barrier", 0, "us")),
            Series::new(
                "raw barrier (threads, plain TCP)",
                of("barrier", 0, "raw_us"),
            ),
        ],
        marks: vec![],
    }];
    for op in ["broadcast", "all_reduce", "all_gather"] {
        let mut series = Vec::new();
        for &size in &sizes {
            series.push(Series::new(format!("{op} {size} B"), of(op, size, "us")));
        }
        for &size in &sizes {
            series.push(Series::new(
                format!("raw TCP {size} B"),
                of(op, size, "raw_us"),
            ));
        }
        panels.push(Panel {
            title: format!("{op} against world size, per message size"),
            x_desc: "world size".into(),
            y_desc: "microseconds (median)".into(),
            series,
            marks: vec![],
        });
    }
    let mut json = Map::new();
    json.insert("x".into(), json!("world size"));
    json.insert(
        "ratio_is".into(),
        json!("us over raw_us (time; above 1 is slower)"),
    );
    json.insert(
        "raw_baseline".into(),
        json!("barrier: the same dissemination barrier among threads over blocking loopback sockets; the others: one raw transfer of the message's bytes to an echo process, acknowledged with one byte"),
    );
    json.insert("transport".into(), json!(args.transport));
    json.insert("sizes".into(), json!(sizes));
    json.insert("iters".into(), json!(args.iters));
    json.insert("points".into(), Value::Array(points));
    finish("collectives", &args.out, json, &panels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plot_without_points_is_drawn_blank_and_with_points_is_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.png");
        let panel = |points: Vec<(f64, f64)>| Panel {
            title: "t".into(),
            x_desc: "x".into(),
            y_desc: "y".into(),
            series: vec![Series::new("s", points)],
            marks: vec![(4.0, "m".into())],
        };
        plot(
            &path,
            &[panel(vec![(1.0, 2.0), (8.0, 30.0)]), panel(vec![])],
        )
        .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    }

    #[test]
    fn world_sizes_out_of_range_are_usage_errors() {
        let e = check_worlds(&[2, 1], 64).unwrap_err();
        assert!(e.downcast_ref::<Usage>().is_some(), "{e}");
        assert!(e.to_string().contains("[2, 1]"), "{e}");
        assert!(check_worlds(&[65], 64).is_err());
        assert!(check_worlds(&[], 64).is_err());
        check_worlds(&[2, 64], 64).unwrap();
    }
}
