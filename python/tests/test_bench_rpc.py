"""`python -m tensorwire.bench rpc` keeps running: a tiny quick run against TensorPipe whose
records and summary are checked (the figures themselves mean nothing at this size)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest


def _need_numpy() -> None:
    # torch's TensorPipe agent cannot start without numpy (init_rpc gathers the device maps
    # with all_gather_object, which goes through numpy). CI installs it (.ci/run).
    try:
        import numpy  # noqa: F401
    except ImportError:
        if os.environ.get("TENSORWIRE_REQUIRE_TORCH"):
            raise
        pytest.skip("numpy is missing: torch's TensorPipe agent, the baseline, needs it")


def test_the_rpc_benchmark_runs_quick_and_reports_every_figure(tmp_path):
    _need_numpy()
    out = tmp_path / "rpc.json"
    env = dict(os.environ, TENSORWIRE_SECRET="bench-test-secret", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "tensorwire.bench", "rpc", "--quick", "--pin", "off", "--repeat", "1",
         "--deadline", "90", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["suite"] == "rpc" and data["baseline"] == "tensorpipe" and data["failures"] == []
    figures = {r["figure"]: r for r in data["records"]}
    assert set(figures) == {"rpc_sync", "rpc_async", "tensor", "remote_to_here"}
    for r in figures.values():
        assert r["pin"] == "unpinned" and len(r["load"]) == 2
        for agent in ("tensorwire", "tensorpipe"):
            assert math.isfinite(r[agent]) and r[agent] > 0, r
        assert r["samples"] > 0
        better = "higher" if r["unit"] == "calls/s" else "lower"
        expected = r["tensorwire"] / r["tensorpipe"] if better == "higher" else r["tensorpipe"] / r["tensorwire"]
        assert r["speedup"] == pytest.approx(expected)
    assert figures["tensor"]["bytes"] == 1 << 20
    assert figures["rpc_async"]["samples"] >= 256
    summary = {s["figure"]: s for s in data["summary"]}
    assert set(summary) == set(figures) and all(s["runs"] == 1 for s in summary.values())
    assert summary["rpc_sync"]["target_speedup"] == 2.0 and summary["remote_to_here"]["met"] is None
    assert "speedup" in result.stdout and "rpc_sync p50 (no-op)" in result.stdout
