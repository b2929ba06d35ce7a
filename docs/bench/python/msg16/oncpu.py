"""CPU time by thread name over the traced tensorwire window (the raw marks' span), from the
``sched_switch`` events of the perf trace ``msg_sched.py`` describes:
``python oncpu.py RAW.json PERF.txt``."""
import json, re, sys
from collections import defaultdict
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # msg_sched.py beside it
from msg_sched import load_perf
raw = json.load(open(sys.argv[1])); perf = load_perf(sys.argv[2])
ts=[e[0] for v in raw.values() for e in v]; a,b=min(ts),max(ts)
cur={}; acc=defaultdict(int)
for t,pid,tid,cpu,ev,rest in perf:
    if ev!='sched:sched_switch': continue
    m=re.search(r'prev_comm=(.*?) prev_pid=.*next_comm=(.*?) next_pid=', rest)
    if cpu in cur and a<=t<=b:
        st,comm=cur[cpu]; acc[comm]+=t-max(st,a)
    cur[cpu]=(t,m.group(2))
tot=sum(acc.values())
for k,v in sorted(acc.items(), key=lambda x:-x[1])[:12]: print(f"{k:20s} {100*v/tot:5.1f}%")
print('window s', (b-a)/1e9)
