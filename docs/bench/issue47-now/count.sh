#!/bin/bash
# Instructions per barrier / 8-byte all_reduce and rank (callgrind, 2 ranks pinned, arena path):
# the same run at --small-iters 1000 and 2000; the difference over the 1,100 more calls.
set -u
cd /work/binB/cg4
for b in main hB; do
  for n in 1000 2000; do
    for f in barrier all_reduce; do
      d=$b-$n-$f; mkdir -p $d
      valgrind --tool=callgrind --trace-children=yes --toggle-collect="*Collectives::$f*" \
        --callgrind-out-file=$d/cg.%p taskset -c 0 /work/binB/tensorwire-$b bench collectives \
        --world 2 --transport shm --small-iters $n --large-iters 1 --rendezvous-world 0 --paths arena \
        > $d/run.log 2>&1
    done
  done
done
