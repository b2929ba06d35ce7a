#!/usr/bin/env python3
"""Medians over rounds of runs/ (rounds.sh): wall and work-CPU per shape, ratios to the same
round's floor; the arena's own (bench JSON) beside them."""
import glob, json, re, statistics as st, sys
d = sys.argv[1] if len(sys.argv) > 1 else "runs"
pat = re.compile(r"(\w+) w8 chunk (\d+)KiB: median ([\d.]+) us .*all ranks ([\d.]+) us")
for place in ("unpinned", "pinned"):
    rows = {}
    for f in sorted(glob.glob(f"{d}/shapes-{place}-*.txt")):
        r = f.rsplit("-", 1)[1][:-4]
        got = {}
        for line in open(f):
            m = pat.match(line)
            if m:
                name = m[1] if m[1] != "cma" else f"cma{m[2]}"
                got[name] = (float(m[3]), float(m[4]))
        b = json.load(open(f"{d}/bench-{place}-{r}.json"))
        got["arena (bench)"] = (b["all_reduce_w8_1MiB_in_place_us"], None)
        got["floor (bench)"] = (b["memcpy_all_ranks_w8_all_reduce_1MiB_us"], None)
        for k, v in got.items():
            fl = got["floor (bench)" if "bench" in k else "floor"][0]
            rows.setdefault(k, []).append((v[0], v[1], v[0] / fl,
                                           v[1] / got["floor"][1] if v[1] else None))
    print(f"## {place}, {len(rows['floor'])} rounds: median (range)")
    print("| shape | wall us | / floor (same run) | work CPU us, 8 ranks | / floor's |")
    print("| --- | --- | --- | --- | --- |")
    for k, v in rows.items():
        def f(i, fmt):
            xs = [x[i] for x in v if x[i] is not None]
            return "-" if not xs else f"{fmt.format(st.median(xs))} ({fmt.format(min(xs))} to {fmt.format(max(xs))})"
        print(f"| {k} | {f(0,'{:.0f}')} | {f(2,'{:.2f}')} | {f(1,'{:.0f}')} | {f(3,'{:.2f}')} |")
    print()
