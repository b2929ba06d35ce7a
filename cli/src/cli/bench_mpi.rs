//! MPICH as a baseline for `tensorwire bench collectives --mpi-python PYTHON`: the same
//! collectives, sizes and iterations as the tensorwire workers, timed the same way (warm-up, a
//! barrier, then each iteration on rank 0, the median), through mpi4py's buffer API by `world`
//! processes that MPICH's `mpiexec` (beside `PYTHON`, as `pip install mpich mpi4py` puts it)
//! starts on this host, so that MPICH takes its shared-memory collectives.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

/// Runs the MPI series on every rank; rank 0 prints one JSON object (its medians, keyed as the
/// tensorwire workers key theirs).
const MPI_SERIES: &str = r#"
import json, statistics, sys, time
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, w = comm.Get_rank(), comm.Get_size()
small, large = int(sys.argv[1]), int(sys.argv[2])
MIB = 1 << 20

def series(f, iters):
    for _ in range(max(iters // 10, 3)):
        f()
    comm.Barrier()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6

out = {}
out[f"barrier_w{w}_us"] = series(comm.Barrier, small)
s8 = np.full(8, rank, dtype=np.uint8); r8 = np.empty(8 * w, dtype=np.uint8)
out[f"all_gather_w{w}_8B_us"] = series(lambda: comm.Allgather(s8, r8), small)
b8 = np.full(8, rank, dtype=np.uint8)
out[f"broadcast_w{w}_8B_us"] = series(lambda: comm.Bcast(b8, 0), small)
i8 = np.array([rank], dtype=np.int64); o8 = np.empty(1, dtype=np.int64)
out[f"reduce_w{w}_8B_us"] = series(lambda: comm.Reduce(i8, o8, MPI.SUM, 0), small)
out[f"all_reduce_w{w}_8B_us"] = series(lambda: comm.Allreduce(i8, o8, MPI.SUM), small)
block = np.full(MIB, rank, dtype=np.uint8); gathered = np.empty(MIB * w, dtype=np.uint8)
out[f"all_gather_w{w}_1MiB_us"] = series(lambda: comm.Allgather(block, gathered), large)
data = (np.arange(MIB // 4) % 7).astype(np.float32); res = np.empty_like(data)
out[f"all_reduce_w{w}_1MiB_us"] = series(lambda: comm.Allreduce(data, res, MPI.SUM), large)
out[f"reduce_w{w}_1MiB_us"] = series(lambda: comm.Reduce(data, res, MPI.SUM, 0), large)
n = MIB // 4
counts = [n // w + (1 if r < n % w else 0) for r in range(w)]
mine = np.empty(counts[rank], dtype=np.float32)
out[f"reduce_scatter_w{w}_1MiB_us"] = series(
    lambda: comm.Reduce_scatter(data, mine, counts, MPI.SUM), large)
lens = [MIB // w + (1 if r < MIB % w else 0) for r in range(w)]
a_in = np.full(lens[rank] * w, rank, dtype=np.uint8); a_out = np.empty(lens[rank] * w, dtype=np.uint8)
out[f"all_to_all_w{w}_1MiB_us"] = series(lambda: comm.Alltoall(a_in, a_out), large)
out[f"broadcast_w{w}_1MiB_us"] = series(lambda: comm.Bcast(data, 0), large)
comm.Barrier()
if rank == 0:
    print(json.dumps(out), flush=True)
"#;

/// MPICH's medians for `world` ranks (keys as the tensorwire workers', without a prefix).
pub(crate) fn measure(
    python: &str,
    world: usize,
    small_iters: usize,
    large_iters: usize,
    bound: Duration,
) -> Result<Map<String, Value>> {
    let mpiexec = Path::new(python)
        .parent()
        .map(|bin| bin.join("mpiexec"))
        .filter(|p| p.exists())
        .with_context(|| format!("no mpiexec beside {python} (pip install mpich mpi4py)"))?;
    let mut child = Command::new(&mpiexec)
        .args(["-n", &world.to_string(), python, "-c", MPI_SERIES])
        .arg(small_iters.to_string())
        .arg(large_iters.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", mpiexec.display()))?;
    let started = std::time::Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > bound {
            let _ = child.kill();
            bail!("MPICH with {world} ranks did not finish within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "MPICH with {world} ranks failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("MPICH printed {line:?}"))
}
