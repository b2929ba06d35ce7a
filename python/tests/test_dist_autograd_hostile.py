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


def test_flat_payloads_round_trip_and_forged_ones_are_refused():
    # A call in a context whose arguments are tracked tensors and scalars, and a result that is
    # one tracked tensor, travel without a pickled skeleton (_serialize.dumps_flat); what a
    # peer forges in that form is refused, naming it, before anything runs.
    import pickle

    from tensorwire.rpc import _serialize
    from tensorwire.rpc._exposed import RefusedError

    h = torch.rand(3, requires_grad=True)
    payload, tensors = _serialize.dumps_flat((("engine", "stage2", h, 1, 2.5, None, True), {}))
    assert payload[:1] == b"\x00" and tensors == [h]
    args, kwargs = _serialize.loads(payload, tensors, [], trusted=False, origin="worker1")
    assert args == ("engine", "stage2", h, 1, 2.5, None, True) and args[2] is h and kwargs == {}
    payload, tensors = _serialize.dumps_flat(h)
    assert payload == b"\x00T" and _serialize.loads(payload, tensors, trusted=False, origin="w") is h
    # Not flat: a tensor twice, one that does not require grad, keyword arguments, a list.
    for value in (((h, h), {}), ((torch.rand(2),), {}), ((h,), {"a": 1}), (([1],), {}), torch.rand(2)):
        assert _serialize.dumps_flat(value) is None
    # Every pickle of tensorwire's starts with PROTO (0x80), never with the flat marker.
    assert _serialize.dumps(((h.detach(),), {}))[0][:1] == b"\x80"
    forged = [
        (b"\x00T", [h, h]),  # one tensor claimed, two came
        (b"\x00Tx", [h]),
        (b"\x00X", []),
        (b"\x00C" + pickle.dumps(((), (1,))), [h]),  # a slot past the end
        (b"\x00C" + pickle.dumps(((), (0, 0))), [h, h]),  # slots not increasing
        (b"\x00C" + pickle.dumps(((), (0,))), [bytearray(4)]),  # an untracked buffer
        (b"\x00C" + pickle.dumps(((RefusedError,), ())), []),  # a global
        (b"\x00C" + pickle.dumps(((), ("0",))), [h]),
        (b"\x00C" + pickle.dumps(([1], ())), []),
        (b"\x00C" + pickle.dumps((([1],), ())), []),  # a container among the scalars
        (b"\x00C\x80", []),  # a truncated pickle
    ]
    for payload, buffers in forged:
        with pytest.raises(RefusedError, match="worker7"):
            _serialize.loads(payload, buffers, [], trusted=False, origin="worker7")
    with pytest.raises(RefusedError, match="worker7"):
        _serialize.loads(b"\x00T", [h], ["an rref"], trusted=False, origin="worker7")
