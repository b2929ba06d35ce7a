//! `tensorwire bench collectives`: process groups of real local processes against raw TCP.
//!
//! For each world size N it starts N copies of this binary (`bench collectives-worker`, a
//! hidden subcommand) with `env://` variables and a fresh cluster secret; rank 0 embeds the
//! store on a free port. The workers time, after warm-up and with a barrier before each series:
//! `barrier_w{N}_us`, `all_gather_w{N}_8B_us`, `broadcast_w{N}_8B_us` and `reduce_w{N}_8B_us`
//! (8 bytes from / to rank 0), `all_gather_w{N}_1MiB_us` (1 MiB per rank,
//! through `all_gather_equal`: equal blocks, no lengths exchange, as gloo's and MPI's
//! all_gathers know their sizes) and `all_reduce_w{N}_1MiB_us`
//! (1 MiB of f32 summed, a copy of the input made in each timed call;
//! `all_reduce_w{N}_1MiB_in_place_us` without it, one buffer reduced again and again),
//! `reduce_w{N}_1MiB_us` (to rank 0), `reduce_scatter_w{N}_1MiB_us`,
//! `all_to_all_w{N}_1MiB_us` (even blocks) and `broadcast_w{N}_1MiB_us` (from rank 0), each the
//! median over its iterations on rank 0; the last four are also given over
//! `raw_tcp_bulk_1MiB_us` (one raw transfer of 1 MiB). In the same run this
//! process measures the raw baselines over plain TCP to an echo *process* (`bench raw-echo`, as
//! `bench transport`; `"raw_baseline": "process"`), in blocks before each group and after the
//! last: `raw_tcp_pingpong_p50_us` (64-byte round trips) and `raw_tcp_bulk_{N}x{N-1}MiB_us` (one
//! transfer of the bytes all ranks of an all_gather of 1 MiB blocks receive together); and
//! `raw_tcp_barrier_w{N}_us`, the same dissemination barrier among N *processes* over blocking
//! loopback sockets (one byte per message, no framing, no runtime: the shape of the groups, and
//! what the scheduler allows when N processes share fewer cores); unless `--transport tcp`,
//! also `raw_shm_barrier_w{N}_us`, the same barrier among N processes over counters in shared
//! memory (the same-host floor, polling while there are cores for every process, yielding
//! otherwise), with the ratios `barrier_w{N}_over_raw_shm_barrier`. The same barriers among N
//! threads of one process are given as `raw_{tcp,shm}_barrier_threads_w{N}_us` (thread switches
//! cost less than process switches; see `bench_raw_barrier`). `rendezvous_barrier_w32_ms` is the wall time from starting
//! rank 0 of 32 processes until all of them finished their first barrier.
//!
//! The `memcpy` floors of the 1 MiB all_gather and all_reduce (the bytes each rank must
//! receive: N - 1 MiB for all_gather; 2 (N - 1) / N MiB for all_reduce, the bandwidth lower
//! bound of any all_reduce (each position's N - 1 other inputs must reach the rank that sums
//! it, and its sum the N - 1 others: 2 (N - 1) transfers a position, over N ranks), which a
//! reduce-scatter then all-gather meets; copied through 1 MiB buffers, the working set of its
//! ranks) are measured twice: copied once in this process alone
//! (`memcpy_w{N}_all_gather_1MiB_us`, `memcpy_w{N}_all_reduce_1MiB_us`; ratios
//! `*_over_memcpy`), and copied by N processes at once between barriers, in the group's shape
//! and sharing the cores as its ranks do (`memcpy_all_ranks_w{N}_all_gather_1MiB_us`,
//! `memcpy_all_ranks_w{N}_all_reduce_1MiB_us`; ratios `*_over_memcpy_all_ranks`). The copy of
//! 1 MiB alone, the output's size (`memcpy_1MiB_us`, `memcpy_all_ranks_w{N}_1MiB_us`; ratios
//! `all_reduce_*_over_memcpy_output*`), stays beside them for reference: before 2026-12-01 it
//! was taken as all_reduce's floor, though it counts fewer bytes than any all_reduce must move
//! (at 8 ranks each rank must receive 1.75 MiB).
//!
//! With `--torch-python PYTHON` (a Python with torch, such as the CI venv's), PyTorch's gloo
//! groups of each world size run the same series right after tensorwire's (`gloo_*` keys) and
//! `ratios` gains `*_over_gloo` (below 1: tensorwire is faster).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use tensorwire_core::collective::{ElementType, ReduceOp};
use tensorwire_core::device::Device;
use tensorwire_core::ports::process_group::{Collectives, ProcessGroup};
use tensorwire_process_group::new_group;
use tensorwire_rendezvous::env_init::env_rendezvous;

use super::bench_common::{median_us, MIB};
use super::bench_raw_barrier::{self as raw_barrier, Medium};
use super::bench_raw_tcp::Raw;

/// The bytes each rank of `world` must receive in an all_reduce of 1 MiB: 2 (N - 1) / N MiB
/// (the module's docs say why).
fn all_reduce_received(world: usize) -> usize {
    2 * (world - 1) * MIB / world
}

/// Raw ping-pong round trips in all (spread over the blocks).
const RAW_PINGPONG: usize = 12_000;
/// Raw bulk transfers of each size per block.
const RAW_BULK_ROUNDS: usize = 3;

