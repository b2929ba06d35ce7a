"""Tests ported from PyTorch's torch/testing/_internal/distributed/rpc/dist_autograd_test.py
(the dense, non-TorchScript ones that need neither RRefs inside arguments nor the graph's
internal send/recv nodes), run as PyTorch runs them: every rank of a world of 4 runs the test
body at once (one long-lived world runs the bodies one after another: see
``ported_fixture.World``).

Changes from PyTorch's text: the imports (``tensorwire.rpc`` for ``torch.distributed.rpc``,
``tensorwire.rpc.dist_autograd`` for ``torch.distributed.autograd``); the functions called
remotely are exposed (``@rpc.expose``); ``self.assertEqual`` on tensors is
``torch.testing.assert_close`` (PyTorch's ``TestCase.assertEqual`` compares tensors with the
same default tolerances), and the test class's helpers are module functions of a ``_Case``
object. Tests changed beyond that say why in their docstring.
"""

from __future__ import annotations

from enum import Enum

import pytest
import torch

import tensorwire.rpc as rpc
from tensorwire.rpc import dist_autograd
import ported_fixture
from ported_fixture import World

WORLD = 4


def worker_name(rank: int) -> str:
    return f"worker{rank}"


class ExecMode(Enum):
    LOCAL = 1
    RPC_SYNC = 2
    REMOTE = 3
    RPC_ASYNC = 4


@rpc.expose
def my_py_add(t1, t2):
    return torch.add(t1, t2)


@rpc.expose
def nested_python_udf(t1, t2, dst):
    t3 = t1 * t2
    t4 = t1 + t2
    res = rpc.rpc_sync(worker_name(dst), my_py_add, args=(t3, t4))
    return t1 * t2 * t3 * t4 * res


@rpc.expose
def mixed_requires_grad_operaton(t1, t2):
    if t2.requires_grad:
        return t1 - t2
    else:
        return t1 * t2


@rpc.expose
def nested_backward_accumulate_grads(t1, t2, dst_rank):
    return rpc.rpc_sync(worker_name(dst_rank), torch.add, args=(t1, t2))


