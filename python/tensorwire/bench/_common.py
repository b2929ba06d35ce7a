"""What the suites share: spawning a world of ranks on this host, pinning, timing, the load."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import tempfile
import time
from typing import Callable, Optional

import torch
import torch.multiprocessing as mp

#: Untimed calls of each case before its samples.
WARMUP = 5
#: Timed blocks per case, taken in ABBA order.
BLOCKS = 4


def pin_process(cpu: int) -> None:
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


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out



def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (``uptime``'s figures)."""
    try:
        with open("/proc/loadavg") as f:
            return [float(v) for v in f.read().split()[:3]]
    except OSError:
        return [float(v) for v in os.getloadavg()]



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(
    world: int, cfg: dict, deadline_s: float, rank_main: Callable[..., None]
) -> tuple[list[dict], Optional[str]]:
    """Runs one world of ``rank_main(rank, world, env, cfg, out_path)`` (a module-level function,
    which spawn pickles by name); returns the records the ranks appended to ``out_path`` (one JSON
    object a line) and a failure, if any."""

    fd, out_path = tempfile.mkstemp(prefix="tw-bench-", suffix=".jsonl")
    os.close(fd)
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "TENSORWIRE_SECRET": os.environ.get("TENSORWIRE_SECRET") or secrets.token_hex(16),
        "OMP_NUM_THREADS": "1",
    }
    failure = None
    ctx = mp.start_processes(
        rank_main, args=(world, env, cfg, out_path), nprocs=world, join=False, start_method="spawn"
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



def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values



def abba_blocks(
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




# -- the suites that compare tensorwire with torch.distributed.rpc (TensorPipe) ------------------

#: The baseline of the speedup suites (``rpc``, ``autograd``).
BASELINE = "tensorpipe"


def speedup_record(
    figure: str, unit: str, values: dict[str, float], n: dict[str, int], better: str, target: Optional[float]
) -> dict:
    """One figure of one run: tensorwire's value and TensorPipe's, and the speedup (how many times
    better tensorwire is: the lower time, or the higher rate when ``better`` is ``"higher"``).
    Prints the line as it goes."""
    tw, tp = values["tensorwire"], values[BASELINE]
    speedup = (tp / tw if better == "lower" else tw / tp) if tw > 0 and tp > 0 else float("nan")
    line = f"    {figure:<15} tensorwire {tw:12.1f} {unit:<7} tensorpipe {tp:12.1f} {unit:<7} speedup {speedup:5.2f}x"
    if target is not None:
        line += f" (target {target:.0f}x: {'met' if speedup >= target else 'NOT met'})"
    print(line, flush=True)
    return {
        "figure": figure,
        "unit": unit,
        "tensorwire": tw,
        BASELINE: tp,
        "ratio": tw / tp if tp > 0 else float("inf"),
        "speedup": speedup,
        "target_speedup": target,
        "met": None if target is None else bool(speedup >= target),
        "samples": n["tensorwire"],
    }


def summarize(records: list[dict], labels: dict[str, str], targets: dict[str, float]) -> list[dict]:
    """Per pin and figure (in ``labels``' order), the medians over the runs: of each agent's figure
    and of the per-run speedups (each measured within one run)."""
    out = []
    for pin in ("unpinned", "pinned"):
        for figure, label in labels.items():
            rs = [r for r in records if r.get("pin") == pin and r.get("figure") == figure and "error" not in r]
            if not rs:
                continue
            speedups = [r["speedup"] for r in rs]
            target = targets.get(figure)
            med = statistics.median(speedups)
            out.append(
                {
                    "pin": pin,
                    "figure": figure,
                    "label": label,
                    "unit": rs[0]["unit"],
                    "runs": len(rs),
                    "tensorwire": statistics.median(r["tensorwire"] for r in rs),
                    BASELINE: statistics.median(r[BASELINE] for r in rs),
                    "speedup": med,
                    "speedup_min": min(speedups),
                    "speedup_max": max(speedups),
                    "target_speedup": target,
                    "met": None if target is None else bool(med >= target),
                }
            )
    return out


def speedup_table(summary: list[dict]) -> str:
    """The summary as a table, one line per pin and figure."""
    head = (
        f"{'pin':<9} {'figure':<27} {'unit':>7} {'tensorwire':>11} {'tensorpipe':>11} "
        f"{'speedup':>8} {'(min-max)':>13} {'target':>7}"
    )
    lines = [head, "-" * len(head)]
    for s in summary:
        target = "-" if s["target_speedup"] is None else f">={s['target_speedup']:.0f}x " + ("ok" if s["met"] else "NO")
        lines.append(
            f"{s['pin']:<9} {s['label']:<27} {s['unit']:>7} {s['tensorwire']:>11.1f} {s[BASELINE]:>11.1f} "
            f"{s['speedup']:>7.2f}x {s['speedup_min']:>6.2f}-{s['speedup_max']:<6.2f} {target:>7}"
        )
    return "\n".join(lines)


def add_speedup_arguments(parser: argparse.ArgumentParser, figures: tuple[str, ...], pinned: str) -> None:
    """The arguments every speedup suite takes; ``pinned`` says what ``--pin on`` pins."""
    parser.add_argument("--pin", nargs="?", const="on", default="both", choices=("on", "off", "both"),
                        help=f"pin {pinned}: on (--pin alone), off, or both (default)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per pin setting; the table gives medians (default %(default)s)")
    parser.add_argument("--figures", default=",".join(figures),
                        help=f"which figures (default: all of {','.join(figures)})")
    parser.add_argument("--quick", action="store_true", help="a tiny run (a smoke test: the figures mean little)")
    parser.add_argument("--json", metavar="FILE", help="also write the records and the summary as JSON to FILE")
    parser.add_argument("--deadline", type=float, default=240.0,
                        help="seconds one run may take before it is killed (default %(default)s)")


def chosen_figures(args: argparse.Namespace, known: tuple[str, ...]) -> list[str]:
    """``--figures``, checked against the suite's ``known`` ones."""
    figures = [f.strip() for f in args.figures.split(",") if f.strip()]
    unknown = set(figures) - set(known)
    if unknown:
        raise SystemExit(f"unknown figures: {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    return figures


def run_speedup_suite(
    args: argparse.Namespace,
    *,
    suite: str,
    title: str,
    world: int,
    rank_main: Callable[..., None],
    cfg: dict,
    labels: dict[str, str],
    targets: dict[str, float],
    extra: dict,
) -> int:
    """Runs ``world`` ranks of ``rank_main`` ``--repeat`` times per pin setting (fresh processes
    each run; ``cfg`` plus ``pin``, ``cpus``, ``run`` and ``timeout_s`` is what they get), prints
    the medians as a table and writes the JSON (``extra`` added to it); 1 if a run failed."""
    cpus = sorted(os.sched_getaffinity(0))
    pins = {"on": [True], "off": [False], "both": [False, True]}[args.pin]
    print(
        f"tensorwire bench {suite}: {title}, torch {torch.__version__}, {len(cpus)} cores, {world} workers, "
        f"pin {args.pin} (pinned: all on cpu {cpus[0]}), {args.repeat} run(s) each; "
        f"speedup = how many times better tensorwire is",
        flush=True,
    )
    records: list[dict] = []
    failures: list[str] = []
    started = time.monotonic()
    for pin in pins:
        pin_name = "pinned" if pin else "unpinned"
        for run in range(args.repeat):
            run_cfg = dict(cfg, pin=pin, cpus=cpus, run=run, timeout_s=max(60.0, args.deadline))
            print(f"  [{pin_name} run {run + 1}/{args.repeat}] load {' '.join(f'{v:.2f}' for v in load_average())}", flush=True)
            t0 = time.monotonic()
            got, failure = run_world(world, run_cfg, args.deadline, rank_main)
            for r in got:
                if "error" in r:
                    failure = failure or r["error"]
            records.extend(r for r in got if "error" not in r)
            note = f"  [{pin_name} run {run + 1}] took {time.monotonic() - t0:.1f} s"
            if failure:
                failures.append(f"{pin_name} run {run + 1}: {failure}")
                note += f"; FAILED: {failure}"
            print(note, flush=True)
    summary = summarize(records, labels, targets)
    print()
    print(f"medians over {args.repeat} run(s) per pin:")
    print(speedup_table(summary))
    if failures:
        print("\nfailures:")
        for f in failures:
            print(f"  {f}")
    print(f"\ntotal {time.monotonic() - started:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "suite": suite,
                    "baseline": BASELINE,
                    "speedup": "tensorpipe/tensorwire for times, tensorwire/tensorpipe for rates (> 1: tensorwire is better)",
                    "ratio": "tensorwire/tensorpipe",
                    "torch": torch.__version__,
                    "cores": len(cpus),
                    "quick": bool(args.quick),
                    "repeat": args.repeat,
                    **extra,
                    "targets": targets,
                    "summary": summary,
                    "records": records,
                    "failures": failures,
                },
                f,
                indent=2,
            )
    return 1 if failures else 0


def run_both_agents(
    rank: int,
    world: int,
    env: dict,
    cfg: dict,
    out_path: str,
    exposed: tuple,
    measure: Callable[[], list[dict]],
) -> None:
    """One worker of a speedup suite: pins it as ``cfg`` says, exposes ``exposed`` on
    tensorwire's agent, starts both agents side by side (``tensorwire.rpc`` through ``env://``,
    TensorPipe through a file store beside ``out_path``), and on rank 0 runs ``measure()`` and
    appends its records (or the error it raised) to ``out_path``; then shuts both down."""
    import traceback
    import warnings

    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    if cfg["pin"]:
        # Every worker on one core, every thread (taskset -c CPU).
        pin_process(cfg["cpus"][0])
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import torch.distributed.rpc as tp

    import tensorwire.rpc as tw

    for fn in exposed:
        tw.expose(fn)
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
    load_before = load_average()
    if rank == 0:
        try:
            records = measure()
        except Exception as e:  # noqa: BLE001  (reported; the shutdown below still runs)
            traceback.print_exc()
            records = [{"figure": "error", "error": f"{type(e).__name__}: {e}"}]
        load = [load_before, load_average()]
        with open(out_path, "a") as f:
            for r in records:
                r.update(pin=pin, run=cfg["run"], load=load)
                f.write(json.dumps(r) + "\n")
    tp.shutdown()
    tw.shutdown()
