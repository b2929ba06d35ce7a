"""The README's Python examples run as written (torchrun, two ranks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from harness import free_port

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_ddp_script_runs_as_written(tmp_path):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    script = next(b for b in blocks if "tensorwire.c10d" in b and "DistributedDataParallel" in b)
    path = tmp_path / "train.py"
    path.write_text(script)
    env = dict(os.environ, TENSORWIRE_SECRET="readme-secret", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(path)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trained" in result.stdout, result.stdout + result.stderr


def test_the_readme_rpc_script_runs_as_written(tmp_path):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    # The quick start, not the distributed-autograd example further down (which also starts RPC).
    script = next(
        b for b in blocks if "import tensorwire.rpc as rpc" in b and "init_rpc" in b and "dist_autograd" not in b
    )
    path = tmp_path / "rpc_demo.py"
    path.write_text(script)
    env = dict(os.environ, TENSORWIRE_SECRET="readme-secret", OMP_NUM_THREADS="1",
               MASTER_PORT=str(free_port()))
    result = subprocess.run(
        [sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Each worker scaled by 3 on its peer, added 1 there, and counted 5 + 1 on its peer.
    for rank in (0, 1):
        assert f"worker{rank} [4.0, 4.0, 4.0] 6" in result.stdout, result.stdout + result.stderr


def test_the_readme_split_model_trains_with_distributed_adam(tmp_path):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    script = next(b for b in blocks if "DistributedOptimizer" in b and "dist_autograd" in b)
    path = tmp_path / "split.py"
    path.write_text(script)
    env = dict(
        os.environ, TENSORWIRE_SECRET="readme-secret", OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(path)], env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    result = outs[0][0]
    line = next(l for l in result.splitlines() if l.startswith("trained"))
    first, last = float(line.split()[1]), float(line.split()[3])
    # Adam on both workers brought the loss down.
    assert last < first / 2, line
