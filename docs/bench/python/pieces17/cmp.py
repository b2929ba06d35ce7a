"""base vs new per-function CPU us per step (worker0: 1000 timed steps; callees: whole run incl. 20 warm-up steps and setup, per 1000)."""
import json, sys
runs = sys.argv[1:]  # prefixes like cpu-base-1
for r in range(3):
    tabs = [json.load(open(f"{p}.{r}.json")) for p in runs]
    keys = sorted(set().union(*tabs), key=lambda k: -tabs[0].get(k, [0])[0])
    print(f"--- worker{r}: CPU us per step: " + " | ".join(runs))
    for k in keys:
        vals = [t.get(k, [0, 0]) for t in tabs]
        if not any(v[1] for v in vals): continue
        print(f"{k:36s} " + " ".join(f"{v[0]/1000/1000:7.1f}" for v in vals) + f"   ({vals[0][1]/1000:.2f}/step)")
