#!/usr/bin/env python3
"""usage: percall.py DIR_SMALL DIR_LARGE CALLS_DIFF
Per process (caller / callee, told apart by `--serve` in the command): user-space instructions
per call and calls of malloc per call, the difference of the two runs over CALLS_DIFF calls."""
import sys, glob, re, collections

def role(f):
    for line in open(f, errors='replace'):
        if line.startswith('cmd:'):
            if '--serve' in line: return 'callee'
            if 'raw-' in line: return 'raw'
            return 'caller'
    return '?'

def parse(f):
    total = 0
    names = {}
    mallocs = 0
    cur_cfn = None
    for line in open(f, errors='replace'):
        if line.startswith('summary:') or line.startswith('totals:'):
            total = int(line.split()[1])
        m = re.match(r'cfn=\((\d+)\)(?: (.*))?', line)
        if m:
            i, name = m.group(1), m.group(2)
            if name: names[i] = name.strip()
            cur_cfn = names.get(i)
            continue
        m = re.match(r'fn=\((\d+)\)(?: (.*))?', line)
        if m and m.group(2): names[m.group(1)] = m.group(2).strip()
        if line.startswith('calls=') and cur_cfn is not None:
            if cur_cfn in ('malloc', '__libc_malloc', 'malloc'):
                mallocs += int(line.split('=')[1].split()[0])
            cur_cfn = None
    return total, mallocs

def load(d):
    out = {}
    for f in glob.glob(d + '/cg.*.out'):
        r = role(f)
        t, m = parse(f)
        out[r] = (t, m, f)
    return out

a, b, n = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3])
for r in ('caller', 'callee'):
    if r in a and r in b:
        print(f"{r}: {(b[r][0]-a[r][0])/n:,.0f} instructions/call, {(b[r][1]-a[r][1])/n:.2f} mallocs/call   ({a[r][2]} -> {b[r][2]})")
