#!/bin/bash
# count.sh BIN TAG PATTERN...: instructions per 1 MiB all_reduce (f32 sum) and rank at 8 ranks
# (callgrind, pinned to one core, arena path): `bench collectives --world 8` at --large-iters 4
# and 8 (3 warm-up calls in both), the difference over the 4 more calls, in the functions
# matching --toggle-collect="*PATTERN*" (e.g. "Collectives::all_reduce" for the whole call,
# "reduce_into" for the reduction). By function: `python3 ../issue47-sync13/byfn.py TAG
# PATTERN 4 8 4` (PATTERN as this names its folder). Each rank's figure is printed, sorted.
set -u
cd "${OUT:-/work/binB/cg15}"
bin=$1; tag=$2; shift 2
for f in "$@"; do
  for n in 4 8; do
    d=$tag-$n-${f//[:*]/_}; rm -rf $d; mkdir -p $d
    valgrind --tool=callgrind --trace-children=yes --toggle-collect="*$f*" \
      --callgrind-out-file=$d/cg.%p taskset -c 0 $bin bench collectives \
      --world 8 --transport shm --small-iters 10 --large-iters $n --rendezvous-world 0 --paths arena --timeout 900 \
      > $d/run.log 2>&1
  done
  python3 - "$tag" "${f//[:*]/_}" <<'PY'
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
lo, hi = totals(f"{tag}-4-{f}"), totals(f"{tag}-8-{f}")
print(tag, f, [round((h - l) / 4) for l, h in zip(sorted(lo), sorted(hi))])
PY
done
