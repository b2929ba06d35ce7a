"""tensorwire.rpc with real processes: calls of exposed functions with tensors and kwargs,
futures, remote exceptions, and init/shutdown/get_worker_info."""

from __future__ import annotations

import io
import sys
import threading
import warnings

import pytest
import torch

import tensorwire.rpc as rpc
from harness import run_world


@rpc.expose
def scale(t: torch.Tensor, factor: float = 2.0, *, bias: float = 0.0) -> torch.Tensor:
    return t * factor + bias


@rpc.expose
def pair(a: torch.Tensor, b: torch.Tensor) -> dict:
    # Results with several tensors, one of them twice, inside containers.
    s = a + b
    return {"sum": s, "again": [s, s], "diff": (a - b,), "n": a.numel()}


@rpc.expose
def echo(*values):
    return values


@rpc.expose
def whoami() -> str:
    return rpc.get_worker_info().name


@rpc.expose
def fails(message: str) -> None:
    raise ValueError(message)


@rpc.expose
class Oops(Exception):
    """An exception type exposed on every worker: raised with its type at the caller."""


@rpc.expose
def fails_exposed() -> None:
    raise Oops("exposed failure")


@rpc.expose
class NeedsCode(Exception):
    """An exposed exception type that cannot be built from a message alone."""

    def __init__(self, code: int, message: str):
        self.code = code
        super().__init__(message)


@rpc.expose
def fails_needs_code() -> None:
    raise NeedsCode(7, "coded failure")


class Private(Exception):
    """Not exposed: the caller gets a RuntimeError naming it."""


@rpc.expose
def fails_private() -> None:
    raise Private("private failure")


@rpc.expose
def relay(to: str, x: torch.Tensor) -> torch.Tensor:
    # A nested call from a function being served.
    return rpc.rpc_sync(to, scale, args=(x,), kwargs={"factor": 10.0}) + 1


_released = threading.Event()


@rpc.expose
def blocks() -> str:
    # Waits (without the GIL) until the caller releases it: no sleep, an event.
    assert _released.wait(120)
    return "released"


@rpc.expose
def release() -> None:
    _released.set()


def start(rank: int, world: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)


def calls(rank: int, world: int) -> None:
    start(rank, world)
    me = rpc.get_worker_info()
    assert me == rpc.WorkerInfo(f"worker{rank}", rank), me
    assert repr(me) == f"WorkerInfo(id={rank}, name=worker{rank})"
    peer = f"worker{(rank + 1) % world}"
    assert rpc.get_worker_info(peer).id == (rank + 1) % world
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank
    # Exposed functions with args and kwargs, by function, name, id and WorkerInfo.
    assert torch.equal(rpc.rpc_sync(peer, scale, args=(x,)), x * 2)
    assert torch.equal(rpc.rpc_sync(peer, scale, args=(x, 3.0), kwargs={"bias": 1.0}), x * 3 + 1)
    assert torch.equal(
        rpc.rpc_sync(rpc.get_worker_info(peer), "test_rpc.scale", args=(x,), kwargs={"factor": 0.5}),
        x * 0.5,
    )
    assert rpc.rpc_sync((rank + 1) % world, whoami) == peer
    # torch's default operations, dtypes, a scalar, an empty and a non-contiguous tensor.
    assert torch.equal(rpc.rpc_sync(peer, torch.add, args=(torch.ones(3), 1)), torch.full((3,), 2.0))
    m = torch.randn(4, 5, dtype=torch.float64)
    # The transposed view arrives intact, bit for bit; its product is close, not equal: the
    # callee may multiply by a contiguous copy, and BLAS kernels on some CPUs (seen on an AMD
    # EPYC) round a product with a transposed operand differently.
    assert torch.equal(rpc.rpc_sync(peer, torch.add, args=(m.t(), 0)), m.t())
    torch.testing.assert_close(rpc.rpc_sync(peer, torch.matmul, args=(m, m.t())), m @ m.t())
    assert torch.equal(rpc.rpc_sync(peer, torch.ones, args=(2, 2)), torch.ones(2, 2))
    i = torch.arange(10, dtype=torch.int64)[::2]
    assert torch.equal(rpc.rpc_sync(peer, torch.mul, args=(i, 3)), i * 3)
    assert rpc.rpc_sync(peer, torch.zeros, args=(0,)).shape == (0,)
    b = torch.tensor([True, False])
    assert torch.equal(rpc.rpc_sync(peer, torch.eq, args=(b, b)), torch.tensor([True, True]))
    assert rpc.rpc_sync(peer, torch.add, args=(torch.tensor(1.5, dtype=torch.bfloat16), 1)).item() == 2.5
    # A result holding one tensor twice keeps them one tensor.
    out = rpc.rpc_sync(peer, pair, args=(x, x))
    assert torch.equal(out["sum"], 2 * x) and out["again"][0] is out["again"][1]
    assert torch.equal(out["diff"][0], torch.zeros_like(x)) and out["n"] == 6
    # Received tensors own writable memory (no "non-writable buffer" warning, writes in place).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = rpc.rpc_sync(peer, scale, args=(x,))
        got.add_(1)
    assert torch.equal(got, x * 2 + 1)
    # torch's own values pass the allow-list: sizes, dtypes, devices.
    assert rpc.rpc_sync(peer, echo, args=(x.shape, x.dtype, x.device)) == (x.shape, x.dtype, x.device)
    # A nested call from inside a served function.
    assert torch.equal(rpc.rpc_sync(peer, relay, args=(f"worker{rank}", x)), x * 10 + 1)
    rpc.shutdown()


