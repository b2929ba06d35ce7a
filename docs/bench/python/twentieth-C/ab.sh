#!/bin/bash
# Alternating A/B of msg16/solo.py's pipeline step (tensorwire only, no PyTorch agent), every
# worker's process CPU per step taken by cprof.py (CPROF=0: nothing profiled).
#   ab.sh OUT.jsonl ROUNDS STEPS NAME=PYTHONPATH_ROOT ...
# Appends one line per worker per run: {tree, round, rank, cpu_us_per_step, ...} and the
# driver's step figures (rank -1).
set -u
out=$1; rounds=$2; steps=$3; shift 3
here=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-/root/.cache/tensorwire-ci/torch-venv/bin/python}
for r in $(seq 1 "$rounds"); do
  for spec in "$@"; do
    name=${spec%%=*}; root=${spec#*=}
    tmp=$(mktemp -d)
    CPROF=${CPROF:-0} CPROF_OUT=$tmp/p SOLO_HOOKS=cprof PYTHONPATH=$root:$here:$here/../msg16 \
      "$PY" "$here/../msg16/solo.py" tensorwire 0 "$steps" "$tmp/steps.jsonl" > "$tmp/log" 2>&1
    "$PY" - "$tmp" "$name" "$r" "$out" <<'PYEOF'
import json, sys, glob
tmp, name, r, out = sys.argv[1:]
lines = []
for l in open(f"{tmp}/steps.jsonl"):
    d = json.loads(l); d.update(tree=name, round=int(r), rank=-1); lines.append(d)
for f in sorted(glob.glob(f"{tmp}/p.*.json")):
    d = json.load(open(f)); d.update(tree=name, round=int(r)); lines.append(d)
with open(out, "a") as fh:
    for d in lines:
        fh.write(json.dumps(d) + "\n")
print(name, r, " ".join(f"r{d['rank']}:{d.get('cpu_us_per_step', d.get('median_us', 0)):.0f}" for d in lines), "load", open("/proc/loadavg").read().split()[0])
PYEOF
    rm -rf "$tmp"
  done
done
