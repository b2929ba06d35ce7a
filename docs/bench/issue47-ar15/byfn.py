import subprocess, sys, glob, re, os
# byfn.py TAG FUNC: exclusive per call, grouped by the (inlined-into) function (count.sh's runs:
# --large-iters 4 and 8, the difference over the 4 more calls; FUNC as count.sh names its folder)
tag, f = sys.argv[1], sys.argv[2]
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
lo, hi = prof(f"{tag}-4-{f}"), prof(f"{tag}-8-{f}")
for (tl, ml), (th, mh) in list(zip(lo, hi))[:1]:
    print("rank total per call", round((th - tl) / 4))
    rows = sorted(((mh[k] - ml.get(k, 0)) / 4, k) for k in mh)[::-1]
    for d, k in rows:
        if abs(d) >= 2: print(f"{d:8.1f}  {k[:220]}")
