import sys, subprocess, re
def load(f):
    out = subprocess.run(['callgrind_annotate','--threshold=100','--auto=no',f],capture_output=True,text=True).stdout
    d={}
    for line in out.splitlines():
        m=re.match(r'\s*([\d,]+) \([^)]*\)\s+(.*)',line)
        if m: d[m.group(2)]=d.get(m.group(2),0)+int(m.group(1).replace(',',''))
    return d
a,b,n=load(sys.argv[1]),load(sys.argv[2]),float(sys.argv[3])
rows=sorted(((b[k]-a.get(k,0))/n,k) for k in b)
short=lambda k: re.sub(r'/rustc/[0-9a-f]+/library/|/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/|/work/\w+/','',k)
for v,k in sorted(rows,reverse=True)[:int(sys.argv[4]) if len(sys.argv)>4 else 60]:
    print(f"{v:7.0f}  {short(k)[:160]}")
