"""Sparse COO tensors through ``tensorwire.rpc`` and its distributed autograd, on worlds of real
processes: as call arguments and results (every shape torch gives them: coalesced or not,
hybrid, empty), their gradients summed in a context as torch's ``AccumulateGrad`` sums them
(sparse with dense), ``DistributedOptimizer`` stepping over a sparse gradient, each compared with
the same model run locally; and forged ones from a hostile peer (an index out of range, a false
coalesced claim, parts that do not fit, a packed tracked tensor or gradient whose bytes lie),
each refused with a typed error (naming the sender for call arguments; a tracked tensor's or a
gradient's refusal says what is wrong, not who sent it: the engine port's import is not told)
while the victim keeps serving. PyTorch's own
sparse dist_autograd tests are in ``test_dist_autograd_ported.py``."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import tensorwire.rpc as rpc
from harness import forged_call, run_world
from tensorwire.rpc import _autograd_engine, dist_autograd
from tensorwire.rpc.optim import DistributedOptimizer


@rpc.expose
def echo(x):
    return x


@rpc.expose
def describe(t):
    """What arrived, as plain values."""
    return (str(t.layout), t.is_coalesced(), t.requires_grad, tuple(t.shape), t._nnz())


@rpc.expose
def embedding_sum(weight, idx):
    # A sparse gradient for a dense weight.
    return F.embedding(idx, weight, sparse=True).sum()


@rpc.expose
def scaled_sum(weight):
    # A dense gradient for the same weight.
    return (weight * 3.0).sum()


@rpc.expose
def make_param():
    return torch.ones(6, 2, requires_grad=True)


@rpc.expose
def owner_embedding_sum(rref, idx):
    return F.embedding(idx, rref.local_value(), sparse=True).sum()


@rpc.expose
def value_of(rref):
    return rref.local_value().detach().clone()


_FORGE = {"on": False}


@rpc.expose
def start_forging():
    _FORGE["on"] = True


def _forged_packed(index: int) -> torch.Tensor:
    """The packed form (``_autograd_engine.pack_sparse``) of a 3x3 float32 tensor with one
    element, at row ``index``."""
    header = _autograd_engine._PACKED_HEADER.pack(b"twsp", 1, 0, 2, 0, 2, 2, 1) + (3).to_bytes(8, "little") * 2
    header += bytes(-len(header) % 8)
    return torch.cat([
        torch.frombuffer(bytearray(header), dtype=torch.uint8),
        torch.tensor([index, 0]).view(torch.uint8),
        torch.tensor([1.0]).view(torch.uint8),
    ])


def _sparse_pid(indices_at: int, indices_shape, values_at: int, values_shape, size, coalesced=False):
    return (
        "sparse_coo",
        ("tensor", indices_at, "int64", tuple(indices_shape), False),
        ("tensor", values_at, "float32", tuple(values_shape), False),
        tuple(size), coalesced, False,
    )


def arguments(rank: int, world: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 0:
        i = torch.tensor([[0, 1, 1], [2, 0, 2]])
        v = torch.tensor([3.2, 4.1, 5.3])
        cases = [
            torch.sparse_coo_tensor(i, v, (3, 3)),
            torch.sparse_coo_tensor(i, v, (3, 3)).coalesce(),
            torch.sparse_coo_tensor(i, v.double(), (3, 3), requires_grad=True),
            torch.sparse_coo_tensor(i[:1], torch.rand(3, 4), (3, 4)),  # hybrid: a dense dimension
            torch.sparse_coo_tensor(torch.empty(2, 0, dtype=torch.long), torch.empty(0), (3, 3)),
            torch.sparse_coo_tensor(torch.tensor([[0, 0, 2]]), torch.tensor([1, 2, 3]), (4,)),  # int64 values
        ]
        for t in cases:
            back = rpc.rpc_sync("worker1", echo, args=(t,))
            assert back.layout == torch.sparse_coo and back.dtype == t.dtype
            assert back.is_coalesced() == t.is_coalesced()
            assert back.requires_grad == t.requires_grad
            torch.testing.assert_close(back.detach().to_dense(), t.detach().to_dense())
            assert rpc.rpc_sync("worker1", describe, args=(t,)) == (
                "torch.sparse_coo", t.is_coalesced(), t.requires_grad, tuple(t.shape), t._nnz(),
            )
        # One tensor twice in a call is one tensor at the callee, as a dense one is.
        a, b = rpc.rpc_sync("worker1", echo, args=((cases[0], cases[0]),))
        assert a is b
        # Inside a context the same values travel (those that require grad tracked).
        with dist_autograd.context():
            for t in cases:
                back = rpc.rpc_sync("worker1", echo, args=(t,))
                assert back.is_coalesced() == t.is_coalesced() and back.requires_grad == t.requires_grad
                torch.testing.assert_close(back.detach().to_dense(), t.detach().to_dense())
        # Layouts the wire does not carry are refused at the sender, saying which.
        with pytest.raises(ValueError, match="dense and sparse COO tensors, not torch.sparse_csr"):
            rpc.rpc_sync("worker1", echo, args=(torch.eye(3).to_sparse_csr(),))
    rpc.shutdown()


def test_sparse_arguments_and_results_arrive_as_sent():
    run_world(arguments, 2)


def accumulation(rank: int, world: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 0:
        idx = torch.tensor([0, 2, 2, 5])
        w = torch.rand(6, 2, requires_grad=True)
        # Locally: a sparse gradient and a dense one for the same leaf, summed dense.
        (F.embedding(idx, w, sparse=True).sum() + (w * 3.0).sum()).backward()
        expected = w.grad
        for order in ((embedding_sum, scaled_sum), (scaled_sum, embedding_sum)):
            with dist_autograd.context() as context_id:
                losses = [
                    rpc.rpc_sync("worker1", f, args=(w, idx) if f is embedding_sum else (w,))
                    for f in order
                ]
                dist_autograd.backward(context_id, [losses[0] + losses[1]])
                got = dist_autograd.get_gradients(context_id)[w]
                assert got.layout == torch.strided
                torch.testing.assert_close(got, expected)
        # Sparse with sparse stays sparse (two backward passes in one context).
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync("worker1", embedding_sum, args=(w, idx))
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            dist_autograd.backward(context_id, [loss])
            got = dist_autograd.get_gradients(context_id)[w]
            assert got.layout == torch.sparse_coo
            w.grad = None
            F.embedding(idx, w, sparse=True).sum().backward()
            torch.testing.assert_close(got.to_dense(), 2 * w.grad.to_dense())
    rpc.shutdown()


def test_sparse_and_dense_gradients_accumulate_as_torch_does():
    run_world(accumulation, 2)


def optimizer(rank: int, world: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 0:
        idx = torch.tensor([1, 1, 4])
        local = torch.ones(6, 2, requires_grad=True)
        F.embedding(idx, local, sparse=True).sum().backward()
        assert local.grad.layout == torch.sparse_coo
        torch.optim.SGD([local], lr=0.5).step()

        param = rpc.remote("worker1", make_param)
        opt = DistributedOptimizer(torch.optim.SGD, [param], lr=0.5)
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync("worker1", owner_embedding_sum, args=(param, idx))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        torch.testing.assert_close(rpc.rpc_sync("worker1", value_of, args=(param,)), local.detach())
    rpc.shutdown()


def test_distributed_optimizer_steps_over_a_sparse_gradient():
    run_world(optimizer, 2)


def _forging_export(honest):
    """This worker's engine, made hostile: while ``_FORGE["on"]``, every sparse tensor it
    exports (a tracked argument or result, a gradient) is packed with an index out of range."""

    def export(t):
        if _FORGE["on"] and t.layout == torch.sparse_coo:
            packed = _forged_packed(7)
            return "uint8", tuple(packed.shape), packed, t.requires_grad
        return honest(t)

    return export


def hostile(rank: int, world: int) -> None:
    _autograd_engine.export_tensor = _forging_export(_autograd_engine.export_tensor)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 0:
        victim = "worker1"
        indices = torch.tensor([[0, 7], [1, 1]])  # 7 is out of range for a 3x3 tensor
        values = torch.tensor([1.0, 2.0])
        forged = {
            "an index out of range": (_sparse_pid(0, (2, 2), 1, (2,), (3, 3)), [indices, values],
                                      "size is inconsistent with indices"),
            "a negative index": (_sparse_pid(0, (2, 2), 1, (2,), (3, 3)),
                                 [torch.tensor([[0, -1], [1, 1]]), values], "negative index"),
            "a false coalesced claim": (_sparse_pid(0, (2, 2), 1, (2,), (3, 3), coalesced=True),
                                        [torch.tensor([[1, 0], [1, 1]]), values], "coalesced"),
            "values that do not fit": (_sparse_pid(0, (2, 2), 1, (3,), (3, 3)),
                                       [torch.tensor([[0, 1], [1, 1]]), torch.ones(3)], "values of shape"),
            "a size beyond int64": (_sparse_pid(0, (1, 1), 1, (1,), (1 << 70,)),
                                    [torch.tensor([[0]]), torch.ones(1)], r"\('sparse_coo'"),
            "a part that is not there": (_sparse_pid(0, (2, 2), 5, (2,), (3, 3)), [indices, values],
                                         r"\('sparse_coo'"),
        }
        for pid, tensors, message in forged.values():
            with pytest.raises(rpc.RefusedError, match=f"malformed sparse tensor.* from worker0: .*{message}"):
                rpc._call_raw(victim, "test_rpc_sparse.echo", forged_call(pid), tensors).wait()

        # A tracked tensor whose packed bytes lie: this (hostile) worker's engine exports it
        # forged; the victim refuses it before its function runs.
        with dist_autograd.context():
            t = torch.sparse_coo_tensor([[0], [0]], [1.0], (3, 3), requires_grad=True)
            _FORGE["on"] = True
            try:
                with pytest.raises(RuntimeError, match="malformed sparse tensor.*size is inconsistent with indices"):
                    rpc.rpc_sync(victim, echo, args=(t,))
            finally:
                _FORGE["on"] = False

        # The victim still serves honest calls, sparse ones included.
        t = torch.sparse_coo_tensor([[0], [2]], [1.0], (3, 3))
        torch.testing.assert_close(rpc.rpc_sync(victim, echo, args=(t,)).to_dense(), t.to_dense())

        # Now worker1 turns: the gradient it sends back for the sparse tensor it got has
        # packed bytes that lie. The backward fails here, naming why, and does not hang.
        with dist_autograd.context() as context_id:
            t = torch.sparse_coo_tensor([[0], [0]], [1.0], (3, 3), requires_grad=True)
            y = rpc.rpc_sync(victim, echo, args=(t,))
            rpc.rpc_sync(victim, start_forging)
            with pytest.raises(RuntimeError, match="malformed sparse tensor.*size is inconsistent with indices"):
                dist_autograd.backward(context_id, [torch.sparse.sum(y)])
    rpc.shutdown()


def test_forged_sparse_tensors_are_refused():
    run_world(hostile, 2)
