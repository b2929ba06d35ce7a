#!/bin/bash
# Alternating rounds: the arena (tensorwire bench, base binary) and the standalone shapes,
# unpinned and pinned to one core. OUT=dir ROUNDS=n BIN=tensorwire binary; REVERSE=1 runs the
# shapes in the other order. Build the standalone first: gcc -O3 -o cma47 cma47.c.
set -u
OUT=${OUT:-runs}; ROUNDS=${ROUNDS:-3}; BIN=${BIN:-/work/binB/tensorwire-main19c}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for place in unpinned pinned; do
    pre=""; [ "$place" = pinned ] && pre="taskset -c 0"
    echo "round $r $place $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> "$OUT/log.txt"
    $pre "$BIN" bench collectives --world 8 --transport shm --paths arena --small-iters 50 \
      --large-iters 10 --rendezvous-world 0 --json "$OUT/bench-$place-$r.json" > /dev/null 2>&1
    shapes=("floor 8 200" "copyin 8 200" "cma 8 200 32" "cma 8 200 128")
    [ "${REVERSE:-0}" = 1 ] && shapes=("cma 8 200 128" "cma 8 200 32" "copyin 8 200" "floor 8 200")
    for m in "${shapes[@]}"; do
      $pre ./cma47 $m >> "$OUT/shapes-$place-$r.txt" 2>&1
    done
  done
done