@pytest.mark.parametrize("world", [2, 3])
def test_rpc_sync_calls_exposed_functions(world):
    run_world(calls, world)


def futures(rank: int, world: int) -> None:
    start(rank, world)
    x = torch.ones(1000)
    futs = [
        rpc.rpc_async(f"worker{(rank + k) % world}", scale, args=(x,), kwargs={"factor": float(k)})
        for k in range(1, 4 * world)
    ]
    chained = futs[0].then(lambda f: f.value().sum().item())
    results = torch.futures.wait_all(futs)
    for k, r in zip(range(1, 4 * world), results):
        assert torch.equal(r, x * k)
    assert chained.wait() == 1000.0
    assert futs[-1].done() and torch.equal(futs[-1].value(), x * (4 * world - 1))
    # A failed call's future raises from wait and from wait_all.
    bad = rpc.rpc_async(f"worker{(rank + 1) % world}", fails, args=("in a future",))
    with pytest.raises(ValueError, match="in a future"):
        bad.wait()
    with pytest.raises(ValueError):
        torch.futures.wait_all([rpc.rpc_async(f"worker{(rank + 1) % world}", torch.ones, args=(1,)), bad])
    rpc.shutdown()


@pytest.mark.parametrize("world", [2, 3])
def test_rpc_async_futures_then_and_wait_all(world):
    run_world(futures, world)


def exceptions(rank: int, world: int) -> None:
    start(rank, world)
    peer = f"worker{1 - rank}"
    with pytest.raises(ValueError) as raised:
        rpc.rpc_sync(peer, fails, args=("boom",))
    text = str(raised.value)
    # Where it happened, what, and the remote traceback's text.
    assert f"On WorkerInfo(id={1 - rank}, name={peer})" in text, text
    assert "boom" in text and "Traceback (most recent call last)" in text, text
    assert 'in fails\n    raise ValueError(message)' in text, text
    with pytest.raises(Oops, match="exposed failure"):
        rpc.rpc_sync(peer, fails_exposed)
    with pytest.raises(RuntimeError, match="test_rpc.Private: private failure") as raised:
        rpc.rpc_sync(peer, fails_private)
    assert type(raised.value) is RuntimeError
    # A type that cannot be rebuilt from the message: a RuntimeError in PyTorch's words.
    with pytest.raises(RuntimeError, match="Failed to create original exception type") as raised:
        rpc.rpc_sync(peer, fails_needs_code)
    text = str(raised.value)
    assert "Original exception on remote side was On WorkerInfo" in text, text
    assert "test_rpc.NeedsCode: coded failure" in text, text
    # A call that outlives its timeout fails with a RuntimeError saying so; the function goes
    # on, and finishes once released.
    late = rpc.rpc_async(peer, blocks, timeout=0.5)
    with pytest.raises(RuntimeError, match="timed out"):
        late.wait()
    rpc.rpc_sync(peer, release)
    assert rpc.rpc_sync(peer, blocks) == "released"
    # A worker nobody knows, a lambda.
    with pytest.raises(RuntimeError, match="unknown worker"):
        rpc.rpc_sync("nobody", scale, args=(torch.ones(1),))
    with pytest.raises(ValueError, match="module level"):
        rpc.rpc_sync(peer, lambda: 1)
    rpc.shutdown()
    with pytest.raises(RuntimeError, match="not been initialized"):
        rpc.rpc_sync(peer, whoami)


