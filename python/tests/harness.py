"""Runs a function on every rank of a world of real processes (torch.multiprocessing, from a
fork server that imported torch once: see ``process_context``)."""

from __future__ import annotations

import faulthandler
import io
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from typing import Callable

import torch.multiprocessing as mp

# How long a whole world may take before the test kills it and fails (not a timing check: a
# bound so that a hang fails instead of stalling CI).
WORLD_DEADLINE_S = float(os.environ.get("TENSORWIRE_TEST_DEADLINE", "240"))


_CONTEXT = None


def process_context():
    """The multiprocessing context every test world starts its ranks from: a fork server that
    imported torch once. Spawned ranks (a fresh interpreter each) paid about 2.5 s of CPU each to
    import torch and about 1 s to tear it down at exit, which was most of the Python suite's time
    on CI's two cores; a rank forked from the server starts with torch imported (tensorwire is
    imported after the fork, in the rank, as under spawn) and ends with ``os._exit`` once its
    function returns, so Python's ``atexit`` handlers do not run in it: a test shuts down what it
    started. (Users' processes are fresh interpreters; ``test_readme``, ``test_rpc_torchrun`` and
    the benchmark tests run those.)"""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch"])
    return _CONTEXT


def forged_call(pid) -> bytes:
    """The pickled ``(args, kwargs)`` of a call whose one argument is the persistent id ``pid``,
    made by hand as a hostile peer would (for ``tensorwire.rpc._call_raw``)."""

    class Forger(pickle.Pickler):
        def persistent_id(self, obj):
            return pid if obj == "t" else None

    buf = io.BytesIO()
    Forger(buf, protocol=5).dump((("t",), {}))
    return buf.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, env: dict, args: tuple, errors: str) -> None:
    # The rank's stderr (the native side's warnings among it) goes to a file of its own, shown
    # with the failure if the rank fails or hangs.
    log = os.open(f"{errors}.log.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    # A rank that hangs writes every thread's Python stack to a file shortly before the world's
    # deadline kills it; the failure shows it (a hang under CI's load leaves nothing else).
    stacks = open(f"{errors}.{rank}.stacks", "w")
    faulthandler.dump_traceback_later(max(WORLD_DEADLINE_S - 5, 1), exit=False, file=stacks)
    try:
        fn(rank, world, *args)
    except BaseException:
        with open(f"{errors}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)


def run_world(
    fn: Callable, world: int, *args, env: dict | None = None, expect_fail: frozenset[int] | set[int] = frozenset()
) -> dict[int, int]:
    """Runs ``fn(rank, world, *args)`` in ``world`` spawned processes, on a fresh port once
    more if the port picked in advance was taken before rank 0's store could listen on it
    (EADDRINUSE: nothing ran). See ``_run_world``."""
    for attempt in range(3):
        try:
            return _run_world(fn, world, *args, env=env, expect_fail=expect_fail)
        except AssertionError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_world(
    fn: Callable, world: int, *args, env: dict | None = None, expect_fail: frozenset[int] | set[int] = frozenset()
) -> dict[int, int]:
    """Runs ``fn(rank, world, *args)`` in ``world`` spawned processes. Fails the test with the
    rank's traceback if a rank not in ``expect_fail`` fails, or if the world outlives its
    deadline. Unlike ``torch.multiprocessing.spawn``, one rank's death does not kill the others
    (the failure tests need the survivors to report). Returns each rank's exit code."""
    port = free_port()
    errors = tempfile.mktemp(prefix="tw-errors-")
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "TENSORWIRE_SECRET": os.environ.get("TENSORWIRE_SECRET", "tensorwire-test-secret"),
        "OMP_NUM_THREADS": "1",
    }
    base.update(env or {})
    ctx = process_context()
    procs = [ctx.Process(target=_entry, args=(r, fn, world, base, args, errors), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + WORLD_DEADLINE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    problems = []
    for r, p in enumerate(procs):
        if r in expect_fail or r in hung:
            continue
        if p.exitcode != 0:
            trace = _read(f"{errors}.{r}") or "(no traceback: the process died)"
            problems.append(f"rank {r} exited with {p.exitcode}:\n{trace}")
    if hung:
        problems.append(f"rank(s) {hung} did not finish within {WORLD_DEADLINE_S} s")
        for r in hung:
            stacks = _read(f"{errors}.{r}.stacks") or "(none written)"
            problems.append(f"rank {r}'s threads shortly before the deadline:\n{stacks}")
    if problems:
        for r in range(world):
            problems.append(f"rank {r}'s stderr (the last 40 lines):\n{_tail(f'{errors}.log.{r}', 40)}")
    keep = os.environ.get("TENSORWIRE_TEST_KEEP_LOGS")  # a folder: every rank's stderr is kept there
    for r in range(world):
        if keep:
            try:
                os.replace(f"{errors}.log.{r}", os.path.join(keep, f"{os.path.basename(errors)}.{fn.__name__}.{r}.log"))
            except OSError:
                pass
        for path in (f"{errors}.{r}", f"{errors}.{r}.stacks", f"{errors}.log.{r}"):
            try:
                os.unlink(path)
            except OSError:
                pass
    if problems:
        raise AssertionError("\n".join(problems))
    return {r: p.exitcode for r, p in enumerate(procs)}


def _read(path: str) -> str:
    """The file's text ("" if it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(path: str, lines: int) -> str:
    if not os.path.exists(path):
        return "(none)"
    return "".join(_read(path).splitlines(keepends=True)[-lines:]) or "(empty)"
