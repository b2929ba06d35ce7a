import sys, subprocess, re, collections
# usage: callees.py A B N FUNC_SUBSTR : what FUNC calls (inclusive), per call
def load(f, func):
    out = subprocess.run(['callgrind_annotate','--tree=calling','--inclusive=yes','--threshold=100','--auto=no',f],capture_output=True,text=True).stdout
    d = collections.Counter(); on=False
    for line in out.splitlines():
        if not line.strip(): on=False; continue
        if '*  ' in line:
            on = func in line
            if on:
                m = re.match(r'\s*([\d,]+)', line); d['*SELF/INCL*'] += int(m.group(1).replace(',',''))
            continue
        if on:
            m = re.match(r'\s*([\d,]+) \([^)]*\)\s+>\s+(.*?) \(([\d,]+)x\)', line)
            if m: d[m.group(2)] += int(m.group(1).replace(',',''))
    return d
a,b,n,func = sys.argv[1],sys.argv[2],float(sys.argv[3]),sys.argv[4]
da,db = load(a,func),load(b,func)
for k,v in sorted(((k,(db[k]-da.get(k,0))/n) for k in db), key=lambda x:-x[1])[:int(sys.argv[5]) if len(sys.argv)>5 else 25]:
    k = re.sub(r'/rustc/[0-9a-f]+/library/|/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/','',k)
    if abs(v) >= 5: print(f"{v:8.1f}  {k[:190]}")
