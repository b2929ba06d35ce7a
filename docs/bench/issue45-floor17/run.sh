#!/bin/bash
# The epoll floor of a TCP ping-pong on this machine (issue 45): 64 bytes over loopback, a
# blocking std client and server (the raw ping-pong's shape), the same in tokio's
# current-thread runtime, and tokio with one far timer pending (tokio then gives every
# epoll_wait a timeout: an hrtimer armed and cancelled per wait, as the agent's driver timer
# does). Pinned to one core, then unpinned, ROUNDS alternating rounds.
# Usage: bash run.sh OUT_FILE [ROUNDS]   (builds into /tmp/pp-target, outside the workspace)
set -e
here=$(cd "$(dirname "$0")" && pwd)
out=$1; rounds=${2:-5}
CARGO_TARGET_DIR=/tmp/pp-target cargo build --release --offline --manifest-path "$here/Cargo.toml" -q
B=/tmp/pp-target/release/pp
: > "$out"
for pin in pinned unpinned; do
  pre=""; [ $pin = pinned ] && pre="taskset -c 0"
  for round in $(seq 1 "$rounds"); do
    for m in raw tokio tokio-timer; do
      port=$((40000 + RANDOM % 10000)); s=serve-$m; [ $m = raw ] && s=serve-raw
      $pre $B $s 127.0.0.1:$port & sleep 0.3
      echo "$pin $round $($pre $B $m 127.0.0.1:$port)" >> "$out"; wait
    done
  done
done
cat "$out"
