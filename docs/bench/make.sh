#!/usr/bin/env bash
# Makes the growth curves and one-run ratios of docs/bench/ (see README.md there).
# Usage: docs/bench/make.sh [OUT_DIR]   (from the repository root, after
#        `cargo build --release -p tensorwire-cli`; TW names another binary)
# TORCH_PYTHON: a Python with torch for the gloo comparison (optional).
# Writes OUT_DIR/*.json and *.png, OUT_DIR/ratios.md (ratios.py) and each command's standard
# error to OUT_DIR/logs/ (not committed: summaries and shutdown warnings).
set -u
out=${1:-docs/bench}
here=$(dirname "$0")
tw=${TW:-target/release/tensorwire}
torch=${TORCH_PYTHON:-$HOME/.cache/tensorwire-ci/torch-venv/bin/python}
[ -x "$tw" ] || { echo "no $tw: run cargo build --release -p tensorwire-cli first" >&2; exit 2; }
mkdir -p "$out/logs"
failed=0
run() { # name, command...: runs it, keeps its standard error, says how long it took
    local name=$1; shift
    local t0=$SECONDS rc=0
    "$@" 2>"$out/logs/$name.log" || rc=$?
    if [ $rc = 0 ]; then echo "$name: ok in $((SECONDS - t0)) s"
    else echo "$name: FAILED (rc $rc) after $((SECONDS - t0)) s, see $out/logs/$name.log"; failed=1; fi
}
# Growth curves (unpinned, as users run them).
run curve-rrefs $tw bench curve rrefs --counts 0,1000,10000,100000 \
    --json "$out/curve-rrefs.json" --png "$out/curve-rrefs.png"
run curve-peers $tw bench curve peers --world 2,4,8,16,32,64 \
    --json "$out/curve-peers.json" --png "$out/curve-peers.png"
run curve-init $tw bench curve init --world 2,4,8,16,32,64 \
    --json "$out/curve-init.json" --png "$out/curve-init.png"
run curve-payload $tw bench curve payload \
    --json "$out/curve-payload.json" --png "$out/curve-payload.png"
run curve-collectives $tw bench curve collectives --world 2,4,8,16 --sizes 8,1024,65536,1048576 \
    --json "$out/curve-collectives.json" --png "$out/curve-collectives.png"
# One-run ratios, unpinned and pinned to one core.
for pin in unpinned pinned; do
    pre=(); [ $pin = pinned ] && pre=(taskset -c 0)
    run rpc-tcp-$pin "${pre[@]}" $tw bench rpc --transport tcp --sync-only --json "$out/rpc-tcp-$pin.json"
    run rpc-shm-$pin "${pre[@]}" $tw bench rpc --transport shm --sync-only --json "$out/rpc-shm-$pin.json"
    run coll-shm-$pin "${pre[@]}" $tw bench collectives --world 2,8 --transport shm \
        --rendezvous-world 0 --json "$out/coll-shm-$pin.json"
    gloo=(); [ -x "$torch" ] && gloo=(--torch-python "$torch")
    run coll-tcp-$pin "${pre[@]}" $tw bench collectives --world 2,8 --transport tcp \
        --rendezvous-world 0 "${gloo[@]}" --json "$out/coll-tcp-$pin.json"
    run init64-$pin "${pre[@]}" $tw bench curve init --world 64 \
        --json "$out/init64-$pin.json" --png "$out/logs/init64-$pin.png"
    run rrefs-$pin "${pre[@]}" $tw bench curve rrefs --counts 0,100000 \
        --json "$out/rrefs-$pin.json" --png "$out/logs/rrefs-$pin.png"
    # Throughput, 64 MiB and the idle agent's CPU time (TCP), and the distributed backward.
    run rpc-full-tcp-$pin "${pre[@]}" $tw bench rpc --transport tcp --json "$out/rpc-full-tcp-$pin.json"
    run autograd-$pin "${pre[@]}" $tw bench autograd --steps 200 --json "$out/autograd-$pin.json"
    # An honest caller's p99 during a flood (never-reading; requests) against none.
    run fairness-$pin "${pre[@]}" $tw bench fairness --json "$out/fairness-$pin.json"
done
python3 "$here/ratios.py" "$out" >"$out/ratios.md" && echo "ratios: $out/ratios.md"
exit $failed