def test_remote_exceptions_keep_their_type_and_traceback():
    run_world(exceptions, 2)


_logged = threading.Event()


@rpc.expose
def logged() -> None:
    _logged.set()


def callee_logs(rank: int, world: int) -> None:
    if rank == 0:
        # Captured before the group meets, so before any call arrives.
        err, old = io.StringIO(), sys.stderr
        sys.stderr = err
        try:
            start(rank, world)
            assert _logged.wait(60)
        finally:
            sys.stderr = old
        text = err.getvalue()
        assert "On WorkerInfo(id=0, name=worker0):\nValueError('logged here')" in text, text
        assert "raise ValueError(message)" in text, text
    else:
        start(rank, world)
        with pytest.raises(ValueError, match="logged here"):
            rpc.rpc_sync("worker0", fails, args=("logged here",))
        rpc.rpc_sync("worker0", logged)
    rpc.shutdown()


def test_the_callee_writes_a_failing_call_to_its_stderr():
    # As PyTorch's workers do (its test_py_raise_in_user_func checks it).
    run_world(callee_logs, 2)


def init_options(rank: int, world: int, init_file: str) -> None:
    # PyTorch's own options class and a file:// rendezvous.
    from torch.distributed.rpc import TensorPipeRpcBackendOptions

    options = TensorPipeRpcBackendOptions(init_method=f"file://{init_file}", rpc_timeout=20)
    rpc.init_rpc(f"w{rank}", backend=rpc.BackendType.TENSORPIPE, rank=rank, world_size=world,
                 rpc_backend_options=options)
    assert rpc.rpc_sync(f"w{(rank + 1) % world}", whoami) == f"w{(rank + 1) % world}"
    rpc.shutdown(graceful=True, timeout=30)


def test_init_with_pytorchs_options_and_a_file_rendezvous(tmp_path):
    run_world(init_options, 2, str(tmp_path / "init"))


_kept: list[torch.Tensor] = []


@rpc.expose
def keep_and_write(t: torch.Tensor) -> torch.Tensor:
    # A received tensor (large: its bytes arrive in the sender's shared-memory slab on one
    # host) is written in place, kept, and sent back.
    t.add_(1)
    _kept.append(t)
    return t


@rpc.expose
def kept_values() -> list[tuple[int, int, int]]:
    return [(int(k.min()), int(k.max()), k.numel()) for k in _kept]


@rpc.expose
def forget_kept() -> None:
    _kept.clear()


def large_tensors(rank: int, world: int) -> None:
    start(rank, world)
    if rank == 0:
        n = 1 << 20  # 8 MiB of int64: each travels through a slab and is received in place
        for round_ in range(2):
            for i in range(4):
                x = torch.full((n,), 10 * round_ + i, dtype=torch.int64)
                got = rpc.rpc_sync("worker1", keep_and_write, args=(x,))
                # The callee's write reached neither the caller's tensor nor anything shared.
                assert torch.equal(x, torch.full((n,), 10 * round_ + i, dtype=torch.int64))
                assert torch.equal(got, x + 1)
                got.mul_(2)
                assert int(got.min()) == int(got.max()) == 2 * (10 * round_ + i + 1)
            # Every tensor the callee kept still holds its own values, though later ones
            # arrived while it held them.
            kept = rpc.rpc_sync("worker1", kept_values)
            assert kept == [(10 * round_ + i + 1, 10 * round_ + i + 1, n) for i in range(4)], kept
            rpc.rpc_sync("worker1", forget_kept)
    rpc.shutdown()


def test_large_received_tensors_are_private_to_their_receiver():
    run_world(large_tensors, 2)