/// Arguments of `tensorwire bench collectives`.
#[derive(Debug, clap::Args)]
pub(crate) struct CollectivesArgs {
    /// World sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    world: Vec<usize>,
    /// Write the results as one JSON object to this file (else to standard output).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Iterations of each small collective (barrier, 8-byte all_gather).
    #[arg(long, default_value_t = 2000)]
    small_iters: usize,
    /// Iterations of each 1 MiB collective.
    #[arg(long, default_value_t = 40)]
    large_iters: usize,
    /// Processes for the rendezvous + first barrier measurement (0 skips it).
    #[arg(long, default_value_t = 32)]
    rendezvous_world: usize,
    /// Bound on each collective and on each group's run, in seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// The transport between the ranks (`TENSORWIRE_TRANSPORT`): `tcp` or `shm` force it,
    /// `auto` lets the group choose (shared memory on one host).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "shm", "auto"])]
    transport: String,
    /// A Python with torch: also time PyTorch's gloo groups of the same sizes in this run
    /// (`gloo_*` keys, `*_over_gloo` ratios; see `bench_gloo`).
    #[arg(long)]
    torch_python: Option<String>,
    /// The collective paths to time, each in its own groups of the same run
    /// (`TENSORWIRE_COLLECTIVES`): `arena` (the group arena on one host; unprefixed keys) and
    /// `links` (`links_*` keys, and `*_over_links` ratios).
    #[arg(long, value_delimiter = ',', default_value = "arena,links")]
    paths: Vec<String>,
    /// A Python with mpi4py (and `mpiexec` beside it, as `pip install mpich mpi4py` gives):
    /// also time MPICH's collectives of the same sizes in this run (`mpi_*` keys,
    /// `*_over_mpi` ratios; see `bench_mpi`).
    #[arg(long)]
    mpi_python: Option<String>,
    /// Simulated hosts, as `NAMESPACE=ADDRESS` pairs (network namespaces made beforehand, each
    /// with that address on its `eth0`; `docs/bench/hosts.sh` makes them): the ranks of each
    /// world are spread over them in even, consecutive blocks (rank 0's host first) and talk
    /// over `--transport auto` (shared memory within a host, TCP between), so a group spanning
    /// them runs its collectives hierarchically (the `arena` path) or flat (`links`); gloo's
    /// ranks are spread the same way. MPICH is not run across hosts (its launcher would need
    /// one per namespace).
    #[arg(long, value_delimiter = ',')]
    netns: Vec<String>,
}

/// Where a rank runs: its host's network namespace and that host's address (`--netns`).
type Host = (String, String);

impl CollectivesArgs {
    /// The simulated hosts (`--netns`), parsed.
    fn hosts(&self) -> Result<Vec<Host>> {
        self.netns
            .iter()
            .map(|pair| {
                let (ns, addr) = pair.split_once('=').with_context(|| {
                    format!("--netns takes NAMESPACE=ADDRESS pairs, not {pair:?}")
                })?;
                Ok((ns.to_owned(), addr.to_owned()))
            })
            .collect()
    }

    /// Each rank's host in a world of `world` (none without `--netns`): even, consecutive
    /// blocks, host 0 first.
    fn placement(&self, world: usize) -> Result<Vec<Option<Host>>> {
        let hosts = self.hosts()?;
        if hosts.is_empty() {
            return Ok(vec![None; world]);
        }
        Ok((0..world)
            .map(|r| Some(hosts[r * hosts.len() / world].clone()))
            .collect())
    }
}

/// Arguments of the hidden worker subcommand (environment: `env://` variables).
#[derive(Debug, clap::Args)]
pub(crate) struct WorkerArgs {
    /// `bench` (timed series) or `rendezvous` (set up, one barrier).
    #[arg(long)]
    mode: String,
    #[arg(long, default_value_t = 2000)]
    small_iters: usize,
    #[arg(long, default_value_t = 40)]
    large_iters: usize,
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// Message sizes in bytes for `--mode curve` (comma-separated).
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
}

