"""The interpreter exits cleanly while native threads still run Python for it.

CPython 3.11 ends a thread that takes the GIL back once the interpreter is finalizing with
`pthread_exit`; unwinding through a C++ frame (torch's `Future.set_result` releases the GIL while
it runs the future's callbacks) then aborts the process ("terminate called without an active
exception", SIGABRT). The README's DDP script died so about once in 40 runs: DDP's last bucket's
future was still being completed on a native thread when the script returned.

The ranks are fresh interpreters (the harness's forked ranks end with `os._exit`, without the
interpreter's exit)."""

from __future__ import annotations

import os
import subprocess
import sys

from harness import free_port

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
import tensorwire.c10d  # registers the backend

rank = int(os.environ["RANK"])
dist.init_process_group("tensorwire", init_method="env://", rank=rank, world_size=2)
t = torch.ones(4)
work = dist.all_reduce(t, async_op=True)

def slow(fut):
    # Runs on the thread that completes the future, inside `set_result`; the sleep releases
    # the GIL, and the script returns meanwhile.
    time.sleep(0.5)
    with open(sys.argv[1] + "." + str(rank), "w") as f:
        f.write(str(fut.value()[0].tolist()))

work.get_future().then(slow)
work.wait()
dist.destroy_process_group()
# The script ends here, the callback perhaps still asleep: the interpreter's exit waits for it.
"""


def test_the_interpreter_exits_after_a_running_work_callback(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(SCRIPT)
    marks = str(tmp_path / "done")
    env = dict(
        os.environ, TENSORWIRE_SECRET="exit-secret", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()), WORLD_SIZE="2",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), marks], env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{outputs[rank]}"
        # The callback ran to its end before the process exited, with the reduced values.
        with open(f"{marks}.{rank}") as f:
            assert f.read() == str([2.0, 2.0, 2.0, 2.0]), outputs[rank]
