"""Work handles on a ``torch.distributed._dist2``-style group (``tensorwire.c10d.new_group``:
not registered with torch.distributed's global state) and the list form of ``all_to_all``,
compared with gloo's group built the same way in the same processes."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from harness import run_world

TIMEOUT = datetime.timedelta(seconds=60)


def gloo_group(rank: int, world: int) -> ProcessGroup:
    """gloo's group as ``_dist2``'s gloo factory makes it, on its own prefix of rank 0's store."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, TIMEOUT
    )
    store = dist.PrefixStore("gloo", store)
    backend = dist.ProcessGroupGloo(store, rank, world, TIMEOUT)
    pg = ProcessGroup(store, rank, world)
    pg._set_default_backend(ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return pg


def finished_well(work, what: str) -> None:
    assert work.is_completed(), f"{what}: not completed after wait"
    assert work.is_success(), f"{what}: not a success after wait"
    assert work.exception() is None, f"{what}: {work.exception()!r}"


def work_handles(rank: int, world: int) -> None:
    import tensorwire.c10d as twc

    pg = twc.new_group(TIMEOUT, "cpu")
    assert isinstance(pg, ProcessGroup) and (pg.rank(), pg.size()) == (rank, world)
    assert not dist.is_initialized(), "new_group registers nothing globally"
    gloo = gloo_group(rank, world)
    store = dist.PrefixStore(
        "test",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, TIMEOUT),
    )

    # A work runs while the peers have not issued theirs: not completed, no exception yet.
    t = torch.full((4,), float(rank + 1))
    if rank == 0:
        work = pg.allreduce([t])
        assert not work.is_completed() and work.exception() is None
        assert not work.is_success()
        store.set("checked", "1")
    else:
        store.wait(["checked"])
        work = pg.allreduce([t])
    assert work.wait(TIMEOUT) is True
    finished_well(work, "allreduce")
    assert torch.equal(t, torch.full((4,), float(sum(range(1, world + 1)))))
    assert work.get_future().wait() == [t]

    def issue(group):
        """Several operations issued async before any wait, through torch.distributed's own
        functions (group=) and the group's methods; their results once all are waited on in
        reverse order."""
        a = torch.arange(6, dtype=torch.float64) * (rank + 1)
        b = torch.full((3,), rank * 10, dtype=torch.int32) if rank == 0 else torch.zeros(3, dtype=torch.int32)
        gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
        ins = [torch.full((2,), 100 * rank + j, dtype=torch.int64) for j in range(world)]
        outs = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
        works = [
            dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group, async_op=True),
            dist.broadcast(b, group=group, group_src=0, async_op=True),
            dist.all_gather(gathered, torch.full((2,), rank, dtype=torch.int64), group=group, async_op=True),
            dist.all_to_all(outs, ins, group=group, async_op=True),
            group.barrier(),
        ]
        for w in reversed(works):
            w.wait()
            finished_well(w, "issued async")
        return [a, b, *gathered, *outs]

    ours, theirs = issue(pg), issue(gloo)
    for i, (x, y) in enumerate(zip(ours, theirs)):
        assert torch.equal(x, y), f"result {i}: tensorwire {x} != gloo {y}"

    # The list form of all_to_all with sizes that differ by rank: rank r sends r + 1 values to
    # every rank. gloo's list form refuses them; its all_to_all_single takes the same exchange
    # as splits, and the results must agree.
    ins = [torch.arange(rank + 1, dtype=torch.float32) + 10 * rank + 100 * j for j in range(world)]
    outs = [torch.full((s + 1,), -1.0) for s in range(world)]
    work = dist.all_to_all(outs, ins, group=pg, async_op=True)
    assert work.wait() is True
    finished_well(work, "uneven all_to_all")
    flat = torch.full((sum(s + 1 for s in range(world)),), -1.0)
    dist.all_to_all_single(
        flat, torch.cat(ins), [s + 1 for s in range(world)], [rank + 1] * world, group=gloo
    )
    assert torch.equal(torch.cat(outs), flat), f"{outs} != gloo's {flat}"
    with pytest.raises(RuntimeError, match="invalid tensor size"):
        dist.all_to_all([o.clone() for o in outs], ins, group=gloo)

    # A failure: sizes that differ. wait() raises torch's error; afterwards the handle says so
    # without raising.
    bad = torch.ones(2 + rank)
    work = pg.allreduce([bad])
    with pytest.raises(dist.DistBackendError) as raised:
        work.wait()
    assert work.is_completed() and not work.is_success()
    error = work.exception()
    assert isinstance(error, dist.DistBackendError), repr(error)
    assert str(error) == str(raised.value)
    other = 1 - rank if world == 2 else None
    if other is not None:
        assert f"rank {other}" in str(error), str(error)
    pg.shutdown()
    leave(store, rank, world)


def leave(store, rank: int, world: int) -> None:
    """Rank 0 hosts the store: it leaves last, once every other rank is done with it."""
    if rank != 0:
        store.set(f"left/{rank}", "1")
    else:
        store.wait([f"left/{r}" for r in range(1, world)])


@pytest.mark.parametrize("world", [2, 3])
def test_work_handles_and_list_all_to_all_on_a_dist2_group(world: int) -> None:
    run_world(work_handles, world)


def factory_options(rank: int, world: int) -> None:
    import tensorwire.c10d as twc

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, TIMEOUT
    )
    with pytest.raises(KeyError, match="no_such_option"):
        twc.process_group_factory(store, rank, world, TIMEOUT, "cpu", no_such_option=1)
    with pytest.raises(RuntimeError, match="CPU"):
        twc.process_group_factory(store, rank, world, TIMEOUT, "meta")
    # Two groups on one store keep apart (names of their own, made in one order everywhere).
    one = twc.process_group_factory(store, rank, world, TIMEOUT, torch.device("cpu"))
    two = twc.process_group_factory(store, rank, world, TIMEOUT, "cpu")
    x, y = torch.ones(2), torch.full((2,), 2.0)
    wx, wy = one.allreduce([x]), two.allreduce([y])
    wy.wait()
    wx.wait()
    assert torch.equal(x, torch.full((2,), float(world)))
    assert torch.equal(y, torch.full((2,), 2.0 * world))
    one.shutdown()
    two.shutdown()
    leave(dist.PrefixStore("test", store), rank, world)


def test_the_dist2_factory_refuses_unknown_options_and_keeps_groups_apart() -> None:
    run_world(factory_options, 2)
