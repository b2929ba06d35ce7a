"""tensorwire.rpc's remote() and RRef, with real processes: values created on their owner,
copied with to_here, read in place with local_value, failures kept and raised, and a remote()
of a function nobody exposed refused."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import tensorwire.rpc as rpc
from harness import run_world


@rpc.expose
class Box:
    """A value kept on its owner."""

    def __init__(self, t: torch.Tensor, label: str):
        self.t = t
        self.label = label


@rpc.expose
def make(n: int, *, fill: float = 1.0) -> torch.Tensor:
    return torch.full((n,), fill)


@rpc.expose
def fails() -> None:
    raise KeyError("no such value")


@rpc.expose
def read_key(r: rpc.RRef, key: str) -> torch.Tensor:
    return r.to_here()[key]


@rpc.expose
def hand_back(r: rpc.RRef) -> rpc.RRef:
    return r


@rpc.expose
def made_there(n: int) -> rpc.RRef:
    return rpc.RRef(torch.full((n,), float(n)))


def rrefs(rank: int, world: int, marker_dir: str) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    peer = f"worker{(rank + 1) % world}"
    # A value created on the peer.
    r = rpc.remote(peer, make, args=(4,), kwargs={"fill": float(rank)})
    assert not r.is_owner()
    assert r.owner() == rpc.get_worker_info(peer) and r.owner_name() == peer
    assert torch.equal(r.to_here(), torch.full((4,), float(rank)))
    assert torch.equal(r.to_here(timeout=30), torch.full((4,), float(rank)))
    with pytest.raises(RuntimeError, match="only available on the owner"):
        r.local_value()
    # An exposed class constructed remotely, by class; copied with its tensor.
    b = rpc.remote(peer, Box, args=(torch.arange(3), "on the peer"))
    box = b.to_here()
    assert isinstance(box, Box) and box.label == "on the peer" and torch.equal(box.t, torch.arange(3))
    # Several references at once, and torch's default operations.
    many = [rpc.remote(f"worker{k % world}", torch.ones, args=(k + 1,)) for k in range(2 * world)]
    for k, m in enumerate(many):
        assert torch.equal(m.to_here(), torch.ones(k + 1))
    # A failure is kept on the owner and raised, with its type, by to_here.
    bad = rpc.remote(peer, fails)
    with pytest.raises(KeyError, match="no such value") as raised:
        bad.to_here()
    assert "Traceback" in str(raised.value)
    # A remote() of what nobody exposed runs nothing.
    path = os.path.join(marker_dir, f"remote{rank}")
    refused = rpc.remote(peer, os.system, args=(f"touch {path}",))
    with pytest.raises(rpc.RefusedError, match="refused to run 'posix.system'"):
        refused.to_here()
    # Owned here: remote() to this worker, and RRef(value).
    mine = rpc.remote(f"worker{rank}", Box, args=(torch.zeros(2), "mine"))
    assert mine.is_owner() and mine.local_value().label == "mine"
    assert mine.local_value() is mine.local_value()
    obj = {"k": torch.ones(1)}
    local = rpc.RRef(obj)
    assert local.is_owner() and local.owner_name() == f"worker{rank}"
    assert local.local_value() is obj
    # On the owner, to_here() is the value itself, as PyTorch's.
    assert local.to_here() is obj and mine.to_here() is mine.local_value()
    # An RRef in arguments is forked for the callee, which reads it from its owner (here),
    # and one in a result comes back as a reference to the value where it lives.
    assert rpc.rpc_sync(peer, read_key, args=(local, "k")).item() == 1.0
    back = rpc.rpc_sync(peer, hand_back, args=(local,))
    assert back.is_owner() and back.local_value() is obj
    theirs = rpc.rpc_sync(peer, made_there, args=(3,))
    assert theirs.owner_name() == peer and not theirs.is_owner()
    assert torch.equal(theirs.to_here(), torch.full((3,), 3.0))
    # An RRef pickled outside a call is refused, as in PyTorch.
    with pytest.raises(RuntimeError, match="Can not pickle rref"):
        pickle.dumps(local)
    rpc.shutdown()


@pytest.mark.parametrize("world", [2, 3])
def test_remote_and_rrefs(world, tmp_path):
    run_world(rrefs, world, str(tmp_path))
    assert os.listdir(tmp_path) == []


@rpc.expose
def weighted_sum(t: torch.Tensor, w: float) -> torch.Tensor:
    return (t * w).sum()


def backwards(rank: int, world: int) -> None:
    import tensorwire.rpc.dist_autograd as dist_autograd

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    peer = f"worker{1 - rank}"
    # The owner's reference without a context: local autograd.
    x = torch.ones(3, requires_grad=True)
    rpc.RRef((x * 3).sum()).backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0))
    # A user's reference in a context: the pass runs on the owner and reaches x here.
    with dist_autograd.context() as ctx:
        r = rpc.remote(peer, weighted_sum, args=(x, 5.0))
        r.backward(ctx, retain_graph=True)
        r.backward(ctx)
        assert torch.equal(dist_autograd.get_gradients(ctx)[x], torch.full((3,), 10.0))
        with pytest.raises(RuntimeError, match="require 'dist_autograd_ctx_id'"):
            r.backward()
        with pytest.raises(RuntimeError, match="should contain a tensor"):
            rpc.remote(peer, make, args=(2,)).remote().tolist().backward(ctx)
    with pytest.raises(RuntimeError, match="should contain a tensor"):
        rpc.RRef("no tensor").backward()
    rpc.shutdown()


def test_rref_backward_runs_on_the_owner():
    # PyTorch's RRef.backward: local autograd on the owner, distributed autograd from a user.
    run_world(backwards, 2)


@rpc.expose
def total(r: rpc.RRef) -> float:
    return r.local_value().sum().item()


def temporaries(rank: int, world: int) -> None:
    import contextlib

    import tensorwire.rpc.dist_autograd as dist_autograd

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 0:
        n = 40
        for scope in (contextlib.nullcontext, dist_autograd.context):
            with scope():
                # Each first reference is dropped as soon as the call naming it is sent (a proxy
                # on a temporary, or an argument): its owner must still find the value when the
                # call runs ("the value is gone" / "no value is kept" before).
                made = [rpc.remote("worker1", make, args=(i + 1,)).remote().tolist() for i in range(n)]
                sums = [rpc.remote("worker1", make, args=(i + 1,)).rpc_async().sum() for i in range(n)]
                args = [rpc.rpc_async("worker1", total, args=(rpc.remote("worker1", make, args=(i + 1,)),)) for i in range(n)]
                made_from = [rpc.remote("worker1", total, args=(rpc.remote("worker1", make, args=(i + 1,)),)) for i in range(n)]
                assert [m.to_here() for m in made] == [[1.0] * (i + 1) for i in range(n)], scope
                assert [f.wait().item() for f in sums] == [float(i + 1) for i in range(n)], scope
                assert [f.wait() for f in args] == [float(i + 1) for i in range(n)], scope
                assert [m.to_here() for m in made_from] == [float(i + 1) for i in range(n)], scope
    rpc.shutdown()


def test_a_temporary_reference_stays_until_the_owner_used_it():
    run_world(temporaries, 2)
