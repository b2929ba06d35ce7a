"""Runs a function on every rank of a world of real processes (torch.multiprocessing, spawn)."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from typing import Callable

import torch.multiprocessing as mp

# How long a whole world may take before the test kills it and fails (not a timing check: a
# bound so that a hang fails instead of stalling CI).
WORLD_DEADLINE_S = float(os.environ.get("TENSORWIRE_TEST_DEADLINE", "240"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, env: dict, args: tuple) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    fn(rank, world, *args)


def run_world(fn: Callable, world: int, *args, env: dict | None = None, expect_fail: set[int] = frozenset()) -> dict[int, int]:
    """Runs ``fn(rank, world, *args)`` in ``world`` processes; fails the test if any rank not in
    ``expect_fail`` fails or the world outlives its deadline. Returns each rank's exit code."""
    port = free_port()
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "TENSORWIRE_SECRET": os.environ.get("TENSORWIRE_SECRET", "tensorwire-test-secret"),
        "TENSORWIRE_TEST_FILE": tempfile.mktemp(prefix="tw-store-"),
        "OMP_NUM_THREADS": "1",
    }
    base.update(env or {})
    ctx = mp.start_processes(_entry, args=(fn, world, base, args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + WORLD_DEADLINE_S
    failure = None
    while True:
        try:
            if ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                break
        except mp.ProcessRaisedException as e:
            if e.error_index not in expect_fail:
                failure = e
                break
        except mp.ProcessExitedException as e:
            if e.error_index not in expect_fail:
                failure = e
                break
        if time.monotonic() > deadline:
            failure = AssertionError(f"the world of {world} did not finish within {WORLD_DEADLINE_S} s")
            break
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join(5)
    if failure is not None:
        raise failure
    return {i: p.exitcode for i, p in enumerate(ctx.processes)}