/// `tensorwire bench collectives`.
pub(crate) fn run(args: &CollectivesArgs) -> Result<()> {
    if args.world.iter().any(|w| *w < 2) || args.small_iters == 0 || args.large_iters == 0 {
        bail!(super::Usage(
            "--world sizes must be at least 2; iterations at least 1".into()
        ));
    }
    let hosts = args.hosts()?;
    if !hosts.is_empty() {
        if args.transport != "auto" {
            bail!(super::Usage(
                "--netns needs --transport auto (shared memory within a host, TCP between)".into()
            ));
        }
        if args.mpi_python.is_some() {
            bail!(super::Usage("MPICH is not run across --netns hosts".into()));
        }
        if args.world.iter().any(|w| *w < hosts.len()) {
            bail!(super::Usage(
                "every --world size needs a rank on each --netns host".into()
            ));
        }
    }
    let steps = 3 + args.world.len() as u64 + u64::from(args.rendezvous_world > 0);
    let bar = super::bench_common::progress(steps, "");
    let mut out = Map::new();

    // The raw baselines: plain TCP to an echo *process* (`bench raw-echo`, as `bench transport`),
    // one block before each group and one after the last, so that they see the load the groups
    // see. Bulk sizes: 1 MiB, and what all ranks of an all_gather of 1 MiB blocks receive.
    let mut sizes = vec![MIB];
    for &world in &args.world {
        let bytes = world * (world - 1) * MIB;
        if !sizes.contains(&bytes) {
            sizes.push(bytes);
        }
    }
    bar.set_message("raw TCP baseline");
    let mut raw = Raw::start_process(&sizes).context("raw TCP baseline")?;
    let data = vec![3u8; sizes.iter().copied().max().unwrap_or(MIB)];
    let mut pings = Vec::new();
    let mut bulk: Vec<Vec<Duration>> = vec![Vec::new(); sizes.len()];
    let blocks = args.world.len() + 1;
    let mut raw_block = |raw: &mut Raw, warm_up: bool| -> Result<()> {
        let times = raw
            .pingpong(RAW_PINGPONG / blocks)
            .context("raw TCP ping-pong")?;
        for (i, &size) in sizes.iter().enumerate() {
            for _ in 0..RAW_BULK_ROUNDS {
                let took = raw.bulk(&data[..size]).context("raw TCP bulk")?;
                if !warm_up {
                    bulk[i].push(took);
                }
            }
        }
        if !warm_up {
            pings.extend(times);
        }
        Ok(())
    };
    raw_block(&mut raw, true)?;
    raw_block(&mut raw, false)?;
    bar.inc(1);

    for &world in &args.world {
        for path in &args.paths {
            bar.set_message(format!("collectives ({path}), {world} processes"));
            // The workers inherit it (nothing else of this process reads it).
            std::env::set_var(tensorwire_process_group::COLLECTIVES_ENV, path);
            let results = run_group(world, "bench", args)
                .with_context(|| format!("world {world}, {path}"))?;
            let prefix = if path == "arena" { "" } else { "links_" };
            for (k, v) in results {
                out.insert(format!("{prefix}{k}"), v);
            }
        }
        std::env::remove_var(tensorwire_process_group::COLLECTIVES_ENV);
        if let Some(python) = &args.mpi_python {
            bar.set_message(format!("MPICH, {world} processes"));
            let mpi = super::bench_mpi::measure(
                python,
                world,
                args.small_iters,
                args.large_iters,
                Duration::from_secs(args.timeout),
            )
            .with_context(|| format!("MPICH baseline, world {world}"))?;
            for (k, v) in mpi {
                out.insert(format!("mpi_{k}"), v);
            }
        }
        // The memcpy floors: the bytes each rank must receive, copied through buffers of the
        // collective's output size (all_reduce's 2 (N - 1) / N MiB through 1 MiB buffers, as
        // its ranks' working set is: one copy of 1.75 MiB buffers at 8 ranks would measure
        // the caches, not the bytes); first once in this process alone.
        let floors = [
            ("1MiB", MIB, MIB),
            ("all_gather", (world - 1) * MIB, (world - 1) * MIB),
            ("all_reduce", all_reduce_received(world), MIB),
        ];
        for (name, bytes, window) in floors {
            let plan = raw_barrier::CopyPlan { bytes, window };
            let src = vec![7u8; plan.buffer_len()];
            let mut dst = vec![0u8; plan.buffer_len()];
            dst.copy_from_slice(&src);
            let times: Vec<Duration> = (0..args.large_iters.max(10))
                .map(|_| {
                    let t = Instant::now();
                    plan.run(&src, &mut dst);
                    t.elapsed()
                })
                .collect();
            let key = if name == "1MiB" {
                "memcpy_1MiB_us".to_owned()
            } else {
                format!("memcpy_w{world}_{name}_1MiB_us")
            };
            out.insert(key, json!(median_us(times)));
        }
        // The same floors in the group's shape: every rank copies what it must receive at
        // once, sharing the cores as the collective's ranks do.
        bar.set_message(format!("memcpy of all {world} ranks"));
        for (name, bytes, window) in floors {
            let key = if name == "1MiB" {
                format!("memcpy_all_ranks_w{world}_1MiB_us")
            } else {
                format!("memcpy_all_ranks_w{world}_{name}_1MiB_us")
            };
            let plan = raw_barrier::CopyPlan { bytes, window };
            let us = raw_barrier::copies(world, plan, args.large_iters.max(10))
                .with_context(|| format!("the memcpy of {world} processes"))?;
            out.insert(key, json!(us));
        }
        if let Some(python) = &args.torch_python {
            bar.set_message(format!("gloo, {world} processes"));
            let bound = Duration::from_secs(args.timeout);
            let gloo = if hosts.is_empty() {
                super::bench_gloo::measure(python, world, args.small_iters, args.large_iters, bound)
            } else {
                let placed: Vec<Host> = args.placement(world)?.into_iter().flatten().collect();
                super::bench_gloo::measure_on_hosts(
                    python,
                    &placed,
                    args.small_iters,
                    args.large_iters,
                    bound,
                )
            }
            .with_context(|| format!("gloo baseline, world {world}"))?;
            for (k, v) in gloo {
                out.insert(format!("gloo_{k}"), v);
            }
        }
        raw_block(&mut raw, false)?;
        bar.inc(1);
    }
    raw.finish()?;

    if args.rendezvous_world > 0 {
        let world = args.rendezvous_world;
        bar.set_message(format!("rendezvous + barrier, {world} processes"));
        let results = run_group(world, "rendezvous", args)
            .with_context(|| format!("rendezvous of {world}"))?;
        for (k, v) in results {
            out.insert(k, v);
        }
        bar.inc(1);
    }

    bar.set_message("raw barriers (processes, then threads)");
    for &world in &args.world {
        let mut media = vec![("tcp", Medium::Tcp)];
        if args.transport != "tcp" {
            media.push(("shm", Medium::Shm));
        }
        for (name, medium) in media {
            let raw = raw_barrier::processes(medium, world, args.small_iters)
                .with_context(|| format!("raw {name} barrier of {world} processes"))?;
            out.insert(format!("raw_{name}_barrier_w{world}_us"), json!(raw));
            let raw = raw_barrier::threads(medium, world, args.small_iters)
                .with_context(|| format!("raw {name} barrier of {world} threads"))?;
            out.insert(
                format!("raw_{name}_barrier_threads_w{world}_us"),
                json!(raw),
            );
        }
    }
    bar.inc(1);
    bar.finish_and_clear();
    let bulk_us: Vec<f64> = bulk.into_iter().map(median_us).collect();
    let bulk_of = |bytes: usize| {
        sizes
            .iter()
            .position(|s| *s == bytes)
            .map_or(f64::NAN, |i| bulk_us[i])
    };
    out.insert("raw_tcp_bulk_1MiB_us".into(), json!(bulk_of(MIB)));
    for &world in &args.world {
        out.insert(
            format!("raw_tcp_bulk_{world}x{}MiB_us", world - 1),
            json!(bulk_of(world * (world - 1) * MIB)),
        );
    }
    let pingpong = median_us(pings);
    out.insert("raw_tcp_pingpong_p50_us".into(), json!(pingpong));
    out.insert("raw_baseline".into(), json!("process"));
    out.insert("transport".into(), json!(args.transport));
    if !hosts.is_empty() {
        let placements: Map<String, Value> = args
            .world
            .iter()
            .map(|w| {
                let of: Vec<String> = args
                    .placement(*w)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|h| h.map(|h| h.0).unwrap_or_default())
                    .collect();
                (format!("w{w}"), json!(of))
            })
            .collect();
        out.insert("hosts".into(), Value::Object(placements));
    }

    let get = |k: &str| out.get(k).and_then(Value::as_f64);
    let mut ratios = Map::new();
    for &world in &args.world {
        for op in ["reduce", "reduce_scatter", "all_to_all", "broadcast"] {
            if let (Some(t), Some(raw)) = (
                get(&format!("{op}_w{world}_1MiB_us")),
                get("raw_tcp_bulk_1MiB_us"),
            ) {
                ratios.insert(
                    format!("{op}_w{world}_1MiB_over_raw_bulk_1MiB"),
                    json!(t / raw),
                );
            }
        }
        if let Some(b) = get(&format!("barrier_w{world}_us")) {
            ratios.insert(
                format!("barrier_w{world}_over_pingpong"),
                json!(b / pingpong),
            );
            if let Some(raw) = get(&format!("raw_tcp_barrier_w{world}_us")) {
                ratios.insert(format!("barrier_w{world}_over_raw_barrier"), json!(b / raw));
            }
            if let Some(raw) = get(&format!("raw_shm_barrier_w{world}_us")) {
                ratios.insert(
                    format!("barrier_w{world}_over_raw_shm_barrier"),
                    json!(b / raw),
                );
            }
        }
        if let (Some(a), Some(r)) = (
            get(&format!("all_gather_w{world}_1MiB_us")),
            get(&format!("raw_tcp_bulk_{world}x{}MiB_us", world - 1)),
        ) {
            ratios.insert(
                format!("all_gather_w{world}_1MiB_over_raw_bulk"),
                json!(a / r),
            );
        }
    }
    let keys: Vec<String> = out.keys().cloned().collect();
    for key in keys {
        for (prefix, baseline) in [("gloo_", "gloo"), ("mpi_", "mpi"), ("links_", "links")] {
            let Some(ours_key) = key.strip_prefix(prefix) else {
                continue;
            };
            if let (Some(theirs), Some(ours)) = (get(&key), get(ours_key)) {
                let name = ours_key.trim_end_matches("_us");
                ratios.insert(format!("{name}_over_{baseline}"), json!(ours / theirs));
            }
        }
    }
    for &world in &args.world {
        for op in ["all_gather", "all_reduce"] {
            for (floor, name) in [
                (format!("memcpy_w{world}_{op}_1MiB_us"), "memcpy"),
                (
                    format!("memcpy_all_ranks_w{world}_{op}_1MiB_us"),
                    "memcpy_all_ranks",
                ),
            ] {
                if let (Some(t), Some(m)) = (get(&format!("{op}_w{world}_1MiB_us")), get(&floor)) {
                    ratios.insert(format!("{op}_w{world}_1MiB_over_{name}"), json!(t / m));
                }
            }
        }
        // For reference: all_reduce against a copy of its output's size only (the floor
        // taken before 2026-12-01; see the module's docs).
        for (floor, name) in [
            ("memcpy_1MiB_us".to_owned(), "memcpy_output"),
            (
                format!("memcpy_all_ranks_w{world}_1MiB_us"),
                "memcpy_output_all_ranks",
            ),
        ] {
            if let (Some(t), Some(m)) = (get(&format!("all_reduce_w{world}_1MiB_us")), get(&floor))
            {
                ratios.insert(
                    format!("all_reduce_w{world}_1MiB_over_{name}"),
                    json!(t / m),
                );
            }
        }
        // The all_reduce without the input's copy in the timed call, against the floor of all
        // ranks and MPICH's out-of-place Allreduce.
        let in_place = get(&format!("all_reduce_w{world}_1MiB_in_place_us"));
        for (floor, name) in [
            (
                format!("memcpy_all_ranks_w{world}_all_reduce_1MiB_us"),
                "memcpy_all_ranks",
            ),
            (format!("mpi_all_reduce_w{world}_1MiB_us"), "mpi"),
        ] {
            if let (Some(t), Some(m)) = (in_place, get(&floor)) {
                ratios.insert(
                    format!("all_reduce_w{world}_1MiB_in_place_over_{name}"),
                    json!(t / m),
                );
            }
        }
    }
    let mut targets = Map::new();
    // Issue 47: the group arena on one host.
    {
        let ratio = |k: &str| ratios.get(k).and_then(Value::as_f64);
        for w in [2, 8] {
            if let Some(r) = ratio(&format!("barrier_w{w}_over_raw_shm_barrier")) {
                targets.insert(
                    format!("arena: barrier_w{w} <= 1.5x raw shm barrier"),
                    json!(r <= 1.5),
                );
            }
            if let Some(r) = ratio(&format!("barrier_w{w}_over_mpi")) {
                targets.insert(
                    format!("arena: barrier_w{w} <= 0.5x MPICH"),
                    json!(r <= 0.5),
                );
            }
        }
        for op in ["all_gather", "all_reduce"] {
            if let Some(r) = ratio(&format!("{op}_w8_1MiB_over_memcpy")) {
                targets.insert(
                    format!("arena: {op}_w8_1MiB <= 1.3x memcpy"),
                    json!(r <= 1.3),
                );
            }
            if let Some(r) = ratio(&format!("{op}_w8_1MiB_over_memcpy_all_ranks")) {
                targets.insert(
                    format!("arena: {op}_w8_1MiB <= 1.3x memcpy of all ranks"),
                    json!(r <= 1.3),
                );
            }
            if let Some(r) = ratio(&format!("{op}_w8_1MiB_over_mpi")) {
                targets.insert(format!("arena: {op}_w8_1MiB <= 1x MPICH"), json!(r <= 1.0));
            }
            if let Some(r) = ratio(&format!("{op}_w8_1MiB_over_gloo")) {
                targets.insert(format!("arena: {op}_w8_1MiB <= 0.5x gloo"), json!(r <= 0.5));
            }
        }
        // The all_reduce alone, without the bench's fresh copy of its input each call.
        if let Some(r) = ratio("all_reduce_w8_1MiB_in_place_over_memcpy_all_ranks") {
            targets.insert(
                "arena: all_reduce_w8_1MiB without the input's copy <= 1.3x memcpy of all ranks"
                    .into(),
                json!(r <= 1.3),
            );
        }
        if let Some(r) = ratio("all_reduce_w8_8B_over_mpi") {
            targets.insert(
                "arena: all_reduce_w8_8B <= 0.5x MPICH".into(),
                json!(r <= 0.5),
            );
        }
    }
    if let Some(r) = ratios
        .get("barrier_w2_over_pingpong")
        .and_then(Value::as_f64)
    {
        targets.insert("barrier_w2 <= 1.5x pingpong".into(), json!(r <= 1.5));
    }
    if let Some(r) = ratios
        .get("barrier_w8_over_pingpong")
        .and_then(Value::as_f64)
    {
        targets.insert("barrier_w8 <= 8x pingpong".into(), json!(r <= 8.0));
    }
    if let Some(r) = ratios
        .get("all_gather_w8_1MiB_over_raw_bulk")
        .and_then(Value::as_f64)
    {
        targets.insert(
            "all_gather_w8_1MiB <= 1.5x raw bulk of 8x7MiB".into(),
            json!(r <= 1.5),
        );
    }
    if args.transport == "shm" {
        // Over shared memory (issue 12): against the same raw TCP baselines.
        let ratio = |k: &str| ratios.get(k).and_then(Value::as_f64);
        if let Some(r) = ratio("barrier_w8_over_pingpong") {
            targets.insert("shm: barrier_w8 <= 4x pingpong".into(), json!(r <= 4.0));
        }
        // Issue 32: the same-host floors.
        if let Some(us) = get("barrier_w2_us") {
            targets.insert("shm: barrier_w2 <= 10 us".into(), json!(us <= 10.0));
        }
        if let Some(r) = ratio("barrier_w8_over_raw_shm_barrier") {
            targets.insert(
                "shm: barrier_w8 <= 1.5x raw shm barrier".into(),
                json!(r <= 1.5),
            );
        }
        if let Some(r) = ratio("all_gather_w8_1MiB_over_raw_bulk") {
            targets.insert(
                "shm: all_gather_w8_1MiB <= 0.5x raw bulk of 8x7MiB".into(),
                json!(r <= 0.5),
            );
        }
    }
    if let Some(r) = ratios
        .get("all_gather_w8_1MiB_over_gloo")
        .and_then(Value::as_f64)
    {
        targets.insert("all_gather_w8_1MiB <= 0.5x gloo".into(), json!(r <= 0.5));
    }
    if let Some(ms) = get("rendezvous_barrier_w32_ms") {
        targets.insert(
            "rendezvous + first barrier w32 < 5 s".into(),
            json!(ms < 5000.0),
        );
    }
    out.insert("ratios".into(), Value::Object(ratios));
    out.insert("targets_met".into(), Value::Object(targets));
    out.insert(
        "settings".into(),
        json!({
            "small_iters": args.small_iters,
            "large_iters": args.large_iters,
            "figures": "medians over iterations on rank 0, microseconds; raw ping-pong and bulk over plain TCP to an echo process (bench raw-echo) in blocks between the groups; raw barrier among as many processes as the group over blocking sockets (raw_tcp_barrier) and, unless --transport tcp, over counters in shared memory polled as shm polls (raw_shm_barrier); *_threads_*: the same among threads of one process",
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        }),
    );
    let text = serde_json::to_string_pretty(&Value::Object(out))?;
    match &args.json {
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

/// One started worker: its stdout lines arrive on a channel.
struct Worker {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

/// Kills every worker still running (on error paths).
struct Workers(Vec<Worker>);

impl Drop for Workers {
    fn drop(&mut self) {
        for w in &mut self.0 {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
    }
}

#[allow(clippy::too_many_arguments)] // one worker's whole command line
fn start_worker(
    rank: usize,
    world: usize,
    port: u16,
    secret: &str,
    mode: &str,
    args: &CollectivesArgs,
    sizes: &[usize],
    host: Option<&Host>,
    master: &str,
) -> Result<Worker> {
    let sizes: Vec<String> = sizes.iter().map(usize::to_string).collect();
    let exe = std::env::current_exe().context("finding this executable")?;
    // On a simulated host, started in its network namespace.
    let mut command = match host {
        Some((ns, _)) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    let mut child = command
        .args(["bench", "collectives-worker", "--mode", mode])
        .args(["--small-iters", &args.small_iters.to_string()])
        .args(["--large-iters", &args.large_iters.to_string()])
        .args(["--timeout", &args.timeout.to_string()])
        .args(
            (!sizes.is_empty())
                .then(|| ["--sizes".to_owned(), sizes.join(",")])
                .into_iter()
                .flatten(),
        )
        .env("MASTER_ADDR", master)
        .env("MASTER_PORT", port.to_string())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("TENSORWIRE_SECRET", secret)
        .env("TENSORWIRE_TRANSPORT", &args.transport)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting a worker")?;
    let stdout = child.stdout.take().context("worker stdout")?;
    let mut stderr = child.stderr.take().context("worker stderr")?;
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    Ok(Worker {
        child,
        lines,
        stderr,
    })
}

/// One group of `bench curve collectives`: `world` processes time a barrier, then broadcast,
/// all_reduce (f32 sum) and all_gather of each of `sizes` bytes (`iters` iterations for the
/// barrier and the smallest sizes, fewer for large ones); rank 0's medians, in microseconds,
/// keyed `barrier_us` and `{op}_{bytes}_us`.
pub(crate) fn run_curve_group(
    world: usize,
    sizes: &[usize],
    iters: usize,
    timeout: u64,
    transport: &str,
) -> Result<Map<String, Value>> {
    let args = CollectivesArgs {
        world: vec![world],
        json: None,
        small_iters: iters,
        large_iters: iters,
        rendezvous_world: 0,
        timeout,
        transport: transport.to_owned(),
        torch_python: None,
        paths: vec!["arena".to_owned()],
        mpi_python: None,
        netns: Vec::new(),
    };
    run_group_sized(world, "curve", &args, sizes)
}

/// Starts `world` workers in `mode`, waits for rank 0's `RESULT` line, checks every exit.
fn run_group(world: usize, mode: &str, args: &CollectivesArgs) -> Result<Map<String, Value>> {
    run_group_sized(world, mode, args, &[])
}

fn run_group_sized(
    world: usize,
    mode: &str,
    args: &CollectivesArgs,
    sizes: &[usize],
) -> Result<Map<String, Value>> {
    let secret = format!("{:032x}", rand::random::<u128>());
    let bound = Duration::from_secs(args.timeout);
    let started = Instant::now();
    let placement = args.placement(world)?;
    let master = placement[0]
        .as_ref()
        .map_or_else(|| "127.0.0.1".to_owned(), |h| h.1.clone());
    let start = |rank: usize, port: u16| {
        let host = placement[rank].as_ref();
        start_worker(rank, world, port, &secret, mode, args, sizes, host, &master)
    };
    let mut workers = Workers(vec![start(0, 0)?]);
    let first = workers.0[0]
        .lines
        .recv_timeout(bound)
        .context("rank 0 did not report its store port")?;
    let port: u16 = first
        .strip_prefix("PORT ")
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("rank 0 printed {first:?} instead of its store port"))?;
    for rank in 1..world {
        workers.0.push(start(rank, port)?);
    }
    // Every rank prints READY after its first barrier.
    for (rank, w) in workers.0.iter().enumerate() {
        loop {
            let line = w.lines.recv_timeout(bound).with_context(|| {
                format!("rank {rank} did not finish its first barrier within {bound:?}")
            })?;
            if line == "READY" {
                break;
            }
        }
    }
    let all_ready = started.elapsed();
    let mut result = Map::new();
    if mode == "rendezvous" {
        result.insert(
            format!("rendezvous_barrier_w{world}_ms"),
            json!(all_ready.as_secs_f64() * 1e3),
        );
    }
    let line = loop {
        let line = workers.0[0]
            .lines
            .recv_timeout(bound)
            .context("rank 0 did not report results")?;
        if let Some(json) = line.strip_prefix("RESULT ") {
            break json.to_owned();
        }
    };
    let reported: Map<String, Value> =
        serde_json::from_str(&line).context("rank 0's results are not JSON")?;
    result.extend(reported);
    let deadline = Instant::now() + bound;
    for (rank, w) in std::mem::take(&mut workers.0).into_iter().enumerate() {
        let mut w = w;
        let status = loop {
            if let Some(s) = w.child.try_wait()? {
                break s;
            }
            if Instant::now() > deadline {
                let _ = w.child.kill();
                bail!("rank {rank} did not exit");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let stderr = w.stderr.join().unwrap_or_default();
        if !status.success() {
            bail!("rank {rank} failed ({status}): {stderr}");
        }
    }
    Ok(result)
}

/// The hidden worker: one rank.
pub(crate) fn worker(args: &WorkerArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    runtime.block_on(worker_main(args))
}

async fn time_series<F, Fut>(pg: &dyn ProcessGroup, iters: usize, mut f: F) -> Result<Vec<Duration>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    // Warm-up (connections, buffers, pages), then aligned starts.
    for _ in 0..(iters / 10).max(3) {
        f().await?;
    }
    pg.barrier().await?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        f().await?;
        times.push(t.elapsed());
    }
    Ok(times)
}

async fn worker_main(args: &WorkerArgs) -> Result<()> {
    let timeout = Duration::from_secs(args.timeout);
    let started = Instant::now();
    let rank: usize = std::env::var("RANK")?.parse()?;
    let _rendezvous = if rank == 0 {
        let rv = env_rendezvous(timeout).await?;
        println!("PORT {}", rv.master_port);
        std::io::stdout().flush()?;
        Some(rv)
    } else {
        None
    };
    let pg = new_group("tensorwire", timeout, Device::Cpu, Vec::new()).await?;
    let world = pg.size();
    pg.barrier().await?;
    let first_barrier = started.elapsed();
    println!("READY");
    std::io::stdout().flush()?;
    let mut out = Map::new();
    if args.mode == "rendezvous" {
        // The slowest rank's view: from its start to its first barrier.
        let mine = (first_barrier.as_secs_f64() * 1e3).to_le_bytes();
        let all = pg.all_gather(&mine).await?;
        let slowest = all
            .iter()
            .filter_map(|b| <[u8; 8]>::try_from(&b[..]).ok())
            .map(f64::from_le_bytes)
            .fold(0.0, f64::max);
        out.insert(
            format!("rendezvous_barrier_w{world}_in_process_ms"),
            json!(slowest),
        );
    } else if args.mode == "curve" {
        curve_series(pg.as_ref(), rank, world, args, &mut out).await?;
    } else {
        let p = pg.as_ref();
        let t = time_series(p, args.small_iters, || async { Ok(p.barrier().await?) }).await?;
        out.insert(format!("barrier_w{world}_us"), json!(median_us(t)));

        let small = [rank as u8; 8];
        let t = time_series(p, args.small_iters, || async {
            p.all_gather_equal(&small).await?;
            Ok(())
        })
        .await?;
        out.insert(format!("all_gather_w{world}_8B_us"), json!(median_us(t)));

        // Small rooted collectives (8 bytes from / to rank 0): where a per-collective cost
        // such as the agreement check (`TENSORWIRE_DEBUG=detail`) shows most.
        let t = time_series(p, args.small_iters, || async {
            let mut buf = [rank as u8; 8];
            p.broadcast(&mut buf, 0).await?;
            Ok(())
        })
        .await?;
        out.insert(format!("broadcast_w{world}_8B_us"), json!(median_us(t)));
        let t = time_series(p, args.small_iters, || async {
            let mut buf = (rank as i64).to_le_bytes();
            p.reduce(&mut buf, ElementType::I64, ReduceOp::Sum, 0)
                .await?;
            Ok(())
        })
        .await?;
        out.insert(format!("reduce_w{world}_8B_us"), json!(median_us(t)));
        let t = time_series(p, args.small_iters, || async {
            let mut buf = (rank as i64).to_le_bytes();
            p.all_reduce(&mut buf, ElementType::I64, ReduceOp::Sum)
                .await?;
            Ok(())
        })
        .await?;
        out.insert(format!("all_reduce_w{world}_8B_us"), json!(median_us(t)));

        let block = vec![rank as u8; MIB];
        let t = time_series(p, args.large_iters, || async {
            let got = p.all_gather_equal(&block).await?;
            if got.len() != world || got.iter().any(|b| b.len() != MIB) {
                bail!("all_gather returned the wrong blocks");
            }
            Ok(())
        })
        .await?;
        out.insert(format!("all_gather_w{world}_1MiB_us"), json!(median_us(t)));

        let mut data = vec![0u8; MIB];
        for (i, c) in data.chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&((i % 7) as f32).to_le_bytes());
        }
        let data = std::cell::RefCell::new(data);
        let t = time_series(p, args.large_iters, || async {
            let mut buf = data.borrow().clone();
            p.all_reduce(&mut buf, ElementType::F32, ReduceOp::Sum)
                .await?;
            Ok(())
        })
        .await?;
        out.insert(format!("all_reduce_w{world}_1MiB_us"), json!(median_us(t)));
        // The same without the copy of the input each call makes above (a fresh 1 MiB, one
        // more read and write of it in the timed call, which the memcpy floors and MPICH's
        // out-of-place Allreduce do not make): one buffer reduced again and again (its sums
        // grow by the world size a call, to infinity in f32 after some 40 calls: timed alike).
        let again = std::cell::Cell::new(Some(data.borrow().clone()));
        let t = time_series(p, args.large_iters, || async {
            let mut buf = again.take().context("the buffer of the last call")?;
            p.all_reduce(&mut buf, ElementType::F32, ReduceOp::Sum)
                .await?;
            again.set(Some(buf));
            Ok(())
        })
        .await?;
        out.insert(
            format!("all_reduce_w{world}_1MiB_in_place_us"),
            json!(median_us(t)),
        );

        // 1 MiB per rank: reduce to rank 0, reduce_scatter into even chunks, all_to_all of
        // even blocks, broadcast from rank 0.
        let t = time_series(p, args.large_iters, || async {
            let mut buf = data.borrow().clone();
            p.reduce(&mut buf, ElementType::F32, ReduceOp::Sum, 0)
                .await?;
            Ok(())
        })
        .await?;
        out.insert(format!("reduce_w{world}_1MiB_us"), json!(median_us(t)));

        let elements = MIB / 4;
        let counts: Vec<usize> = (0..world)
            .map(|r| elements / world + usize::from(r < elements % world))
            .collect();
        let t = time_series(p, args.large_iters, || async {
            let input = data.borrow().clone();
            let mine = p
                .reduce_scatter(&input, &counts, ElementType::F32, ReduceOp::Sum)
                .await?;
            if mine.len() != counts[rank] * 4 {
                bail!("reduce_scatter returned {} bytes", mine.len());
            }
            Ok(())
        })
        .await?;
        out.insert(
            format!("reduce_scatter_w{world}_1MiB_us"),
            json!(median_us(t)),
        );

        let lens: Vec<usize> = (0..world)
            .map(|r| MIB / world + usize::from(r < MIB % world))
            .collect();
        let blocks: Vec<bytes::Bytes> = lens
            .iter()
            .map(|n| bytes::Bytes::from(vec![rank as u8; *n]))
            .collect();
        let t = time_series(p, args.large_iters, || async {
            // Block r (to rank r) has `lens[r]` bytes on every rank: `lens[rank]` from each here.
            let got = p.all_to_all(&blocks, &vec![lens[rank]; world]).await?;
            if got.len() != world || got.iter().any(|b| b.len() != lens[rank]) {
                bail!("all_to_all returned the wrong blocks");
            }
            Ok(())
        })
        .await?;
        out.insert(format!("all_to_all_w{world}_1MiB_us"), json!(median_us(t)));

        let t = time_series(p, args.large_iters, || async {
            let mut buf = data.borrow().clone();
            p.broadcast(&mut buf, 0).await?;
            Ok(())
        })
        .await?;
        out.insert(format!("broadcast_w{world}_1MiB_us"), json!(median_us(t)));
    }
    pg.barrier().await?;
    if rank == 0 {
        println!("RESULT {}", serde_json::to_string(&out)?);
        std::io::stdout().flush()?;
    }
    // Everyone has what it needs from everyone before anyone leaves.
    pg.barrier().await?;
    pg.shutdown().await;
    Ok(())
}

/// Iterations for a series of `bytes`-byte messages: `iters` up to 64 KiB, then fewer, so that
/// each series moves about as many bytes as 64 KiB ones do (at least 5).
pub(crate) fn iters_for(iters: usize, bytes: usize) -> usize {
    if bytes <= 64 << 10 {
        iters
    } else {
        (iters * (64 << 10) / bytes).max(5)
    }
}

/// The series of `--mode curve` (see [`run_curve_group`]).
async fn curve_series(
    p: &dyn ProcessGroup,
    rank: usize,
    world: usize,
    args: &WorkerArgs,
    out: &mut Map<String, Value>,
) -> Result<()> {
    let t = time_series(p, args.small_iters, || async { Ok(p.barrier().await?) }).await?;
    out.insert("barrier_us".into(), json!(median_us(t)));
    for &bytes in &args.sizes {
        let iters = iters_for(args.small_iters, bytes);
        // f32 elements for all_reduce: the size rounded down to whole elements (at least one).
        let data: Vec<u8> = (0..bytes.max(4) / 4 * 4)
            .map(|i| if i % 4 == 3 { 0x3f } else { 0 })
            .collect();
        let t = time_series(p, iters, || async {
            let mut buf = vec![rank as u8; bytes];
            p.broadcast(&mut buf, 0).await?;
            Ok(())
        })
        .await?;
        out.insert(format!("broadcast_{bytes}_us"), json!(median_us(t)));
        let t = time_series(p, iters, || async {
            let mut buf = data.clone();
            p.all_reduce(&mut buf, ElementType::F32, ReduceOp::Sum)
                .await?;
            Ok(())
        })
        .await?;
        out.insert(format!("all_reduce_{bytes}_us"), json!(median_us(t)));
        let block = vec![rank as u8; bytes];
        let t = time_series(p, iters, || async {
            let got = p.all_gather_equal(&block).await?;
            if got.len() != world || got.iter().any(|b| b.len() != bytes) {
                bail!("all_gather returned the wrong blocks");
            }
            Ok(())
        })
        .await?;
        out.insert(format!("all_gather_{bytes}_us"), json!(median_us(t)));
    }
    Ok(())
}
