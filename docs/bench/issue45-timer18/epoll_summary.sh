#!/bin/bash
# usage: epoll_summary.sh STRACE_FILE : per pid, the count of epoll_wait calls by timeout class
f=$1
python3 - "$f" <<'PY'
import re,sys,collections
pids=collections.defaultdict(collections.Counter)
unf={}
for line in open(sys.argv[1]):
    m=re.match(r"(\d+)\s+(?:[0-9:.]+\s+)?epoll_wait\((\d+), (.*)",line)
    r=re.match(r"(\d+)\s+(?:[0-9:.]+\s+)?<\.\.\. epoll_wait resumed>(.*)",line)
    if m:
        pid,rest=m.group(1),m.group(3)
        if '<unfinished' in rest: unf[pid]=True; continue
        t=re.search(r', (\d+), (-?\d+)\) *=',rest)
    elif r:
        pid,rest=r.group(1),r.group(2)
        t=re.search(r', (\d+), (-?\d+)\) *=',rest)
    else: continue
    if not t: continue
    to=int(t.group(2))
    cls = '-1' if to==-1 else '0' if to==0 else '1..999ms' if to<1000 else '1..59s' if to<60000 else '>=60s'
    pids[pid][cls]+=1
for pid,c in pids.items():
    print(pid, sum(c.values()), dict(c))
PY
