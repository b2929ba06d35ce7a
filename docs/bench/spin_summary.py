#!/usr/bin/env python3
"""Medians of spin.sh's runs, spin off against on, unpinned and pinned, as a Markdown table.

Usage: python3 docs/bench/spin_summary.py [DIR] [SPIN_US]   (default docs/bench/spin, 50)
Each cell is the median over the runs with the range in brackets; a missing file or key is
left out of the median (the run count says how many were used).
"""
import glob
import json
import os
import statistics
import sys

d = sys.argv[1] if len(sys.argv) > 1 else "docs/bench/spin"
on = sys.argv[2] if len(sys.argv) > 2 else "50"

FIGURES = [
    ("rpc", ("rpc_sync_p50_us",), "rpc_sync p50 (us)"),
    ("rpc", ("ratios", "rpc_sync_p50_over_raw_pingpong_p50"), "rpc_sync p50 / raw ping-pong"),
    ("rpc", ("rpc_async_calls_per_s",), "rpc_async calls/s"),
    ("rpc", ("idle_cpu_us_per_s_caller",), "idle CPU, caller (us/s)"),
    ("rpc", ("idle_cpu_us_per_s_callee",), "idle CPU, callee (us/s)"),
    ("coll", ("barrier_w2_us",), "TCP barrier w2 (us)"),
    ("coll", ("ratios", "barrier_w2_over_raw_barrier"), "TCP barrier w2 / raw barrier"),
    ("coll", ("barrier_w8_us",), "TCP barrier w8 (us)"),
    ("coll", ("ratios", "barrier_w8_over_raw_barrier"), "TCP barrier w8 / raw barrier"),
]


def values(kind, pin, spin, path):
    out = []
    for f in sorted(glob.glob(os.path.join(d, f"{kind}-{pin}-spin{spin}-run*.json"))):
        try:
            v = json.load(open(f))
        except (OSError, ValueError):
            continue
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if isinstance(v, (int, float)):
            out.append(v)
    return out


def cell(vs):
    if not vs:
        return "missing"
    return f"{statistics.median(vs):.4g} [{min(vs):.4g}-{max(vs):.4g}] (n={len(vs)})"


print(f"| run | figure | spin off | spin {on} us | on / off |")
print("| --- | --- | --- | --- | --- |")
for pin in ("unpinned", "pinned"):
    for kind, path, name in FIGURES:
        off_v, on_v = values(kind, pin, "0", path), values(kind, pin, on, path)
        ratio = (
            f"{statistics.median(on_v) / statistics.median(off_v):.2f}"
            if off_v and on_v and statistics.median(off_v)
            else "-"
        )
        print(f"| {pin} | {name} | {cell(off_v)} | {cell(on_v)} | {ratio} |")
