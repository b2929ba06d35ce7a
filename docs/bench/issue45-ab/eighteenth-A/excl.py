import sys, subprocess, re
# usage: excl.py A_SMALL A_LARGE B_SMALL B_LARGE N: self instructions a call per function, A vs B, largest differences
def load(f):
    out = subprocess.run(['callgrind_annotate','--threshold=100','--auto=no',f],capture_output=True,text=True).stdout
    d = {}
    for line in out.splitlines():
        m = re.match(r'\s*([\d,]+) \([^)]*\)\s+(.*)', line)
        if m:
            # The binary's name off, and the worktree's (/work/main/, /work/wB/ ...), so that builds
            # from two worktrees compare.
            k = re.sub(r'^/work/\w+/','',re.sub(r' \[.*\]$','',m.group(2))); d[k] = d.get(k,0) + int(m.group(1).replace(',',''))
    return d
a1,a2,b1,b2 = [load(f) for f in sys.argv[1:5]]; n=float(sys.argv[5])
keys=set(a2)|set(b2)
diff=[]
for k in keys:
    a=(a2.get(k,0)-a1.get(k,0))/n; b=(b2.get(k,0)-b1.get(k,0))/n
    if abs(b-a)>=8: diff.append((b-a,a,b,k))
for d,a,b,k in sorted(diff):
    k = re.sub(r'/rustc/[0-9a-f]+/library/|/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/|/work/\w+/','',k)
    print(f"{d:+7.0f} {a:7.0f} {b:7.0f}  {k[:150]}")
