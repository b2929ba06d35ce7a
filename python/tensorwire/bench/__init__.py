"""Measures tensorwire against PyTorch's own engines, in the same processes and the same run, and
reports ratios (absolute times on a shared machine are noise):

- ``python -m tensorwire.bench c10d``: the ``"tensorwire"`` process-group backend against gloo
  (:mod:`tensorwire.bench.c10d`);
- ``python -m tensorwire.bench rpc``: ``tensorwire.rpc`` against ``torch.distributed.rpc``'s
  TensorPipe agent (:mod:`tensorwire.bench.rpc`);
- ``python -m tensorwire.bench autograd``: a distributed training step (forward, distributed
  backward, ``DistributedOptimizer`` step) of a model split over three workers, tensorwire against
  ``torch.distributed.rpc`` with ``torch.distributed.autograd`` (:mod:`tensorwire.bench.autograd`).

Each suite's module docstring says what it times and how; ``--help`` lists its settings.
"""

from __future__ import annotations

import argparse
from typing import Optional

from . import autograd, c10d, rpc

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> int:
    """Parses ``argv`` (the command line when None), runs the suite it names, and returns the exit
    status (1 if a world or a run failed)."""
    parser = argparse.ArgumentParser(
        prog="python -m tensorwire.bench",
        description="Measures tensorwire against a baseline in the same run and reports ratios.",
    )
    sub = parser.add_subparsers(dest="suite", required=True)
    suites = {"c10d": c10d, "rpc": rpc, "autograd": autograd}
    for module in suites.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    return suites[args.suite].main(args)
