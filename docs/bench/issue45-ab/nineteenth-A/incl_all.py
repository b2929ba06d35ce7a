import sys, subprocess, re
# usage: incl_all.py SMALL LARGE N [MIN]: every function whose inclusive instructions a call (the
# difference of the two runs over N calls) reach MIN (200), with its calls a call; largest first.
def load(f):
    out = subprocess.run(['callgrind_annotate', '--inclusive=yes', '--threshold=100', '--auto=no', f],
                         capture_output=True, text=True).stdout
    d = {}
    for line in out.splitlines():
        m = re.match(r'\s*([\d,]+) \([^)]*\)\s+(?:\* )?\s*(.*)', line)
        if m: d[m.group(2)] = d.get(m.group(2), 0) + int(m.group(1).replace(',', ''))
    return d
def calls(f):
    # calls of each function (the sum of its callers' call counts)
    out = subprocess.run(['callgrind_annotate', '--tree=caller', '--inclusive=yes', '--threshold=100', '--auto=no', f],
                         capture_output=True, text=True).stdout
    c = {}; pend = 0
    for line in out.splitlines():
        m = re.match(r'\s*([\d,]+) \([^)]*\)\s+<\s+.* \(([\d,]+)x\)', line)
        if m: pend += int(m.group(2).replace(',', '')); continue
        m = re.match(r'\s*([\d,]+) \([^)]*\)\s+\*\s+(.*)', line)
        if m: c[m.group(2)] = c.get(m.group(2), 0) + pend; pend = 0
    return c
a, b, n = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3])
ca, cb = calls(sys.argv[1]), calls(sys.argv[2])
lo = float(sys.argv[4]) if len(sys.argv) > 4 else 200
short = lambda k: re.sub(r'/rustc/[0-9a-f]+/library/|/root/.cargo/registry/src/index.crates.io-[0-9a-f]+/|/work/\w+/|\[.*?\]', '', k)
rows = []
for k in b:
    v = (b[k] - a.get(k, 0)) / n
    if v >= lo:
        rows.append((v, (cb.get(k, 0) - ca.get(k, 0)) / n, k))
for v, c, k in sorted(rows, key=lambda r: -r[0]):
    print(f"{v:8.0f} {c:6.2f}x  {short(k)[:170]}")
