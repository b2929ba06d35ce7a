"""What PyTorch's RPC test files get from their fixtures (``RpcAgentTestFixture``, ``dist_init``,
``worker_name``), for tests ported from ``torch/testing/_internal/distributed/rpc/`` to run
against ``tensorwire.rpc``, and the world that runs them.

PyTorch starts a new world of processes for every test. Here a :class:`World` of four
long-lived worker processes runs one test body after another, on every rank at once (as
PyTorch's ``MultiProcessTestCase`` does): a ``@dist_init`` test finds RPC initialized (the
group is started once, and again only after a test left it shut down); a
``@dist_init(setup_rpc=False)`` test finds it shut down and starts it itself with
``self.init_method`` (a fresh ``file://`` rendezvous per start). A test's ``clean_shutdown`` is
replaced by the controller's barrier: the next test starts once every rank reported; a
``@dist_init(clean_shutdown=False)`` test's ranks let go of their agent at once when the body
returns (``rpc.shutdown(graceful=False)``, as PyTorch's ``dist_init`` does), and the next test
meets in a new group. A body that ends its process with ``sys.exit(0)`` (which PyTorch's
``MultiProcessTestCase`` counts as a pass) ends this one too, and the world starts new
processes for the next test.

``initialize_pg`` (PyTorch's ``dist_utils.initialize_pg``: a gloo process group for
``dist.barrier()``) starts a group over a ``file://`` store of its own
(``self.file_init_method``) that the processes keep for the tests that follow, until a test
fails with one (its ranks may have left a collective out of step): then every rank destroys
it, and the next ``initialize_pg`` meets over a new store. A test that starts the group
itself (``dist.init_process_group``) is run with ``World.run(..., fresh_pg=True)``: the kept
group is destroyed before it, as PyTorch's new processes have none.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import io
import os
import re
import sys
import tempfile
import time
import traceback
import unittest
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import tensorwire.rpc as rpc
from harness import process_context

#: PyTorch's fixture's world size.
WORLD_SIZE = 4
#: How long one test body may run on all ranks before the world is declared hung and restarted.
TEST_DEADLINE_S = float(os.environ.get("TENSORWIRE_TEST_DEADLINE", "90"))


def worker_name(rank: int) -> str:
    """PyTorch's ``dist_utils.worker_name``."""
    return f"worker{rank}"


def dist_init(
    old_test_method: Optional[Callable] = None,
    setup_rpc: bool = True,
    clean_shutdown: bool = True,
    faulty_messages: Any = None,
    messages_to_delay: Any = None,
):
    """PyTorch's ``dist_init`` decorator, as a marker: the world (see :class:`World`) reads
    ``setup_rpc`` to know whether the body expects RPC up or down when it starts."""
    if old_test_method is None:
        return functools.partial(
            dist_init, setup_rpc=setup_rpc, clean_shutdown=clean_shutdown
        )

    @functools.wraps(old_test_method)
    def new_test_method(self, *args, **kwargs):
        return old_test_method(self, *args, **kwargs)

    new_test_method.setup_rpc = setup_rpc  # type: ignore[attr-defined]
    new_test_method.clean_shutdown = clean_shutdown  # type: ignore[attr-defined]
    return new_test_method


#: The environment variable that names the world's process group store (see ``initialize_pg``).
PG_INIT_ENV = "TENSORWIRE_PORTED_PG_INIT"
#: How long a collective of that group (``dist.barrier()``) waits for the other ranks.
PG_TIMEOUT_S = float(os.environ.get("TENSORWIRE_PORTED_PG_TIMEOUT", "60"))


