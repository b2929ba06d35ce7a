#!/usr/bin/env python3
"""Differential check of `tensorwire validate` against PyTorch's own device-map rules.

Generates random cluster plans (valid ones and ones with random defects), asks PyTorch's
`_validate_device_maps`, `_create_reverse_mapping` and `_create_device_list` for the verdict,
asks `tensorwire validate --json` for its verdict, and compares: valid or not, the error kind,
the worker and the destination named, and for valid plans every worker's reverse maps and
device list.

The oracle is, in order of preference:
  1. the installed torch (`torch.distributed.rpc.backend_registry`), or
  2. the same functions taken from PyTorch's source text in shared/reference/seeds
     (executed with a minimal stand-in for `torch.device`).
If neither is available the script exits 77 (skipped) and says why.

Usage: diff_validate.py TENSORWIRE_BIN [--plans N] [--seed S] [--oracle torch|seed|auto]
"""

import argparse
import ast
import glob
import json
import os
import random
import subprocess
import sys
import tempfile

KINDS = [
    ("has duplicated devices", "duplicated_devices"),
    ("has devices with invalid indices", "invalid_device_indices"),
    ("has invalid target node names", "invalid_target_node_names"),
    ("has duplicated target devices", "duplicated_target_devices"),
    ("has unexpected source devices", "unexpected_source_devices"),
    ("has source devices with invalid indices", "invalid_source_device_indices"),
    ("has unexpected target devices", "unexpected_target_devices"),
    ("has target devices with invalid indices", "invalid_target_device_indices"),
]
FUNCS = ["_tensorpipe_validate_devices", "_validate_device_maps", "_create_device_list", "_create_reverse_mapping"]


class Device:
    """Stand-in for torch.device with the parts the rules use."""

    def __init__(self, s):
        if s == "cpu":
            self.type, self.index = "cpu", None
        else:
            t, i = s.split(":")
            self.type, self.index = t, int(i)

    def __eq__(self, o):
        return isinstance(o, Device) and (self.type, self.index) == (o.type, o.index)

    def __hash__(self):
        return hash((self.type, self.index))

    def __repr__(self):
        return "cpu" if self.index is None else f"{self.type}:{self.index}"


def torch_oracle():
    import torch  # noqa: F401
    from torch.distributed.rpc import backend_registry as br

    return ("torch " + torch.__version__, torch.device, {f: getattr(br, f) for f in FUNCS})


def seed_oracle():
    here = os.path.dirname(os.path.abspath(__file__))
    roots = [os.environ.get("TENSORWIRE_SEEDS", ""), os.path.join(here, "../../../shared/reference/seeds")]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "*.txt"))):
            text = open(path, encoding="utf-8").read()
            # The seed may wrap the source in markdown; take the python block if there is one.
            if "```py" in text:
                text = text.split("```py", 1)[1].split("```", 1)[0]
                text = text[text.index("\n") + 1:]
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in FUNCS]
            if {d.name for d in defs} != set(FUNCS):
                continue
            module = ast.Module(body=defs, type_ignores=[])
            class _Torch:
                device = Device
            env = {"torch": _Torch, "Set": set, "Dict": dict, "List": list}
            exec(compile(module, path, "exec"), env)
            return ("PyTorch source " + os.path.basename(path), Device, {f: env[f] for f in FUNCS})
    raise RuntimeError("no seed file with PyTorch's device-map functions found")


def gen_plan(rng):
    n = rng.randint(1, 5)
    names = [f"w{i}" for i in range(n)]
    static = rng.random() < 0.7
    pool = ["cpu"] + [f"cuda:{i}" for i in range(5)]
    workers = []
    for name in names:
        count = rng.randint(0, 4)
        # Mostly sensible choices, sometimes anything from the pool (defects happen naturally).
        own = ["cpu"] + [f"cuda:{i}" for i in range(count)]
        if rng.random() < 0.5:
            devices = []
        else:
            src = own if rng.random() < 0.8 else pool
            devices = rng.sample(src, rng.randint(1, len(src)))
            if rng.random() < 0.05:
                devices.append(devices[0])
        workers.append({"name": name, "device_count": count, "devices": devices, "device_maps": {}})
    for w in workers:
        targets = rng.sample(names, rng.randint(0, n))
        if rng.random() < 0.15:
            targets.insert(rng.randint(0, len(targets)), "ghost")
        for t in targets:
            tw = next((x for x in workers if x["name"] == t), None)
            mine = w["devices"] or ["cpu"] + [f"cuda:{i}" for i in range(w["device_count"])]
            theirs = (tw and (tw["devices"] or ["cpu"] + [f"cuda:{i}" for i in range(tw["device_count"])])) or pool
            srcs = rng.sample(mine if rng.random() < 0.85 else pool, rng.randint(0, 3) if len(mine) >= 3 else rng.randint(0, len(mine)))
            dsts_pool = theirs if rng.random() < 0.85 else pool
            if len(dsts_pool) >= len(srcs) and rng.random() < 0.9:
                dsts = rng.sample(dsts_pool, len(srcs))
            else:
                dsts = [rng.choice(dsts_pool) for _ in srcs]
            w["device_maps"][t] = dict(zip(srcs, dsts))
    return {"static_group": static, "workers": workers}


