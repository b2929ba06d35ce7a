//! `tensorwire bench ...`: measurements that compare tensorwire with a raw baseline in one run.
//!
//! - `bench transport --transport tcp|quic|shm [--json FILE]`: on loopback, plain blocking TCP
//!   sockets without framing, served by a raw echo *process* (this binary re-run with the hidden
//!   `bench raw-echo`; ping-pong of small messages, bulk transfers), against the chosen transport
//!   (frame ping-pong, bulk frames of 1 MiB and 64 MiB), with the ratios of each pair; and a
//!   64 MiB `memcpy`, the limit of any transfer on one host. Absolute figures on a shared
//!   machine are noise; the ratios, measured in one run, are what we track.

use std::io::{BufRead, IsTerminal, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};

use super::Usage;
use tensorwire_core::ports::transport::{Connection, Transport};
use tensorwire_core::wire::Frame;

/// Arguments of `tensorwire bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    bench: Bench,
}

/// What to measure.
#[derive(Debug, clap::Subcommand)]
enum Bench {
    /// A transport against plain TCP sockets on loopback: ping-pong latency and bulk throughput.
    Transport(TransportArgs),
    /// The RPC agent between two processes on loopback against plain TCP sockets.
    Rpc(super::bench_rpc::RpcArgs),
    /// Process-group collectives of local processes against raw TCP (see
    /// `bench_collectives`).
    Collectives(super::bench_collectives::CollectivesArgs),
    /// How costs grow (references, peers, world size, payload size), each against a raw
    /// baseline measured in the same run; JSON and a PNG plot.
    Curve(super::bench_curves::CurveArgs),
    /// Distributed autograd's backward (chain, diamond, parameter server) against the local
    /// backward of the same model, with its overhead in round trips.
    Autograd(AutogradArgs),
    /// One rank of a `bench curve` group (started by it).
    #[command(hide = true)]
    CurveWorker(super::bench_curves::CurveWorkerArgs),
    /// A rendezvous-shaped load on the store server from one process holding N connections.
    Store(super::bench_store::StoreArgs),
    /// One rank of `bench collectives` (started by it).
    #[command(hide = true)]
    CollectivesWorker(super::bench_collectives::WorkerArgs),
    /// The raw TCP echo process of `bench transport` (started by it).
    #[command(hide = true)]
    RawEcho(RawEchoArgs),
    /// The raw shared-memory echo process of `bench rpc` (started by it).
    #[command(hide = true)]
    RawShmEcho(super::bench_raw_shm::RawShmEchoArgs),
    /// One rank of a raw barrier among processes (started by `bench collectives`).
    #[command(hide = true)]
    RawBarrierRank(super::bench_raw_barrier::RankArgs),
}

#[cfg(feature = "autograd-candle")]
use super::bench_autograd::AutogradArgs;

/// Arguments of `bench autograd` in a build without distributed autograd (it says so).
#[cfg(not(feature = "autograd-candle"))]
#[derive(Debug, clap::Args)]
struct AutogradArgs {
    /// Ignored: the build has no distributed autograd.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    rest: Vec<String>,
}

/// Arguments of the hidden `bench raw-echo`.
#[derive(Debug, clap::Args)]
struct RawEchoArgs {
    /// Connections to serve before exiting.
    #[arg(long)]
    connections: usize,
}

/// Transports `bench transport` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TransportKind {
    /// tokio TCP with a cluster secret (the default transport).
    Tcp,
    /// quinn QUIC with mutual TLS.
    Quic,
    /// Shared memory between processes of one host (memfd rings, cluster secret).
    Shm,
}

/// Arguments of `tensorwire bench transport`.
#[derive(Debug, clap::Args)]
struct TransportArgs {
    /// The transport to measure.
    #[arg(long, value_enum, default_value = "tcp")]
    transport: TransportKind,
    /// Write the results as one JSON object to this file (else to standard output).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Round trips per ping-pong measurement (raw and framed alternate in 20 blocks, after one
    /// block each for warm-up).
    #[arg(long, default_value_t = 20_000)]
    pingpong: usize,
    /// Transfers of 64 MiB per bulk measurement (the median is reported).
    #[arg(long, default_value_t = 24)]
    bulk_64mib: usize,
    /// Transfers of 1 MiB per bulk measurement (the median is reported).
    #[arg(long, default_value_t = 400)]
    bulk_1mib: usize,
}

