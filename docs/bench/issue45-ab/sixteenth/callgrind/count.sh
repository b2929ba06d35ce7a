#!/bin/bash
# usage: count.sh BIN NAME [TRANSPORT]: runs ../../callgrind.sh with --calls 1000 and 6000 into
# $CGB/NAME-{1000,6000} (CGB defaults to /work/binB/cgB), shm under `taskset -c 0`, TCP unpinned,
# and prints each side's instructions and malloc calls a call (the difference over 5,500 calls).
BIN=$1; NAME=$2; T=${3:-shm}; CGB=${CGB:-/work/binB/cgB}; HERE=$(cd "$(dirname "$0")" && pwd)
for n in 1000 6000; do
  rm -rf "$CGB/$NAME-$n"
  pre="taskset -c 0"; [ "$T" = tcp ] && pre=""
  $pre bash "$HERE/../../callgrind.sh" "$BIN" "$T" $n "$CGB/$NAME-$n"
done
python3 "$HERE/percall.py" "$CGB/$NAME-1000" "$CGB/$NAME-6000" 5500
