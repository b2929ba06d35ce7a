"""One local pass of tensorwire's torch engine (``_autograd_engine.backward``) and one received
tensor's import and recv node, two versions of the engine module alternating in one process
(issue 48)::

    git show BASE:python/tensorwire/rpc/_autograd_engine.py > /tmp/engine_base.py
    python docs/bench/python/engine_pass_ab.py /tmp/engine_base.py [--width 256] [--rounds 300]

A: the module file given (loaded under a name of its own); B: the ``_autograd_engine`` of the
``tensorwire`` this Python imports. The graph is a pipeline stage's (a received ``batch x width``
tensor, ``Linear(width, width)``, ReLU), rebuilt for every pass by each module's own
``import_tensor`` and ``receive``; 8 MB of memory are written between calls, so that each call
starts with cold caches as it does in a step. The figures are the calling thread's CPU time
(``time.thread_time_ns``, steadier under load than wall time), medians, with their ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", help="the A version's _autograd_engine.py")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tensorwire.rpc import _autograd_engine as new

    spec = importlib.util.spec_from_file_location("_tensorwire_engine_base", args.base)
    assert spec is not None and spec.loader is not None
    base = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = base
    spec.loader.exec_module(base)
    new._install()  # the base module installed itself as tensorwire.rpc's hook on import

    w, b = args.width, args.batch
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU())
    buf = bytearray(torch.randn(b, w).numpy().tobytes())
    seed = torch.randn(b, w)
    junk = torch.zeros(2 * 1024 * 1024)
    passes: dict[str, list[float]] = {"A": [], "B": []}
    received: dict[str, list[float]] = {"A": [], "B": []}
    sides = (("A", base), ("B", new))
    for r in range(args.rounds):
        for name, engine in sides if r % 2 == 0 else sides[::-1]:
            junk.add_(1.0)
            t0 = time.thread_time_ns()
            x = engine.import_tensor("float32", (b, w), buf, True)
            engine.receive([x])
            t1 = time.thread_time_ns()
            y = stage(x)
            junk.add_(1.0)
            t2 = time.thread_time_ns()
            out = engine.backward([y], [seed])
            t3 = time.thread_time_ns()
            # The parameters' gradients, then the received tensor's: both versions agree.
            grads = [g for _, g, _ in out]
            if name == "A":
                first = grads
            elif r % 2 == 0:
                assert len(grads) == len(first) == 3 and all(map(torch.equal, grads, first))
            received[name].append((t1 - t0) / 1e3)
            passes[name].append((t3 - t2) / 1e3)
    for what, d in (("a pass (backward)", passes), ("import + recv node", received)):
        a, bb = statistics.median(d["A"]), statistics.median(d["B"])
        print(f"{what:22s} A {a:8.1f} us   B {bb:8.1f} us   B/A {bb / a:.2f}")


if __name__ == "__main__":
    main()
