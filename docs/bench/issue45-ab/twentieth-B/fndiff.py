import sys, subprocess, re
# usage: fndiff.py A_SMALL A_LARGE B_SMALL B_LARGE N [MIN]: self instructions a call per function, B - A
def load(f):
    out = subprocess.run(['callgrind_annotate','--threshold=100','--auto=no',f],capture_output=True,text=True).stdout
    d={}
    for line in out.splitlines():
        m=re.match(r'\s*([\d,]+) \([^)]*\)\s+(.*?)(\s+\[.*\])?$',line)
        if m:
            k=re.sub(r"^/work/\w+/","",re.sub(r"\s*\[[^\]]*\]\s*$","",m.group(2))); d[k]=d.get(k,0)+int(m.group(1).replace(",",""))
    return d
a1,a2,b1,b2=[load(f) for f in sys.argv[1:5]]; n=float(sys.argv[5]); lo=float(sys.argv[6]) if len(sys.argv)>6 else 8
short=lambda k: re.sub(r'/rustc/[0-9a-f]+/library/|/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/|/work/\w+/','',k)
keys=set(a2)|set(b2); rows=[]
for k in keys:
    va=(a2.get(k,0)-a1.get(k,0))/n; vb=(b2.get(k,0)-b1.get(k,0))/n
    if abs(vb-va)>=lo: rows.append((vb-va,va,vb,k))
for d,va,vb,k in sorted(rows):
    print(f"{d:+7.0f} {va:7.0f} -> {vb:7.0f}  {short(k)[:150]}")
print(f"sum of rows shown: {sum(r[0] for r in rows):+.0f}")
