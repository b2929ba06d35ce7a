#!/usr/bin/env python3
"""usage: events.py SMALL.data LARGE.data N: per-call events of each process of a `bench rpc
--transport shm` run recorded with `perf record -e context-switches -e syscalls:...`, as the
difference between two runs over N calls. The four processes are told apart by the order of
their process ids: the caller, `raw-echo`, `raw-shm-echo`, the callee (the order the caller
starts them in; a run's pids are consecutive enough for that)."""
import collections, subprocess, sys

ROLES = ["caller", "raw-echo", "raw-shm-echo", "callee"]

def load(path):
    out = subprocess.run(["perf", "script", "-i", path, "-F", "pid,event"],
                         capture_output=True, text=True).stdout
    c = collections.defaultdict(collections.Counter)
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            c[int(parts[0])][parts[1].rstrip(":")] += 1
    pids = sorted(c)
    return {ROLES[i] if i < len(ROLES) else str(p): c[p] for i, p in enumerate(pids)}

small, large, n = load(sys.argv[1]), load(sys.argv[2]), int(sys.argv[3])
for role in ROLES:
    s, l = small.get(role, collections.Counter()), large.get(role, collections.Counter())
    print(f"{role:13}", "  ".join(f"{k.split(':')[-1]} {(l[k] - s[k]) / n:.2f}"
                                  for k in sorted(set(l) | set(s))))
