"""Prints a cprof.py run's functions per step for each worker: calls, own us, inclusive us (cProfile's, so inflated by the profiler), sorted by "tottime", "calls" or "cum"::

    python show.py /tmp/cp-new calls 60
"""
import pstats, sys, json
pre = sys.argv[1]; sort = sys.argv[2] if len(sys.argv) > 2 else "tottime"; n = int(sys.argv[3]) if len(sys.argv) > 3 else 45
for r in (0, 1, 2):
    meta = json.load(open(f"{pre}.{r}.json"))
    st = pstats.Stats(f"{pre}.{r}.prof")
    steps = meta["steps"]
    print(f"=== rank {r}: {meta.get('calls_per_step', 0):.1f} calls/step, cpu {meta.get('cpu_us_per_step', 0):.0f} us/step")
    rows = []
    for (f, l, fn), (cc, nc, tt, ct, callers) in st.stats.items():
        rows.append((tt if sort == "tottime" else (nc if sort == "calls" else ct), nc / steps, tt / steps * 1e6, ct / steps * 1e6, f"{f.split('site-packages/')[-1].split('python/tensorwire/')[-1]}:{l}({fn})"))
    rows.sort(reverse=True)
    for _, c, tt, ct, name in rows[:n]:
        print(f"{c:6.2f} {tt:8.1f} {ct:8.1f}  {name}")
