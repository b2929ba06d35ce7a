"""Dynamic RPC groups (``init_rpc`` without ``world_size``) with real processes: PyTorch's
``test_dynamic_rpc_*`` tests of ``rpc_test.py`` (``TensorPipeAgentRpcTest``), ported by changing
the import, and a group that workers join and leave while it runs.

As in PyTorch's tests, the workers line up with a gloo process group over a ``file://`` store
(``initialize_pg``); they never sleep to wait. The ports keep PyTorch's bodies; what changed is
said at each."""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist

import tensorwire.rpc as rpc
from harness import free_port, run_world

WORLD = 3
# A bound on anything that waits for the group, so that a hang fails instead of stalling.
LIMIT_S = 60.0


def worker_name(rank: int) -> str:
    return f"worker{rank}"


def _options(init_method: str) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=LIMIT_S)


def _init(rank: int, init_method: str) -> None:
    rpc.init_rpc(
        name=worker_name(rank),
        backend=rpc.BackendType.TENSORPIPE,
        rank=rank,
        rpc_backend_options=_options(init_method),
    )


def _knows(name: str) -> bool:
    try:
        rpc.get_worker_info(name)
        return True
    except RuntimeError:
        return False


def _until_forgotten(name: str) -> None:
    """Waits (bounded) until this worker no longer knows ``name``, which left. Unlike PyTorch's,
    a leaver's ``shutdown`` returns once the coordinator removed it, while the other members
    may still be reading the coordinator's word (or noticing the closed connection)."""
    deadline = time.monotonic() + LIMIT_S
    while _knows(name):
        assert time.monotonic() < deadline, f"{rpc.get_worker_info().name} still knows {name}"
        time.sleep(0.01)


# --- PyTorch's tests (their bodies; `self.rpc_backend_options` is a fresh file:// store) ----------


def dynamic_rpc_init_rpc(rank: int, world: int, init_method: str) -> None:
    # test_dynamic_rpc_init_rpc: every worker joins and leaves, in whatever order they come.
    _init(rank, init_method)
    rpc.shutdown()


def dynamic_rpc_new_rank_can_communicated_with_existing_rank(rank: int, world: int, init_method: str) -> None:
    if rank == 0:
        _init(rank, init_method)
    # Rank 0 will be initialized with RPC after this barrier
    dist.barrier()
    if rank != 0:
        # Newly joined ranks will be able to communicate with rank 0, since that was created first
        _init(rank, init_method)
        result = rpc.rpc_sync(worker_name(0), torch.add, args=(torch.tensor(1), torch.tensor(1)))
        assert torch.equal(torch.add(torch.tensor(1), torch.tensor(1)), result)
    # Barrier to ensure that all rpc_sync calls are finished
    dist.barrier()
    rpc.shutdown()


def dynamic_rpc_existing_rank_can_communicate_with_new_rank(rank: int, world: int, init_method: str) -> None:
    if rank == 0:
        _init(rank, init_method)
    # Rank 0 will be initialized with RPC after this barrier
    dist.barrier()
    # Rest of ranks join after barrier
    if rank != 0:
        _init(rank, init_method)
    dist.barrier()
    if rank == 0:
        for i in range(1, world):
            result = rpc.rpc_sync(worker_name(i), torch.add, args=(torch.tensor(1), torch.tensor(1)))
            assert torch.equal(torch.add(torch.tensor(1), torch.tensor(1)), result)
    # Barrier to ensure that all rpc_sync calls are finished
    dist.barrier()
    rpc.shutdown()


def dynamic_and_static_init_rpc_together(rank: int, world: int, init_method: str) -> None:
    # Changed: tensorwire's message ("mixing static and dynamic members is refused") for
    # PyTorch's ("RPC group mixes statically and dynamically initialized members which is not
    # supported."); the type, RuntimeError, is PyTorch's.
    world_size_minus_one = world - 1
    if rank < world_size_minus_one:
        rpc.init_rpc(
            name=worker_name(rank),
            backend=rpc.BackendType.TENSORPIPE,
            rank=rank,
            world_size=world_size_minus_one,
            rpc_backend_options=_options(init_method),
        )
    dist.barrier()
    # Attempt to add an additional dynamic group member
    if rank == world_size_minus_one:
        try:
            _init(rank, init_method)
        except RuntimeError as e:
            assert "mixing static and dynamic members is refused" in str(e), e
        else:
            raise AssertionError("a dynamic member joined a static group")
    dist.barrier()
    if rank < world_size_minus_one:
        rpc.shutdown()


