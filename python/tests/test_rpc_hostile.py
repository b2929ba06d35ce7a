"""A hostile member of the group (authenticated: it has the cluster secret) tries to make
another worker run code it was not given: a pickle whose loading runs ``os.system``, a call of
a function nobody exposed, an instance of a class nobody exposed. Each is refused with a clear
error at the caller, and nothing runs on the callee: the file each payload would create is
never created. The payloads go through the real wire path (the public API, and hand-made
pickles through the one native call every call takes), nothing is mocked."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import tensorwire.rpc as rpc
from harness import run_world


@rpc.expose
def echo(x):
    return x


@rpc.expose
def exists(path: str) -> bool:
    return os.path.exists(path)


def not_exposed(path: str) -> str:
    """Defined beside exposed functions, importable, but never exposed."""
    open(path, "w").close()
    return "ran"


class RunsOnLoad:
    """Loading it runs ``os.system(command)``: the classic pickle exploit."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class EvalsOnLoad:
    """Loading it runs ``eval(source)``."""

    def __init__(self, source: str):
        self.source = source

    def __reduce__(self):
        return (eval, (self.source,))


class Sneaky:
    """Not exposed anywhere: decoding an instance would run its ``__setstate__``."""

    def __init__(self, path: str):
        self.path = path

    def __getstate__(self):
        return self.path

    def __setstate__(self, path):
        open(path, "w").close()
        self.path = path


@rpc.expose
def returns_sneaky(path: str) -> Sneaky:
    # The callee side is honest here; the *caller* must refuse what it did not expose.
    s = Sneaky.__new__(Sneaky)
    s.path = path
    return s


def args_pickle(*args) -> bytes:
    return pickle.dumps((args, {}), protocol=5)


def hostile(rank: int, world: int, marker_dir: str) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 0:
        victim = "worker1"
        files = {k: os.path.join(marker_dir, k) for k in
                 ("system", "system_raw", "eval", "call", "call_raw", "private", "sneaky",
                  "sneaky_result")}

        # (a) A pickle whose loading would run os.system, as an argument of an exposed
        # function: through the API, and as hand-made bytes.
        with pytest.raises(rpc.RefusedError, match=r"refused to unpickle posix\.system from worker0"):
            rpc.rpc_sync(victim, echo, args=(RunsOnLoad(f"touch {files['system']}"),))
        with pytest.raises(rpc.RefusedError, match=r"posix\.system"):
            rpc._call_raw(victim, "test_rpc_hostile.echo",
                          args_pickle(RunsOnLoad(f"touch {files['system_raw']}")), []).wait()
        with pytest.raises(rpc.RefusedError, match=r"refused to unpickle builtins\.eval"):
            rpc.rpc_sync(victim, echo, args=(EvalsOnLoad(
                f"__import__('os').system('touch {files['eval']}')"),))

        # (b) Calls of functions nobody exposed: os.system itself (by the function and by the
        # name "os.system"), eval, an importable but unexposed function, and a dunder of an
        # exposed function's module.
        with pytest.raises(rpc.RefusedError, match=r"worker1.* refused to run 'posix\.system'"):
            rpc.rpc_sync(victim, os.system, args=(f"touch {files['call']}",))
        with pytest.raises(rpc.RefusedError, match=r"refused to run 'os\.system'"):
            rpc._call_raw(victim, "os.system", args_pickle(f"touch {files['call_raw']}"), []).wait()
        with pytest.raises(rpc.RefusedError, match=r"refused to run 'builtins\.eval'"):
            rpc.rpc_sync(victim, "builtins.eval", args=("1",))
        with pytest.raises(rpc.RefusedError, match=r"refused to run 'test_rpc_hostile\.not_exposed'"):
            rpc.rpc_sync(victim, not_exposed, args=(files["private"],))
        with pytest.raises(rpc.RefusedError, match="refused to run"):
            rpc.rpc_sync(victim, "test_rpc_hostile.echo.__globals__", args=())

        # (c) An instance of a class nobody exposed, as an argument.
        with pytest.raises(rpc.RefusedError, match=r"refused to unpickle test_rpc_hostile\.Sneaky"):
            rpc.rpc_sync(victim, echo, args=(Sneaky(files["sneaky"]),))
        # ... and as a result: the caller refuses it too.
        with pytest.raises(rpc.RefusedError, match=r"refused to unpickle test_rpc_hostile\.Sneaky from worker1"):
            rpc.rpc_sync(victim, returns_sneaky, args=(files["sneaky_result"],))

        # A malformed tensor reference is refused, not trusted.
        class BadRef(pickle.Pickler):
            def persistent_id(self, obj):
                return ("tensor", 7, "float32", (1 << 40,), False) if obj == "t" else None

        import io
        buf = io.BytesIO()
        BadRef(buf, protocol=5).dump((("t",), {}))
        with pytest.raises(rpc.RefusedError, match="malformed tensor reference"):
            rpc._call_raw(victim, "test_rpc_hostile.echo", buf.getvalue(), []).wait()

        # The victim still serves honest calls, and nothing ran there.
        assert torch.equal(rpc.rpc_sync(victim, echo, args=(torch.ones(2),)), torch.ones(2))
        for name, path in files.items():
            assert not rpc.rpc_sync(victim, exists, args=(path,)), name
    rpc.shutdown()


def test_a_hostile_caller_runs_nothing_it_was_not_given(tmp_path):
    run_world(hostile, 2, str(tmp_path))
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def trusting(rank: int, world: int, marker_dir: str) -> None:
    with pytest.warns(RuntimeWarning, match="trust_peers=True"):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, trust_peers=True)
    if rank == 0:
        # PyTorch's behaviour, asked for: any importable function, any pickle.
        path = os.path.join(marker_dir, "trusted")
        assert rpc.rpc_sync("worker1", not_exposed, args=(path,)) == "ran"
        assert os.path.exists(path)
        assert rpc.rpc_sync("worker1", echo, args=(Sneaky(path + ".2"),)).path == path + ".2"
    rpc.shutdown()


def test_trust_peers_restores_pytorchs_behaviour_with_a_warning(tmp_path):
    run_world(trusting, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["trusted", "trusted.2"]