def initialize_pg(init_method: str, rank: int, world_size: int) -> None:
    """PyTorch's ``dist_utils.initialize_pg``: a gloo process group for ``dist.barrier()``,
    started unless this process has one (kept for the tests that follow, until a test fails
    with it: see the module's docstring)."""
    if not dist.is_initialized():
        dist.init_process_group(
            backend="gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )


@rpc.expose
def noop() -> None:
    """PyTorch's ``dist_utils.noop``: what ``wait_until_node_failure`` calls."""


def wait_until_node_failure(rank: int, expected_error_regex: str = ".*") -> str:
    """PyTorch's ``dist_utils.wait_until_node_failure``: calls ``worker{rank}`` until a call
    fails with an error matching ``expected_error_regex``, and returns its message. Bounded by
    the world's deadline (a test that hangs here fails and restarts the world)."""
    while True:
        try:
            rpc.rpc_sync(f"worker{rank}", noop, args=())
            time.sleep(0.1)
        except Exception as e:
            if re.search(pattern=expected_error_regex, string=str(e)):
                return str(e)


def _contains_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (list, tuple)):
        return any(_contains_tensor(v) for v in x)
    if isinstance(x, dict):
        return any(_contains_tensor(v) for v in x.values())
    return False


class RpcAgentTestFixture(unittest.TestCase):
    """The fixture's properties PyTorch's RPC tests use, for one rank of a :class:`World`,
    and ``assertEqual`` comparing tensors as torch's ``TestCase`` does."""

    world_size = WORLD_SIZE
    rpc_backend = rpc.BackendType.TENSORPIPE

    def __init__(self, rank: int, init_method: str):
        super().__init__("runTest")
        self.rank = rank
        self.worker_id = rank
        self._init_method = init_method

    def runTest(self) -> None:  # unittest wants one; the world calls test methods by name
        pass

    @property
    def init_method(self) -> str:
        return self._init_method

    @property
    def file_init_method(self) -> str:
        """The store of this world's process group (``initialize_pg``); PyTorch's tests pass
        it nowhere else."""
        return os.environ[PG_INIT_ENV]

    @property
    def rpc_backend_options(self) -> rpc.TensorPipeRpcBackendOptions:
        return rpc.TensorPipeRpcBackendOptions(init_method=self.init_method, rpc_timeout=60)

    def get_shutdown_error_regex(self) -> str:
        return "|".join(
            ("unreachable", "shut down", "lost", "closed by the peer", "not running", "Connection")
        )

    def get_timeout_error_regex(self) -> str:
        return "timed out"

    def assertEqual(self, first: Any, second: Any, msg: Any = None, **kwargs: Any) -> None:  # noqa: N802
        if _contains_tensor(first) or _contains_tensor(second):
            if isinstance(first, torch.Tensor) and not isinstance(second, torch.Tensor):
                second = torch.as_tensor(second, dtype=first.dtype)
            if isinstance(second, torch.Tensor) and not isinstance(first, torch.Tensor):
                first = torch.as_tensor(first, dtype=second.dtype)
            torch.testing.assert_close(first, second, check_dtype=False, msg=msg)
        else:
            super().assertEqual(first, second, msg)

    def assertNotEqual(self, first: Any, second: Any, msg: Any = None) -> None:  # noqa: N802
        try:
            self.assertEqual(first, second)
        except AssertionError:
            return
        raise self.failureException(msg or f"{first!r} == {second!r}")


# --- the world ---------------------------------------------------------------------------------


def _rpc_up() -> bool:
    return rpc._agent is not None


