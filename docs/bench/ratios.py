#!/usr/bin/env python3
"""Prints the one-run ratios of issue 32 from the JSON files make.sh wrote, as a Markdown table.

Usage: python3 docs/bench/ratios.py [DIR]   (default docs/bench)
A figure whose file or key is missing prints as "missing", never as a number.
"""
import json
import os
import sys

d = sys.argv[1] if len(sys.argv) > 1 else "docs/bench"


def load(name):
    try:
        with open(os.path.join(d, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def get(doc, *path):
    for p in path:
        if doc is None:
            return None
        doc = doc[p] if isinstance(doc, list) else doc.get(p)
    return doc


def fmt(v, unit="x"):
    if not isinstance(v, (int, float)):
        return "missing"
    return f"{v:.2f}{unit}" if unit == "x" else f"{v:.3f} {unit}"


rows = []
for pin in ("unpinned", "pinned"):
    tcp = load(f"rpc-tcp-{pin}.json")
    shm = load(f"rpc-shm-{pin}.json")
    cshm = load(f"coll-shm-{pin}.json")
    ctcp = load(f"coll-tcp-{pin}.json")
    init = load(f"init64-{pin}.json")
    rrefs = load(f"rrefs-{pin}.json")
    fair = load(f"fairness-{pin}.json")
    r = lambda doc, k: get(doc, "ratios", k)
    init_s = get(init, "points", -1, "init_wall_ms")
    pts = get(rrefs, "points") or []
    p0 = next((p for p in pts if p.get("x") == 0), None)
    p100k = next((p for p in pts if p.get("x") == 100000), None)
    rref_ratio = (
        p100k["rpc_sync_p50_us"] / p0["rpc_sync_p50_us"] if p0 and p100k else None
    )
    rows += [
        (pin, "rpc_sync TCP p50 / raw TCP ping-pong p50", fmt(r(tcp, "rpc_sync_p50_over_raw_pingpong_p50"))),
        (pin, "rpc_sync shm p50 / raw shm ping-pong p50", fmt(r(shm, "rpc_sync_p50_over_raw_shm_pingpong_p50"))),
        (pin, "barrier w2 shm / raw shm barrier", fmt(r(cshm, "barrier_w2_over_raw_shm_barrier"))),
        (pin, "barrier w8 shm / raw shm barrier", fmt(r(cshm, "barrier_w8_over_raw_shm_barrier"))),
        (pin, "barrier w2 shm (us)", fmt(get(cshm, "barrier_w2_us"), "us")),
        (pin, "barrier w2 TCP / raw TCP barrier", fmt(r(ctcp, "barrier_w2_over_raw_barrier"))),
        (pin, "barrier w8 TCP / raw TCP barrier", fmt(r(ctcp, "barrier_w8_over_raw_barrier"))),
        (pin, "all_gather w8 1 MiB TCP / gloo", fmt(r(ctcp, "all_gather_w8_1MiB_over_gloo"))),
        (pin, "init_rpc w64, all ready (s)", fmt(init_s / 1000 if init_s else None, "s")),
        (pin, "rpc_sync p50 with 100,000 rrefs / with 0", fmt(rref_ratio)),
        (pin, "honest p99 during a never-reading flood / none", fmt(r(fair, "p99_unread_over_none"))),
        (pin, "honest p99 during a request flood / none", fmt(r(fair, "p99_requests_over_none"))),
    ]
print("| run | figure | value |")
print("| --- | --- | --- |")
for pin, name, v in rows:
    print(f"| {pin} | {name} | {v} |")
