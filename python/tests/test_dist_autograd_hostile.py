"""A hostile worker in a distributed backward, on a world of real processes: its engine sends
back a gradient of another dtype than the tensor it was given (float64 for a float32 input).
The driver refuses it as that peer's violation (``MismatchedGradients``, checked in Rust before
any Python sees the gradient), its backward fails naming the peer and both dtypes instead of
hanging or casting, and it goes on training through an honest worker. The forged shapes and
counts are tested in Rust (``dist-autograd/tests/hostile_autograd.rs``), over every transport."""

from __future__ import annotations

import threading

import pytest
import torch

import tensorwire.rpc as rpc
from harness import run_world
from tensorwire.rpc import _autograd_engine, dist_autograd

_FORGE = {"on": False}
_finished = threading.Event()


@rpc.expose
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@rpc.expose
def start_forging() -> None:
    _FORGE["on"] = True


@rpc.expose
def wait_finished() -> None:
    # The hostile worker waits here (at the honest one) until the driver is done with both.
    assert _finished.wait(120)


@rpc.expose
def finish() -> None:
    _finished.set()


def _forging_export(honest):
    """This worker's engine, made hostile: while ``_FORGE["on"]``, every dense float32 gradient
    it exports (a tensor that does not require grad: not a result it returns) goes as
    float64."""

    def export(t):
        forged = t.layout == torch.strided and t.dtype == torch.float32 and not t.requires_grad
        if _FORGE["on"] and forged:
            return honest(t.detach().double())
        return honest(t)

    return export


def world(rank: int, world_size: int) -> None:
    _autograd_engine.export_tensor = _forging_export(_autograd_engine.export_tensor)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        x = torch.rand(3, 3, requires_grad=True)
        # Honest first: the same call's gradient comes back as float32.
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [rpc.rpc_sync("worker1", double, args=(x,)).sum()])
            assert torch.equal(dist_autograd.get_gradients(cid)[x], torch.full((3, 3), 2.0))
        rpc.rpc_sync("worker1", start_forging)
        with dist_autograd.context() as cid:
            y = rpc.rpc_sync("worker1", double, args=(x,))
            with pytest.raises(RuntimeError) as raised:
                dist_autograd.backward(cid, [y.sum()])
        message = str(raised.value)
        assert "F64" in message and "F32" in message, message
        assert "worker1" in message or "worker 1" in message, message
        # The driver goes on through the honest worker.
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [rpc.rpc_sync("worker2", double, args=(x,)).sum()])
            grads = dist_autograd.get_gradients(cid)
            assert grads[x].dtype == torch.float32
            assert torch.equal(grads[x], torch.full((3, 3), 2.0))
        # worker2 ends once it has this: its answer may be cut by its shutdown.
        try:
            rpc.rpc_sync("worker2", finish)
        except RuntimeError as e:
            assert "worker 2" in str(e) or "worker2" in str(e), e
    elif rank == 1:
        # Held until the driver is done: the answer, or worker2's shutdown failing the call.
        try:
            rpc.rpc_sync("worker2", wait_finished, timeout=0)
        except RuntimeError as e:
            assert "worker 2" in str(e) or "worker2" in str(e), e
    else:
        assert _finished.wait(120)
    rpc.shutdown(graceful=False)


def test_a_gradient_of_another_dtype_is_the_peers_violation():
    run_world(world, 3)
