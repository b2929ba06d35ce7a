#!/usr/bin/env python3
"""usage: fndiff.py BASE_1000 BASE_6000 AFTER_1000 AFTER_6000 (one process's callgrind files):
per function, self instructions a call (difference of the two runs over 5,500 calls), after
minus base, the ten largest cuts and the four largest growths."""
import subprocess,sys,re,collections
def fns(f):
    out=subprocess.run(['callgrind_annotate','--inclusive=no','--threshold=100',f],capture_output=True,text=True).stdout
    d=collections.Counter()
    for l in out.splitlines():
        m=re.match(r'\s*([\d,]+) \([^)]*\)\s+\S*?:(.*?)( \[.*\])?$',l)
        if m: d[m.group(2)]+=int(m.group(1).replace(',',''))
    return d
def per(a,b): 
    A,B=fns(a),fns(b); return {k:(B[k]-A[k])/5500 for k in set(A)|set(B)}
base=per(sys.argv[1],sys.argv[2]); after=per(sys.argv[3],sys.argv[4])
diff=sorted(((after.get(k,0)-base.get(k,0)),k) for k in set(base)|set(after))
for d,k in diff[:10]+diff[-4:]:
    print(f"{d:8.1f}  base {base.get(k,0):7.1f} after {after.get(k,0):7.1f}  {k[:110]}")
