"""init_process_group("tensorwire") with every init method c10d has: env://, tcp://, file://
and a store passed in (PyTorch's own TCPStore and a FileStore)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_world


def check_sum(rank: int, world: int) -> None:
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2
    assert dist.get_backend() == "tensorwire"
    dist.destroy_process_group()


def by_method(rank: int, world: int, method: str, path: str) -> None:
    import tensorwire.c10d  # noqa: F401

    timeout = datetime.timedelta(seconds=60)
    if method == "env":
        dist.init_process_group("tensorwire", init_method="env://", rank=rank, world_size=world, timeout=timeout)
    elif method == "tcp":
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group("tensorwire", init_method=url, rank=rank, world_size=world, timeout=timeout)
    elif method == "file":
        dist.init_process_group("tensorwire", init_method=f"file://{path}", rank=rank, world_size=world, timeout=timeout)
    elif method == "tcpstore":
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timeout=timeout
        )
        dist.init_process_group("tensorwire", store=store, rank=rank, world_size=world, timeout=timeout)
    elif method == "filestore":
        store = dist.FileStore(path, world)
        dist.init_process_group("tensorwire", store=store, rank=rank, world_size=world, timeout=timeout)
    check_sum(rank, world)


@pytest.mark.parametrize("method", ["env", "tcp", "file", "tcpstore", "filestore"])
def test_every_init_method(method, tmp_path):
    run_world(by_method, 2, method, str(tmp_path / "store"))
