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


def test_the_step_trace_sees_every_stage_of_a_pipeline_step(tmp_path):
    """`python -m tensorwire.bench.autograd_trace` (issue 48's breakdown) on a tiny model: the
    median step it reports holds the stages of every worker, in the protocol's order."""
    try:
        import numpy  # noqa: F401  (torch's TensorPipe agent, the baseline, needs it)
    except ImportError:
        if os.environ.get("TENSORWIRE_REQUIRE_TORCH"):
            raise
        pytest.skip("numpy is missing: torch's TensorPipe agent, the baseline, needs it")
    out = tmp_path / "trace.json"
    env = dict(os.environ, TENSORWIRE_SECRET="bench-test-secret", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "tensorwire.bench.autograd_trace", "--steps", "20", "--width", "16",
         "--batch", "4", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    rows = data["timeline"]
    at = {(r["proc"], r["stage"]): r["at_us"] for r in rows}
    # The forward reaches worker1 then worker2; backward starts at the driver, passes worker2,
    # then worker1; each owner steps its optimizer; the step ends at the driver.
    order = [
        ("worker0", "rpc_sync>"), ("worker1", "serve>"), ("worker1", "fn.tensorwire<"),
        ("worker0", "rpc_sync>#2"), ("worker2", "serve>"), ("worker0", "dist_backward>"),
        ("worker2", "engine.backward>"), ("worker1", "engine.backward>"),
        ("worker0", "backward.done"), ("worker0", "opt.done"), ("worker0", "step<"),
    ]
    for key in order:
        assert key in at, (key, sorted(at))
    assert [at[k] for k in order] == sorted(at[k] for k in order), [(k, at[k]) for k in order]
    assert ("worker1", "owner_call>") in at and ("worker2", "owner_call>") in at
    assert all(r["steps"] >= 18 for r in rows)
    for engine in ("tensorwire", "tensorpipe"):
        assert data["phases_us"][engine]["step"] > 0 and data["plain_us"][engine] > 0
    assert data["local_us"]["step"] > 0
    assert "tensorwire's median step" in result.stdout
