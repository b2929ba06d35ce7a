"""py-spy --gil raw stacks of worker0's timed steps (stacks through `_Engine.step`), leaf counts per function and per line for the named functions."""
import collections, re, sys
FRAME = re.compile(r"^(.*?) \((.*?):(\d+)\)$")
def fold(path):
    leaf, incl, total = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        n = int(n)
        frames = stack.split(";")
        if not any(f.startswith("_Engine.step ") for f in frames):
            continue
        total += n
        names = []
        for f in frames:
            m = FRAME.match(f)
            if m:
                names.append(f"{m.group(1)} {m.group(2).rsplit('/', 1)[-1]}")
        leaf[names[-1]] += n
        for f in set(names):
            incl[f] += n
    return total, leaf, incl
runs = sys.argv[1:]
res = [fold(p) for p in runs]
print("worker0's steps, samples holding the GIL: " + " | ".join(f"{p}: {r[0]}" for p, r in zip(runs, res)))
keys = [k for k, _ in res[0][1].most_common(40)]
for k in list(res[-1][1].keys()):
    if k not in keys and res[-1][1][k] >= 15: keys.append(k)
print("--- leaf (own bytecode and the C functions it calls)")
for k in keys:
    print(" ".join(f"{r[1][k]:6d}" for r in res), k)
print("--- inclusive")
ikeys = [k for k, _ in res[0][2].most_common(45)]
for k in ikeys:
    print(" ".join(f"{r[2][k]:6d}" for r in res), k)
