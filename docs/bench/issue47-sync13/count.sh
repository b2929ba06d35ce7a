#!/bin/bash
# count.sh BIN TAG FUNC...: instructions per call and rank (callgrind, 2 ranks pinned, arena path):
# the same run at --small-iters 1000 and 2000, the difference over the 1,100 more calls, with
# --toggle-collect="*${PAT}FUNC*" (PAT defaults to "Collectives::"; the barrier's future is
# RunUnit since 40a85c7: PAT="" ... RunUnit; the all_gather's: PAT=ext:: ... gathered).
# byfn.py TAG FUNC: the same difference by function (exclusive, inlined code with its host).
set -u
cd "${OUT:-/work/binB/cg13}"
bin=$1; tag=$2; shift 2
for f in "$@"; do
  for n in 1000 2000; do
    d=$tag-$n-$f; rm -rf $d; mkdir -p $d
    valgrind --tool=callgrind --trace-children=yes --toggle-collect="*${PAT-Collectives::}$f*" \
      --callgrind-out-file=$d/cg.%p taskset -c 0 $bin bench collectives \
      --world 2 --transport shm --small-iters $n --large-iters 1 --rendezvous-world 0 --paths arena \
      > $d/run.log 2>&1
  done
  python3 - "$tag" "$f" <<'PY'
import glob, sys
tag, f = sys.argv[1], sys.argv[2]
def totals(d):
    out = []
    for p in sorted(glob.glob(d + "/cg.*")):
        for line in open(p, errors="replace"):
            if line.startswith(("totals:", "summary:")):
                t = int(line.split()[1])
                if t > 0: out.append(t)
                break
    return out
lo, hi = totals(f"{tag}-1000-{f}"), totals(f"{tag}-2000-{f}")
print(tag, f, [round((h - l) / 1100) for l, h in zip(sorted(lo), sorted(hi))], lo, hi)
PY
done
