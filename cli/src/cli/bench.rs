//! `tensorwire bench ...`: measurements that compare tensorwire with a raw baseline in one run.
//!
//! - `bench fairness [--json FILE]`: an honest caller's latency while another peer floods the
//!   same worker, against none (see `bench_fairness`).
//! - `bench transport --transport tcp|quic|shm [--json FILE]`: on loopback, plain blocking TCP
//!   sockets without framing, served by a raw echo *process* (this binary re-run with the hidden
//!   `bench raw-echo`; ping-pong of small messages, bulk transfers), against the chosen transport
//!   (frame ping-pong, bulk frames of 1 MiB and 64 MiB), with the ratios of each pair; and a
//!   64 MiB `memcpy`, the limit of any transfer on one host. Absolute figures on a shared
//!   machine are noise; the ratios, measured in one run, are what we track.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use serde_json::{json, Value};

use super::bench_common::{mbps, median, percentile, progress, runtime, write_json, MIB, SMALL};
use super::bench_raw_tcp::Raw;
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
    /// An honest caller's p50/p99 while another peer floods the same worker (a peer that
    /// never reads its replies; a request flood), against no flood, as ratios.
    #[cfg(feature = "tcp")]
    Fairness(super::bench_fairness::FairnessArgs),
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

/// Ping-pong measurements alternate between raw and framed in this many blocks.
const BLOCKS: usize = 20;

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
        #[cfg(feature = "tcp")]
        Bench::Fairness(a) => super::bench_fairness::run(&a),
        Bench::RawEcho(a) => super::bench_raw_tcp::raw_echo(a.connections),
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
            runtime(1)?.block_on(async move {
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
        let rt = runtime(1)?;
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
