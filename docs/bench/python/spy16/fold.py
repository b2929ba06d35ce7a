"""Sums py-spy's collapsed stacks (`--format raw`) by function, leaving out imports: the
samples by process, then each function's samples as the innermost frame (leaf) and anywhere in
the stack (inclusive).

    python fold.py RAW.txt > summary.txt
"""

import collections
import re
import sys

FRAME = re.compile(r"^(.*?) \((.*?):\d+\)$")


def name(frame: str) -> str:
    m = FRAME.match(frame)
    return f"{m.group(1)} {m.group(2).rsplit('/', 1)[-1]}" if m else frame


def main() -> None:
    procs, leaf, incl = collections.Counter(), collections.Counter(), collections.Counter()
    for line in open(sys.argv[1]):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        if any(f.startswith("_find_and_load") for f in frames):
            continue
        procs[frames[0][:60]] += int(n)
        names = [name(f) for f in frames[1:]]
        if names:
            leaf[names[-1]] += int(n)
        for f in set(names):
            incl[f] += int(n)
    for title, counts, most in (("process", procs, 10), ("leaf", leaf, 30), ("inclusive", incl, 60)):
        print(f"--- {title}")
        for k, v in counts.most_common(most):
            print(v, k)


if __name__ == "__main__":
    main()
