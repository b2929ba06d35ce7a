#!/bin/bash
# A/B of the arena bench (issue 47, one coder + all_gather length skip): main's binary (A,
# aac994a) against hB's (B), alternating, unpinned and pinned.
set -u
cd "${OUT:-/work/binB/ab47}"  # the run folder (the idle runs: OUT=/work/binB/idle)
ROUNDS=${ROUNDS:-3}
EXTRA=${EXTRA:-}
for r in $(seq ${FIRST:-1} $ROUNDS); do
  for b in A B; do
    # The two builds (A_BIN and B_BIN override them, e.g. for idle-rooted/).
    bin=${A_BIN:-/work/binB/tensorwire-main}; [ $b = B ] && bin=${B_BIN:-/work/binB/tensorwire-hB}
    for pl in unpinned pinned; do
      pre=""; [ $pl = pinned ] && pre="taskset -c 0"
      echo "$(date -u +%T) $b $pl $r load: $(cut -d' ' -f1-3 /proc/loadavg)" >> loads.txt
      $pre $bin bench collectives --world 2,8 --transport shm --small-iters 500 --large-iters 10 \
        --rendezvous-world 0 --paths arena --mpi-python /work/venvB/bin/python $EXTRA \
        --json $b-$pl-$r.json > $b-$pl-$r.log 2>&1 || echo "FAILED $b $pl $r" >> loads.txt
    done
  done
done
echo "$(date -u +%T) done load: $(cut -d' ' -f1-3 /proc/loadavg)" >> loads.txt
