#!/bin/bash
# usage: ab.sh OUTDIR RUNS BASE NEW
OUT=$1; RUNS=$2; BASE=$3; NEW=$4
mkdir -p $OUT; cd $OUT
uptime > $OUT/uptime-start.txt
for i in $(seq 1 $RUNS); do
  for t in tcp shm; do
    for pin in pinned unpinned; do
      for b in base new; do
        bin=$BASE; [ $b = new ] && bin=$NEW
        pre=""; [ $pin = pinned ] && pre="taskset -c 0"
        $pre $bin bench rpc --sync-only --transport $t --idle-ms 0 --json $OUT/$b-$t-$pin-$i.json > /dev/null 2>> $OUT/log || echo "FAIL $b $t $pin $i" >> $OUT/log
      done
    done
  done
done
uptime > $OUT/uptime-end.txt
