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

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;

mod collectives;
mod group;
mod init;
mod output;
mod payload;
mod peers;
mod rrefs;

#[cfg(feature = "autograd-candle")]
pub(crate) use group::start_group_with;
pub(crate) use group::worker;

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
        Curve::Rrefs(a) => rrefs::rrefs(a),
        Curve::Peers(a) => peers::peers(a),
        Curve::Init(a) => init::init(a),
        Curve::Payload(a) => payload::payload(a),
        Curve::Collectives(a) => collectives::collectives(a),
    }
}
