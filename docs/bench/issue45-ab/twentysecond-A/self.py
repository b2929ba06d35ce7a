import sys, subprocess, re
# self.py SMALL LARGE N [MIN]: self instructions a call per function (file:fn), largest first
def load(f):
    out = subprocess.run(['callgrind_annotate','--threshold=100','--auto=no',f],capture_output=True,text=True).stdout
    d = {}
    for line in out.splitlines():
        m = re.match(r'\s*([\d,]+) \([^)]*\)\s+(.*)', line)
        if m:
            k = re.sub(r'^/work/\w+/','',re.sub(r' \[.*\]$','',m.group(2))); d[k] = d.get(k,0) + int(m.group(1).replace(',',''))
    return d
a,b=load(sys.argv[1]),load(sys.argv[2]); n=float(sys.argv[3]); lo=float(sys.argv[4]) if len(sys.argv)>4 else 10
rows=sorted(((b[k]-a.get(k,0))/n,k) for k in b)
rows.reverse()
for v,k in rows:
    if v>=lo:
        k = re.sub(r'/rustc/[0-9a-f]+/library/|/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/|/work/\w+/','',k)
        print(f"{v:7.0f}  {k[:170]}")
