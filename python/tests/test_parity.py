"""Every operation x dtype on the tensorwire backend against gloo's result for the same inputs,
in the same processes and the same run, at world sizes 1 to 4."""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_world

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
OPS = {
    "SUM": dist.ReduceOp.SUM,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "BAND": dist.ReduceOp.BAND,
    "BOR": dist.ReduceOp.BOR,
    "BXOR": dist.ReduceOp.BXOR,
}


def values(seed: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in any summation order), in the dtype."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    low = 0 if dtype == torch.uint8 else -2
    return torch.randint(low, 3, (n,), generator=g).to(dtype)


def operations(rank: int, world: int, dtype: torch.dtype):
    """(name, function(group) -> list of result tensors) for every operation."""
    n = 6
    seed = lambda k: 1000 * k + 17 * rank  # noqa: E731  (the same integers in every dtype)
    ops = []
    for name, op in OPS.items():
        def allreduce(group, op=op):
            t = values(seed(1), n, dtype)
            dist.all_reduce(t, op=op, group=group)
            return [t]

        ops.append((f"all_reduce/{name}", allreduce))

    def allreduce_noncontiguous(group):
        t = values(seed(2), 2 * n, dtype).view(n, 2).t()  # a transposed view
        dist.all_reduce(t, group=group)
        return [t.contiguous()]

    def allreduce_coalesced(group):
        ts = [values(seed(3), n, dtype), values(seed(4), 3, dtype)]
        dist.all_reduce_coalesced(ts, group=group)
        return ts

    def reduce(group):
        t = values(seed(5), n, dtype)
        dist.reduce(t, dst=world - 1, group=group)
        # Only the destination's tensor is defined afterwards (gloo writes into the others).
        return [t] if rank == world - 1 else []

    def broadcast(group):
        t = values(seed(6), n, dtype)
        dist.broadcast(t, src=world - 1, group=group)
        return [t]

    def all_gather(group):
        out = [torch.zeros(n, dtype=dtype) for _ in range(world)]
        dist.all_gather(out, values(seed(7), n, dtype), group=group)
        return out

    def all_gather_into_tensor(group):
        out = torch.zeros(n * world, dtype=dtype)
        dist.all_gather_into_tensor(out, values(seed(8), n, dtype), group=group)
        return [out]

    def all_gather_coalesced(group):
        ins = [values(seed(9), n, dtype), values(seed(10), 2, dtype)]
        out = [[torch.zeros(n, dtype=dtype), torch.zeros(2, dtype=dtype)] for _ in range(world)]
        dist.all_gather_coalesced(out, ins, group=group)
        return [t for lst in out for t in lst]

    def reduce_scatter(group):
        ins = [values(seed(11) + r, n, dtype) for r in range(world)]
        out = torch.zeros(n, dtype=dtype)
        dist.reduce_scatter(out, ins, group=group)
        return [out]

    def reduce_scatter_tensor(group):
        out = torch.zeros(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, values(seed(12), n * world, dtype), group=group)
        return [out]

    def all_to_all(group):
        ins = [values(seed(13) + r, n, dtype) for r in range(world)]
        out = [torch.zeros(n, dtype=dtype) for _ in range(world)]
        dist.all_to_all(out, ins, group=group)
        return out

    def all_to_all_single(group):
        out = torch.zeros(world * 2, dtype=dtype)
        dist.all_to_all_single(out, values(seed(14), world * 2, dtype), group=group)
        return [out]

    def all_to_all_single_uneven(group):
        # rank r sends r + 1 rows to every rank; receives (s + 1) rows from rank s.
        ins = values(seed(15), (rank + 1) * world * 2, dtype).view(-1, 2)
        out = torch.zeros(sum(s + 1 for s in range(world)), 2, dtype=dtype)
        dist.all_to_all_single(
            out, ins, output_split_sizes=[s + 1 for s in range(world)],
            input_split_sizes=[rank + 1] * world, group=group,
        )
        return [out]

    def gather(group):
        out = [torch.zeros(n, dtype=dtype) for _ in range(world)] if rank == 0 else None
        dist.gather(values(seed(16), n, dtype), out, dst=0, group=group)
        return out or []

    def scatter(group):
        ins = [values(seed(17) + r, n, dtype) for r in range(world)] if rank == 0 else None
        out = torch.zeros(n, dtype=dtype)
        dist.scatter(out, ins, src=0, group=group)
        return [out]

    def send_recv(group):
        if world == 1:
            return []
        t = values(seed(18), n, dtype)
        out = torch.zeros(n, dtype=dtype)
        right, left = (rank + 1) % world, (rank - 1) % world
        reqs = [dist.isend(t, right, group=group), dist.irecv(out, left, group=group)]
        for r in reqs:
            r.wait()
        return [out]

    def barrier(group):
        dist.barrier(group=group)
        return []

    ops += [
        ("all_reduce/non-contiguous", allreduce_noncontiguous),
        ("all_reduce_coalesced", allreduce_coalesced),
        ("reduce", reduce),
        ("broadcast", broadcast),
        ("all_gather", all_gather),
        ("all_gather_into_tensor", all_gather_into_tensor),
        ("all_gather_coalesced", all_gather_coalesced),
        ("reduce_scatter", reduce_scatter),
        ("reduce_scatter_tensor", reduce_scatter_tensor),
        ("all_to_all", all_to_all),
        ("all_to_all_single", all_to_all_single),
        ("all_to_all_single/uneven", all_to_all_single_uneven),
        ("gather", gather),
        ("scatter", scatter),
        ("send/recv", send_recv),
        ("barrier", barrier),
    ]
    return ops


