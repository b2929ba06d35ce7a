"""An owner's optimizer step alone, in one process (issue 48, twentieth session, helper C):
``torch.optim.SGD`` through ``Optimizer.step`` over ``.grad`` (what ``tensorwire.rpc.optim``
ran before) against its functional counterpart (``_as_functional``, what it runs now, as
PyTorch's ``DistributedOptimizer`` does), over a Linear(256)'s two parameters: Python calls per
step (cProfile) and CPU us per step (``time.thread_time_ns``, 2,000 steps a round, rounds
alternating, medians)::

    PYTHONPATH=<tree>/python python owner_step.py [ROUNDS]
"""
import cProfile
import pstats
import statistics
import sys
import time

import torch

from tensorwire.rpc import optim as dist_optim

torch.set_num_threads(1)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
params = list(torch.nn.Linear(256, 256).parameters())
grads = [torch.randn_like(p) for p in params]
cls_opt = torch.optim.SGD(params, lr=1e-3)
fun_opt = dist_optim._as_functional(torch.optim.SGD, torch.optim.SGD(params, lr=1e-3), params)


def through_the_class() -> None:
    for p, g in zip(params, grads):
        p.grad = g
    cls_opt.step()


def functional() -> None:
    fun_opt.step(grads)


pieces = {"Optimizer.step": through_the_class, "functional": functional}
for name, f in pieces.items():
    for _ in range(100):
        f()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        f()
    pr.disable()
    print(f"{name}: {pstats.Stats(pr).total_calls / 100:.0f} Python calls a step")
times: dict = {name: [] for name in pieces}
for _ in range(rounds):
    for name, f in pieces.items():
        t = time.thread_time_ns()
        for _ in range(2000):
            f()
        times[name].append((time.thread_time_ns() - t) / 2000 / 1e3)
for name, ts in times.items():
    print(f"{name}: {' '.join(f'{x:.1f}' for x in ts)} us; median {statistics.median(ts):.1f}")
print("load", open("/proc/loadavg").read().split()[:3])
