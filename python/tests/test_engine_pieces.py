"""The per-tensor pieces of the torch engine's Python layer, in one process (no workers): what a
received tensor is made of, what a tensor sent travels as, which tensors the wire refuses, and
whether a node has hooks of its own. The seventeenth session made each cheaper; these pin what
they must still do."""

from __future__ import annotations

import pytest
import torch

from tensorwire.rpc import _autograd_engine as engine
from tensorwire.rpc import _serialize


def test_a_received_tensor_is_its_shape_over_the_buffer_itself_and_no_view():
    data = torch.arange(12, dtype=torch.float32)
    buf = bytearray(data.numpy().tobytes())
    t = engine.import_tensor("float32", (3, 4), buf, True)
    assert t.shape == (3, 4) and t.stride() == (4, 1) and t._base is None
    assert torch.equal(t, data.view(3, 4))
    buf[0:4] = bytes(torch.tensor([7.0]).numpy().tobytes())  # no copy: the buffer's bytes
    assert t[0, 0].item() == 7.0
    engine.receive([t])
    with torch.no_grad():
        t.mul_(2)  # writable in place, as PyTorch's received tensors are
    s = engine.import_tensor("float64", (), bytearray(8), False)
    assert s.shape == () and s.dtype == torch.float64


@pytest.mark.parametrize("n", [4 * 11, 4 * 13])
def test_a_buffer_of_another_length_than_its_shape_says_is_refused(n):
    with pytest.raises(ValueError, match=r"a received tensor of shape \(3, 4\) over \d+ bytes of float32"):
        engine.import_tensor("float32", (3, 4), bytearray(n), True)


def test_a_tensor_sent_travels_detached_contiguous_resolved_with_its_requires_grad():
    x = torch.randn(4, 3, requires_grad=True)
    name, shape, wire, requires_grad = engine.export_tensor(x.t())
    assert (name, shape, requires_grad) == ("float32", (3, 4), True)
    assert wire.is_contiguous() and not wire.requires_grad and torch.equal(wire, x.t().detach())
    assert engine.export_tensor(torch.ones(2))[3] is False
    neg = torch._neg_view(torch.arange(3.0))
    assert neg.is_neg()
    resolved = _serialize._prepare(neg)
    assert not resolved.is_neg() and torch.equal(resolved, torch.tensor([-0.0, -1.0, -2.0]))
    z = torch.tensor([1 + 2j, 3 - 1j]).conj()
    assert z.is_conj()
    resolved = _serialize._prepare(z)
    assert not resolved.is_conj() and torch.equal(resolved, torch.tensor([1 - 2j, 3 + 1j]))
    sparse = torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), check_invariants=True).requires_grad_()
    name, shape, packed, requires_grad = engine.export_tensor(sparse)
    assert name == "uint8" and packed.dtype == torch.uint8 and requires_grad is True


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_the_wire_refuses_what_it_does_not_carry():
    _serialize.check_carried(torch.ones(2))
    _serialize.check_carried(torch.sparse_coo_tensor([[0]], [1.0], (2,), check_invariants=True))
    with pytest.raises(RuntimeError, match="carries CPU tensors; this one is on meta"):
        _serialize.check_carried(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"not torch.sparse_csr ones"):
        _serialize.check_carried(torch.eye(2).to_sparse_csr())
    q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    with pytest.raises(ValueError, match=r"\(quantized\)"):
        _serialize.check_carried(q)


def test_a_node_has_hooks_only_when_some_were_registered_on_it_and_the_probe_leaves_none():
    w = torch.randn(3, requires_grad=True)
    y = (w * 2).sum()
    node = y.grad_fn
    acc = torch.autograd.graph.get_gradient_edge(w).node
    assert not engine._has_node_hooks(node) and not engine._has_node_hooks(acc)
    assert not engine._has_node_hooks(node)  # the probe leaves nothing behind
    pre = node.register_prehook(lambda grad_outputs: None)
    assert engine._has_node_hooks(node)
    pre.remove()
    assert not engine._has_node_hooks(node)
    post = acc.register_hook(lambda grad_inputs, grad_outputs: None)
    assert engine._has_node_hooks(acc)
    post.remove()
    assert not engine._has_node_hooks(acc)


@pytest.mark.parametrize("value", [None, 7, -1.5, "a", True, (), (3,), (1, 2.5, "s", None, False), 10**30])
def test_plain_values_pickle_to_the_picklers_bytes_and_back(value):
    import io

    buf = io.BytesIO()
    _serialize._Pickler(buf).dump(value)
    assert _serialize.dumps(value) == (buf.getvalue(), [], [])
    assert _serialize.loads(buf.getvalue(), [], [], trusted=False, origin="a test") == value

