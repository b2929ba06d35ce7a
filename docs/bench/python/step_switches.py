"""Context switches and CPU time per step of the autograd suite's 3-stage pipeline, tensorwire's
engine alone (issue 48): figures that stay steady on a loaded machine, where a step's wall time
does not.

    python docs/bench/python/step_switches.py OUT.json            # 300 steps, unpinned
    PIN=1 STEPS=200 python docs/bench/python/step_switches.py OUT.json

Three processes (the suite's models, sizes and seeds: ``tensorwire.bench.autograd``), worker0
drives. After 20 untimed steps, each process's ``getrusage(RUSAGE_SELF)`` is read before and
after the timed steps (worker1's and worker2's through an ``rpc_sync``, the same for every
build); the record gives per step and per process the voluntary context switches (a thread
that blocked: each is a wake-up to come, a hand-off), the involuntary ones and the CPU time,
and the median wall time of a step. It also prints each thread's voluntary switches per step.
Run it with two builds' interpreters alternately and compare the counts.
"""

import json
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

STEPS = int(os.environ.get("STEPS", "300"))


def usage() -> tuple:
    """This process's voluntary and involuntary context switches and CPU seconds so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_nvcsw, r.ru_nivcsw, r.ru_utime + r.ru_stime)


def threads() -> dict:
    """Every thread of this process: ``{tid: (name, voluntary, involuntary switches)}``."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            lines = open(f"/proc/self/task/{tid}/status").read().split("\n")
        except OSError:
            continue
        d = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
        out[tid] = (d["Name"].strip(), int(d["voluntary_ctxt_switches"]), int(d["nonvoluntary_ctxt_switches"]))
    return out


def _main(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3", RANK=str(rank),
        TENSORWIRE_SECRET=os.environ.get("TENSORWIRE_SECRET", "step-switches"), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    if os.environ.get("PIN", "0") != "0":
        os.sched_setaffinity(0, {0})
    import tensorwire.rpc as rpc
    from tensorwire.bench import autograd as suite
    from tensorwire.rpc import dist_autograd
    from tensorwire.rpc.optim import DistributedOptimizer

    cfg = dict(suite.AUTOGRAD_DEFAULTS)
    suite._build(cfg)
    for fn in (suite.stage_forward, suite.stage_parameter, usage, threads):
        rpc.expose(fn)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    if rank == 0:
        x, y = suite._batch(0, cfg)
        models = suite._MODELS
        params = [rpc.RRef(p) for p in models[("tensorwire", "stage1")].parameters()]
        for worker, stage in (("worker1", "stage2"), ("worker2", "stage3")):
            n = len(list(models[("tensorwire", stage)].parameters()))
            params += [rpc.remote(worker, suite.stage_parameter, args=("tensorwire", stage, i)) for i in range(n)]
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=suite.LR)

        def step() -> None:
            with dist_autograd.context() as c:
                h = models[("tensorwire", "stage1")](x)
                h = rpc.rpc_sync("worker1", suite.stage_forward, args=("tensorwire", "stage2", h))
                h = rpc.rpc_sync("worker2", suite.stage_forward, args=("tensorwire", "stage3", h))
                dist_autograd.backward(c, [F.mse_loss(h, y)])
                opt.step(c)

        for _ in range(20):
            step()
        others = ("worker1", "worker2")
        t0 = [threads()] + [rpc.rpc_sync(w, threads) for w in others]
        u0 = [usage()] + [rpc.rpc_sync(w, usage) for w in others]
        walls = []
        for _ in range(STEPS):
            t = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t)
        u1 = [usage()] + [rpc.rpc_sync(w, usage) for w in others]
        t1 = [threads()] + [rpc.rpc_sync(w, threads) for w in others]
        for p, (a, b) in enumerate(zip(t0, t1)):
            rows = []
            for tid, (name, v, _) in sorted(b.items()):
                dv = (v - a.get(tid, (name, 0, 0))[1]) / STEPS
                if dv >= 0.05:
                    rows.append(f"{name}:{tid}:{dv:.2f}")
            print(f"worker{p} voluntary switches per step, by thread:", " ".join(rows), flush=True)
        d = [tuple(b[i] - a[i] for i in range(3)) for a, b in zip(u0, u1)]
        record = {
            "steps": STEPS,
            "pinned": os.environ.get("PIN", "0") != "0",
            "wall_us_median": statistics.median(walls) * 1e6,
            "voluntary_switches_per_step": [v / STEPS for v, _, _ in d],
            "involuntary_switches_per_step": [iv / STEPS for _, iv, _ in d],
            "cpu_us_per_step": [c / STEPS * 1e6 for _, _, c in d],
            "load": os.getloadavg(),
        }
        with open(out, "w") as f:
            json.dump(record, f)
    rpc.shutdown()


if __name__ == "__main__":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.start_processes(_main, args=(port, sys.argv[1]), nprocs=3, join=True, start_method="spawn")
    print(open(sys.argv[1]).read())
