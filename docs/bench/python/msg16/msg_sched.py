"""Where a gradient message's time goes, between the sender's ``export<`` and the receiver's
``import>`` (issue 48): the trace's raw marks (``TENSORWIRE_TRACE_RAW``) lined up with a
system-wide scheduler and syscall trace taken meanwhile on the same clock::

    perf record -k CLOCK_MONOTONIC -a -o P.data -e sched:sched_switch,sched:sched_wakeup \
        -e 'syscalls:sys_enter_write*' -e 'syscalls:sys_enter_send*' \
        -e 'syscalls:sys_exit_read*' -e 'syscalls:sys_exit_recv*' \
        -e syscalls:sys_exit_epoll_wait -- env TENSORWIRE_TRACE_RAW=R.json \
        python -m tensorwire.bench.autograd_trace --steps 100
    perf script -i P.data -F tid,pid,cpu,time,event,trace > P.txt
    python msg_sched.py R.json P.txt

For each message of each traced step's backward, the receiver's first event after the
sender's write: the write (the sender's thread enters ``write``/``sendmsg``), the wake-up of a
receiver's thread, its switch in, its ``epoll_wait`` return and ``read``, the switch to the
thread that then imports (the tag's thread), and the import. Printed: the median of each
interval over every message of a kind (the hop), in us.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from bisect import bisect_left, bisect_right

from tensorwire.bench.autograd_trace import marked_windows

LINE = re.compile(r"^\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)$")


def load_perf(path):
    evs = []  # (ns, pid, tid, cpu, event, rest)
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            pid, tid, cpu, t, ev, rest = m.groups()
            evs.append((int(round(float(t) * 1e9)), int(pid), int(tid), int(cpu), ev, rest))
    evs.sort()
    return evs


def main() -> int:
    raw = json.load(open(sys.argv[1]))
    perf = load_perf(sys.argv[2])
    times = [e[0] for e in perf]
    tid_pid = {}
    for _, pid, tid, *_ in perf:
        tid_pid.setdefault(tid, pid)
    proc_pid = {}
    for proc, evs in raw.items():
        pids = [tid_pid.get(tid) for _, _, tid in evs if tid_pid.get(tid)]
        proc_pid[proc] = max(set(pids), key=pids.count) if pids else None
    pid_proc = {v: k for k, v in proc_pid.items()}
    print("processes:", proc_pid)
    # Backward windows on the driver.
    wins = marked_windows(raw["worker0"], "dist_backward>", "dist_backward<")
    marks = sorted((t, tag, tid, proc) for proc, evs in raw.items() for t, tag, tid in evs)
    mtimes = [m[0] for m in marks]
    rows: dict[str, list[dict]] = {}
    for a, b in wins:
        inwin = marks[bisect_left(mtimes, a):bisect_right(mtimes, b)]
        hop = 0
        for i, (t, tag, tid, proc) in enumerate(inwin):
            if tag != "export<":
                continue
            imp = next(((t2, tid2, p2) for t2, tag2, tid2, p2 in inwin[i + 1:]
                        if tag2 == "import>" and p2 != proc), None)
            if imp is None:
                continue
            t_imp, tid_imp, recv = imp
            hop += 1
            spid, rpid = proc_pid[proc], proc_pid[recv]
            seg = perf[bisect_left(times, t):bisect_right(times, t_imp)]
            r = {"total": (t_imp - t) / 1e3}
            w = next((e for e in seg if e[1] == spid and e[4].startswith("syscalls:sys_enter_") and
                      ("write" in e[4] or "send" in e[4])), None)
            if w:
                r["export->write"] = (w[0] - t) / 1e3
                after = [e for e in seg if e[0] >= w[0]]
                wk = next((e for e in after if e[4] == "sched:sched_wakeup" and
                           tid_pid.get(int(re.search(r"pid=(\d+)", e[5]).group(1))) == rpid), None)
                if wk:
                    woken = int(re.search(r"pid=(\d+)", wk[5]).group(1))
                    r["write->wakeup"] = (wk[0] - w[0]) / 1e3
                    r["woken_is_importer"] = woken == tid_imp
                    sw = next((e for e in after if e[0] >= wk[0] and e[4] == "sched:sched_switch" and
                               f"next_pid={woken} " in e[5] + " "), None)
                    if sw:
                        r["wakeup->on_cpu"] = (sw[0] - wk[0]) / 1e3
                        rd = next((e for e in after if e[0] >= sw[0] and e[2] == woken and
                                   e[4].startswith("syscalls:sys_exit_read") or
                                   (e[0] >= sw[0] and e[2] == woken and e[4].startswith("syscalls:sys_exit_recv"))), None)
                        if rd:
                            r["on_cpu->read"] = (rd[0] - sw[0]) / 1e3
                            r["read->import"] = (t_imp - rd[0]) / 1e3
                    # Switches of the receiver's threads in the interval, and wake-ups.
                r["recv_wakeups"] = sum(1 for e in after if e[4] == "sched:sched_wakeup" and
                                        tid_pid.get(int(re.search(r"pid=(\d+)", e[5]).group(1))) == rpid)
                sw_in = [e for e in after if e[4] == "sched:sched_switch" and
                         tid_pid.get(int(re.search(r"next_pid=(\d+)", e[5]).group(1)) or 0) == rpid]
                r["recv_switch_ins"] = len(sw_in)
                if w and sw_in:
                    # the importer's last switch in before the import
                    imp_in = [e for e in sw_in if f"next_pid={tid_imp} " in e[5] + " "]
                    if imp_in:
                        r["importer_last_on_cpu->import"] = (t_imp - imp_in[-1][0]) / 1e3
            rows.setdefault(f"hop{hop} {proc}->{recv}", []).append(r)
    for key, rs in rows.items():
        print(f"{key}: {len(rs)} messages")
        keys = []
        for r in rs:
            for k in r:
                if k not in keys:
                    keys.append(k)
        for k in keys:
            vals = [r[k] for r in rs if k in r]
            if k == "woken_is_importer":
                print(f"  {k:32s} {sum(vals)}/{len(vals)}")
            else:
                print(f"  {k:32s} median {statistics.median(vals):8.1f}  (n={len(vals)}, p25 "
                      f"{sorted(vals)[len(vals)//4]:.1f}, p75 {sorted(vals)[3*len(vals)//4]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