/// Size of a ping-pong message, raw and framed (as the frame's message header).
pub(crate) const SMALL: usize = 64;
/// Ping-pong measurements alternate between raw and framed in this many blocks.
const BLOCKS: usize = 20;
pub(crate) const MIB: usize = 1 << 20;

pub(crate) fn run(args: Args) -> ExitCode {
    let result = match args.bench {
        Bench::Transport(a) => bench_transport(&a),
        Bench::Rpc(a) => super::bench_rpc::bench_rpc(&a),
        Bench::Collectives(a) => super::bench_collectives::run(&a),
        Bench::Curve(a) => super::bench_curves::run(&a),
        #[cfg(feature = "autograd-candle")]
        Bench::Autograd(a) => super::bench_autograd::run(&a),
        #[cfg(not(feature = "autograd-candle"))]
        Bench::Autograd(_) => Err(Usage(
            "this tensorwire was built without the `autograd-candle` feature; rebuild with it"
                .into(),
        )
        .into()),
        Bench::CurveWorker(a) => super::bench_curves::worker(&a),
        Bench::CollectivesWorker(a) => super::bench_collectives::worker(&a),
        Bench::Store(a) => super::bench_store::run(&a),
        Bench::RawEcho(a) => raw_echo(&a),
        Bench::RawShmEcho(a) => super::bench_raw_shm::raw_shm_echo(&a),
        Bench::RawBarrierRank(a) => super::bench_raw_barrier::rank(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tensorwire bench: error: {e:#}");
            super::exit_code(&e)
        }
    }
}

/// A progress bar on standard error, hidden when it is not a terminal.
pub(crate) fn progress(len: u64, what: &str) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(len), target);
    bar.set_style(
        ProgressStyle::with_template("{msg:32} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(what.to_owned());
    bar
}

/// Builds the transport to measure. A fresh random secret: both ends are in this process.
fn make_transport(kind: TransportKind) -> Result<Arc<dyn Transport>> {
    match kind {
        #[cfg(feature = "tcp")]
        TransportKind::Tcp => {
            use tensorwire_transport_tcp::{ClusterSecret, TcpConfig, TcpTransport};
            let secret: [u8; 32] = rand::random();
            let config = TcpConfig::new(ClusterSecret::new(secret.to_vec())?);
            Ok(Arc::new(TcpTransport::new(config)?))
        }
        #[cfg(not(feature = "tcp"))]
        TransportKind::Tcp => {
            bail!(Usage(
                "this tensorwire was built without the `tcp` feature; rebuild with it".into()
            ))
        }
        // A fresh cluster CA and one node certificate: both ends are in this process.
        #[cfg(feature = "quic")]
        TransportKind::Quic => {
            use tensorwire_transport_quic::{
                certs::ClusterCa, ClusterTls, QuicConfig, QuicTransport,
            };
            let ca = ClusterCa::generate()?;
            let tls = ClusterTls::new(ca.issue_node("bench")?, vec![ca.cert_der().clone()]);
            Ok(Arc::new(QuicTransport::new(QuicConfig::new(tls))?))
        }
        #[cfg(not(feature = "quic"))]
        TransportKind::Quic => bail!(Usage(
            "QUIC not built in: this tensorwire was built without the `quic` feature \
             (tensorwire-transport-quic); rebuild with `--features quic` or use --transport tcp"
                .into()
        )),
        #[cfg(feature = "shm")]
        TransportKind::Shm => {
            use tensorwire_transport_shm::{ClusterSecret, ShmConfig, ShmTransport};
            let secret: [u8; 32] = rand::random();
            let config = ShmConfig::new(ClusterSecret::new(secret.to_vec())?);
            Ok(Arc::new(ShmTransport::new(config)?))
        }
        #[cfg(not(feature = "shm"))]
        TransportKind::Shm => bail!(Usage(
            "shared memory not built in: this tensorwire was built without the `shm` feature \
             (tensorwire-transport-shm); rebuild with `--features shm` or use --transport tcp"
                .into()
        )),
    }
}

/// The `p` quantile (0 to 1) of `sorted`, in microseconds: the benchmarks' one percentile.
// Exact, from the sorted samples: a run keeps at most some thousands of them, so a histogram
// (hdrhistogram) would save nothing and add its bucket error.
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e6
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Megabytes (10^6 bytes) per second.
pub(crate) fn mbps(bytes: usize, took: Duration) -> f64 {
    bytes as f64 / took.as_secs_f64() / 1e6
}

/// Writes the results: to `path` (and a copy to standard error) or to standard output.
pub(crate) fn write_json(
    out: &serde_json::Map<String, Value>,
    path: Option<&PathBuf>,
) -> Result<()> {
    let text = serde_json::to_string_pretty(&Value::Object(out.clone()))?;
    match path {
        Some(path) => {
            std::fs::write(path, format!("{text}\n"))
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!("{text}");
            eprintln!("tensorwire bench: wrote {}", path.display());
        }
        None => println!("{text}"),
    }
    Ok(())
}

fn bench_transport(args: &TransportArgs) -> Result<()> {
    if args.pingpong < BLOCKS || args.bulk_64mib == 0 || args.bulk_1mib == 0 {
        bail!(Usage(format!(
            "--pingpong must be at least {BLOCKS}; --bulk-64mib and --bulk-1mib at least 1"
        )));
    }
    let transport = make_transport(args.transport)?;
    let mut raw = Raw::start_process(&[MIB, 64 * MIB]).context("raw TCP baseline")?;
    let mut framed = Framed::start(transport).context("starting the transport")?;

    // Raw and framed measurements alternate in blocks, so that both see the same load from the
    // rest of the machine and their ratio stays meaningful on a busy host.
    let per_block = args.pingpong / BLOCKS;
    let bar = progress(2 * (BLOCKS as u64 + 1), "ping-pong (raw, framed)");
    let (mut raw_times, mut frame_times) = (Vec::new(), Vec::new());
    for block in 0..=BLOCKS {
        let r = raw.pingpong(per_block).context("raw TCP ping-pong")?;
        bar.inc(1);
        let f = framed.pingpong(per_block).context("frame ping-pong")?;
        bar.inc(1);
        // Block 0 warms up.
        if block > 0 {
            raw_times.extend(r);
            frame_times.extend(f);
        }
    }
    bar.finish_and_clear();
    raw_times.sort();
    frame_times.sort();

    // The limit on one host: one copy of 64 MiB between buffers already faulted in.
    let mut copy_src = vec![5u8; 64 * MIB];
    let mut copy_dst = vec![0u8; 64 * MIB];
    let mut memcpy = Vec::new();
    let mut bulk = |size: usize, rounds: usize, what: &str| -> Result<(f64, f64)> {
        let data = vec![3u8; size];
        let frame = Frame::message(Bytes::new(), vec![Bytes::from(data.clone())]);
        let bar = progress(rounds as u64 + 1, what);
        let (mut r, mut f) = (Vec::new(), Vec::new());
        for round in 0..=rounds {
            if size == 64 * MIB {
                copy_src[round % 64] = round as u8;
                let t = Instant::now();
                copy_dst.copy_from_slice(std::hint::black_box(&copy_src));
                let took = t.elapsed();
                std::hint::black_box(&copy_dst);
                if round > 0 {
                    memcpy.push(mbps(size, took));
                }
            }
            // Alternate which goes first, so neither always finds warmer caches.
            let (raw_took, frame_took) = if round % 2 == 0 {
                let r = raw.bulk(&data).context("raw TCP bulk")?;
                (r, framed.bulk(&frame).context("frame bulk")?)
            } else {
                let f = framed.bulk(&frame).context("frame bulk")?;
                (raw.bulk(&data).context("raw TCP bulk")?, f)
            };
            // Round 0 warms up buffers and pages.
            if round > 0 {
                r.push(mbps(size, raw_took));
                f.push(mbps(size, frame_took));
            }
            bar.inc(1);
        }
        bar.finish_and_clear();
        Ok((median(r), median(f)))
    };
    let (raw_1, frame_1) = bulk(MIB, args.bulk_1mib, "bulk 1 MiB (raw, framed)")?;
    let (raw_64, frame_64) = bulk(64 * MIB, args.bulk_64mib, "bulk 64 MiB (raw, framed)")?;
    raw.finish()?;
    framed.finish()?;
    let memcpy_64 = median(memcpy);

    let raw = json!({
        "raw_tcp_pingpong_p50_us": percentile(&raw_times, 0.5),
        "raw_tcp_pingpong_p99_us": percentile(&raw_times, 0.99),
        "raw_tcp_bulk_1MiB_MBps": raw_1,
        "raw_tcp_bulk_64MiB_MBps": raw_64,
    });
    let framed = json!({
        "frame_pingpong_p50_us": percentile(&frame_times, 0.5),
        "frame_pingpong_p99_us": percentile(&frame_times, 0.99),
        "frame_bulk_1MiB_MBps": frame_1,
        "frame_bulk_64MiB_MBps": frame_64,
    });
    let ratio = |a: &str, b: &str| -> Value {
        match (framed[a].as_f64(), raw[b].as_f64()) {
            (Some(f), Some(r)) if r > 0.0 => json!(f / r),
            _ => Value::Null,
        }
    };
    let ratios = json!({
        "pingpong_p50": ratio("frame_pingpong_p50_us", "raw_tcp_pingpong_p50_us"),
        "bulk_1MiB": ratio("frame_bulk_1MiB_MBps", "raw_tcp_bulk_1MiB_MBps"),
        "bulk_64MiB": ratio("frame_bulk_64MiB_MBps", "raw_tcp_bulk_64MiB_MBps"),
        "bulk_64MiB_vs_memcpy": frame_64 / memcpy_64,
    });
    let mut out = serde_json::Map::new();
    out.insert(
        "transport".into(),
        json!(format!("{:?}", args.transport).to_lowercase()),
    );
    for obj in [&raw, &framed] {
        for (k, v) in obj.as_object().into_iter().flatten() {
            out.insert(k.clone(), v.clone());
        }
    }
    out.insert("memcpy_64MiB_MBps".into(), json!(memcpy_64));
    out.insert("raw_baseline".into(), json!("process"));
    out.insert("ratios".into(), ratios);
    out.insert(
        "settings".into(),
        json!({
            "pingpong_round_trips": args.pingpong / BLOCKS * BLOCKS,
            "interleaved_blocks": BLOCKS,
            "pingpong_message_bytes": SMALL,
            "bulk_64MiB_transfers": args.bulk_64mib,
            "bulk_1MiB_transfers": args.bulk_1mib,
            "MBps": "10^6 bytes per second; bulk = one transfer plus a 1-byte acknowledgement",
            "raw_baseline": "plain TCP to an echo process (bench raw-echo); the transport's two \
                             ends are threads of this process",
        }),
    );
    write_json(&out, args.json.as_ref())
}

// ---------------------------------------------------------------------------------------------
// Raw baseline: blocking std sockets, no framing, an echo process (`bench raw-echo`) serving
// each connection on a thread.

/// Modes of a raw connection, named once in its first message (never per exchange, so the
/// baseline carries no framing at all).
const RAW_PING: u8 = 1;
const RAW_BULK: u8 = 2;

/// Serves one raw connection: echoes [`SMALL`]-byte messages, or acknowledges each transfer
/// of the announced size with one byte, until the client closes.
fn raw_connection(mut s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut setup = [0u8; 9];
    s.read_exact(&mut setup)?;
    let size = u64::from_le_bytes(setup[1..].try_into().unwrap_or_default()) as usize;
    let mut buf = vec![0u8; if setup[0] == RAW_PING { SMALL } else { size }];
    loop {
        match s.read_exact(&mut buf) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        if setup[0] == RAW_PING {
            s.write_all(&buf)?;
        } else {
            s.write_all(&[1])?;
        }
    }
}

/// The raw baseline's client: blocking sockets to echo threads, one connection per kind of
/// exchange.
pub(crate) struct Raw {
    /// Ping-pong connections, each served by its own echo thread.
    pings: Vec<TcpStream>,
    bulk: Vec<(usize, TcpStream)>,
    /// The raw echo process.
    server: std::process::Child,
}

/// Accepts `connections` raw connections on `listener` and serves each on a thread.
fn raw_serve(listener: TcpListener, connections: usize) -> std::io::Result<()> {
    let mut handlers = Vec::new();
    for _ in 0..connections {
        let (s, _) = listener.accept()?;
        handlers.push(std::thread::spawn(move || raw_connection(s)));
    }
    for h in handlers {
        h.join()
            .map_err(|_| std::io::Error::other("raw echo thread panicked"))??;
    }
    Ok(())
}

/// `bench raw-echo`: serves raw connections in this process; prints its address first.
fn raw_echo(args: &RawEchoArgs) -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("{}", listener.local_addr()?);
    std::io::stdout().flush()?;
    raw_serve(listener, args.connections)?;
    Ok(())
}

