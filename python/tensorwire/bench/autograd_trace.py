"""Where a step of the ``autograd`` suite's 3-stage pipeline spends its time (issue 48)::

    python -m tensorwire.bench.autograd_trace                 # 200 traced steps, unpinned
    python -m tensorwire.bench.autograd_trace --pin on --steps 300

Three workers, as in ``python -m tensorwire.bench autograd`` (both agents side by side, the same
models and sizes). Every process records ``time.perf_counter_ns()`` (``CLOCK_MONOTONIC``, one
clock for every process of the host) and the thread at each stage tensorwire's Python layer
passes: the driver's forward, each ``rpc_sync`` (its arguments pickled, the native call, the
reply decoded), the callee's serving job and the function in it, every tensor the native side
imports or exports, each local pass of torch's engine, the optimizer's step on each owner, the
context's release. The table is the median step: each stage's median offset from the step's
start, with the process and the thread (``T0`` is the thread the process's first stage ran on;
a new ``T`` is a thread hand-off). Then the phases of both engines' steps (PyTorch's can only be
timed at the driver and in the served function), and the same model's forward, backward and
SGD step in one process, for the floor the work itself sets.

The wrappers cost about 1 us each (a list append); the traced step is within noise of the
untraced one (both printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import autograd as suite
from ._common import run_world

#: (ns, tag, native thread id) per stage this process passed.
_EVENTS: list[tuple[int, str, int]] = []
_ON = [False]


def _mark(tag: str) -> None:
    if _ON[0]:
        _EVENTS.append((time.perf_counter_ns(), tag, threading.get_native_id()))


def _wrap(module: Any, name: str, tag: str) -> None:
    inner = getattr(module, name)

    def traced(*args: Any, **kwargs: Any) -> Any:
        _mark(tag + ">")
        try:
            return inner(*args, **kwargs)
        finally:
            _mark(tag + "<")

    setattr(module, name, traced)


def _instrument() -> None:
    """Wraps the stages of tensorwire's Python layer (the native side looks each one up by name
    on every use, so the wrappers see every call)."""
    from tensorwire import rpc
    from tensorwire.rpc import _autograd_engine as eng
    from tensorwire.rpc import dist_autograd

    for name, tag in (
        ("serve", "serve"),
        ("_run_in", "run_in"),
        ("dumps_split", "pickle"),
        ("backward", "engine.backward"),
        ("import_tensor", "import"),
        ("receive", "receive"),
        ("export_tensor", "export"),
        ("accumulate", "accumulate"),
        ("owner_call", "owner_call"),
        ("_prepare_call", "prepare"),
        ("_decode", "decode"),
        ("rpc_sync", "rpc_sync"),
        ("owner_call_async", "owner_call_async"),
    ):
        _wrap(eng, name, tag)
    _wrap(dist_autograd, "backward", "dist_backward")
    _wrap(dist_autograd, "get_gradients", "get_gradients")
    _wrap(rpc, "_invoke", "invoke")


def traced_stage(engine: str, name: str, x: torch.Tensor) -> torch.Tensor:
    """``stage_forward``, marked."""
    _mark(f"fn.{engine}>")
    try:
        return suite._MODELS[(engine, name)](x)
    finally:
        _mark(f"fn.{engine}<")


def take_events(on: bool) -> list:
    """This process's events so far (then none), and whether to record from now on."""
    out = list(_EVENTS)
    _EVENTS.clear()
    _ON[0] = on
    return out


def _rank_main(rank: int, world: int, env: dict, cfg: dict, out_path: str) -> None:
    suite._build(cfg)
    _instrument()
    from ._common import run_both_agents

    run_both_agents(
        rank, world, env, cfg, out_path,
        (traced_stage, suite.stage_parameter, suite.max_difference, take_events),
        lambda: [_measure(cfg)],
    )


