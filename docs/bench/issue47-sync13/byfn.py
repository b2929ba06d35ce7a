import subprocess, sys, glob, re, os
# byfn.py TAG FUNC [LO HI CALLS]: exclusive per call, grouped by the (inlined-into) function,
# the difference of the runs at LO and HI iterations over the CALLS more calls between them
# (defaults: count.sh's 1000 and 2000 small iterations, 1,100 calls; issue47-ar15/count.sh's
# runs are 4 8 4)
tag, f = sys.argv[1], sys.argv[2]
lo_n, hi_n, calls = (sys.argv[3:6] + ["1000", "2000", "1100"][len(sys.argv[3:6]):])
calls = int(calls)
def prof(d):
    files = sorted(glob.glob(d + "/cg.*"), key=lambda p: -os.path.getsize(p))
    res = []
    for p in files:
        out = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", "--auto=no", p], capture_output=True, text=True).stdout
        m = {}; tot = 0
        for line in out.splitlines():
            mm = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)", line)
            if mm:
                v = int(mm.group(1).replace(",", "")); name = mm.group(2)
                name = re.sub(r" \[/.*\]$", "", name)
                if "PROGRAM TOTALS" in name: tot = v; continue
                name = name.split(":", 1)[1] if ":" in name else name
                m[name] = m.get(name, 0) + v
        if tot > 0: res.append((tot, m))
    res.sort(key=lambda x: x[0])
    return res
lo, hi = prof(f"{tag}-{lo_n}-{f}"), prof(f"{tag}-{hi_n}-{f}")
for (tl, ml), (th, mh) in list(zip(lo, hi))[:1]:
    print("rank total per call", round((th - tl) / calls))
    rows = sorted(((mh[k] - ml.get(k, 0)) / calls, k) for k in mh)[::-1]
    for d, k in rows:
        if abs(d) >= 2: print(f"{d:8.1f}  {k[:220]}")
