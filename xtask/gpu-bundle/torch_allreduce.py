"""The baseline of the bundle's NCCL bench: torch.distributed's all_reduce of 256 MiB (f32, sum)
with the NCCL backend, on the same machine in the same run as tensorwire's (`tw-gpu-suite
nccl-bench`). Started by run.sh with `python -m torch.distributed.run --standalone
--nproc_per_node=N`, one rank per GPU. Rank 0 prints one `RESULT {json}` line; a machine where
it cannot run prints `SKIPPED: <reason>` and exits 0."""

import json
import os
import sys
import time


def main() -> int:
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - any import failure means "cannot run here"
        print(f"SKIPPED: PyTorch is not importable: {e}")
        return 0
    if not torch.cuda.is_available():
        print("SKIPPED: PyTorch sees no CUDA device")
        return 0
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    n = 64 << 20  # f32: 256 MiB
    t = torch.full((n,), float(rank + 1), dtype=torch.float32, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    want = world * (world + 1) / 2
    if not bool((t == want).all()):
        print(f"FAIL: all_reduce of 256 MiB is not {want} everywhere", file=sys.stderr)
        return 1
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        dist.all_reduce(t)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    if rank == 0:
        print("RESULT " + json.dumps({
            "world": world,
            "torch_all_reduce_256mib_s": round(median, 6),
            "torch_version": torch.__version__,
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
        }))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
