"""The Python pieces issue 48's seventeenth session changed, timed alone in one process (hot
caches: a lower bound of what each costs inside a step), so that a base tree and a new one can
be compared by running this with each on ``PYTHONPATH``, alternating::

    PYTHONPATH=<tree>/python python pieces.py LABEL OUT.json

appends ``{label, piece: median CPU ns per call (the thread's CPU time: preemption by other processes is not counted) over 7 rounds}`` to OUT.json (a line).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from tensorwire.rpc import _autograd_engine as E
from tensorwire.rpc import _serialize as S


def per_call(f, n: int = 4000, rounds: int = 7) -> float:
    f()
    out = []
    for _ in range(rounds):
        t = time.thread_time_ns()
        for _ in range(n):
            f()
        out.append((time.thread_time_ns() - t) / n)
    return statistics.median(out)


def main() -> None:
    torch.set_num_threads(1)
    label, path = sys.argv[1], sys.argv[2]
    buf = bytearray(32 * 256 * 4)  # the suite's activations: 32 x 256 float32
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(32, 256, requires_grad=True)
    h = torch.relu(lin(x))
    acc = h.grad_fn.next_functions[0][0].next_functions[0][0]  # a parameter's AccumulateGrad
    recv = E.import_tensor("float32", (32, 256), bytearray(buf), True)
    E.receive([recv])
    pieces = {
        "import_tensor": lambda: E.import_tensor("float32", (32, 256), buf, True),
        "export_tensor": lambda: E.export_tensor(h),
        "check_carried": lambda: S.check_carried(h),
        "_prepare": lambda: S._prepare(h),
        "_has_node_hooks(AccumulateGrad)": lambda: E._has_node_hooks(acc),
        "_has_node_hooks(recv)": lambda: E._has_node_hooks(recv.grad_fn),
        "receive": lambda: E.receive([E.import_tensor("float32", (32, 256), buf, True)]),
        "backward(relay)": lambda: E.backward([recv], [torch.ones(32, 256)]),
        "backward(stage)": lambda: E.backward([h], [torch.ones(32, 256)]),
    }
    row = {"label": label}
    for name, f in pieces.items():
        row[name] = round(per_call(f, n=2000 if name.startswith("backward") else 4000))
    print(json.dumps(row))
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