def _worker(rank: int, conn: Any, module_name: str, env: dict) -> None:
    """One rank: runs the test bodies it is sent, reports, and keeps RPC as the tests need."""
    os.environ.update(env)
    import importlib

    module = importlib.import_module(module_name)
    cls = module.RpcTest
    while True:
        msg = conn.recv()
        if msg is None:
            break
        command, name, init_method, pg_init = msg
        os.environ[PG_INIT_ENV] = pg_init
        if command == "reset_pg":
            # A test failed with the process group in use: its collectives may be out of
            # step across ranks, so the next initialize_pg starts a new one.
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
                conn.send(("ok", "", _rpc_up()))
            except BaseException:
                conn.send(("failed", traceback.format_exc(), _rpc_up()))
            continue
        if command == "reset":
            try:
                if _rpc_up():
                    rpc.shutdown(graceful=False)
                conn.send(("ok", "", False))
            except BaseException:
                conn.send(("failed", traceback.format_exc(), _rpc_up()))
            continue
        if command == "fresh":
            # The module state PyTorch's new processes start with, set on every rank before
            # any rank starts the body (a body calls the other ranks at once, and a rank
            # that set its state afterwards would wipe what such a call recorded).
            try:
                module._fresh_state()
                conn.send(("ok", "", _rpc_up()))
            except BaseException:
                conn.send(("failed", traceback.format_exc(), _rpc_up()))
            continue
        test = cls(rank, init_method)
        method = getattr(test, name)
        try:
            # A test without @dist_init starts (or not) RPC itself.
            wants_rpc = getattr(method, "setup_rpc", False)
            if wants_rpc and not _rpc_up():
                rpc.init_rpc(
                    worker_name(rank),
                    backend=test.rpc_backend,
                    rank=rank,
                    world_size=test.world_size,
                    rpc_backend_options=test.rpc_backend_options,
                )
            elif not wants_rpc and _rpc_up():
                rpc.shutdown()
            elif wants_rpc:
                # What a fresh group would have (a test may have changed it).
                rpc._set_rpc_timeout(test.rpc_backend_options.rpc_timeout)
            # A body that hangs prints every thread's Python stack before the world is
            # restarted under it (pytest shows it with the failure).
            faulthandler.dump_traceback_later(max(TEST_DEADLINE_S - 5, 1), exit=False)
            try:
                method()
            finally:
                faulthandler.cancel_dump_traceback_later()
                if not getattr(method, "clean_shutdown", True) and _rpc_up():
                    # PyTorch's dist_init(clean_shutdown=False): no barrier with the others.
                    rpc.shutdown(graceful=False)
            conn.send(("ok", "", _rpc_up(), dist.is_initialized()))
        except SystemExit as e:
            if e.code not in (0, None):
                conn.send(("failed", traceback.format_exc(), _rpc_up(), dist.is_initialized()))
                continue
            # The body ended its process with exit code 0, as PyTorch's tests may (its
            # MultiProcessTestCase passes a rank that exits 0): this one ends too, and the
            # world starts new processes for the next test.
            conn.send(("exited", "", _rpc_up(), dist.is_initialized()))
            break
        except BaseException:
            conn.send(("failed", traceback.format_exc(), _rpc_up(), dist.is_initialized()))
    if _rpc_up():
        rpc.shutdown(graceful=False)


