"""Under real ``torchrun``: its elastic agent serves the job's store on ``MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``), and every worker joins it as a plain c10d client, as
PyTorch's do. ``tensorwire.rpc.init_rpc`` (static, twice in a row, and dynamic) and
``init_process_group("tensorwire")`` run in one job; the workers' own connections still prove
the cluster secret."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from harness import free_port

# A bound on the whole job (torchrun and two workers), so that a hang fails the test.
JOB_LIMIT_S = 120

SCRIPT = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    import tensorwire.c10d
    import tensorwire.rpc as rpc

    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    peer = (rank + 1) % world

    dist.init_process_group("tensorwire")  # env://: the agent's store, through c10d
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0], t

    for attempt in range(2):  # a static group, twice on the same store
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
        got = rpc.rpc_sync(f"worker{peer}", torch.add, args=(torch.ones(2), attempt))
        assert got.tolist() == [1.0 + attempt] * 2, got
        rpc.shutdown()

    rpc.init_rpc(f"dyn{rank}", rank=rank)  # a dynamic group on the agent's store
    dist.barrier()
    assert rpc.rpc_sync(f"dyn{peer}", torch.mul, args=(torch.ones(1), rank + 2)).item() == rank + 2
    dist.barrier()
    rpc.shutdown()
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)
    """
)


def test_init_rpc_and_init_process_group_under_torchrun(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["TENSORWIRE_SECRET"] = os.environ.get("TENSORWIRE_SECRET", "tensorwire-test-secret")
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()),
        str(script),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_LIMIT_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "rank 0 ok" in out and "rank 1 ok" in out, out
    assert "Address already in use" not in out, out
