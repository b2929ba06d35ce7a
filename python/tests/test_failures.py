"""Failures on the tensorwire backend: a killed peer, a mismatch, a bad secret, bad arguments
(gloo's exception types), async operations and subgroups, CUDA tensors refused."""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_world


def init(rank: int, world: int, seconds: float = 60) -> None:
    import tensorwire.c10d  # noqa: F401

    dist.init_process_group(
        "tensorwire", init_method="env://", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=seconds),
    )


def killed_peer(rank: int, world: int, marker: str) -> None:
    init(rank, world, seconds=120)
    dist.barrier()
    if rank == 2:
        os._exit(9)  # dies without a goodbye, mid-run
    t = torch.ones(1 << 16)
    started = time.monotonic()
    with pytest.raises(dist.DistBackendError) as raised:
        for _ in range(1000):  # the peer's death surfaces in one of these
            dist.all_reduce(t)
    elapsed = time.monotonic() - started
    message = str(raised.value)
    assert "rank 2" in message, message
    # Long before the group's timeout (120 s): the death is noticed, not waited out.
    assert elapsed < 60, elapsed
    with open(f"{marker}.{rank}", "w") as f:
        f.write(message)


@pytest.mark.parametrize("path", ["arena", "links"])
def test_a_killed_peer_fails_wait_naming_the_rank(tmp_path, path):
    marker = str(tmp_path / "raised")
    run_world(killed_peer, 3, marker, expect_fail={2}, env={"TENSORWIRE_COLLECTIVES": path})
    for rank in (0, 1):
        assert "rank 2" in open(f"{marker}.{rank}").read()


def stopped_peer(rank: int, world: int, marker: str, path: str) -> None:
    init(rank, world, seconds=4)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, but never runs again (rank 0 kills it)
        os._exit(3)
    try:
        t = torch.ones(1 << 12)
        started = time.monotonic()
        with pytest.raises(dist.DistBackendError) as raised:
            for _ in range(1000):
                dist.all_reduce(t)
        elapsed = time.monotonic() - started
        message = str(raised.value)
        assert "timed out after 4s" in message, message
        if path == "arena":
            # Every rank waits on the stopped one itself, and names it. (Over the links, a rank
            # may name the neighbour that waits for it.)
            assert "rank(s) 2" in message, message
        # Within the timeout (4 s) and a little: nobody waits or spins past it.
        assert elapsed < 12, elapsed
        with open(f"{marker}.{rank}", "w") as f:
            f.write(message)
    finally:
        if rank == 0:
            os.kill(pids[2], signal.SIGKILL)


@pytest.mark.parametrize("path", ["arena", "links"])
def test_a_stopped_peer_fails_wait_naming_the_rank_within_the_timeout(tmp_path, path):
    marker = str(tmp_path / "raised")
    run_world(stopped_peer, 3, marker, path, expect_fail={2}, env={"TENSORWIRE_COLLECTIVES": path})
    for rank in (0, 1):
        assert "timed out" in open(f"{marker}.{rank}").read()


def mismatch(rank: int, world: int) -> None:
    init(rank, world)
    dist.barrier()
    # Rank 1 reduces a different number of elements: under DETAIL every rank is told.
    t = torch.ones(4 if rank == 0 else 5)
    with pytest.raises(dist.DistBackendError, match="disagrees|ran"):
        dist.all_reduce(t)


@pytest.mark.parametrize("variable", ["TORCH_DISTRIBUTED_DEBUG", "TENSORWIRE_DEBUG"])
def test_a_mismatch_raises_under_detail(variable):
    run_world(mismatch, 2, env={variable: "DETAIL"})


def bad_secret(rank: int, world: int) -> None:
    import tensorwire.c10d  # noqa: F401

    if rank == 1:
        os.environ["TENSORWIRE_SECRET"] = "not-the-cluster-secret"
    with pytest.raises(dist.DistError):
        dist.init_process_group(
            "tensorwire", init_method="env://", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=10),
        )


def test_a_bad_secret_is_refused():
    run_world(bad_secret, 2)


