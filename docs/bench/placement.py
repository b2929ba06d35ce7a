#!/usr/bin/env python3
"""Where the unpinned round trip goes on a VM: a blocking-socket ping-pong between two processes,
placed on one core or on two (issue 32, "what stands in the way").

Usage: python3 docs/bench/placement.py [ROUND_TRIPS]

For each placement (parent CPU, child CPU) it runs ROUND_TRIPS (default 20000) round trips of
64 bytes over loopback TCP, both sides blocking in recv, and prints the median. Plain Python: its
own cost per turn is the same in every placement, so the differences are the scheduler's. On
the 2-core VM of docs/bench, two cores cost about 65 us more per round trip than one: each
message wakes a process sleeping on an idle core, and an idle virtual CPU takes tens of
microseconds to wake. A raw ping-pong that the scheduler happens to keep on one core never pays
this; an agent whose processes end up on two cores pays it on every call. Needs 2 CPUs."""
import os
import socket
import sys
import time

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
MSG = b"x" * 64
STOP = b"q" * 64


def run(parent_cpu, child_cpu):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {child_cpu})
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            d = c.recv(64)
            if not d or d == STOP:
                os._exit(0)
            c.sendall(d)
    os.sched_setaffinity(0, {parent_cpu})
    s, _ = listener.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(N):
        t = time.perf_counter_ns()
        s.sendall(MSG)
        s.recv(64)
        times.append(time.perf_counter_ns() - t)
    s.sendall(STOP)
    os.waitpid(pid, 0)
    times.sort()
    return times[len(times) // 2] / 1000


if len(os.sched_getaffinity(0)) < 2:
    sys.exit("placement.py needs 2 CPUs (it places the two processes itself)")
cpus = sorted(os.sched_getaffinity(0))[:2]
for a, b in [(cpus[0], cpus[0]), (cpus[0], cpus[1]), (cpus[1], cpus[1]), (cpus[1], cpus[0])]:
    where = "one core " if a == b else "two cores"
    print(f"{where} (parent cpu {a}, child cpu {b}): p50 {run(a, b):.1f} us")
