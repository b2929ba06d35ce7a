"""PyTorch's own TCPStore client, from 8 processes, against tensorwire's store server and
PyTorch's libuv server, in one run (blocks alternate between the servers).

    python tests/pytorch/store_bench.py path/to/tensorwire [--procs 8] [--pairs 2000] [--blocks 4]
        [--baseline path/to/older/tensorwire]

Each process connects with `TCPStore(is_master=False)` (PyTorch's client), waits for a common
start, then does `--pairs` set+get pairs on keys of its own (64-byte values). Reported per server
(medians over blocks): ops_per_s (all processes' operations over the wall time from the common
start to the last process done) and set_get_p50_us (the median pair, pooled), and the ratios
tensorwire / PyTorch. With `--baseline`, a second tensorwire server (an older build, say) joins
the same alternation as `baseline`, and the ratios tensorwire / baseline are reported too. Prints
one JSON object.
"""

import argparse
import datetime
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time


def worker(jobs, results, rank, pairs):
    from torch.distributed import TCPStore

    while True:
        job = jobs.get()
        if job is None:
            return
        host, port, tag = job
        s = TCPStore(host, port, None, False, datetime.timedelta(seconds=120))
        value = b"v" * 64
        s.add(f"{tag}/ready", 1)
        s.wait([f"{tag}/go"])
        lat = []
        for i in range(pairs):
            key = f"{tag}/r{rank}/k{i % 64}"
            t = time.perf_counter()
            s.set(key, value)
            s.get(key)
            lat.append(time.perf_counter() - t)
        results.put((rank, time.time(), lat))
        del s


def cpu_seconds(pid):
    """User and system CPU time of a process so far, from /proc (Linux)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def block(control, jobs, results, host, port, tag, procs, pairs):
    for _ in range(procs):
        jobs.put((host, port, tag))
    deadline = time.time() + 120
    while control.add(f"{tag}/ready", 0) < procs:
        if time.time() > deadline:
            raise SystemExit(f"{tag}: the workers did not connect")
        time.sleep(0.01)
    start = time.time()
    control.set(f"{tag}/go", "1")
    ends, lat = [], []
    for _ in range(procs):
        _, end, l = results.get(timeout=300)
        ends.append(end)
        lat.extend(l)
    wall = max(ends) - start
    lat.sort()
    return 2 * pairs * procs / wall, lat[len(lat) // 2] * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tensorwire")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--baseline", help="another tensorwire binary to serve in the same run")
    a = ap.parse_args()

    from torch.distributed import TCPStore

    def serve(binary):
        proc = subprocess.Popen(
            [binary, "store", "serve", "--port", "0", "--host", "127.0.0.1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = proc.stdout.readline().strip()
        prefix = "tensorwire store listening on "
        if not line.startswith(prefix):
            proc.kill()
            raise SystemExit(f"{binary} store serve printed {line!r}")
        return proc, int(line[len(prefix):].rsplit(":", 1)[1])

    ours, our_port = serve(a.tensorwire)
    procs = [ours]
    theirs = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=300),
                      wait_for_workers=False, use_libuv=True)
    servers = {
        "tensorwire": TCPStore("127.0.0.1", our_port, None, False, datetime.timedelta(seconds=60)),
        "pytorch": theirs,
    }
    ports = {"tensorwire": our_port, "pytorch": theirs.port}
    if a.baseline:
        base, base_port = serve(a.baseline)
        procs.append(base)
        servers["baseline"] = TCPStore("127.0.0.1", base_port, None, False,
                                       datetime.timedelta(seconds=60))
        ports["baseline"] = base_port

    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=worker, args=(jobs, results, r, a.pairs)) for r in range(a.procs)]
    for w in workers:
        w.start()
    figures = {name: [] for name in servers}
    # CPU time of our server processes (PyTorch's server runs inside this process).
    pids = {"tensorwire": ours.pid}
    if a.baseline:
        pids["baseline"] = base.pid
    cpu = {name: [] for name in pids}
    try:
        # One warm-up block each (imports, connections), then alternating blocks.
        for b in range(a.blocks + 1):
            order = list(servers) if b % 2 == 0 else list(reversed(servers))
            for name in order:
                before = cpu_seconds(pids[name]) if name in pids else 0.0
                r = block(servers[name], jobs, results, "127.0.0.1", ports[name], f"{name}{b}",
                          a.procs, a.pairs)
                if b > 0:
                    figures[name].append(r)
                    if name in pids:
                        ops = 2 * a.pairs * a.procs
                        cpu[name].append((cpu_seconds(pids[name]) - before) / ops * 1e6)
    finally:
        for _ in workers:
            jobs.put(None)
        for w in workers:
            w.join(timeout=30)
        for p in procs:
            p.kill()
    out = {}
    for name, rs in figures.items():
        out[f"{name}_ops_per_s"] = statistics.median(r[0] for r in rs)
        out[f"{name}_set_get_p50_us"] = statistics.median(r[1] for r in rs)
    for name, rs in cpu.items():
        out[f"{name}_server_cpu_us_per_op"] = statistics.median(rs)
    out["ratios"] = {
        "ops_per_s": out["tensorwire_ops_per_s"] / out["pytorch_ops_per_s"],
        "set_get_p50": out["tensorwire_set_get_p50_us"] / out["pytorch_set_get_p50_us"],
    }
    if a.baseline:
        out["ratios"]["ops_per_s_over_baseline"] = (
            out["tensorwire_ops_per_s"] / out["baseline_ops_per_s"])
        out["ratios"]["set_get_p50_over_baseline"] = (
            out["tensorwire_set_get_p50_us"] / out["baseline_set_get_p50_us"])
        out["ratios"]["server_cpu_per_op_over_baseline"] = (
            out["tensorwire_server_cpu_us_per_op"] / out["baseline_server_cpu_us_per_op"])
    out["settings"] = {"procs": a.procs, "pairs_per_proc": a.pairs, "blocks": a.blocks,
                       "client": "torch.distributed.TCPStore (PyTorch's own)",
                       "pytorch_server": "TCPStore use_libuv=True"}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
