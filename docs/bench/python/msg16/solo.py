"""Does the other engine's idle agent slow an engine's step down? (issue 48)

The ``autograd`` suite starts both agents in every process and alternates the engines' steps.
TensorPipe's shared-memory transport polls busily (its reactor threads spin, yielding, for as
long as the agent lives: ``TP_SHM_reactor``), so while tensorwire's steps run, PyTorch's idle
agent keeps three spinning threads on the two cores. This runs the suite's pipeline step of one
engine in a world where the other agent is started too or not at all::

    python solo.py ENGINE OTHER STEPS OUT.json    # ENGINE: tensorwire|tensorpipe; OTHER: 0|1

and appends ``{engine, other, median_us, mean_us, p90_us, steps, cpu_s_worker0}`` to OUT.json (a line).

``SOLO_HOOKS=MODULE`` (importable in the workers) has every worker call ``MODULE.install()`` before
it starts its agents, worker0 ``MODULE.reset_all()`` after the warm-up steps, and every worker
``MODULE.dump(rank)`` at its end (``pieces17/solo_tw.py`` times the Python layer's pieces so).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time

import torch

from tensorwire.bench import autograd as suite
from tensorwire.bench._common import run_world, timed


def _rank_main(rank: int, world: int, env: dict, cfg: dict, out_path: str) -> None:
    import warnings

    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    suite._build(cfg)
    import torch.distributed.rpc as tp

    import tensorwire.rpc as tw

    engine, other = cfg["engine"], cfg["other"]
    hooks = importlib.import_module(os.environ["SOLO_HOOKS"]) if os.environ.get("SOLO_HOOKS") else None
    if hooks:
        hooks.install()
    for fn in (suite.stage_forward, suite.stage_parameter):
        tw.expose(fn)
    timeout = 60.0
    if engine == "tensorwire" or other:
        tw.init_rpc(f"worker{rank}", rank=rank, world_size=world,
                    rpc_backend_options=tw.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=timeout))
    if engine == "tensorpipe" or other:
        tp.init_rpc(f"worker{rank}", rank=rank, world_size=world,
                    rpc_backend_options=tp.TensorPipeRpcBackendOptions(
                        init_method=f"file://{out_path}.tensorpipe-store", rpc_timeout=timeout))
    if rank == 0:
        e = suite._Engine(engine)
        x, y = suite._batch(0, cfg)
        name = engine
        params = [e.rpc.RRef(p) for p in suite._MODELS[(name, "stage1")].parameters()]
        for worker, stage in (("worker1", "stage2"), ("worker2", "stage3")):
            n = len(list(suite._MODELS[(name, stage)].parameters()))
            params += [e.rpc.remote(worker, suite.stage_parameter, args=(name, stage, i)) for i in range(n)]
        opt = e.optimizer(torch.optim.SGD, params, lr=suite.LR)

        def forward() -> torch.Tensor:
            h = suite._MODELS[(name, "stage1")](x)
            h = e.rpc.rpc_sync("worker1", suite.stage_forward, args=(name, "stage2", h))
            return e.rpc.rpc_sync("worker2", suite.stage_forward, args=(name, "stage3", h))

        def step() -> None:
            e.step(forward, y, opt)

        timed(step, 20)
        if hooks:
            hooks.reset_all()
        c0 = time.process_time()
        s = timed(step, cfg["steps"])
        c1 = time.process_time()
        with open(out_path, "a") as f:
            f.write(json.dumps({"engine": engine, "other": other, "median_us": statistics.median(s) * 1e6,
                                "mean_us": statistics.fmean(s) * 1e6,
                                "p90_us": statistics.quantiles(s, n=10)[-1] * 1e6,
                                "steps": len(s), "cpu_s_worker0": c1 - c0}) + "\n")
    if engine == "tensorpipe" or other:
        tp.shutdown()
    if engine == "tensorwire" or other:
        tw.shutdown()
    if hooks:
        hooks.dump(rank)


def main() -> int:
    engine, other, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cfg = {"width": 256, "batch": 32, "layers": 3, "steps": steps, "engine": engine, "other": other}
    records, failure = run_world(3, cfg, 600.0, _rank_main)
    if failure:
        print(failure)
        return 1
    for r in records:
        r["load"] = open("/proc/loadavg").read().split()[:3]
        print(json.dumps(r))
        with open(out, "a") as f:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