def async_and_subgroups(rank: int, world: int) -> None:
    init(rank, world)
    # Several operations in flight at once, waited in reverse: each gets its own result.
    tensors = [torch.full((3,), float(rank + i)) for i in range(5)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future() for w in works]
    for w in reversed(works):
        w.wait()
    total = sum(range(world))
    for i, t in enumerate(tensors):
        assert torch.equal(t, torch.full((3,), float(total + world * i))), (i, t)
    assert torch.equal(futures[0].wait()[0], tensors[0])
    # Subgroups: odd and even ranks, each reducing among its own members.
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    members = [r for r in range(world) if r % 2 == rank % 2]
    assert t.item() == float(sum(members))
    # split_group over the world's backend.
    halves = dist.split_group(split_ranks=[[0, 1], [2, 3]])
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=halves)
    assert t.item() == 2.0
    # Point to point in a ring, with a tag.
    out = torch.zeros(2)
    right, left = (rank + 1) % world, (rank - 1) % world
    reqs = [dist.isend(torch.full((2,), float(rank)), right, tag=7), dist.irecv(out, left, tag=7)]
    for r in reqs:
        r.wait()
    assert torch.equal(out, torch.full((2,), float(left)))
    # AVG, which gloo lacks: the mean of the ranks.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.item() == sum(range(world)) / world
    # A receive from any source, on the backend: its work names the sender.
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    if rank == 0:
        got = torch.zeros(1)
        work = backend.recv_anysource([got], 9)
        work.wait()
        assert work.source_rank() == int(got.item()) == 3
    elif rank == 3:
        dist.send(torch.tensor([3.0]), 0, tag=9)
    if rank == 0:
        assert dist.get_backend() == "tensorwire"
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    dist.destroy_process_group()


def test_async_operations_subgroups_and_point_to_point():
    run_world(async_and_subgroups, 4)


def bad_arguments(rank: int, world: int) -> None:
    init(rank, world)
    # Both as subgroups of the world, so that c10d's own checks (global to group ranks) are
    # the same on both sides and what differs is the backend's.
    ours_group = dist.new_group(backend="tensorwire")
    gloo = dist.new_group(backend="gloo")
    cases = {
        "broadcast from a rank outside the group": lambda g: dist.broadcast(torch.ones(2), src=world, group=g),
        "all_gather with too few outputs": lambda g: dist.all_gather([torch.ones(2)], torch.ones(2), group=g),
        "all_gather_into_tensor of the wrong size": lambda g: dist.all_gather_into_tensor(torch.ones(3), torch.ones(2), group=g),
        "reduce_scatter_tensor of the wrong size": lambda g: dist.reduce_scatter_tensor(torch.ones(2), torch.ones(3), group=g),
        "all_reduce with PREMUL_SUM": lambda g: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0), group=g),
        "all_to_all_single with bad splits": lambda g: dist.all_to_all_single(torch.ones(4), torch.ones(4), [1, 1], [3, 3], group=g),
        "send to itself": lambda g: dist.send(torch.ones(2), rank, group=g),
        "an unsupported dtype": lambda g: dist.all_reduce(torch.ones(2, dtype=torch.uint16), group=g),
    }
    for what, call in cases.items():
        kinds = []
        for group in (ours_group, gloo):
            try:
                call(group)
                kinds.append(None)
            except Exception as e:  # compared below
                kinds.append(type(e))
        ours, theirs = kinds
        assert ours is not None, f"{what}: tensorwire accepted it"
        if theirs is not None:
            assert issubclass(ours, theirs) or issubclass(theirs, ours) or ours is theirs, (what, ours, theirs)
    # A refused call breaks nothing: the group still works.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    # CUDA (here: any non-CPU) tensors are refused, naming the composite backend string.
    with pytest.raises(RuntimeError, match="cpu:tensorwire,cuda:nccl"):
        dist.group.WORLD._get_backend(torch.device("cpu")).allreduce([torch.ones(2, device="meta")], dist.AllreduceOptions())
    dist.destroy_process_group()


def test_bad_arguments_raise_gloos_exception_types():
    run_world(bad_arguments, 2)
