"""`python -m tensorwire.bench autograd` keeps running: a tiny quick run against PyTorch's RPC,
distributed autograd and DistributedOptimizer, whose records and summary are checked. The run
itself checks that both engines end every figure with the same parameters (same start, data and
steps), so this also says that tensorwire's distributed step computes what PyTorch's does."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest


def test_the_autograd_benchmark_runs_quick_and_both_engines_train_alike(tmp_path):
    try:
        import numpy  # noqa: F401  (torch's TensorPipe agent, the baseline, needs it)
    except ImportError:
        if os.environ.get("TENSORWIRE_REQUIRE_TORCH"):
            raise
        pytest.skip("numpy is missing: torch's TensorPipe agent, the baseline, needs it")
    out = tmp_path / "autograd.json"
    env = dict(os.environ, TENSORWIRE_SECRET="bench-test-secret", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "tensorwire.bench", "autograd", "--quick", "--pin", "off", "--repeat", "1",
         "--deadline", "120", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["suite"] == "autograd" and data["baseline"] == "tensorpipe" and data["failures"] == []
    figures = {r["figure"]: r for r in data["records"]}
    assert set(figures) == {"ps", "pipeline"}
    for r in figures.values():
        assert r["pin"] == "unpinned" and r["unit"] == "us/step"
        for engine in ("tensorwire", "tensorpipe"):
            assert math.isfinite(r[engine]) and r[engine] > 0, r
        assert r["speedup"] == pytest.approx(r["tensorpipe"] / r["tensorwire"])
        assert 0 <= r["max_difference"] <= 1e-6, r
    # Two trainers' steps at the parameter server, the driver's in the pipeline.
    assert figures["ps"]["samples"] == 2 * 2 * 4 and figures["pipeline"]["samples"] == 2 * 4
    summary = {s["figure"]: s for s in data["summary"]}
    assert set(summary) == {"ps", "pipeline"} and all(s["target_speedup"] == 2.0 for s in summary.values())
    assert "3-stage pipeline" in result.stdout and "parameter server, 2 trainers" in result.stdout
