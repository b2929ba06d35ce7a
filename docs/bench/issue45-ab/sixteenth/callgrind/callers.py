import sys, subprocess, re, collections
# usage: callers.py A B N FUNC_SUBSTR : who calls FUNC (inclusive cost passed to it), per call
def load(f, func):
    out = subprocess.run(['callgrind_annotate','--tree=caller','--threshold=100','--auto=no',f],capture_output=True,text=True).stdout
    d = collections.Counter(); blk=[]
    for line in out.splitlines():
        if not line.strip(): blk=[]; continue
        blk.append(line)
        if '*  ' in line and func in line:
            for l in blk[:-1]:
                m = re.match(r'\s*([\d,]+) \([^)]*\)\s+<\s+(.*?) \(([\d,]+)x\)', l)
                if m: d[m.group(2)] += int(m.group(1).replace(',',''))
    return d
a,b,n,func = sys.argv[1],sys.argv[2],float(sys.argv[3]),sys.argv[4]
da,db = load(a,func),load(b,func)
for k,v in sorted(((k,(db[k]-da.get(k,0))/n) for k in db), key=lambda x:-x[1])[:25]:
    k = re.sub(r'/rustc/[0-9a-f]+/library/|/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/','',k)
    print(f"{v:8.1f}  {k[:190]}")
