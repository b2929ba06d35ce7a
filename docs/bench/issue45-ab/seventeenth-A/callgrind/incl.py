import sys, subprocess, re
# usage: incl.py SMALL LARGE N PATTERN...: inclusive instructions per call of functions matching each pattern
def load(f):
    out = subprocess.run(['callgrind_annotate','--inclusive=yes','--threshold=100','--auto=no',f],capture_output=True,text=True).stdout
    d = {}
    for line in out.splitlines():
        m = re.match(r'\s*([\d,]+) \([^)]*\)\s+(?:\* )?\s*(.*)', line)
        if m: d[m.group(2)] = d.get(m.group(2),0) + int(m.group(1).replace(',',''))
    return d
a,b,n = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3])
for pat in sys.argv[4:]:
    tot = {}
    for k in b:
        if re.search(pat, k):
            tot[k] = (b[k]-a.get(k,0))/n
    best = sorted(tot.items(), key=lambda x:-x[1])[:2]
    for k,v in best:
        k = re.sub(r'/rustc/[0-9a-f]+/library/|/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/|/work/\w+/','',k)
        print(f"{v:8.0f}  {pat:40s} {k[:150]}")
