import re,sys
f,pid=sys.argv[1],sys.argv[2]
prev=None
for line in open(f):
    if not line.startswith(pid+' '): continue
    if 'epoll_wait' not in line: continue
    t=re.search(r', 1024, (-?\d+)\)',line)
    if not t: continue
    ts=line.split()[1]; to=int(t.group(1))
    c='inf' if to==-1 else 'zero' if to==0 else 'ms' if to<1000 else 's'
    if c!=prev: print(ts,to); prev=c