impl Raw {
    /// The baseline with its echo in another process (this binary, `bench raw-echo`).
    pub(crate) fn start_process(bulk_sizes: &[usize]) -> Result<Self> {
        Self::start_process_pings(1, bulk_sizes)
    }

    /// The baseline with `pings` ping-pong connections (at least 1) to the echo process, for
    /// round trips spread over several peers ([`Raw::pingpong_round_robin`]).
    pub(crate) fn start_process_pings(pings: usize, bulk_sizes: &[usize]) -> Result<Self> {
        let pings = pings.max(1);
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .args(["bench", "raw-echo", "--connections"])
            .arg((pings + bulk_sizes.len()).to_string())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("starting the raw echo process")?;
        let mut line = String::new();
        let read = child
            .stdout
            .take()
            .map(|out| std::io::BufReader::new(out).read_line(&mut line));
        let addr = match read {
            Some(Ok(_)) => line.trim().parse::<SocketAddr>().ok(),
            _ => None,
        };
        let Some(addr) = addr else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the raw echo process did not report its address (got {line:?})");
        };
        Self::connect(addr, pings, bulk_sizes, child)
    }

    fn connect(
        addr: SocketAddr,
        pings: usize,
        bulk_sizes: &[usize],
        server: std::process::Child,
    ) -> Result<Self> {
        let open = |mode: u8, size: usize| -> Result<TcpStream> {
            let mut s = TcpStream::connect(addr)?;
            s.set_nodelay(true)?;
            let mut setup = [mode; 9];
            setup[1..].copy_from_slice(&(size as u64).to_le_bytes());
            s.write_all(&setup)?;
            Ok(s)
        };
        let pings = (0..pings)
            .map(|_| open(RAW_PING, SMALL))
            .collect::<Result<_>>()?;
        let bulk = bulk_sizes
            .iter()
            .map(|&size| Ok((size, open(RAW_BULK, size)?)))
            .collect::<Result<_>>()?;
        Ok(Raw {
            pings,
            bulk,
            server,
        })
    }

    /// `n` round trips of [`SMALL`] bytes on the first connection; the time of each.
    pub(crate) fn pingpong(&mut self, n: usize) -> Result<Vec<Duration>> {
        self.pingpong_on(n, 1)
    }

    /// `n` round trips of [`SMALL`] bytes, each on the next of the ping-pong connections in
    /// turn; the time of each.
    pub(crate) fn pingpong_round_robin(&mut self, n: usize) -> Result<Vec<Duration>> {
        self.pingpong_on(n, self.pings.len())
    }

    fn pingpong_on(&mut self, n: usize, connections: usize) -> Result<Vec<Duration>> {
        let msg = [7u8; SMALL];
        let mut back = [0u8; SMALL];
        let mut times = Vec::with_capacity(n);
        for i in 0..n {
            let s = &mut self.pings[i % connections];
            let t = Instant::now();
            s.write_all(&msg)?;
            s.read_exact(&mut back)?;
            times.push(t.elapsed());
        }
        Ok(times)
    }

    /// Sends `data` and waits for the 1-byte acknowledgement.
    pub(crate) fn bulk(&mut self, data: &[u8]) -> Result<Duration> {
        let s = self
            .bulk
            .iter_mut()
            .find(|(size, _)| *size == data.len())
            .map(|(_, s)| s)
            .context("no raw connection for this transfer size")?;
        let t = Instant::now();
        s.write_all(data)?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)?;
        Ok(t.elapsed())
    }

    pub(crate) fn finish(self) -> Result<()> {
        drop(self.pings);
        drop(self.bulk);
        let mut server = self.server;
        let status = server.wait()?;
        if !status.success() {
            bail!("the raw echo process failed: {status}");
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The transport: an echo/ack server on its own thread and runtime, the client on this one, as
// in the raw baseline.

/// Echoes frames without payloads; answers frames with payloads by a 1-byte frame.
async fn frame_server(conn: Box<dyn Connection>) {
    let ack = Frame::message(Bytes::from_static(&[1]), vec![]);
    while let Ok(frame) = conn.recv().await {
        let reply = if frame.payloads.is_empty() {
            frame
        } else {
            ack.clone()
        };
        if conn.send(reply).await.is_err() {
            return;
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// The transport's client: a current-thread runtime on this thread, the server on another.
struct Framed {
    rt: tokio::runtime::Runtime,
    conn: Box<dyn Connection>,
    server: std::thread::JoinHandle<Result<()>>,
}

impl Framed {
    fn start(transport: Arc<dyn Transport>) -> Result<Self> {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel::<Result<SocketAddr, String>>();
        let server_transport = transport.clone();
        let server = std::thread::spawn(move || -> Result<()> {
            runtime()?.block_on(async move {
                let listener = match server_transport.listen(([127, 0, 0, 1], 0).into()).await {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = addr_tx.send(Err(e.to_string()));
                        return Ok(());
                    }
                };
                let _ = addr_tx.send(Ok(listener.local_addr()));
                let conn = listener.accept().await?;
                frame_server(conn).await;
                Ok(())
            })
        });
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(30))
            .context("the benchmark server did not start")?
            .map_err(anyhow::Error::msg)?;
        let rt = runtime()?;
        let conn = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(30), transport.connect(addr))
                .await
                .context("connecting timed out")
        })??;
        Ok(Framed { rt, conn, server })
    }

    /// `n` round trips of a frame with a [`SMALL`]-byte header; the time of each.
    fn pingpong(&mut self, n: usize) -> Result<Vec<Duration>> {
        let conn = &self.conn;
        self.rt.block_on(async {
            let msg = Frame::message(Bytes::from(vec![7u8; SMALL]), vec![]);
            let mut times = Vec::with_capacity(n);
            for _ in 0..n {
                let t = Instant::now();
                conn.send(msg.clone()).await?;
                let back = conn.recv().await?;
                times.push(t.elapsed());
                anyhow::ensure!(back.header.len() == SMALL, "ping-pong reply garbled");
            }
            Ok(times)
        })
    }

    /// Sends `frame` and waits for the acknowledgement frame.
    fn bulk(&mut self, frame: &Frame) -> Result<Duration> {
        let conn = &self.conn;
        self.rt.block_on(async {
            let t = Instant::now();
            conn.send(frame.clone()).await?;
            let ack = conn.recv().await?;
            let took = t.elapsed();
            anyhow::ensure!(ack.header[..] == [1], "bulk acknowledgement garbled");
            Ok(took)
        })
    }

    fn finish(self) -> Result<()> {
        self.rt.block_on(self.conn.close())?;
        self.server
            .join()
            .map_err(|_| anyhow::anyhow!("benchmark server thread panicked"))??;
        Ok(())
    }
}