class _Case:
    """The parts of PyTorch's DistAutogradTest that the ported tests use."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    def _next_rank(self):
        if hasattr(self, "dst_rank"):
            self.dst_rank = (self.dst_rank + 1) % self.world_size
            if self.dst_rank == self.rank:
                return self._next_rank()
        else:
            self.dst_rank = (self.rank + 1) % self.world_size
        return self.dst_rank

    def _exec_func_with_dst(self, dst, exec_mode, method, *args):
        if ExecMode.LOCAL == exec_mode:
            if len(args) == 1 and isinstance(args[0], list):
                return method(*args[0])
            return method(*args)
        elif ExecMode.RPC_SYNC == exec_mode:
            return rpc.rpc_sync(worker_name(dst), method, args=(args))
        elif ExecMode.REMOTE == exec_mode:
            return rpc.remote(worker_name(dst), method, args=(args)).to_here()
        elif ExecMode.RPC_ASYNC == exec_mode:
            return rpc.rpc_async(worker_name(dst), method, args=(args)).wait()
        raise ValueError(f"Unrecognized ExecMode {exec_mode}")

    def _exec_func(self, exec_mode, method, *args):
        return self._exec_func_with_dst(self._next_rank(), exec_mode, method, *args)

    def _verify_backwards(self, exec_mode, tensors, context_id, local_grads, *args):
        if exec_mode == ExecMode.LOCAL:
            torch.autograd.backward(tensors)
            return [arg.grad for arg in args]
        self._verify_backwards_remote(tensors, context_id, local_grads, *args)

    def _verify_backwards_remote(self, tensors, context_id, local_grads, *args):
        dist_autograd.backward(context_id, tensors)
        grads = dist_autograd.get_gradients(context_id)
        ngrads = 0
        for i in range(len(args)):
            if local_grads[i] is not None:
                assert args[i] in grads
                torch.testing.assert_close(local_grads[i], grads[args[i]])
                ngrads += 1
            else:
                assert args[i] not in grads
        assert ngrads == len(grads)

    # --- the tests ---

    def test_backward_simple(self):
        self._backward_simple(self._next_rank())

    def test_backward_simple_self(self):
        self._backward_simple(self.rank)

    def _backward_simple(self, dst):
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        local_grads = None
        for exec_mode in [ExecMode.LOCAL, ExecMode.RPC_SYNC, ExecMode.REMOTE]:
            with dist_autograd.context() as context_id:
                ret = self._exec_func_with_dst(dst, exec_mode, torch.add, t1, t2)
                loss = ret.sum()
                ret = self._verify_backwards(exec_mode, [loss], context_id, local_grads, t1, t2)
                local_grads = ret if ret else local_grads

    def test_backward_multiple_round_trips(self):
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3))
        t3 = torch.rand((3, 3), requires_grad=True)
        t4 = torch.rand((3, 3))
        t5 = torch.rand((3, 3), requires_grad=True)
        local_grads = None
        for exec_mode in [ExecMode.LOCAL, ExecMode.RPC_SYNC, ExecMode.REMOTE]:
            with dist_autograd.context() as context_id:
                val = self._exec_func(exec_mode, torch.add, t1, t2)
                val = self._exec_func(exec_mode, torch.mul, t3, val)
                s1 = self._exec_func(exec_mode, torch.stack, (t4, val))
                s2 = self._exec_func(exec_mode, torch.stack, (t5, val))
                val = self._exec_func(exec_mode, torch.bmm, s1, s2)
                val = self._exec_func(exec_mode, torch.matmul, val, val)
                loss = val.sum()
                ret = self._verify_backwards(exec_mode, [loss], context_id, local_grads, t1, t2, t3, t4, t5)
                local_grads = ret if ret else local_grads

    def test_backward_different_dtypes(self):
        t1 = torch.rand((3, 3), requires_grad=True, dtype=torch.float32)
        t2 = torch.rand((3, 3), requires_grad=True, dtype=torch.float64)
        local_grads = None
        for exec_mode in [ExecMode.LOCAL, ExecMode.REMOTE]:
            with dist_autograd.context() as context_id:
                loss = self._exec_func(exec_mode, torch.add, t1, t2).sum()
                local_grads = self._verify_backwards(exec_mode, [loss], context_id, local_grads, t1, t2)

    def test_backward_simple_python_udf(self):
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        local_grads = None
        for exec_mode in [ExecMode.LOCAL, ExecMode.REMOTE]:
            with dist_autograd.context() as context_id:
                ret = self._exec_func(exec_mode, my_py_add, t1, t2)
                loss = ret.sum()
                local_grads = self._verify_backwards(exec_mode, [loss], context_id, local_grads, t1, t2)

    def test_backwards_nested_python_udf(self):
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        t3 = t1 * t2
        t4 = t1 + t2
        res = t3 + t4
        loss = (t1 * t2 * t3 * t4 * res).sum()
        torch.autograd.backward([loss])
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync(
                worker_name(self._next_rank()), nested_python_udf, args=(t1, t2, self._next_rank())
            ).sum()
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
            torch.testing.assert_close(t1.grad, grads[t1])
            torch.testing.assert_close(t2.grad, grads[t2])

    def test_mixed_requires_grad(self):
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=False)
        for exec_mode in [ExecMode.RPC_SYNC, ExecMode.REMOTE]:
            with dist_autograd.context() as context_id:
                ret = self._exec_func(exec_mode, mixed_requires_grad_operaton, t1, t2)
                torch.testing.assert_close(t1 * t2, ret)
                dist_autograd.backward(context_id, [ret.sum()])
                assert t1.requires_grad and not t2.requires_grad
                grads = dist_autograd.get_gradients(context_id)
                assert t1 in grads and t2 not in grads
                torch.testing.assert_close(t2, grads[t1])

    def test_multiple_backward(self):
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync(worker_name(self._next_rank()), torch.add, args=(t1, t2)).sum()
            for _ in range(1000):
                dist_autograd.backward(context_id, [loss], retain_graph=True)

    def test_nested_backward_accumulate_grads(self):
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        with dist_autograd.context() as context_id:
            ret = rpc.rpc_sync(
                worker_name(self._next_rank()),
                nested_backward_accumulate_grads,
                args=(t1, t2, self._next_rank()),
            )
            loss = ret.sum()
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            dist_autograd.backward(context_id, [loss])

    def test_backward_no_grad_on_tensor(self):
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync(worker_name(self._next_rank()), torch.add, args=(t1, t2)).sum()
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            assert t1.grad is None and t2.grad is None
            loss_local = torch.add(t1, t2).sum()
            loss_local.backward()
            assert t1.grad is not None and t2.grad is not None
            t1_grad_before, t2_grad_before = t1.grad, t2.grad
            dist_autograd.backward(context_id, [loss])
            torch.testing.assert_close(t1_grad_before, t1.grad)
            torch.testing.assert_close(t2_grad_before, t2.grad)

    def test_backward_unused_tensors(self):
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        t3 = torch.rand((3, 3), requires_grad=True)
        local_grads = None
        for exec_mode in [ExecMode.LOCAL, ExecMode.RPC_SYNC, ExecMode.REMOTE]:
            with dist_autograd.context() as context_id:
                s = self._exec_func(exec_mode, torch.stack, (t1, t2, t3))
                val = self._exec_func(
                    exec_mode, torch.matmul, torch.narrow(s, 0, 0, 1), torch.narrow(s, 0, 2, 1)
                )
                loss = val.sum()
                ret = self._verify_backwards(exec_mode, [loss], context_id, local_grads, t1, t2, t3)
                local_grads = ret if ret else local_grads

    def test_nested_context(self):
        with dist_autograd.context():
            with pytest.raises(RuntimeError, match="Already have an autograd context id for this thread"):
                with dist_autograd.context():
                    pass

    def test_autograd_context(self):
        """Changed: tensorwire's context ids hold the worker id in the high 32 bits (PyTorch:
        16), and there is no ``_get_max_id``."""
        context_ids = []
        for _ in range(200):
            with dist_autograd.context() as context_id:
                assert context_id == dist_autograd._retrieve_context(context_id)._context_id()
                assert self.rank == context_id >> 32
                context_ids.append(context_id)
        for context_id in context_ids:
            with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {context_id}"):
                dist_autograd._retrieve_context(context_id)

    def test_backward_invalid_args(self):
        """Written from PyTorch's test of the same name: the same errors, in PyTorch's words."""
        with dist_autograd.context() as context_id:
            with pytest.raises(TypeError):
                dist_autograd.backward(context_id, None)
            with pytest.raises(TypeError):
                dist_autograd.backward(None, None)
            with pytest.raises(RuntimeError, match="No tensors were given as roots"):
                dist_autograd.backward(context_id, [])
            with pytest.raises(RuntimeError, match="requires_grad not set|does not require grad"):
                t = torch.rand(3, 3)
                dist_autograd.backward(context_id, [t])
            with pytest.raises(RuntimeError, match="is not a scalar|only for scalar outputs"):
                t = torch.rand(3, 3, requires_grad=True)
                dist_autograd.backward(context_id, [t])
            with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
                t = torch.rand(1, requires_grad=True)
                dist_autograd.backward(context_id, [t])


TESTS = [name for name in vars(_Case) if name.startswith("test_")]

# Each body expects RPC up when it starts (PyTorch's @dist_init), as the shared world reads it.
for _name in TESTS:
    getattr(_Case, _name).setup_rpc = True


class RpcTest(ported_fixture.RpcAgentTestFixture, _Case):
    """One rank's test object for :class:`ported_fixture.World`, which runs every body on a
    world of four long-lived processes one after another (PyTorch starts a world per test;
    starting one per body cost about 15 s each)."""

    __test__ = False  # run by the world, not collected by pytest

    def __init__(self, rank: int, init_method: str):
        ported_fixture.RpcAgentTestFixture.__init__(self, rank, init_method)
        _Case.__init__(self, rank, WORLD)


def _fresh_state() -> None:
    """What the world calls before each body: the bodies keep no module state."""


# Ported but failing: each an open issue, not a skip.
FAILING: dict[str, str] = {}


@pytest.fixture(scope="module")
def world():
    w = World(__name__)
    yield w
    w.close()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=FAILING[n])) if n in FAILING else n
        for n in TESTS
    ],
)
def test_ported(world, name):
    world.run(name, True)
