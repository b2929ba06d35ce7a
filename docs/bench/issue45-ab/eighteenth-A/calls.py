import sys, subprocess, re
# usage: calls.py SMALL LARGE N PATTERN...: calls a call to functions matching each pattern, by caller
def load(f):
    out = subprocess.run(['callgrind_annotate','--tree=caller','--inclusive=yes','--threshold=100','--auto=no',f],capture_output=True,text=True).stdout
    d = {}; callers = {}
    pend = []
    for line in out.splitlines():
        m = re.match(r'\s*([\d,]+) \([^)]*\)\s+<\s+(.*) \(([\d,]+)x\)', line)
        if m:
            pend.append((m.group(2), int(m.group(3).replace(',',''))))
            continue
        m = re.match(r'\s*([\d,]+) \([^)]*\)\s+\*\s+(.*)', line)
        if m:
            fn = m.group(2)
            for c,n in pend:
                callers[(fn,c)] = callers.get((fn,c),0)+n
            pend = []
    return callers
a,b,n = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3])
short = lambda k: re.sub(r'/rustc/[0-9a-f]+/library/|/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/|/work/\w+/|\[.*?\]','',k)
for pat in sys.argv[4:]:
    tot = {}
    for (fn,c),v in b.items():
        if re.search(pat, fn):
            d = (v - a.get((fn,c),0))/n
            if abs(d) >= 0.05: tot[(fn,c)] = d
    print(f"== {pat}: total {sum(tot.values()):.2f} a call")
    for (fn,c),v in sorted(tot.items(), key=lambda x:-x[1])[:8]:
        print(f"   {v:6.2f}  {short(fn)[:90]}  <  {short(c)[:110]}")
