"""The README's Python quick start runs as written (torchrun, two ranks)."""

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
    script = next(b for b in blocks if "import tensorwire.rpc as rpc" in b and "init_rpc" in b)
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
