import sys, subprocess, re, collections
def load(f, inclusive):
    out = subprocess.run(['callgrind_annotate', '--auto=no', '--threshold=100', '--inclusive=' + ('yes' if inclusive else 'no'), f], capture_output=True, text=True).stdout
    d = collections.Counter()
    for line in out.splitlines():
        m = re.match(r'\s*([\d,]+) \([^)]*\)\s+(.*)$', line)
        if m and 'PROGRAM TOTALS' not in line:
            name = m.group(2)
            name = re.sub(r' \[[^\]]*\]$', '', name)
            name = re.sub(r'^.*?:(?=[^/:]*(::|$))', '', name, count=1) if False else name
            d[name] += int(m.group(1).replace(',', ''))
    return d
a, b, n = sys.argv[1], sys.argv[2], float(sys.argv[3])
inc = len(sys.argv) > 4 and sys.argv[4] == 'inc'
da, db = load(a, inc), load(b, inc)
diff = {k: (db[k] - da.get(k, 0)) / n for k in db}
tot = 0
for k, v in sorted(diff.items(), key=lambda x: -x[1])[:int(sys.argv[5]) if len(sys.argv) > 5 else 60]:
    print(f"{v:9.1f}  {k[-200:]}")
