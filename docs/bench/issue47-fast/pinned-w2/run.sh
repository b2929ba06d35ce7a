#!/bin/bash
# Supplement to ../ab.sh's rounds: the pinned 2-rank figures only (--world 2), more rounds,
# main's binary (A) and hB's (B) alternating, MPICH through mpi4py in the same runs.
set -u
cd "${OUT:-.}"
for r in $(seq 1 ${ROUNDS:-10}); do
  for b in A B; do
    bin=/work/binB/tensorwire-$([ $b = A ] && echo main || echo hB)
    echo "$(date -u +%T) $b pinned $r load: $(cut -d' ' -f1-3 /proc/loadavg)" >> loads.txt
    taskset -c 0 $bin bench collectives --world 2 --transport shm --small-iters 2000 --large-iters 10 \
      --rendezvous-world 0 --paths arena --mpi-python /work/venvB/bin/python \
      --json $b-pinned-$r.json > $b-pinned-$r.log 2>&1 || echo "FAILED $b $r" >> loads.txt
  done
done
echo "$(date -u +%T) done load: $(cut -d' ' -f1-3 /proc/loadavg)" >> loads.txt
