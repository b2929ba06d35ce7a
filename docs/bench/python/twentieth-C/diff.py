"""Per worker, the functions whose calls per step differ by 0.5 or more between two cprof.py runs (line numbers move with edits: a function renumbered shows as one gone, one new)::

    python diff.py /tmp/cp-base /tmp/cp-new
"""
import pstats, sys, json
a, b = sys.argv[1], sys.argv[2]
for r in (0, 1, 2):
    res = {}
    for tag, pre in (("a", a), ("b", b)):
        steps = json.load(open(f"{pre}.{r}.json"))["steps"]
        for (f, l, fn), (cc, nc, tt, ct, callers) in pstats.Stats(f"{pre}.{r}.prof").stats.items():
            key = f"{f.split('site-packages/')[-1].split('python/tensorwire/')[-1]}:{l}({fn})"
            res.setdefault(key, {"a": 0, "b": 0})[tag] += nc / steps
    print(f"=== rank {r}")
    rows = sorted(res.items(), key=lambda kv: kv[1]["b"] - kv[1]["a"])
    for k, v in rows:
        d = v["b"] - v["a"]
        if abs(d) >= 0.5:
            print(f"{v['a']:6.2f} -> {v['b']:6.2f}  {k}")
