"""Summarizes alternating suite runs (``python -m tensorwire.bench autograd --repeat 1 --pin both
--json DIR/TREE-ROUND.json``): per figure, each tree's speedups over PyTorch's RPC, their
median, and tensorwire's and PyTorch's median us/step::

    python suite_ab.py suite-ab base new
"""
import glob
import json
import statistics
import sys

folder, trees = sys.argv[1], sys.argv[2:]
rows: dict = {}
for tree in trees:
    for path in sorted(glob.glob(f"{folder}/{tree}-*.json")):
        for s in json.load(open(path))["summary"]:
            rows.setdefault((s["pin"], s["figure"]), {}).setdefault(tree, []).append(s)
print(f"{'placement':9} {'figure':9} " + " ".join(f"{t + ' speedups (median)':44} {t + ' tw / pt us':18}" for t in trees))
for (pin, fig), by in rows.items():
    line = f"{pin:9} {fig:9} "
    for t in trees:
        runs = by.get(t, [])
        sp = [r["speedup"] for r in runs]
        cells = " ".join(f"{x:.2f}" for x in sp)
        line += f"{cells} ({statistics.median(sp):.2f})".ljust(45)
        line += f"{statistics.median(r['tensorwire'] for r in runs):7.0f} / {statistics.median(r['tensorpipe'] for r in runs):7.0f}   "
    print(line)
