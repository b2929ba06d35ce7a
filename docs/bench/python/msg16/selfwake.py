"""Per gradient message of the backward: wake-ups a sender's process gave its own threads
between the sender's ``export<`` and the receiver's ``import>``, and wake-ups of the
receiver's threads (``python selfwake.py RAW.json PERF.txt``, made as ``msg_sched.py`` says)."""
import json, sys, re
from bisect import bisect_left, bisect_right
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # msg_sched.py beside it
from msg_sched import load_perf
raw = json.load(open(sys.argv[1])); perf = load_perf(sys.argv[2])
times = [e[0] for e in perf]
tid_pid = {}
for _, pid, tid, *_ in perf: tid_pid.setdefault(tid, pid)
marks = sorted((t, tag, tid, proc) for proc, evs in raw.items() for t, tag, tid in evs)
mt=[m[0] for m in marks]
drv = raw['worker0']; wins=[]; s=None
for t, tag, _ in drv:
    if tag == 'dist_backward>': s=t
    elif tag == 'dist_backward<' and s: wins.append((s,t)); s=None
stats={}
for a,b in wins:
    inwin = marks[bisect_left(mt,a):bisect_right(mt,b)]
    hop=0
    for i,(t,tag,tid,proc) in enumerate(inwin):
        if tag!='export<': continue
        imp = next(((t2,tid2,p2) for t2,tag2,tid2,p2 in inwin[i+1:] if tag2=='import>' and p2!=proc), None)
        if not imp: continue
        hop+=1
        sp = tid_pid.get(tid); rp = tid_pid.get(imp[1])
        seg = perf[bisect_left(times,t):bisect_right(times,imp[0])]
        own = sum(1 for e in seg if e[4]=='sched:sched_wakeup' and e[1]==sp and tid_pid.get(int(re.search(r' pid=(\d+)', e[5]).group(1)))==sp)
        rw = sum(1 for e in seg if e[4]=='sched:sched_wakeup' and tid_pid.get(int(re.search(r' pid=(\d+)', e[5]).group(1)))==rp)
        st = stats.setdefault(hop, [0,0,0,[]]); st[0]+=1; st[1]+=own; st[2]+=rw; st[3].append((imp[0]-t)/1e3)
import statistics
for h,(n,own,rw,tot) in sorted(stats.items()):
    print(f"hop{h}: {n} msgs, sender-process self wakeups/msg {own/n:.2f}, wakeups of receiver threads/msg {rw/n:.2f}, median total {statistics.median(tot):.1f} us")
