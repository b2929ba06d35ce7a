#!/usr/bin/env python3
"""usage: syscalls.py SMALL.txt LARGE.txt N: per-call system calls of each process of a
`bench rpc` run traced with `strace -f -o FILE -e trace=execve,clone,clone3,...` (the lines
begin with the thread id), grouped by process (a thread belongs to the process that cloned it
with CLONE_THREAD; a process is named by its execve's arguments), as the difference between two
runs over N calls."""
import re, sys, collections

def parse(path):
    owner = {}   # tid -> process id (tgid)
    name = {}    # tgid -> name
    counts = collections.defaultdict(collections.Counter)
    pending = {}  # tid -> whether its unfinished clone is a thread
    first = None
    for line in open(path):
        m = re.match(r"(\d+)\s+(.*)", line)
        if not m:
            continue
        tid, rest = int(m.group(1)), m.group(2)
        if first is None:
            first = tid
            owner[tid] = tid
        tg = owner.setdefault(tid, tid)
        if rest.startswith("execve("):
            args = re.search(r'\[(.*?)\]', rest).group(1)
            a = [x.strip('" ') for x in args.split(",")]
            label = "caller" if "--serve" not in a and a[2:3] == ["rpc"] else (
                "callee" if "--serve" in a else a[2])
            name[tg] = label
            continue
        mc = re.match(r"(clone3?|vfork|fork)\((.*)", rest)
        if mc:
            pending[tid] = "CLONE_THREAD" in rest
            mr = re.search(r"= (\d+)$", rest.strip())
            if mr:
                child = int(mr.group(1))
                owner[child] = tg if pending.pop(tid) else child
            continue
        mres = re.match(r"<\.\.\. (clone3?|vfork|fork) resumed>.*= (\d+)", rest)
        if mres:
            child = int(mres.group(2))
            owner[child] = tg if pending.pop(tid, False) else child
            continue
        ms = re.match(r"(\w+)\(", rest) or re.match(r"<\.\.\. (\w+) resumed>", rest)
        if ms and not rest.startswith("<..."):
            counts[tg][ms.group(1)] += 1
    return {name.get(k, str(k)): v for k, v in counts.items()}

small, large, n = parse(sys.argv[1]), parse(sys.argv[2]), int(sys.argv[3])
for proc in sorted(large):
    s = small.get(proc, collections.Counter())
    diffs = {k: (large[proc][k] - s[k]) / n for k in large[proc]}
    print(proc, " ".join(f"{k} {v:.2f}" for k, v in sorted(diffs.items()) if abs(v) >= 0.005))
