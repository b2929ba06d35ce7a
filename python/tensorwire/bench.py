"""Measures tensorwire against PyTorch's own engines, in the same processes and the same run:
``c10d`` (the process-group backend against gloo) and ``rpc`` (``tensorwire.rpc`` against
``torch.distributed.rpc``'s TensorPipe agent; see "rpc" below).

Run it with the Python that has torch and tensorwire installed::

    TENSORWIRE_SECRET=... python -m tensorwire.bench c10d
    python -m tensorwire.bench c10d --worlds 2 --iters 20          # a quick look
    python -m tensorwire.bench c10d --sizes 8,1048576 --worlds 2,4,8 --pin both --json out.json

(``TENSORWIRE_SECRET`` is optional: without it one random secret is made for the run and handed
to every rank.)

For every world size a world of processes is spawned on this host (``torch.multiprocessing``,
spawn). Each rank initializes the default group with the ``"tensorwire"`` backend and a second
group with ``dist.new_group(backend="gloo")``; both meet through the same store. Then, per
figure, both backends run the same operation on the same tensors:

- ``all_reduce``, ``all_gather`` (``all_gather_into_tensor``), ``broadcast`` (from rank 0),
  ``reduce_scatter`` (``reduce_scatter_tensor``) at each ``--sizes`` (bytes of float32 each rank
  contributes: the input of all_reduce, broadcast and all_gather, the output of reduce_scatter,
  whose input is world times larger) and ``barrier``;
- ``ddp_step``: one DistributedDataParallel training step (forward, backward, SGD step) of a small
  MLP (3 Linear layers, 256 wide, batch 32); the size column is its gradient bytes.

A figure is the median time of one operation (issue and wait, timed one by one) over the
iterations after a warm-up. The two backends alternate in blocks (tensorwire, gloo, gloo,
tensorwire, ...), and every rank passes a barrier of the group about to be timed before each
block. Each rank takes its own median; the figure reported is the largest median over the
ranks (a collective is as slow as its slowest rank).

The ratio is tensorwire / gloo: below 1 tensorwire is faster, above 1 it is slower. Only ratios
mean something: absolute times on a shared machine are noise, and with more ranks than cores
both backends are timed under the same oversubscription.

``--pin on`` pins each rank (every thread of it) to one core, ``rank % cores``; ``--pin off``
leaves the scheduler free; ``--pin both`` (the default) runs every world both ways.

The Python dispatch overhead is also reported, in microseconds: the median time of
``dist.all_reduce`` of 8 B through c10d on the tensorwire group minus the median time of calling
the native handle directly (``backend._pg.all_reduce([t], "torch.float32", "SUM").wait()``), in
the same alternating blocks.

``--iters N`` is the most iterations a figure gets at world 2; larger worlds get fewer
(``N * 2 / world``), and a figure also stops growing once both backends together would take
about ``--budget`` seconds, so that a full default run stays within a few minutes on two cores.

rpc
---
::

    python -m tensorwire.bench rpc                          # both pin settings, 3 runs each
    python -m tensorwire.bench rpc --pin on --repeat 5 --json out.json
    python -m tensorwire.bench rpc --quick --pin off        # a smoke test (seconds)

Two workers are spawned on this host; each starts both agents side by side (``tensorwire.rpc``
through ``env://``, TensorPipe through a file store; each with its defaults, so both pick their
same-host transport), and worker 0 calls worker 1 with both, in alternating blocks (ABBA):

- ``rpc_sync``: the median time of ``rpc_sync`` of a no-op (no arguments, ``None`` back);
- ``rpc_async``: calls per second of ``rpc_async`` of the no-op with 64 in flight (one more is
  sent when the oldest completes); the median over the blocks;
- ``tensor``: the median time of ``rpc_sync`` of a function that returns its 64 MiB float32
  tensor argument (the tensor there and back; ``--tensor-mib``);
- ``remote_to_here``: the median time of ``remote(...)`` of a function returning its int
  argument, then ``to_here()``.

The speedup is how many times better tensorwire is (TensorPipe's time over tensorwire's; for
calls/s tensorwire's over TensorPipe's); the issue's targets are 2x for ``rpc_sync``, 3x for
``rpc_async`` and 2x for the tensor. ``--pin on`` pins both workers, every thread, to the first
allowed core (as ``taskset -c 0``). Every setting runs ``--repeat`` times (fresh processes);
the table gives the medians over the runs (the speedup: the median of each run's own), and each
record carries the load average before and after its run.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import secrets
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "barrier")
DEFAULT_SIZES = (8, 1 << 20)
DEFAULT_WORLDS = (2, 4, 8)
DEFAULT_ITERS = 200
DEFAULT_BUDGET_S = 1.5
MIN_ITERS = 10
BLOCKS = 4
WARMUP = 5
MLP_WIDTH = 256
MLP_BATCH = 32


# -- helpers in the ranks -------------------------------------------------------------------------


def _pin_process(cpu: int) -> None:
    """Pins every thread of this process (and so every thread it starts later) to ``cpu``."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {cpu})
        except OSError:
            pass  # a thread that ended meanwhile
    os.sched_setaffinity(0, {cpu})


