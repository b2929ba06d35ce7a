# Counts rpc/src and core/src/protocol code lines at each commit named, as tests/tests/layout.rs counts
# (code_lines: not blank, not a comment, before a top-level #[cfg(test)] mod; no tests.rs, no tests/ dir).
# Usage: python3 count_commits.py main <commit>...
import subprocess,sys
def code_lines(text):
    lines=text.split('\n')
    if text.endswith('\n'): lines=lines[:-1]
    n=0
    for i,line in enumerate(lines):
        l=line.strip()
        nxt=lines[i+1].lstrip() if i+1<len(lines) else None
        next_is_mod = nxt is not None and (nxt.startswith("mod ") or nxt.startswith("pub mod ") or " mod " in nxt)
        if l=="#[cfg(test)]" and not line.startswith(' ') and next_is_mod: break
        if l and not l.startswith("//"): n+=1
    return n
def files(commit, d):
    out=subprocess.run(['git','ls-tree','-r','--name-only',commit,d],capture_output=True,text=True).stdout.split()
    return [f for f in out if f.endswith('.rs') and not f.endswith('/tests.rs') and '/tests/' not in f[len(d):]]
def total(commit,d):
    per={}
    for f in files(commit,d):
        per[f]=code_lines(subprocess.run(['git','show',f'{commit}:{f}'],capture_output=True,text=True).stdout)
    return per
prev=None
for c in sys.argv[1:]:
    r=total(c,'rpc/src'); p=total(c,'core/src/protocol')
    R=sum(r.values()); P=sum(p.values())
    subj=subprocess.run(['git','log','-1','--format=%h %s',c],capture_output=True,text=True).stdout.strip()[:90]
    d='' if prev is None else f" (rpc {R-prev[0]:+d}, protocol {P-prev[1]:+d})"
    print(f"{R:5d} {P:5d} {R/P:.4f}{d}  {subj}")
    prev=(R,P)
