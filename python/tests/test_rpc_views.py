"""Non-contiguous tensors through ``tensorwire.rpc`` on a world of real processes: a view keeps
its strides across a call and back, as in PyTorch's RPC (``test_non_cont_tensors`` of its suite
is in ``test_rpc_ported.py``), travelling as the span of storage it reads; a view of a small part
of a large storage travels as a contiguous copy; and forged views from a hostile peer (strides
that read past the span, shapes and strides that do not match, a span that is not a flat
buffer) are refused with ``RefusedError`` naming the sender, while the victim goes on serving."""

from __future__ import annotations


import pytest
import torch

import tensorwire.rpc as rpc
from harness import forged_call, run_world
from tensorwire.rpc import _serialize


@rpc.expose
def echo(x):
    return x


@rpc.expose
def layout_of(t):
    """How the tensor arrived, as plain values."""
    return tuple(t.shape), t.stride(), t.is_contiguous(), t.requires_grad


def _span_pid(index: int, n: int, requires_grad: bool = False) -> tuple:
    return ("tensor", index, "float32", (n,), requires_grad)


def views(rank: int, world: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 0:
        peer = "worker1"
        base = torch.rand(6, 7)
        kept = {
            "a narrow": base.narrow(1, 2, 3),
            "a transpose": base.t(),
            "a permutation": torch.rand(2, 3, 4).permute(2, 0, 1),
            "an expansion": torch.rand(3).expand(4, 3),
            "every other column": base[:, ::2],
            "a view that requires grad": torch.rand(7, 6, requires_grad=True).t(),
        }
        for what, t in kept.items():
            assert not t.is_contiguous(), what
            assert rpc.rpc_sync(peer, layout_of, args=(t,)) == (
                tuple(t.shape), t.stride(), False, t.requires_grad,
            ), what
            back = rpc.rpc_sync(peer, echo, args=(t,))
            assert torch.equal(back.detach(), t.detach()), what
            assert back.stride() == t.stride() and back.requires_grad == t.requires_grad, what

        # A few columns of a large matrix: the span it reads is 256 times its bytes, so it
        # travels as a contiguous copy (as PyTorch clones such a view).
        big = torch.rand(1024, 1024)
        few = big[:, :4]
        assert rpc.rpc_sync(peer, layout_of, args=(few,)) == ((1024, 4), (4, 1), True, False)
        assert torch.equal(rpc.rpc_sync(peer, echo, args=(few,)), few)

        # One view twice in a call is one tensor at the callee.
        a, b = rpc.rpc_sync(peer, echo, args=((kept["a narrow"], kept["a narrow"]),))
        assert a is b

        # Forged views: each refused at the victim, naming the sender.
        span = torch.arange(10, dtype=torch.float32)
        forged = {
            "strides that read past the span": (("strided", _span_pid(0, 10), (4, 4), (3, 1), False), "reads 13 elements of a span of 10"),
            "a huge stride": (("strided", _span_pid(0, 10), (2,), (1 << 62,), False), "reads"),
            "more strides than dimensions": (("strided", _span_pid(0, 10), (2,), (1, 1), False), "malformed tensor view"),
            "a negative stride": (("strided", _span_pid(0, 10), (2,), (-1,), False), "malformed tensor view"),
            "a stride beyond int64": (("strided", _span_pid(0, 10), (2,), (1 << 70,), False), "malformed tensor view"),
            "a span that is not flat": (("strided", ("tensor", 0, "float32", (2, 5), False), (2,), (1,), False), "malformed tensor view"),
            "a span that is not there": (("strided", _span_pid(3, 10), (2,), (1,), False), "malformed tensor reference"),
            "a span that claims to require grad": (("strided", _span_pid(0, 10, True), (2,), (1,), False), "malformed tensor view"),
        }
        for what, (pid, message) in forged.items():
            with pytest.raises(rpc.RefusedError, match=message) as refused:
                rpc._call_raw(peer, "test_rpc_views.echo", forged_call(pid), [span]).wait()
            assert "from worker0" in str(refused.value), what
        # An honest view built by hand through the same call is served.
        honest = ("strided", _span_pid(0, 10), (3, 3), (3, 1), False)
        got = rpc._call_raw(peer, "test_rpc_views.echo", forged_call(honest), [span]).wait()
        assert torch.equal(got, span[:9].view(3, 3))
        assert torch.equal(rpc.rpc_sync(peer, echo, args=(kept["a transpose"],)), kept["a transpose"])
    rpc.shutdown()


def test_views_keep_their_strides_and_forged_ones_are_refused():
    run_world(views, 2)


def test_what_travels_as_a_view_is_decided_by_the_span():
    # The rule itself, without a world: a narrow or a transpose reads at most twice its bytes
    # (or under VIEW_SPAN_BYTES); a few columns of a large matrix do not.
    assert _serialize._travels_as_view(torch.rand(5, 5).narrow(1, 2, 2))
    assert _serialize._travels_as_view(torch.rand(512, 512).t())
    assert not _serialize._travels_as_view(torch.rand(512, 512)[:, :2])
    assert not _serialize._travels_as_view(torch.rand(0, 5).t())
    assert _serialize._span(torch.rand(6, 7)[:, ::2]) == 1 + 5 * 7 + 3 * 2
