"""``autograd``: one distributed training step of a model split over three workers, tensorwire
(``tensorwire.rpc``, its ``dist_autograd`` and ``DistributedOptimizer``) against PyTorch
(``torch.distributed.rpc`` on TensorPipe, ``torch.distributed.autograd`` and
``torch.distributed.optim.DistributedOptimizer``), in the same processes and the same run::

    python -m tensorwire.bench autograd                    # both pin settings, 3 runs each
    python -m tensorwire.bench autograd --pin on --repeat 5 --json out.json
    python -m tensorwire.bench autograd --quick --pin off  # a smoke test (seconds)

Three workers are spawned on this host; each starts both agents side by side (as the ``rpc`` suite
does) and builds the same models for both, from the same seeds. A step is: forward (remote parts
through ``rpc_sync``), an MSE loss, ``dist_autograd.backward`` in a context (the gradients reach
every owner inside the context), then ``DistributedOptimizer(torch.optim.SGD, ...).step`` on every
owner. Two shapes:

- ``ps``: a parameter server and two trainers, training at the same time. worker0 serves an MLP
  (``--layers`` Linear layers of ``--width``, ReLU between them) for each trainer, as PyTorch's
  own parameter-server example does since pytorch/examples#877 (one shared model breaks both
  engines: a trainer's optimizer step changes in place the weights another trainer's backward
  still needs); worker1 and worker2 each own a Linear head and train on their own batch
  (``--batch`` rows): the MLP's forward on the server, the head, the loss and backward on the
  trainer, the optimizer step on both owners. The figure is a trainer's time per step, the median
  over its steps, the larger of the two trainers' (worker0 starts each block on both trainers and
  waits for both).
- ``pipeline``: three stages, one per worker, each a Linear layer of ``--width`` (with a ReLU after
  the first two). worker0 drives: stage 1 locally, stage 2 on worker1 and stage 3 on worker2
  through ``rpc_sync``, the loss, backward through all three and the optimizer step on all three
  owners. The figure is the driver's time per step, the median.

Both engines run every figure in alternating blocks (ABBA) with the same number of steps, from
the same start on the same data, so they must end with the same parameters: a run fails if any
differ by more than 1e-6 (checked after each figure). The
speedup is PyTorch's time per step over tensorwire's; the target is 2x (tensorwire's step at most
half of PyTorch's). ``--pin on`` pins all three workers, every thread, to the first allowed core
(as ``taskset -c 0``). Every setting runs ``--repeat`` times (fresh processes); the table gives
the medians over the runs.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ._common import (
    BLOCKS,
    abba_blocks,
    add_speedup_arguments,
    chosen_figures,
    run_both_agents,
    run_speedup_suite,
    speedup_record,
    timed,
)

AUTOGRAD_FIGURES = ("ps", "pipeline")
#: tensorwire's time per step at most half of PyTorch's.
AUTOGRAD_TARGETS = {"ps": 2.0, "pipeline": 2.0}
AUTOGRAD_DEFAULTS = {"width": 256, "batch": 32, "layers": 3, "steps": 200}
AUTOGRAD_QUICK = {"width": 16, "batch": 4, "layers": 2, "steps": 8}
ENGINES = ("tensorwire", "tensorpipe")
LR = 1e-3
#: Untimed steps of each engine before a figure's blocks.
WARMUP_STEPS = 5
#: How far the two engines' pipeline parameters may be apart after the same steps.
TOLERANCE = 1e-6

#: (engine, model name) -> the model, built on every worker (only the owner's copy is used).
_MODELS: dict[tuple[str, str], torch.nn.Module] = {}
#: engine -> (step function) on a trainer, built on its first block.
_TRAINERS: dict[str, Callable[[], None]] = {}


class _Engine:
    """One engine's modules: its rpc, dist_autograd and DistributedOptimizer."""

    def __init__(self, name: str):
        self.name = name
        if name == "tensorwire":
            import tensorwire.rpc as rpc
            from tensorwire.rpc import dist_autograd
            from tensorwire.rpc.optim import DistributedOptimizer
        else:
            import torch.distributed.autograd as dist_autograd
            import torch.distributed.rpc as rpc
            from torch.distributed.optim import DistributedOptimizer
        self.rpc = rpc
        self.dist_autograd = dist_autograd
        self.optimizer = DistributedOptimizer

    def step(self, forward: Callable[[], torch.Tensor], y: torch.Tensor, opt: Any) -> None:
        """One training step: ``forward``, the loss, distributed backward, the optimizer step."""
        with self.dist_autograd.context() as context_id:
            loss = F.mse_loss(forward(), y)
            self.dist_autograd.backward(context_id, [loss])
            opt.step(context_id)