class World:
    """Four worker processes that run PyTorch's test bodies one after another (see the
    module's docstring). A test that leaves any rank without RPC makes the next test start a
    new group; a test that hangs past :data:`TEST_DEADLINE_S` fails and restarts the world."""

    def __init__(self, module_name: str):
        self.module_name = module_name
        self.dir = tempfile.mkdtemp(prefix="tw-ported-")
        self.generation = 0
        self.starts = 0
        self.pg_generation = 0
        self.fresh_group = True
        self._start()

    def _start(self) -> None:
        ctx = process_context()
        self.starts += 1
        env = {
            "TENSORWIRE_SECRET": os.environ.get("TENSORWIRE_SECRET", "tensorwire-test-secret"),
            "OMP_NUM_THREADS": "1",
        }
        self.conns = []
        self.procs = []
        for rank in range(WORLD_SIZE):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, there, self.module_name, env), daemon=True)
            p.start()
            self.conns.append(here)
            self.procs.append(p)
        self.fresh_group = True

    def _pg_init(self) -> str:
        """The store of the process group (``initialize_pg``): a fresh one for each set of
        processes and after a failed test that had one."""
        return f"file://{self.dir}/pg-{self.starts}-{self.pg_generation}"

    def _init_method(self) -> str:
        if self.fresh_group:
            self.generation += 1
            self.fresh_group = False
        return f"file://{self.dir}/init-{self.generation}"

    def _send_all(self, msg: tuple) -> list[tuple]:
        for c in self.conns:
            c.send(msg)
        replies = []
        for rank, c in enumerate(self.conns):
            if not c.poll(TEST_DEADLINE_S):
                raise TimeoutError(f"rank {rank} did not finish within {TEST_DEADLINE_S} s")
            replies.append(c.recv())
        return replies

    def run(self, name: str, setup_rpc: bool, fresh_pg: bool = False) -> None:
        """Runs test ``name`` on every rank; raises ``AssertionError`` with the failing
        ranks' tracebacks. ``fresh_pg``: the body starts the default process group itself
        (``dist.init_process_group``), as PyTorch's new processes can: every rank destroys the
        one it kept first, and ``file_init_method`` names a new store."""
        if fresh_pg:
            self.pg_generation += 1
            try:
                self._send_all(("reset_pg", "", "", self._pg_init()))
            except (TimeoutError, EOFError, OSError):
                self.restart()
        if not setup_rpc:
            # The body starts its own group: it needs a fresh rendezvous.
            self.fresh_group = True
        init_method = self._init_method()
        try:
            fresh = self._send_all(("fresh", name, init_method, self._pg_init()))
            bad = [f"rank {r}:\n{trace}" for r, (status, trace, _) in enumerate(fresh) if status != "ok"]
            if bad:
                raise AssertionError(f"{name}: a rank failed to set its fresh state:\n" + "\n".join(bad))
            replies = self._send_all(("run", name, init_method, self._pg_init()))
        except (TimeoutError, EOFError, OSError) as e:
            self.restart()
            raise AssertionError(f"{name}: {e}; the world was restarted") from None
        failures = [
            f"rank {r}:\n{trace}"
            for r, (status, trace, _, _) in enumerate(replies)
            if status not in ("ok", "exited")
        ]
        if any(status == "exited" for status, _, _, _ in replies):
            # Some rank's body ended its process (``sys.exit(0)``): new processes, as PyTorch
            # has for every test.
            self.restart()
            if failures:
                raise AssertionError(f"{name} failed:\n" + "\n".join(failures))
            return
        if not all(up for _, _, up, _ in replies):
            # Some rank ended without RPC: every rank lets go of its agent, and the next test
            # meets in a new group.
            try:
                self._send_all(("reset", "", "", self._pg_init()))
            except (TimeoutError, EOFError, OSError):
                self.restart()
            self.fresh_group = True
        if failures and any(pg for _, _, _, pg in replies):
            # Some rank may have left a collective the others were in: a new process group.
            self.pg_generation += 1
            try:
                self._send_all(("reset_pg", "", "", self._pg_init()))
            except (TimeoutError, EOFError, OSError):
                self.restart()
        if failures:
            raise AssertionError(f"{name} failed:\n" + "\n".join(failures))

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)



@contextlib.contextmanager
def TemporaryFileName(*args: Any, **kwargs: Any):  # noqa: N802 - PyTorch's name
    """PyTorch's ``common_utils.TemporaryFileName`` (whose module needs ``expecttest``)."""
    with tempfile.NamedTemporaryFile(*args, **kwargs) as f:
        yield f.name


@contextlib.contextmanager
def captured_output():
    """PyTorch's ``common_distributed.captured_output``: this process's ``sys.stdout`` and
    ``sys.stderr`` as ``StringIO``\\ s while the block runs."""
    new_out, new_err = io.StringIO(), io.StringIO()
    old_out, old_err = sys.stdout, sys.stderr
    try:
        sys.stdout, sys.stderr = new_out, new_err
        yield sys.stdout, sys.stderr
    finally:
        sys.stdout, sys.stderr = old_out, old_err


def skip_but_pass_in_sandcastle_if(condition: bool, reason: str) -> Callable:
    """PyTorch's ``common_utils.skip_but_pass_in_sandcastle_if`` (outside Meta's sandcastle:
    ``unittest.skipIf``)."""
    return unittest.skipIf(condition, reason)
