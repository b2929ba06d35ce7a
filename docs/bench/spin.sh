#!/usr/bin/env bash
# Measures TcpConfig::spin on against off (TENSORWIRE_TCP_SPIN_US), alternating runs of the same
# release binary, unpinned and pinned to one core (see README.md here).
# Usage: docs/bench/spin.sh [OUT_DIR] [RUNS] [SPIN_US]
set -u
out=${1:-docs/bench/spin}
runs=${2:-5}
on=${3:-50}
tw=${TW:-target/release/tensorwire}
mkdir -p "$out"
for i in $(seq 1 "$runs"); do
    for pin in unpinned pinned; do
        pre=(); [ $pin = pinned ] && pre=(taskset -c 0)
        for spin in 0 "$on"; do
            tag=$pin-spin$spin-run$i
            TENSORWIRE_TCP_SPIN_US=$spin "${pre[@]}" $tw bench rpc --transport tcp \
                --calls 2000 --async-calls 20000 --tensor-64mib 1 --idle-ms 1000 \
                --json "$out/rpc-$tag.json" 2>"$out/rpc-$tag.log" || echo "rpc $tag failed"
            TENSORWIRE_TCP_SPIN_US=$spin "${pre[@]}" $tw bench collectives --transport tcp \
                --world 2,8 --rendezvous-world 0 --small-iters 500 --large-iters 5 \
                --json "$out/coll-$tag.json" 2>"$out/coll-$tag.log" || echo "coll $tag failed"
            echo "$tag done at $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
        done
    done
done