def _build(cfg: dict) -> None:
    """Every model of both shapes for both engines, each engine's copy from the same seed."""
    width, layers = cfg["width"], cfg["layers"]

    def mlp() -> torch.nn.Module:
        parts: list[torch.nn.Module] = []
        for i in range(layers):
            parts.append(torch.nn.Linear(width, width))
            if i + 1 < layers:
                parts.append(torch.nn.ReLU())
        return torch.nn.Sequential(*parts)

    def stage(last: bool) -> torch.nn.Module:
        if last:
            return torch.nn.Linear(width, width)
        return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())

    makers = (
        ("ps1", mlp),
        ("ps2", mlp),
        ("head", lambda: stage(True)),
        ("stage1", lambda: stage(False)),
        ("stage2", lambda: stage(False)),
        ("stage3", lambda: stage(True)),
    )
    for engine in ENGINES:
        for seed, (name, make) in enumerate(makers):
            torch.manual_seed(seed)
            _MODELS[(engine, name)] = make()


def _batch(rank: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(cfg["batch"], cfg["width"], generator=g), torch.randn(cfg["batch"], cfg["width"], generator=g)


# -- what the workers call on each other (exposed on tensorwire's callees) -----------------------


def stage_forward(engine: str, name: str, x: torch.Tensor) -> torch.Tensor:
    """Runs this worker's copy of model ``name`` for ``engine`` on ``x``."""
    return _MODELS[(engine, name)](x)


def stage_parameter(engine: str, name: str, i: int) -> torch.nn.Parameter:
    """The ``i``-th parameter of this worker's model ``name`` (``remote`` keeps it here: an RRef
    the optimizer's owner part updates in place)."""
    return list(_MODELS[(engine, name)].parameters())[i]


def max_difference(name: str) -> float:
    """The largest difference between the two engines' copies of model ``name`` on this worker."""
    pairs = zip(_MODELS[("tensorwire", name)].parameters(), _MODELS[("tensorpipe", name)].parameters())
    with torch.no_grad():
        return max(float((a - b).abs().max()) for a, b in pairs)


def trainer_block(engine: str, steps: int, cfg: dict) -> list[float]:
    """On a trainer of the ``ps`` shape: runs ``steps`` training steps with ``engine`` and returns
    each one's seconds (the optimizer and the batch are made on the first call)."""
    step = _TRAINERS.get(engine)
    if step is None:
        e = _Engine(engine)
        rank = e.rpc.get_worker_info().id
        served, head = f"ps{rank}", _MODELS[(engine, "head")]
        n = len(list(_MODELS[(engine, served)].parameters()))
        params = [e.rpc.RRef(p) for p in head.parameters()]
        params += [e.rpc.remote("worker0", stage_parameter, args=(engine, served, i)) for i in range(n)]
        opt = e.optimizer(torch.optim.SGD, params, lr=LR)
        x, y = _batch(rank, cfg)

        def forward() -> torch.Tensor:
            return head(e.rpc.rpc_sync("worker0", stage_forward, args=(engine, served, x)))

        def step() -> None:
            e.step(forward, y, opt)

        _TRAINERS[engine] = step
    return timed(step, steps)


# -- the workers ----------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, env: dict, cfg: dict, out_path: str) -> None:
    """One of the three workers: both engines side by side in this process, worker0 drives."""
    _build(cfg)
    run_both_agents(
        rank, world, env, cfg, out_path, (stage_forward, stage_parameter, max_difference, trainer_block),
        lambda: _measure({name: _Engine(name) for name in ENGINES}, cfg),
    )


def _measure(engines: dict[str, _Engine], cfg: dict) -> list[dict]:
    """worker0's figures, each with both engines in alternating blocks."""
    blocks = cfg["blocks"]
    per_block = max(1, math.ceil(cfg["steps"] / blocks))
    records: list[dict] = []

    def record(figure: str, samples: dict[str, list[list[float]]], extra: dict) -> None:
        # The figure: the slowest participant's median (one list of samples per participant).
        values = {e: max(statistics.median(s) for s in per) * 1e6 for e, per in samples.items()}
        counts = {e: sum(len(s) for s in per) for e, per in samples.items()}
        r = speedup_record(figure, "us/step", values, counts, "lower", AUTOGRAD_TARGETS[figure])
        r.update(extra)
        records.append(r)

    if "ps" in cfg["figures"]:
        trainers = ("worker1", "worker2")

        def ps_block(e: _Engine, steps: int) -> list[list[float]]:
            futures = [e.rpc.rpc_async(t, trainer_block, args=(e.name, steps, cfg)) for t in trainers]
            return [f.wait() for f in futures]

        got: dict[str, list[list[float]]] = {name: [[] for _ in trainers] for name in engines}

        def ps_case(e: _Engine) -> Callable[[], list[float]]:
            def block() -> list[float]:
                for mine, theirs in zip(got[e.name], ps_block(e, per_block)):
                    mine.extend(theirs)
                return []

            return block

        for e in engines.values():
            ps_block(e, WARMUP_STEPS)
        abba_blocks({name: ps_case(e) for name, e in engines.items()}, blocks)
        # Each trainer's model trained the same steps from the same start with either engine.
        apart = max(max_difference("ps1"), max_difference("ps2"))
        apart = max(
            [apart] + [engines["tensorwire"].rpc.rpc_sync(t, max_difference, args=("head",)) for t in trainers]
        )
        if apart > TOLERANCE:
            raise AssertionError(
                f"after the same steps the engines' parameter-server models differ by {apart:g} (more than {TOLERANCE:g})"
            )
        record("ps", got, {"max_difference": apart})

    if "pipeline" in cfg["figures"]:
        x, y = _batch(0, cfg)

        def pipeline_step(e: _Engine) -> Callable[[], None]:
            name = e.name
            params = [e.rpc.RRef(p) for p in _MODELS[(name, "stage1")].parameters()]
            for worker, stage in (("worker1", "stage2"), ("worker2", "stage3")):
                n = len(list(_MODELS[(name, stage)].parameters()))
                params += [e.rpc.remote(worker, stage_parameter, args=(name, stage, i)) for i in range(n)]
            opt = e.optimizer(torch.optim.SGD, params, lr=LR)

            def forward() -> torch.Tensor:
                h = _MODELS[(name, "stage1")](x)
                h = e.rpc.rpc_sync("worker1", stage_forward, args=(name, "stage2", h))
                return e.rpc.rpc_sync("worker2", stage_forward, args=(name, "stage3", h))

            return lambda: e.step(forward, y, opt)

        steps = {name: pipeline_step(e) for name, e in engines.items()}
        for step in steps.values():
            timed(step, WARMUP_STEPS)
        samples = abba_blocks({name: (lambda s=step: timed(s, per_block)) for name, step in steps.items()}, blocks)
        tw = engines["tensorwire"].rpc
        apart = max(
            [max_difference("stage1")]
            + [tw.rpc_sync(w, max_difference, args=(s,)) for w, s in (("worker1", "stage2"), ("worker2", "stage3"))]
        )
        if apart > TOLERANCE:
            raise AssertionError(
                f"after the same steps the engines' pipeline parameters differ by {apart:g} (more than {TOLERANCE:g})"
            )
        record("pipeline", {name: [s] for name, s in samples.items()}, {"max_difference": apart})
    return records


# -- the command ----------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """Runs the suite as ``args`` (from :func:`add_parser`'s parser) say; 1 if a run failed."""
    figures = chosen_figures(args, AUTOGRAD_FIGURES)
    sizes = dict(AUTOGRAD_QUICK if args.quick else AUTOGRAD_DEFAULTS)
    for key in sizes:
        given = getattr(args, key)
        if given is not None:
            if given < 1:
                raise SystemExit(f"--{key} must be at least 1")
            sizes[key] = given
    labels = {
        "ps": "parameter server, 2 trainers",
        "pipeline": "3-stage pipeline",
    }
    return run_speedup_suite(
        args,
        suite="autograd",
        title="a distributed training step, tensorwire vs torch.distributed.rpc + autograd + optim (TensorPipe)",
        world=3,
        rank_main=_rank_main,
        cfg={"blocks": 2 if args.quick else BLOCKS, "figures": figures, **sizes},
        labels=labels,
        targets=AUTOGRAD_TARGETS,
        extra=sizes,
    )


def add_parser(sub: Any) -> None:
    """Adds the ``autograd`` suite's subcommand to ``sub``."""
    p = sub.add_parser(
        "autograd",
        help="a distributed training step over 3 workers against torch.distributed.rpc + autograd (speedup, > 1 is better)",
    )
    add_speedup_arguments(p, AUTOGRAD_FIGURES, "all three workers to one core")
    d = AUTOGRAD_DEFAULTS
    p.add_argument("--width", type=int, help=f"every Linear layer's width (default {d['width']})")
    p.add_argument("--batch", type=int, help=f"rows of each batch (default {d['batch']})")
    p.add_argument("--layers", type=int, help=f"Linear layers of the parameter server's MLP (default {d['layers']})")
    p.add_argument("--steps", type=int, help=f"timed steps per engine and figure (default {d['steps']})")