def oracle_verdict(oracle, plan):
    _, dev, f = oracle
    names = [w["name"] for w in plan["workers"]]
    counts = {w["name"]: w["device_count"] for w in plan["workers"]}
    maps = {w["name"]: {t: {dev(a): dev(b) for a, b in m.items()} for t, m in w["device_maps"].items()} for w in plan["workers"]}
    devices = {w["name"]: [dev(d) for d in w["devices"]] for w in plan["workers"]}
    try:
        f["_validate_device_maps"](names, counts, maps, devices, is_static_group=plan["static_group"])
    except ValueError as e:
        msg = str(e)
        first = msg.split("\n", 1)[0]
        kind = next(k for p, k in KINDS if p in first)
        node = first.split(" ")[1]
        target = first.rsplit(" for ", 1)[1] if " in its device map for " in first else None
        return {"valid": False, "kind": kind, "node": node, "target": target, "message": msg}
    out = {}
    for name in names:
        rev = f["_create_reverse_mapping"](name, names, maps)
        try:
            dl = f["_create_device_list"](devices[name], maps[name], rev)
        except TypeError:
            # PyTorch cannot sort a declared list that mixes cpu (index None) with CUDA devices.
            dl = sorted((d for d in devices[name] if d.type != "cpu"), key=lambda d: d.index)
        out[name] = {
            "devices": [str(d) for d in dl if d.type != "cpu"],
            "reverse_device_maps": {k: {str(a): str(b) for a, b in v.items()} for k, v in rev.items()},
        }
    return {"valid": True, "workers": out}


def ours(binary, plan, tmp):
    with open(tmp, "w") as fh:
        json.dump(plan, fh)
    p = subprocess.run([binary, "validate", "--json", tmp], capture_output=True, text=True, timeout=30)
    return p.returncode, json.loads(p.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--plans", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=20261122)
    ap.add_argument("--oracle", choices=["auto", "torch", "seed"], default="auto")
    a = ap.parse_args()

    oracle = None
    reasons = []
    if a.oracle in ("auto", "torch"):
        try:
            oracle = torch_oracle()
        except Exception as e:  # noqa: BLE001
            reasons.append(f"torch not importable ({e.__class__.__name__}: {e})")
    if oracle is None and a.oracle in ("auto", "seed"):
        try:
            oracle = seed_oracle()
        except Exception as e:  # noqa: BLE001
            reasons.append(f"seed oracle unavailable ({e})")
    if oracle is None:
        print("SKIP: " + "; ".join(reasons))
        return 77

    rng = random.Random(a.seed)
    tmp = os.path.join(tempfile.mkdtemp(), "plan.json")
    stats = {}
    failures = 0
    for i in range(a.plans):
        plan = gen_plan(rng)
        want = oracle_verdict(oracle, plan)
        code, got = ours(a.binary, plan, tmp)
        key = "valid" if want["valid"] else want["kind"]
        stats[key] = stats.get(key, 0) + 1
        problem = None
        if want["valid"]:
            if code != 0 or got.get("valid") is not True:
                problem = f"PyTorch: valid; tensorwire: exit {code} {got}"
            elif got["workers"] != want["workers"]:
                problem = f"reverse maps / devices differ:\n  PyTorch:    {want['workers']}\n  tensorwire: {got['workers']}"
        else:
            e = got.get("error") or {}
            if code != 1 or (e.get("kind"), e.get("node"), e.get("target")) != (want["kind"], want["node"], want["target"]):
                problem = f"PyTorch: {want['kind']} {want['node']} {want['target']}; tensorwire: exit {code} {got}"
            elif not e["message"].startswith(want["message"].split("\n", 1)[0]):
                problem = f"message differs: {e['message']!r} vs {want['message']!r}"
        if problem:
            failures += 1
            if failures <= 5:
                print(f"MISMATCH on plan {i}: {json.dumps(plan)}\n  {problem}")
    print(f"oracle: {oracle[0]}; {a.plans} plans; verdicts: {json.dumps(dict(sorted(stats.items())))}")
    if failures:
        print(f"{failures} mismatches")
        return 1
    missing = [k for _, k in KINDS if k not in stats]
    if missing:
        print(f"generator did not produce: {missing}")
        return 1
    print("all verdicts agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
