#!/bin/bash
# usage: callgrind.sh BIN TRANSPORT CALLS OUTDIR  (docs/bench/README.md, "Where the instructions of a call go")
BIN=$1; T=$2; N=$3; OUT=$4
mkdir -p $OUT
cd $OUT
valgrind --tool=callgrind --trace-children=yes \
  --trace-children-skip-by-arg='*raw-echo*,*raw-shm-echo*' \
  --callgrind-out-file=$OUT/cg.%p.out \
  $BIN bench rpc --sync-only --transport $T --calls $N --idle-ms 0 --json $OUT/res.json > $OUT/log 2>&1
echo rc=$?
