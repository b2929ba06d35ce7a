import glob, sys
# Instructions per call and rank: (total at 2000 - total at 1000) / 1100 (warm-up included).
def totals(d):
    out = []
    for f in sorted(glob.glob(d + "/cg.*")):
        for line in open(f, errors="replace"):
            if line.startswith(("totals:", "summary:")):
                t = int(line.split()[1]);
                if t > 0: out.append(t)
                break
    return out
for b in ("main", "hB"):
    for f in ("barrier", "all_reduce", "all_gather_equal"):
        lo, hi = totals(f"{b}-1000-{f}"), totals(f"{b}-2000-{f}")
        if len(lo) == len(hi) == 2:
            print(b, f, [round((h - l) / 1100) for l, h in zip(sorted(lo), sorted(hi))])
