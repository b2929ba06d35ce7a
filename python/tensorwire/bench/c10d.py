"""``c10d``: the process-group backend against gloo, in the same processes and the same run.

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

The Python dispatch overhead is also reported, in microseconds, from three medians of an 8 B
all_reduce in the same alternating blocks: ``dist.all_reduce`` through c10d on the tensorwire
group, the backend's own ``allreduce([t], opts).wait()`` (tensorwire's Python layer), and the
native handle called directly (``backend._pg.all_reduce([t], "torch.float32", "SUM").wait()``).
"ours" is what tensorwire's Python layer adds over the native call; "torch's" is what c10d's
dispatch adds over the backend (its Python wrapper, and the C++ ``PyBackend`` trampoline that
every backend written in Python goes through; gloo, in C++, pays only the wrapper).

``--iters N`` is the most iterations a figure gets at world 2; larger worlds get fewer
(``N * 2 / world``), and a figure also stops growing once both backends together would take
about ``--budget`` seconds, so that a full default run stays within a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ._common import BLOCKS, WARMUP, ints, pin_process, run_world, timed

OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "barrier")
DEFAULT_SIZES = (8, 1 << 20)
DEFAULT_WORLDS = (2, 4, 8)
DEFAULT_ITERS = 200
DEFAULT_BUDGET_S = 1.5
MIN_ITERS = 10
MLP_WIDTH = 256
MLP_BATCH = 32


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
            warm.append(statistics.median(timed(op, WARMUP)))
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
                samples[name].extend(timed(op, per_block))
        medians = [statistics.median(samples[n]) for n in names]
        worst = self._max(medians)
        return dict(zip(names, worst)), len(samples[names[0]])


def _rank_main(rank: int, world: int, env: dict, cfg: dict, out_path: str) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    if cfg["pin"]:
        cpus = cfg["cpus"]
        pin_process(cpus[rank % len(cpus)])
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
            print(f"  [{pin} world {world}] dispatch: {_dispatch(record)}", flush=True)
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
            t8b = torch.ones(2)
            t8n = torch.ones(2)
            options = dist.AllreduceOptions()
            cases = {
                "c10d": (lambda: dist.all_reduce(t8, group=tw_pg), lambda: dist.barrier(group=tw_pg)),
                "backend": (
                    lambda: backend.allreduce([t8b], options).wait(),
                    lambda: dist.barrier(group=tw_pg),
                ),
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
                    "backend_us": medians["backend"] * 1e6,
                    "native_us": medians["native"] * 1e6,
                    "overhead_us": (medians["c10d"] - medians["native"]) * 1e6,
                    "ours_us": (medians["backend"] - medians["native"]) * 1e6,
                    "iters": iters,
                }
            )
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            emit({"op": "dispatch", "size": 8, "error": f"{type(e).__name__}: {e}"})

    dist.barrier(group=gloo_pg)
    dist.destroy_process_group()



def _dispatch(r: dict) -> str:
    """A dispatch record as one line: the three medians, then what our Python layer adds over the
    native handle and what torch's c10d dispatch (its Python wrapper and the C++ ``PyBackend``
    trampoline every Python backend goes through) adds over ours."""
    return (
        f"c10d {r['c10d_us']:.1f} us, backend {r['backend_us']:.1f} us, native {r['native_us']:.1f} us; "
        f"ours {r['ours_us']:.1f} us, torch's {r['c10d_us'] - r['backend_us']:.1f} us"
    )


def _size(size: Optional[int]) -> str:
    if size is None:
        return "-"
    if size >= 1 << 20 and size % (1 << 20) == 0:
        return f"{size >> 20} MiB"
    if size >= 1 << 10:
        return f"{size / 1024:.0f} KiB"
    return f"{size} B"



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
        lines.append(
            "python dispatch overhead (all_reduce of 8 B: dist.all_reduce through c10d, the backend's "
            "own allreduce().wait(), the native handle; ours = backend - native, torch's = c10d - backend):"
        )
        for r in disp:
            if "error" in r:
                lines.append(f"  {r['pin']:<9} world {r['world']}: ERROR {r['error']}")
            else:
                lines.append(f"  {r['pin']:<9} world {r['world']}: {_dispatch(r)}")
    return "\n".join(lines)



def add_parser(sub: Any) -> None:
    """Adds the ``c10d`` suite's subcommand to ``sub``."""
    c10d = sub.add_parser("c10d", help="the torch.distributed backend against gloo (ratio tensorwire/gloo, < 1 is faster)")
    c10d.add_argument("--sizes", type=ints, default=list(DEFAULT_SIZES), help="bytes per rank, comma-separated (default 8,1048576)")
    c10d.add_argument("--worlds", type=ints, default=list(DEFAULT_WORLDS), help="world sizes, comma-separated (default 2,4,8)")
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


def main(args: argparse.Namespace) -> int:
    """Runs the suite as ``args`` (from :func:`add_parser`'s parser) say; 1 if a world failed."""

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(ops) - set(OPS + ("ddp_step",))
    if unknown:
        raise SystemExit(f"unknown ops: {', '.join(sorted(unknown))}")
    if args.iters < 1:
        raise SystemExit("--iters must be at least 1")
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
            got, failure = run_world(world, cfg, args.deadline, _rank_main)
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
