//! PyTorch's gloo process group as a baseline for `tensorwire bench collectives --torch-python
//! PYTHON`: the same collectives, sizes and iterations as the tensorwire workers, timed the
//! same way (warm-up, a barrier, then each iteration on rank 0, the median), by `world`
//! processes that PyTorch starts (`torch.multiprocessing`) over `tcp://` on loopback, in the
//! same run as tensorwire's groups; or, across simulated hosts ([`measure_on_hosts`]), one
//! process per rank in its host's network namespace.

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

/// Runs the gloo series on `world` ranks; prints one JSON object (rank 0's medians, keyed as
/// the tensorwire workers key theirs).
const GLOO_SERIES: &str = r#"
import datetime, json, socket, statistics, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

world, port, small, large, bound = (int(a) for a in sys.argv[1:6])
# One rank of a group spread over hosts: its rank and rank 0's address.
one = (int(sys.argv[6]), sys.argv[7]) if len(sys.argv) > 7 else None
MIB = 1 << 20

def series(f, iters):
    for _ in range(max(iters // 10, 3)):
        f()
    dist.barrier()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6

def run(rank, q, addr="127.0.0.1"):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=bound))
    w = world
    out = {}
    out[f"barrier_w{w}_us"] = series(dist.barrier, small)
    s8 = torch.full((8,), rank, dtype=torch.uint8)
    outs8 = [torch.empty(8, dtype=torch.uint8) for _ in range(w)]
    out[f"all_gather_w{w}_8B_us"] = series(lambda: dist.all_gather(outs8, s8), small)
    b8 = torch.full((8,), rank, dtype=torch.uint8)
    out[f"broadcast_w{w}_8B_us"] = series(lambda: dist.broadcast(b8.clone(), 0), small)
    r8 = torch.tensor([rank], dtype=torch.int64)
    out[f"reduce_w{w}_8B_us"] = series(lambda: dist.reduce(r8.clone(), 0), small)
    out[f"all_reduce_w{w}_8B_us"] = series(lambda: dist.all_reduce(r8.clone()), small)
    block = torch.full((MIB,), rank, dtype=torch.uint8)
    outs = [torch.empty(MIB, dtype=torch.uint8) for _ in range(w)]
    out[f"all_gather_w{w}_1MiB_us"] = series(lambda: dist.all_gather(outs, block), large)
    data = (torch.arange(MIB // 4) % 7).float()
    out[f"all_reduce_w{w}_1MiB_us"] = series(lambda: dist.all_reduce(data.clone()), large)
    out[f"reduce_w{w}_1MiB_us"] = series(lambda: dist.reduce(data.clone(), 0), large)
    try:
        n = MIB // 4
        mine = torch.empty(n // w + (1 if rank < n % w else 0))
        chunks = list(data.split([n // w + (1 if r < n % w else 0) for r in range(w)]))
        out[f"reduce_scatter_w{w}_1MiB_us"] = series(
            lambda: dist.reduce_scatter(mine, [c.clone() for c in chunks]), large)
    except RuntimeError:
        pass  # gloo has no reduce_scatter in some versions
    lens = [MIB // w + (1 if r < MIB % w else 0) for r in range(w)]
    a2a_in = torch.full((MIB,), rank, dtype=torch.uint8)
    a2a_out = torch.empty(lens[rank] * w, dtype=torch.uint8)
    out[f"all_to_all_w{w}_1MiB_us"] = series(
        lambda: dist.all_to_all_single(a2a_out, a2a_in, [lens[rank]] * w, lens), large)
    out[f"broadcast_w{w}_1MiB_us"] = series(lambda: dist.broadcast(data.clone(), 0), large)
    dist.barrier()
    if rank == 0:
        if q is None:
            print(json.dumps(out))
        else:
            q.put(out)
    dist.destroy_process_group()

if __name__ == "__main__" and one is not None:
    run(one[0], None, one[1])
elif __name__ == "__main__":
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = q.get(timeout=bound)
    except Exception:
        for p in procs:
            p.kill()
        raise
    for p in procs:
        p.join(timeout=60)
    print(json.dumps(out))
"#;

/// Gloo's medians for `world` ranks (keys as the tensorwire workers', without a prefix).
pub(crate) fn measure(
    python: &str,
    world: usize,
    small_iters: usize,
    large_iters: usize,
    bound: Duration,
) -> Result<Map<String, Value>> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = Command::new(python)
        .args([
            "-c",
            GLOO_SERIES,
            &world.to_string(),
            &port.to_string(),
            &small_iters.to_string(),
            &large_iters.to_string(),
        ])
        .arg(bound.as_secs().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {python}"))?;
    // The script bounds itself (`bound` on the wait for rank 0's figures).
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "gloo with {world} ranks failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("gloo printed {line:?}"))
}

/// Gloo's medians for a group of one rank per entry of `hosts` (its host's network namespace
/// and address, rank 0's first), each rank a process of its own started in its namespace
/// (`ip netns exec`), talking over the namespaces' `eth0` (`GLOO_SOCKET_IFNAME`).
pub(crate) fn measure_on_hosts(
    python: &str,
    hosts: &[(String, String)],
    small_iters: usize,
    large_iters: usize,
    bound: Duration,
) -> Result<Map<String, Value>> {
    let world = hosts.len();
    // Free in rank 0's namespace: a fresh namespace has nothing bound; any port will do.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let master = hosts.first().map(|h| h.1.clone()).unwrap_or_default();
    let mut children = Vec::with_capacity(world);
    for (rank, (ns, _)) in hosts.iter().enumerate() {
        let child = Command::new("ip")
            .args(["netns", "exec", ns, python, "-c", GLOO_SERIES])
            .args([
                world.to_string(),
                port.to_string(),
                small_iters.to_string(),
                large_iters.to_string(),
                bound.as_secs().to_string(),
                rank.to_string(),
                master.clone(),
            ])
            .env("GLOO_SOCKET_IFNAME", "eth0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {python} in {ns}"))?;
        children.push(child);
    }
    let mut first = None;
    let mut failed = Vec::new();
    for (rank, child) in children.into_iter().enumerate() {
        let output = child.wait_with_output()?;
        if !output.status.success() {
            failed.push(format!(
                "rank {rank} ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        if rank == 0 {
            first = Some(String::from_utf8_lossy(&output.stdout).into_owned());
        }
    }
    if !failed.is_empty() {
        bail!(
            "gloo across hosts with {world} ranks failed: {}",
            failed.join("; ")
        );
    }
    let text = first.unwrap_or_default();
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("gloo printed {line:?}"))
}