def _measure(cfg: dict) -> dict:
    engines = {name: suite._Engine(name) for name in suite.ENGINES}
    x, y = suite._batch(0, cfg)
    workers = ("worker1", "worker2")
    tw = engines["tensorwire"].rpc

    def make(e: suite._Engine) -> Callable[[], None]:
        name = e.name
        params = [e.rpc.RRef(p) for p in suite._MODELS[(name, "stage1")].parameters()]
        for worker, stage in zip(workers, ("stage2", "stage3")):
            n = len(list(suite._MODELS[(name, stage)].parameters()))
            params += [e.rpc.remote(worker, suite.stage_parameter, args=(name, stage, i)) for i in range(n)]
        opt = e.optimizer(torch.optim.SGD, params, lr=suite.LR)

        def step() -> None:
            _mark("step>")
            with e.dist_autograd.context() as context_id:
                _mark("ctx.entered")
                h = suite._MODELS[(name, "stage1")](x)
                _mark("stage1.done")
                h = e.rpc.rpc_sync("worker1", traced_stage, args=(name, "stage2", h))
                _mark("hop1.done")
                out = e.rpc.rpc_sync("worker2", traced_stage, args=(name, "stage3", h))
                _mark("hop2.done")
                loss = F.mse_loss(out, y)
                _mark("loss.done")
                e.dist_autograd.backward(context_id, [loss])
                _mark("backward.done")
                opt.step(context_id)
                _mark("opt.done")
            _mark("step<")

        return step

    steps = {name: make(e) for name, e in engines.items()}
    for s in steps.values():
        for _ in range(20):
            s()
    # Untraced step times, both engines, alternating.
    plain: dict[str, list[float]] = {n: [] for n in steps}
    for _ in range(cfg["steps"] // 20):
        for n, s in steps.items():
            for _ in range(20):
                t0 = time.perf_counter_ns()
                s()
                plain[n].append((time.perf_counter_ns() - t0) / 1e3)
    # Traced: every process records.
    for w in workers:
        tw.rpc_sync(w, take_events, args=(True,))
    take_events(True)
    phases: dict[str, list[list[int]]] = {}
    for n in ("tensorpipe", "tensorwire"):
        take_events(True)
        for _ in range(cfg["steps"]):
            steps[n]()
        if n == "tensorpipe":
            phases[n] = _phases(take_events(True))
    events = {"worker0": take_events(False)}
    for w in workers:
        events[w] = tw.rpc_sync(w, take_events, args=(False,))
    phases["tensorwire"] = _phases(events["worker0"])
    raw = os.environ.get("TENSORWIRE_TRACE_RAW")
    if raw:
        # Every mark of every process (ns, tag, native thread id), for lining up with a
        # system-wide scheduler trace taken meanwhile (``perf record -k CLOCK_MONOTONIC``).
        with open(raw, "w") as f:
            json.dump(events, f)
    return {
        "figure": "trace",
        "plain_us": {n: statistics.median(v) for n, v in plain.items()},
        "phases_us": {n: _phase_medians(p) for n, p in phases.items()},
        "timeline": _timeline(events),
        "local_us": _local(cfg),
    }


_PHASES = ("ctx.entered", "stage1.done", "hop1.done", "hop2.done", "loss.done", "backward.done", "opt.done", "step<")


def _phases(events: list) -> list[list[int]]:
    """Per step, the driver's phase marks' offsets from its start (ns)."""
    out, start, marks = [], None, {}
    for t, tag, _ in events:
        if tag == "step>":
            start, marks = t, {}
        elif start is not None and tag in _PHASES:
            marks[tag] = t - start
            if tag == "step<":
                out.append([marks.get(p, 0) for p in _PHASES])
                start = None
    return out


def _phase_medians(steps: list[list[int]]) -> dict[str, float]:
    """Each phase's median length (us): from the previous mark to its own."""
    out = {}
    for i, p in enumerate(_PHASES):
        lengths = [(s[i] - (s[i - 1] if i else 0)) / 1e3 for s in steps]
        out[p] = statistics.median(lengths)
    out["step"] = statistics.median(s[-1] / 1e3 for s in steps)
    return out


def marked_windows(marks: list, begin: str, end: str) -> list[tuple[int, int]]:
    """The spans of one process's marks ``(t, tag, thread)`` from each ``begin`` tag to the
    ``end`` tag that follows it (an ``end`` with no ``begin`` before it is passed over)."""
    windows = []
    start = None
    for t, tag, _ in marks:
        if tag == begin:
            start = t
        elif tag == end and start is not None:
            windows.append((start, t))
            start = None
    return windows


def _timeline(events: dict[str, list]) -> list[dict]:
    """The median step: every stage every process passed, by its median offset from the step's
    start (the k-th occurrence of a tag in a step is one stage)."""
    windows = marked_windows(events["worker0"], "step>", "step<")
    offsets: dict[tuple[str, str, int], list[int]] = {}
    threads: dict[tuple[str, str, int], list[int]] = {}
    thread_names: dict[tuple[str, int], str] = {}
    for proc, evs in events.items():
        i = 0
        for a, b in windows:
            seen: dict[str, int] = {}
            while i < len(evs) and evs[i][0] < a:
                i += 1
            j = i
            while j < len(evs) and evs[j][0] <= b:
                t, tag, tid = evs[j]
                k = seen.get(tag, 0)
                seen[tag] = k + 1
                key = (proc, tag, k)
                offsets.setdefault(key, []).append(t - a)
                if (proc, tid) not in thread_names:
                    thread_names[(proc, tid)] = f"T{sum(1 for p, _ in thread_names if p == proc)}"
                threads.setdefault(key, []).append(tid)
                j += 1
            i = j
    n = len(windows)
    rows = []
    for key, offs in offsets.items():
        if len(offs) < n * 0.9:
            continue  # a stage not in (nearly) every step
        proc, tag, k = key
        tids = threads[key]
        common = max(set(tids), key=tids.count)
        rows.append({
            "at_us": statistics.median(offs) / 1e3,
            "proc": proc,
            "stage": tag + (f"#{k + 1}" if k else ""),
            "thread": thread_names[(proc, common)],
            "steps": len(offs),
        })
    rows.sort(key=lambda r: r["at_us"])
    return rows


def _local(cfg: dict) -> dict[str, float]:
    """The same three stages, the loss, backward and an SGD step in one process."""
    models = [suite._MODELS[("tensorwire", s)] for s in ("stage1", "stage2", "stage3")]
    import copy

    models = [copy.deepcopy(m) for m in models]
    params = [p for m in models for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=suite.LR)
    x, y = suite._batch(0, cfg)
    fwd, bwd, stp, tot = [], [], [], []
    for i in range(cfg["steps"] + 20):
        t0 = time.perf_counter_ns()
        h = x
        for m in models:
            h = m(h)
        loss = F.mse_loss(h, y)
        t1 = time.perf_counter_ns()
        loss.backward()
        t2 = time.perf_counter_ns()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter_ns()
        if i >= 20:
            fwd.append((t1 - t0) / 1e3)
            bwd.append((t2 - t1) / 1e3)
            stp.append((t3 - t2) / 1e3)
            tot.append((t3 - t0) / 1e3)
    med = statistics.median
    return {"forward": med(fwd), "backward": med(bwd), "sgd_step": med(stp), "step": med(tot)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pin", choices=("on", "off"), default="off")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=suite.AUTOGRAD_DEFAULTS["width"])
    p.add_argument("--batch", type=int, default=suite.AUTOGRAD_DEFAULTS["batch"])
    p.add_argument("--json", help="also write the record here")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    cfg = {
        "width": args.width, "batch": args.batch, "layers": suite.AUTOGRAD_DEFAULTS["layers"],
        "steps": args.steps, "pin": args.pin == "on", "cpus": cpus, "run": 0, "timeout_s": 60.0,
    }
    from tensorwire.bench import autograd_trace as me  # by its name, not __main__'s (spawn)

    records, failure = run_world(3, cfg, 600.0, me._rank_main)
    if failure:
        print(failure)
        return 1
    r = records[0]
    if r.get("figure") == "error":
        print(r["error"])
        return 1
    print(f"untraced step (us, median): {json.dumps(r['plain_us'])}   load {r.get('load')}")
    print(f"local step, one process (us): {json.dumps(r['local_us'])}")
    print("driver phases (us, median length of each):")
    for n, ph in r["phases_us"].items():
        print(f"  {n:10s} " + "  ".join(f"{k}={v:.0f}" for k, v in ph.items()))
    print("tensorwire's median step, every stage:")
    prev = 0.0
    for row in r["timeline"]:
        print(f"  {row['at_us']:9.1f} (+{row['at_us'] - prev:7.1f})  {row['proc']:8s} {row['thread']:3s} {row['stage']}")
        prev = row["at_us"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
