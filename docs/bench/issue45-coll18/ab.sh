#!/bin/bash
# Issue 45's "bench collectives no worse than 3 %": two builds (A = base, B = new) alternating,
# TCP between the ranks, world sizes 2 and 8, unpinned and pinned to one core.
# Usage: bash ab.sh OUT ROUNDS A_BIN B_BIN; then python3 summary.py OUT
set -u
OUT=$1; ROUNDS=$2; A=$3; B=$4
mkdir -p "$OUT"; cd "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for b in A B; do
    bin=$A; [ $b = B ] && bin=$B
    for pl in unpinned pinned; do
      pre=""; [ $pl = pinned ] && pre="taskset -c 0"
      echo "$(date -u +%T) $b $pl $r load: $(cut -d' ' -f1-3 /proc/loadavg)" >> loads.txt
      $pre $bin bench collectives --world 2,8 --transport tcp --small-iters 500 --large-iters 10 \
        --rendezvous-world 0 --json $b-$pl-$r.json > $b-$pl-$r.log 2>&1 || echo "FAILED $b $pl $r" >> loads.txt
    done
  done
done
echo "$(date -u +%T) done load: $(cut -d' ' -f1-3 /proc/loadavg)" >> loads.txt