PORTED = [
    dynamic_rpc_init_rpc,
    dynamic_rpc_new_rank_can_communicated_with_existing_rank,
    dynamic_rpc_existing_rank_can_communicate_with_new_rank,
    dynamic_and_static_init_rpc_together,
]


# --- join, call, join later, leave: env://, where rank 0 hosts the store ---------------------------


@rpc.expose
def members_known_to(names: list) -> list:
    """Which of ``names`` the worker serving this call knows."""
    return [n for n in names if _knows(n)]


def join_call_leave(rank: int, world: int) -> None:
    names = [worker_name(r) for r in range(world)]
    if rank < 2:
        _init(rank, "env://")
    dist.barrier()  # workers 0 and 1 are in
    if rank < 2:
        other = worker_name(1 - rank)
        assert rpc.get_worker_info(other).id == 1 - rank
        got = rpc.rpc_sync(other, torch.add, args=(torch.ones(2), rank))
        assert torch.equal(got, torch.ones(2) + rank), got
        assert not _knows(worker_name(2))
    dist.barrier()  # a third joins later
    if rank == 2:
        _init(rank, "env://")
        futs = [rpc.rpc_async(worker_name(r), torch.mul, args=(torch.ones(3), r + 2)) for r in (0, 1)]
        assert [f.wait().tolist() for f in futs] == [[2.0] * 3, [3.0] * 3]
        # Every member knows every other, and says so when asked.
        for r in (0, 1):
            assert rpc.rpc_sync(worker_name(r), members_known_to, args=(names,)) == names
    dist.barrier()
    # The first members call the newcomer, by name and by WorkerInfo; RRefs work across it.
    if rank == 0:
        assert rpc.rpc_sync(rpc.get_worker_info(worker_name(2)), torch.add, args=(torch.ones(1), 1)).item() == 2
        r = rpc.remote(worker_name(2), torch.ones, args=(4,))
        assert r.to_here().sum().item() == 4
    dist.barrier()
    # Worker 1 leaves; the others forget it, and calls to it fail.
    if rank == 1:
        rpc.shutdown()
    dist.barrier()
    if rank != 1:
        _until_forgotten(worker_name(1))
        try:
            rpc.rpc_sync(worker_name(1), torch.add, args=(torch.ones(1), 1))
        except RuntimeError as e:
            assert "worker1" in str(e), e
        else:
            raise AssertionError("a call to a worker that left succeeded")
        peer = worker_name(2 - rank)
        assert rpc.rpc_sync(peer, torch.add, args=(torch.ones(1), 1)).item() == 2
    dist.barrier()
    # Rank 0, which hosts the store, leaves first (as PyTorch's workers may): the last member
    # still leaves cleanly.
    if rank == 0:
        rpc.shutdown()
    dist.barrier()
    if rank == 2:
        _until_forgotten(worker_name(0))
        rpc.shutdown()


# --- the world -----------------------------------------------------------------------------------


def _world(rank: int, world: int, rpc_dir: str, pg_file: str, master_ports: list) -> None:
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=world)
    try:
        for i, test in enumerate(PORTED):
            # PyTorch's fixture: a fresh file:// init method per test.
            test(rank, world, f"file://{rpc_dir}/{test.__name__}")
            dist.barrier()
        os.environ["MASTER_PORT"] = str(master_ports[0])
        join_call_leave(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_dynamic_groups_as_pytorchs_tests_and_workers_joining_and_leaving() -> None:
    with tempfile.TemporaryDirectory(prefix="tw-dyn-") as tmp:
        run_world(_world, WORLD, tmp, os.path.join(tmp, "pg"), [free_port()])