def _timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


class _Figure:
    """Times several cases of one figure in alternating blocks, every rank in step."""

    def __init__(self, gloo_pg, cap: int, budget_s: float):
        self.gloo_pg = gloo_pg
        self.cap = cap
        self.budget_s = budget_s

    def _max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.gloo_pg)
        return t.tolist()

    def run(self, cases: dict[str, tuple[Callable[[], object], Callable[[], object]]]) -> tuple[dict[str, float], int]:
        """``cases`` maps a name to (operation, barrier). Returns each case's median seconds (the
        largest over the ranks) and the iterations each got."""
        names = list(cases)
        warm = []
        for name in names:
            op, barrier = cases[name]
            barrier()
            warm.append(statistics.median(_timed(op, WARMUP)))
        # Every rank must run the same number of operations: agree on it through gloo.
        (slowest,) = self._max([max(warm)])
        iters = int(self.budget_s / (len(names) * max(slowest, 1e-7)))
        iters = max(MIN_ITERS, min(self.cap, iters))
        blocks = max(1, min(BLOCKS, iters // 5))
        per_block = math.ceil(iters / blocks)
        samples: dict[str, list[float]] = {n: [] for n in names}
        for b in range(blocks):
            # ABBA order: the case that ran last in one pass runs first in the next.
            for name in names if b % 2 == 0 else names[::-1]:
                op, barrier = cases[name]
                barrier()
                samples[name].extend(_timed(op, per_block))
        medians = [statistics.median(samples[n]) for n in names]
        worst = self._max(medians)
        return dict(zip(names, worst)), len(samples[names[0]])


def _rank_main(rank: int, world: int, env: dict, cfg: dict, out_path: str) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    if cfg["pin"]:
        cpus = cfg["cpus"]
        _pin_process(cpus[rank % len(cpus)])
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", message=".*NumPy.*")
    import tensorwire.c10d  # noqa: F401  (registers "tensorwire")

    timeout = datetime.timedelta(seconds=cfg["timeout_s"])
    dist.init_process_group("tensorwire", init_method="env://", rank=rank, world_size=world, timeout=timeout)
    tw_pg = dist.group.WORLD
    gloo_pg = dist.new_group(backend="gloo", timeout=timeout)
    pin = "pinned" if cfg["pin"] else "unpinned"
    cap = max(MIN_ITERS, cfg["iters"] * 2 // world)
    figure = _Figure(gloo_pg, cap, cfg["budget_s"])

    def emit(record: dict) -> None:
        if rank != 0:
            return
        record.update(world=world, pin=pin)
        with open(out_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if "error" in record:
            print(f"  [{pin} world {world}] {record['op']} {record.get('size', '')}: ERROR {record['error']}", flush=True)
        elif record["op"] == "dispatch":
            print(
                f"  [{pin} world {world}] dispatch: c10d {record['c10d_us']:.1f} us, native "
                f"{record['native_us']:.1f} us, overhead {record['overhead_us']:.1f} us",
                flush=True,
            )
        else:
            print(
                f"  [{pin} world {world}] {record['op']:<15} {_size(record['size']):>8}  "
                f"tensorwire {record['tensorwire_us']:10.1f} us  gloo {record['gloo_us']:10.1f} us  "
                f"ratio {record['ratio']:6.2f}  ({record['iters']} iters)",
                flush=True,
            )

    def pair(op: str, size: Optional[int], make: Callable[[object], Callable[[], object]]) -> None:
        try:
            cases = {
                "tensorwire": (make(tw_pg), lambda: dist.barrier(group=tw_pg)),
                "gloo": (make(gloo_pg), lambda: dist.barrier(group=gloo_pg)),
            }
            medians, iters = figure.run(cases)
        except Exception as e:  # noqa: BLE001  (reported, and the run goes on)
            traceback.print_exc()
            emit({"op": op, "size": size, "error": f"{type(e).__name__}: {e}"})
            dist.barrier(group=gloo_pg)
            return
        tw, gl = medians["tensorwire"], medians["gloo"]
        emit(
            {
                "op": op,
                "size": size,
                "tensorwire_us": tw * 1e6,
                "gloo_us": gl * 1e6,
                "ratio": tw / gl if gl > 0 else float("inf"),
                "iters": iters,
            }
        )

    for size in cfg["sizes"]:
        n = max(1, size // 4)

        def all_reduce(pg, n=n):
            t = torch.zeros(n)
            return lambda: dist.all_reduce(t, group=pg)

        def all_gather(pg, n=n):
            t = torch.zeros(n)
            out = torch.empty(n * world)
            return lambda: dist.all_gather_into_tensor(out, t, group=pg)

        def broadcast(pg, n=n):
            t = torch.zeros(n)
            return lambda: dist.broadcast(t, src=0, group=pg)

        def reduce_scatter(pg, n=n):
            inp = torch.zeros(n * world)
            out = torch.empty(n)
            return lambda: dist.reduce_scatter_tensor(out, inp, group=pg)

        for op, make in (
            ("all_reduce", all_reduce),
            ("all_gather", all_gather),
            ("broadcast", broadcast),
            ("reduce_scatter", reduce_scatter),
        ):
            if op in cfg["ops"]:
                pair(op, n * 4, make)

    if "barrier" in cfg["ops"]:
        pair("barrier", None, lambda pg: (lambda: dist.barrier(group=pg)))

    if "ddp_step" in cfg["ops"]:
        from torch.nn.parallel import DistributedDataParallel as DDP

        def mlp():
            torch.manual_seed(0)
            return torch.nn.Sequential(
                torch.nn.Linear(MLP_WIDTH, MLP_WIDTH),
                torch.nn.ReLU(),
                torch.nn.Linear(MLP_WIDTH, MLP_WIDTH),
                torch.nn.ReLU(),
                torch.nn.Linear(MLP_WIDTH, MLP_WIDTH),
            )

        grad_bytes = sum(p.numel() * p.element_size() for p in mlp().parameters())
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(MLP_BATCH, MLP_WIDTH, generator=g)
        y = torch.randn(MLP_BATCH, MLP_WIDTH, generator=g)

        def ddp_step(pg):
            model = DDP(mlp(), process_group=pg)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)

            def step():
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()

            return step

        pair("ddp_step", grad_bytes, ddp_step)

    if cfg["dispatch"]:
        try:
            backend = tw_pg._get_backend(torch.device("cpu"))
            native = backend._pg
            t8 = torch.ones(2)
            t8n = torch.ones(2)
            cases = {
                "c10d": (lambda: dist.all_reduce(t8, group=tw_pg), lambda: dist.barrier(group=tw_pg)),
                "native": (
                    lambda: native.all_reduce([t8n], "torch.float32", "SUM").wait(),
                    lambda: dist.barrier(group=tw_pg),
                ),
            }
            medians, iters = figure.run(cases)
            emit(
                {
                    "op": "dispatch",
                    "size": 8,
                    "c10d_us": medians["c10d"] * 1e6,
                    "native_us": medians["native"] * 1e6,
                    "overhead_us": (medians["c10d"] - medians["native"]) * 1e6,
                    "iters": iters,
                }
            )
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            emit({"op": "dispatch", "size": 8, "error": f"{type(e).__name__}: {e}"})

    dist.barrier(group=gloo_pg)
    dist.destroy_process_group()


# -- the driver -----------------------------------------------------------------------------------


def _size(size: Optional[int]) -> str:
    if size is None:
        return "-"
    if size >= 1 << 20 and size % (1 << 20) == 0:
        return f"{size >> 20} MiB"
    if size >= 1 << 10:
        return f"{size / 1024:.0f} KiB"
    return f"{size} B"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(
    world: int, cfg: dict, deadline_s: float, rank_main: str = "_rank_main"
) -> tuple[list[dict], Optional[str]]:
    """Runs one world of ``rank_main`` (a function of this module); returns rank 0's records
    and a failure, if any."""
    from tensorwire import bench  # so that spawn pickles the function by its module name

    fd, out_path = tempfile.mkstemp(prefix="tw-bench-", suffix=".jsonl")
    os.close(fd)
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "TENSORWIRE_SECRET": os.environ.get("TENSORWIRE_SECRET") or secrets.token_hex(16),
        "OMP_NUM_THREADS": "1",
    }
    failure = None
    ctx = mp.start_processes(
        getattr(bench, rank_main), args=(world, env, cfg, out_path), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            if ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            failure = f"rank {e.error_index} failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
            break
        if time.monotonic() > deadline:
            failure = f"world {world} did not finish within {deadline_s:.0f} s (hang?)"
            break
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join(5)
    records = []
    try:
        with open(out_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    finally:
        os.unlink(out_path)
        try:
            os.unlink(out_path + ".tensorpipe-store")  # the rpc suite's TensorPipe store
        except FileNotFoundError:
            pass
    return records, failure


def _table(records: list[dict]) -> str:
    lines = []
    head = f"{'pin':<9} {'op':<15} {'size':>8} {'world':>5} {'tensorwire us':>14} {'gloo us':>12} {'ratio':>7}"
    lines.append(head)
    lines.append("-" * len(head))
    for r in records:
        if r["op"] == "dispatch":
            continue
        if "error" in r:
            lines.append(f"{r['pin']:<9} {r['op']:<15} {_size(r.get('size')):>8} {r['world']:>5}  ERROR {r['error']}")
            continue
        lines.append(
            f"{r['pin']:<9} {r['op']:<15} {_size(r['size']):>8} {r['world']:>5} "
            f"{r['tensorwire_us']:>14.1f} {r['gloo_us']:>12.1f} {r['ratio']:>7.2f}"
        )
    disp = [r for r in records if r["op"] == "dispatch"]
    if disp:
        lines.append("")
        lines.append("python dispatch overhead (dist.all_reduce of 8 B through c10d minus the native handle):")
        for r in disp:
            if "error" in r:
                lines.append(f"  {r['pin']:<9} world {r['world']}: ERROR {r['error']}")
            else:
                lines.append(
                    f"  {r['pin']:<9} world {r['world']}: c10d {r['c10d_us']:.1f} us, native "
                    f"{r['native_us']:.1f} us, overhead {r['overhead_us']:.1f} us"
                )
    return "\n".join(lines)


# -- rpc: tensorwire.rpc against torch's TensorPipe agent ----------------------------------------

RPC_FIGURES = ("rpc_sync", "rpc_async", "tensor", "remote_to_here")
RPC_BACKENDS = ("tensorwire", "tensorpipe")
#: Each figure's target, as a speedup (how many times better tensorwire is than TensorPipe):
#: rpc_sync p50 at most half of TensorPipe's, 3x the calls/s, the 64 MiB round trip in half the
#: time. remote + to_here has none.
RPC_TARGETS = {"rpc_sync": 2.0, "rpc_async": 3.0, "tensor": 2.0}
RPC_IN_FLIGHT = 64
RPC_DEFAULTS = {"calls": 2000, "async_calls": 6400, "tensor_mib": 64, "tensor_rounds": 12, "remote_calls": 400}
RPC_QUICK = {"calls": 40, "async_calls": 256, "tensor_mib": 1, "tensor_rounds": 4, "remote_calls": 20}


def rpc_noop() -> None:
    """The benchmark's no-op (called by both agents; exposed on tensorwire's callee)."""
    return None


def rpc_echo(value: Any) -> Any:
    """Returns its argument (the tensor round trip; ``remote`` + ``to_here`` of an int)."""
    return value


def _load() -> list[float]:
    """The 1, 5 and 15 minute load averages (``uptime``'s figures)."""
    try:
        with open("/proc/loadavg") as f:
            return [float(v) for v in f.read().split()[:3]]
    except OSError:
        return [float(v) for v in os.getloadavg()]


def _rpc_blocks(
    cases: dict[str, Callable[[], list[float]]], blocks: int
) -> dict[str, list[float]]:
    """Runs each case's block function ``blocks`` times, in ABBA order, and gathers what each
    block returned (samples)."""
    names = list(cases)
    out: dict[str, list[float]] = {n: [] for n in names}
    for b in range(blocks):
        for name in names if b % 2 == 0 else names[::-1]:
            out[name].extend(cases[name]())
    return out


def _rpc_rank_main(rank: int, world: int, env: dict, cfg: dict, out_path: str) -> None:
    """One of the two workers: both agents side by side in this process, rank 0 the caller."""
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    if cfg["pin"]:
        # Both processes on one core, every thread (taskset -c CPU).
        _pin_process(cfg["cpus"][0])
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed.rpc as tp
    import tensorwire.rpc as tw

    from tensorwire import bench  # the functions by the name the callee knows them

    tw.expose(bench.rpc_noop)
    tw.expose(bench.rpc_echo)
    timeout = cfg["timeout_s"]
    tw.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world,
        rpc_backend_options=tw.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=timeout),
    )
    tp.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world,
        rpc_backend_options=tp.TensorPipeRpcBackendOptions(
            init_method=f"file://{out_path}.tensorpipe-store", rpc_timeout=timeout
        ),
    )
    pin = "pinned" if cfg["pin"] else "unpinned"
    load_before = _load()
    if rank == 0:
        try:
            records = _rpc_measure({"tensorwire": tw, "tensorpipe": tp}, cfg)
        except Exception as e:  # noqa: BLE001  (reported; the shutdown below still runs)
            traceback.print_exc()
            records = [{"figure": "error", "error": f"{type(e).__name__}: {e}"}]
        load = [load_before, _load()]
        with open(out_path, "a") as f:
            for r in records:
                r.update(pin=pin, run=cfg["run"], load=load)
                f.write(json.dumps(r) + "\n")
    tp.shutdown()
    tw.shutdown()


def _rpc_measure(agents: dict[str, Any], cfg: dict) -> list[dict]:
    """Rank 0's figures, each with both agents in alternating blocks."""
    to = "worker1"
    blocks = cfg["blocks"]
    records: list[dict] = []

    def per_block(n: int) -> int:
        return max(1, math.ceil(n / blocks))

    def record(figure: str, unit: str, values: dict[str, float], n: dict[str, int], better: str) -> None:
        tw, tp = values["tensorwire"], values["tensorpipe"]
        # speedup: how many times better tensorwire is (lower time or higher rate).
        speedup = (tp / tw if better == "lower" else tw / tp) if tw > 0 and tp > 0 else float("nan")
        target = RPC_TARGETS.get(figure)
        records.append(
            {
                "figure": figure,
                "unit": unit,
                "tensorwire": tw,
                "tensorpipe": tp,
                "ratio": tw / tp if tp > 0 else float("inf"),
                "speedup": speedup,
                "target_speedup": target,
                "met": None if target is None else bool(speedup >= target),
                "samples": n["tensorwire"],
            }
        )
        line = f"    {figure:<15} tensorwire {tw:12.1f} {unit:<7} tensorpipe {tp:12.1f} {unit:<7} speedup {speedup:5.2f}x"
        if target is not None:
            line += f" (target {target:.0f}x: {'met' if speedup >= target else 'NOT met'})"
        print(line, flush=True)

    def timed(fn: Callable[[], object], n: int) -> Callable[[], list[float]]:
        return lambda: _timed(fn, n)

    if "rpc_sync" in cfg["figures"]:
        def sync_noop(rpc: Any) -> Callable[[], object]:
            def op() -> None:
                if rpc.rpc_sync(to, rpc_noop) is not None:
                    raise AssertionError("the no-op returned something")

            return op

        ops = {b: sync_noop(a) for b, a in agents.items()}
        for op in ops.values():
            _timed(op, WARMUP * 4)
        k = per_block(cfg["calls"])
        samples = _rpc_blocks({b: timed(op, k) for b, op in ops.items()}, blocks)
        record(
            "rpc_sync",
            "us",
            {b: statistics.median(s) * 1e6 for b, s in samples.items()},
            {b: len(s) for b, s in samples.items()},
            "lower",
        )

    if "rpc_async" in cfg["figures"]:
        def in_flight(rpc: Any, n: int) -> Callable[[], list[float]]:
            # `n` calls with at most RPC_IN_FLIGHT outstanding: one more is sent as soon as the
            # oldest has completed. One sample: the block's calls per second.
            def block() -> list[float]:
                pending: collections.deque = collections.deque()
                t0 = time.perf_counter()
                for _ in range(n):
                    if len(pending) == RPC_IN_FLIGHT:
                        pending.popleft().wait()
                    pending.append(rpc.rpc_async(to, rpc_noop))
                while pending:
                    pending.popleft().wait()
                return [n / (time.perf_counter() - t0)]

            return block

        k = per_block(cfg["async_calls"])
        for a in agents.values():
            in_flight(a, RPC_IN_FLIGHT * 2)()
        samples = _rpc_blocks({b: in_flight(a, k) for b, a in agents.items()}, blocks)
        record(
            "rpc_async",
            "calls/s",
            {b: statistics.median(s) for b, s in samples.items()},
            {b: len(s) * k for b, s in samples.items()},
            "higher",
        )

    if "tensor" in cfg["figures"]:
        nbytes = cfg["tensor_mib"] << 20
        t = torch.ones(nbytes // 4, dtype=torch.float32)

        def round_trip(rpc: Any) -> Callable[[], object]:
            def op() -> None:
                back = rpc.rpc_sync(to, rpc_echo, args=(t,))
                if back.numel() != t.numel() or back.dtype != t.dtype:
                    raise AssertionError(f"the tensor came back as {back.dtype} {tuple(back.shape)}")

            return op

        ops = {b: round_trip(a) for b, a in agents.items()}
        for op in ops.values():
            op()
        k = per_block(cfg["tensor_rounds"])
        samples = _rpc_blocks({b: timed(op, k) for b, op in ops.items()}, blocks)
        check = agents["tensorwire"].rpc_sync(to, rpc_echo, args=(t,))
        if not torch.equal(check, t):
            raise AssertionError("tensorwire's round trip changed the tensor")
        record(
            "tensor",
            "us",
            {b: statistics.median(s) * 1e6 for b, s in samples.items()},
            {b: len(s) for b, s in samples.items()},
            "lower",
        )
        records[-1]["bytes"] = nbytes

    if "remote_to_here" in cfg["figures"]:
        def remote_to_here(rpc: Any) -> Callable[[], object]:
            counter = [0]

            def op() -> None:
                counter[0] += 1
                got = rpc.remote(to, rpc_echo, args=(counter[0],)).to_here()
                if got != counter[0]:
                    raise AssertionError(f"to_here returned {got!r}, not {counter[0]}")

            return op

        ops = {b: remote_to_here(a) for b, a in agents.items()}
        for op in ops.values():
            _timed(op, WARMUP)
        k = per_block(cfg["remote_calls"])
        samples = _rpc_blocks({b: timed(op, k) for b, op in ops.items()}, blocks)
        record(
            "remote_to_here",
            "us",
            {b: statistics.median(s) * 1e6 for b, s in samples.items()},
            {b: len(s) for b, s in samples.items()},
            "lower",
        )
    return records


def _rpc_label(figure: str, tensor_mib: int) -> str:
    return {
        "rpc_sync": "rpc_sync p50 (no-op)",
        "rpc_async": f"rpc_async, {RPC_IN_FLIGHT} in flight",
        "tensor": f"{tensor_mib} MiB round trip p50",
        "remote_to_here": "remote + to_here p50",
    }[figure]


def _rpc_summary(records: list[dict], tensor_mib: int) -> list[dict]:
    """Per pin and figure, the medians over the runs: of each agent's figure and of the
    per-run speedups (each measured within one run)."""
    out = []
    for pin in ("unpinned", "pinned"):
        for figure in RPC_FIGURES:
            rs = [r for r in records if r.get("pin") == pin and r.get("figure") == figure and "error" not in r]
            if not rs:
                continue
            speedups = [r["speedup"] for r in rs]
            target = RPC_TARGETS.get(figure)
            med = statistics.median(speedups)
            out.append(
                {
                    "pin": pin,
                    "figure": figure,
                    "label": _rpc_label(figure, tensor_mib),
                    "unit": rs[0]["unit"],
                    "runs": len(rs),
                    "tensorwire": statistics.median(r["tensorwire"] for r in rs),
                    "tensorpipe": statistics.median(r["tensorpipe"] for r in rs),
                    "speedup": med,
                    "speedup_min": min(speedups),
                    "speedup_max": max(speedups),
                    "target_speedup": target,
                    "met": None if target is None else bool(med >= target),
                }
            )
    return out


def _rpc_table(summary: list[dict]) -> str:
    head = (
        f"{'pin':<9} {'figure':<27} {'unit':>7} {'tensorwire':>11} {'tensorpipe':>11} "
        f"{'speedup':>8} {'(min-max)':>13} {'target':>7}"
    )
    lines = [head, "-" * len(head)]
    for s in summary:
        target = "-" if s["target_speedup"] is None else f">={s['target_speedup']:.0f}x " + ("ok" if s["met"] else "NO")
        lines.append(
            f"{s['pin']:<9} {s['label']:<27} {s['unit']:>7} {s['tensorwire']:>11.1f} {s['tensorpipe']:>11.1f} "
            f"{s['speedup']:>7.2f}x {s['speedup_min']:>6.2f}-{s['speedup_max']:<6.2f} {target:>7}"
        )
    return "\n".join(lines)


def _rpc_main(args: argparse.Namespace) -> int:
    figures = [f.strip() for f in args.figures.split(",") if f.strip()]
    unknown = set(figures) - set(RPC_FIGURES)
    if unknown:
        raise SystemExit(f"unknown figures: {', '.join(sorted(unknown))} (known: {', '.join(RPC_FIGURES)})")
    sizes = dict(RPC_QUICK if args.quick else RPC_DEFAULTS)
    for key in sizes:
        given = getattr(args, key)
        if given is not None:
            if given < 1:
                raise SystemExit(f"--{key.replace('_', '-')} must be at least 1")
            sizes[key] = given
    cpus = sorted(os.sched_getaffinity(0))
    pins = {"on": [True], "off": [False], "both": [False, True]}[args.pin]
    blocks = 2 if args.quick else BLOCKS
    print(
        f"tensorwire bench rpc: tensorwire.rpc vs torch.distributed.rpc (TensorPipe), torch "
        f"{torch.__version__}, {len(cpus)} cores, 2 workers, pin {args.pin} (pinned: both on cpu "
        f"{cpus[0]}), {args.repeat} run(s) each; speedup = how many times better tensorwire is",
        flush=True,
    )
    records: list[dict] = []
    failures: list[str] = []
    started = time.monotonic()
    for pin in pins:
        for run in range(args.repeat):
            pin_name = "pinned" if pin else "unpinned"
            cfg = {
                "pin": pin,
                "cpus": cpus,
                "run": run,
                "blocks": blocks,
                "figures": figures,
                "timeout_s": max(60.0, args.deadline),
                **sizes,
            }
            print(f"  [{pin_name} run {run + 1}/{args.repeat}] load {' '.join(f'{v:.2f}' for v in _load())}", flush=True)
            t0 = time.monotonic()
            got, failure = _run_world(2, cfg, args.deadline, "_rpc_rank_main")
            for r in got:
                if "error" in r:
                    failure = failure or r["error"]
            records.extend(r for r in got if "error" not in r)
            note = f"  [{pin_name} run {run + 1}] took {time.monotonic() - t0:.1f} s"
            if failure:
                failures.append(f"{pin_name} run {run + 1}: {failure}")
                note += f"; FAILED: {failure}"
            print(note, flush=True)
    summary = _rpc_summary(records, sizes["tensor_mib"])
    print()
    print(f"medians over {args.repeat} run(s) per pin:")
    print(_rpc_table(summary))
    if failures:
        print("\nfailures:")
        for f in failures:
            print(f"  {f}")
    print(f"\ntotal {time.monotonic() - started:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "suite": "rpc",
                    "baseline": "tensorpipe",
                    "speedup": "tensorpipe/tensorwire for times, tensorwire/tensorpipe for calls/s (> 1: tensorwire is better)",
                    "ratio": "tensorwire/tensorpipe",
                    "torch": torch.__version__,
                    "cores": len(cpus),
                    "quick": bool(args.quick),
                    "repeat": args.repeat,
                    "in_flight": RPC_IN_FLIGHT,
                    **sizes,
                    "targets": RPC_TARGETS,
                    "summary": summary,
                    "records": records,
                    "failures": failures,
                },
                f,
                indent=2,
            )
    return 1 if failures else 0


def _rpc_parser(sub: Any) -> None:
    rpc = sub.add_parser(
        "rpc",
        help="tensorwire.rpc against torch.distributed.rpc's TensorPipe agent (speedup, > 1 is better)",
    )
    rpc.add_argument("--pin", nargs="?", const="on", default="both", choices=("on", "off", "both"),
                     help="pin both workers to one core: on (--pin alone), off, or both (default)")
    rpc.add_argument("--repeat", type=int, default=3, help="runs per pin setting; the table gives medians (default %(default)s)")
    rpc.add_argument("--figures", default=",".join(RPC_FIGURES), help=f"which figures (default: all of {','.join(RPC_FIGURES)})")
    rpc.add_argument("--quick", action="store_true", help="a tiny run (a smoke test: the figures mean little)")
    rpc.add_argument("--calls", type=int, help=f"rpc_sync calls per agent (default {RPC_DEFAULTS['calls']})")
    rpc.add_argument("--async-calls", type=int, help=f"rpc_async calls per agent (default {RPC_DEFAULTS['async_calls']})")
    rpc.add_argument("--tensor-mib", type=int, help=f"the round-tripped tensor's MiB (default {RPC_DEFAULTS['tensor_mib']})")
    rpc.add_argument("--tensor-rounds", type=int, help=f"tensor round trips per agent (default {RPC_DEFAULTS['tensor_rounds']})")
    rpc.add_argument("--remote-calls", type=int, help=f"remote + to_here per agent (default {RPC_DEFAULTS['remote_calls']})")
    rpc.add_argument("--json", metavar="FILE", help="also write the records and the summary as JSON to FILE")
    rpc.add_argument("--deadline", type=float, default=240.0, help="seconds one run may take before it is killed (default %(default)s)")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tensorwire.bench",
        description="Measures tensorwire against a baseline in the same run and reports ratios.",
    )
    sub = parser.add_subparsers(dest="suite", required=True)
    c10d = sub.add_parser("c10d", help="the torch.distributed backend against gloo (ratio tensorwire/gloo, < 1 is faster)")
    c10d.add_argument("--sizes", type=_ints, default=list(DEFAULT_SIZES), help="bytes per rank, comma-separated (default 8,1048576)")
    c10d.add_argument("--worlds", type=_ints, default=list(DEFAULT_WORLDS), help="world sizes, comma-separated (default 2,4,8)")
    c10d.add_argument("--iters", type=int, default=DEFAULT_ITERS, help="most timed iterations per backend at world 2; world w gets N*2/w (default %(default)s)")
    c10d.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="about how many seconds one figure's timed part may take (default %(default)s)")
    c10d.add_argument(
        "--pin",
        nargs="?",
        const="on",
        default="both",
        choices=("on", "off", "both"),
        help="pin each rank to one core: on (--pin alone), off, or both (default)",
    )
    c10d.add_argument("--ops", default=",".join(OPS + ("ddp_step",)), help="which figures (default: all)")
    c10d.add_argument("--no-dispatch", action="store_true", help="skip the python dispatch overhead figure")
    c10d.add_argument("--json", metavar="FILE", help="also write the records as JSON to FILE")
    c10d.add_argument("--deadline", type=float, default=240.0, help="seconds one world may take before it is killed (default %(default)s)")
    _rpc_parser(sub)
    args = parser.parse_args(argv)
    if args.suite == "rpc":
        return _rpc_main(args)

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(ops) - set(OPS + ("ddp_step",))
    if unknown:
        parser.error(f"unknown ops: {', '.join(sorted(unknown))}")
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    cpus = sorted(os.sched_getaffinity(0))
    pins = {"on": [True], "off": [False], "both": [False, True]}[args.pin]
    print(
        f"tensorwire bench c10d: tensorwire vs gloo, torch {torch.__version__}, {len(cpus)} cores, "
        f"sizes {args.sizes}, worlds {args.worlds}, iters <= {args.iters} (x2/world), "
        f"pin {args.pin}; ratio = tensorwire/gloo, < 1 is faster",
        flush=True,
    )
    records: list[dict] = []
    failures: list[str] = []
    started = time.monotonic()
    for pin in pins:
        for world in args.worlds:
            cfg = {
                "pin": pin,
                "cpus": cpus,
                "sizes": args.sizes,
                "iters": args.iters,
                "budget_s": args.budget,
                "ops": ops,
                "dispatch": not args.no_dispatch,
                "timeout_s": max(60.0, args.deadline),
            }
            t0 = time.monotonic()
            got, failure = _run_world(world, cfg, args.deadline)
            records.extend(got)
            note = f"  [{'pinned' if pin else 'unpinned'} world {world}] took {time.monotonic() - t0:.1f} s"
            if failure:
                failures.append(f"{'pinned' if pin else 'unpinned'} world {world}: {failure}")
                note += f"; FAILED: {failure}"
            print(note, flush=True)
    print()
    print(_table(records))
    if failures:
        print("\nfailures:")
        for f in failures:
            print(f"  {f}")
    print(f"\ntotal {time.monotonic() - started:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "suite": "c10d",
                    "baseline": "gloo",
                    "ratio": "tensorwire/gloo (< 1 is faster)",
                    "torch": torch.__version__,
                    "cores": len(cpus),
                    "sizes": args.sizes,
                    "worlds": args.worlds,
                    "iters": args.iters,
                    "records": records,
                    "failures": failures,
                },
                f,
                indent=2,
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
