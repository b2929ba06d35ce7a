"""DDP and FSDP2 on the tensorwire backend against the same training on gloo, in the same
processes: parameters (and FSDP2's losses) must come out equal."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from harness import run_world

STEPS = 20


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    ).double()


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64)


def train_ddp(rank: int, group) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # A small bucket cap makes DDP all-reduce several buckets per step.
    net = DDP(model(), process_group=group, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()] + [p.grad.clone() for p in net.parameters()]


def ddp(rank: int, world: int) -> None:
    import tensorwire.c10d  # noqa: F401

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("tensorwire", init_method="env://", rank=rank, world_size=world, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    ours = train_ddp(rank, dist.group.WORLD)
    theirs = train_ddp(rank, gloo)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), (a, b)
    # The replicas agree with each other too.
    gathered = [torch.zeros_like(ours[0]) for _ in range(world)]
    dist.all_gather(gathered, ours[0])
    assert all(torch.equal(g, ours[0]) for g in gathered)
    dist.destroy_process_group()


def test_ddp_20_steps_equal_gloo():
    run_world(ddp, 2)


def train_fsdp(rank: int, mesh) -> tuple[list[float], list[torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    net = model()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = [p.full_tensor().detach().clone() for p in net.parameters()]
    return losses, full


def fsdp(rank: int, world: int) -> None:
    import tensorwire.c10d  # noqa: F401
    from torch.distributed.device_mesh import DeviceMesh

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("tensorwire", init_method="env://", rank=rank, world_size=world, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    ours = train_fsdp(rank, DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    theirs = train_fsdp(rank, DeviceMesh.from_group(gloo, "cpu"))
    assert ours[0] == theirs[0], (ours[0], theirs[0])
    for a, b in zip(ours[1], theirs[1]):
        assert torch.equal(a, b), (a, b)
    dist.destroy_process_group()


def test_fsdp2_losses_and_parameters_equal_gloo():
    run_world(fsdp, 2)