def outcome(fn, group):
    try:
        return "ok", fn(group)
    except Exception as e:  # compared with gloo's below
        return "raised", type(e).__name__ + ": " + str(e).splitlines()[0][:120]


def parity(rank: int, world: int, report: str) -> None:
    """Runs every operation on both groups; where gloo refuses a dtype (int16), tensorwire's
    result is compared with gloo's on the same integers as int32, cast back."""
    import tensorwire.c10d  # noqa: F401

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("tensorwire", init_method="env://", rank=rank, world_size=world, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    table = {}
    failures = []
    for dtype in DTYPES:
        wider = operations(rank, world, torch.int32) if dtype == torch.int16 else None
        for i, (name, fn) in enumerate(operations(rank, world, dtype)):
            tw_kind, tw = outcome(fn, dist.group.WORLD)
            gloo_kind, gl = outcome(fn, gloo)
            if gloo_kind == "raised" and wider is not None:
                gloo_kind, gl = outcome(wider[i][1], gloo)
                if gloo_kind == "ok":
                    gl = [t.to(dtype) for t in gl]
            key = f"{name} {str(dtype).removeprefix('torch.')}"
            if tw_kind == "ok" and gloo_kind == "ok":
                same = len(tw) == len(gl) and all(
                    a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(tw, gl)
                )
                table[key] = "equal" if same else "DIFFERENT"
                if not same:
                    failures.append(f"{key}: tensorwire {tw} gloo {gl}")
            elif tw_kind == "ok":
                table[key] = f"DIFFERENT: gloo refuses ({gl}), tensorwire runs it"
                failures.append(f"{key}: gloo refused ({gl}), tensorwire ran it")
            elif gloo_kind == "ok":
                table[key] = f"DIFFERENT: tensorwire raised {tw}"
                failures.append(f"{key}: tensorwire raised {tw}, gloo ran it")
            else:
                table[key] = "both refuse"
            # Both groups must still be usable (a refused call breaks neither).
    dist.barrier()
    if rank == 0:
        with open(report, "w") as f:
            json.dump({"world": world, "table": table}, f, indent=1)
    dist.destroy_process_group()
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("path", ["arena", "links"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_operation_and_dtype_equals_gloo(world, path, tmp_path):
    """On both collective paths: the group arena (the default on one host) and the links."""
    report = str(tmp_path / "parity.json")
    run_world(parity, world, report, env={"TENSORWIRE_COLLECTIVES": path})
    table = json.load(open(report))["table"]
    print(f"\nparity at world {world}:")
    for key, verdict in sorted(table.items()):
        print(f"  {key}: {verdict}")
    out = os.environ.get("TENSORWIRE_PARITY_DIR")
    if out:
        with open(os.path.join(out, f"parity-w{world}{'' if path == 'arena' else '-links'}.json"), "w") as f:
            json.dump(table, f, indent=1)
    equal = sum(v == "equal" for v in table.values())
    refused = sum(v == "both refuse" for v in table.values())
    print(f"world {world}: {equal} equal to gloo, {refused} refused by both, of {len(table)}")
    assert equal + refused == len(table), table
