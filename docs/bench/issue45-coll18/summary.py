"""Medians of each timed key over the rounds, A and B, and B / A, per placement (ab.sh's files)."""
import glob
import json
import statistics
import sys

out = sys.argv[1]
for pl in ("unpinned", "pinned"):
    runs = {b: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{b}-{pl}-*.json"))] for b in "AB"}
    if not runs["A"] or not runs["B"]:
        continue
    print(f"{pl}: {len(runs['A'])} rounds of A, {len(runs['B'])} of B; medians, us")
    print(f"  {'key':44} {'A':>10} {'B':>10} {'B/A':>6}")
    for key in runs["A"][0]:
        if not key.endswith("_us") or key.startswith(("memcpy", "raw")):
            continue
        a = statistics.median(r[key] for r in runs["A"] if key in r)
        b = statistics.median(r[key] for r in runs["B"] if key in r)
        print(f"  {key:44} {a:10.2f} {b:10.2f} {b / a:6.2f}")
