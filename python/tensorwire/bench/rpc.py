"""``rpc``: ``tensorwire.rpc`` against ``torch.distributed.rpc``'s TensorPipe agent, in the same
processes and the same run.
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
import math
import statistics
import time
from typing import Any, Callable

import torch

from ._common import (
    BLOCKS,
    WARMUP,
    abba_blocks,
    add_speedup_arguments,
    chosen_figures,
    run_both_agents,
    run_speedup_suite,
    speedup_record,
    timed,
)

RPC_FIGURES = ("rpc_sync", "rpc_async", "tensor", "remote_to_here")
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


def _rpc_rank_main(rank: int, world: int, env: dict, cfg: dict, out_path: str) -> None:
    """One of the two workers: both agents side by side in this process, rank 0 the caller."""
    import tensorwire.rpc as tw
    import torch.distributed.rpc as tp

    run_both_agents(
        rank, world, env, cfg, out_path, (rpc_noop, rpc_echo),
        lambda: _rpc_measure({"tensorwire": tw, "tensorpipe": tp}, cfg),
    )


def _rpc_measure(agents: dict[str, Any], cfg: dict) -> list[dict]:
    """Rank 0's figures, each with both agents in alternating blocks."""
    to = "worker1"
    blocks = cfg["blocks"]
    records: list[dict] = []

    def per_block(n: int) -> int:
        return max(1, math.ceil(n / blocks))

    def record(figure: str, unit: str, values: dict[str, float], n: dict[str, int], better: str) -> None:
        records.append(speedup_record(figure, unit, values, n, better, RPC_TARGETS.get(figure)))

    def block_of(fn: Callable[[], object], n: int) -> Callable[[], list[float]]:
        return lambda: timed(fn, n)

    if "rpc_sync" in cfg["figures"]:
        def sync_noop(rpc: Any) -> Callable[[], object]:
            def op() -> None:
                if rpc.rpc_sync(to, rpc_noop) is not None:
                    raise AssertionError("the no-op returned something")

            return op

        ops = {b: sync_noop(a) for b, a in agents.items()}
        for op in ops.values():
            timed(op, WARMUP * 4)
        k = per_block(cfg["calls"])
        samples = abba_blocks({b: block_of(op, k) for b, op in ops.items()}, blocks)
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
        samples = abba_blocks({b: in_flight(a, k) for b, a in agents.items()}, blocks)
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
        samples = abba_blocks({b: block_of(op, k) for b, op in ops.items()}, blocks)
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
            timed(op, WARMUP)
        k = per_block(cfg["remote_calls"])
        samples = abba_blocks({b: block_of(op, k) for b, op in ops.items()}, blocks)
        record(
            "remote_to_here",
            "us",
            {b: statistics.median(s) * 1e6 for b, s in samples.items()},
            {b: len(s) for b, s in samples.items()},
            "lower",
        )
    return records


def main(args: argparse.Namespace) -> int:
    """Runs the suite as ``args`` (from :func:`add_parser`'s parser) say; 1 if a run failed."""
    figures = chosen_figures(args, RPC_FIGURES)
    sizes = dict(RPC_QUICK if args.quick else RPC_DEFAULTS)
    for key in sizes:
        given = getattr(args, key)
        if given is not None:
            if given < 1:
                raise SystemExit(f"--{key.replace('_', '-')} must be at least 1")
            sizes[key] = given
    labels = {
        "rpc_sync": "rpc_sync p50 (no-op)",
        "rpc_async": f"rpc_async, {RPC_IN_FLIGHT} in flight",
        "tensor": f"{sizes['tensor_mib']} MiB round trip p50",
        "remote_to_here": "remote + to_here p50",
    }
    return run_speedup_suite(
        args,
        suite="rpc",
        title="tensorwire.rpc vs torch.distributed.rpc (TensorPipe)",
        world=2,
        rank_main=_rpc_rank_main,
        cfg={"blocks": 2 if args.quick else BLOCKS, "figures": figures, **sizes},
        labels=labels,
        targets=RPC_TARGETS,
        extra={"in_flight": RPC_IN_FLIGHT, **sizes},
    )


def add_parser(sub: Any) -> None:
    """Adds the ``rpc`` suite's subcommand to ``sub``."""
    rpc = sub.add_parser(
        "rpc",
        help="tensorwire.rpc against torch.distributed.rpc's TensorPipe agent (speedup, > 1 is better)",
    )
    add_speedup_arguments(rpc, RPC_FIGURES, "both workers to one core")
    rpc.add_argument("--calls", type=int, help=f"rpc_sync calls per agent (default {RPC_DEFAULTS['calls']})")
    rpc.add_argument("--async-calls", type=int, help=f"rpc_async calls per agent (default {RPC_DEFAULTS['async_calls']})")
    rpc.add_argument("--tensor-mib", type=int, help=f"the round-tripped tensor's MiB (default {RPC_DEFAULTS['tensor_mib']})")
    rpc.add_argument("--tensor-rounds", type=int, help=f"tensor round trips per agent (default {RPC_DEFAULTS['tensor_rounds']})")
    rpc.add_argument("--remote-calls", type=int, help=f"remote + to_here per agent (default {RPC_DEFAULTS['remote_calls']})")

