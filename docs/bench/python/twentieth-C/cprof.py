"""``SOLO_HOOKS`` module for ``msg16/solo.py`` (issue 48, twentieth session, helper C): every
worker's Python profiled by cProfile, function by function, over the timed steps, with the
call counts per step, and each worker's process CPU per step.

Every entry from Rust into Python (``_autograd_engine``'s functions the native side looks up
by name, ``rpc``'s ``_serve``/``_create``/``_fetch``) enables a cProfile profiler of its
thread while it runs (entries from native threads are not seen by ``threading.setprofile``);
worker0's main thread is profiled over the timed steps (``solo.timed``'s second call). A
callee starts counting at its ``SKIP``-th ``serve`` (after the warm-up). With
``CPROF=0`` nothing is profiled: only the CPU figures are taken (for A/B runs). Each worker
writes ``$CPROF_OUT.<rank>.prof`` (pstats) and ``$CPROF_OUT.<rank>.json``::

    CPROF_OUT=/tmp/p PYTHONPATH=<tree>/python:docs/bench/python/twentieth-C:docs/bench/python/msg16 \\
        SOLO_HOOKS=cprof python docs/bench/python/msg16/solo.py tensorwire 0 500 out.jsonl
"""
from __future__ import annotations

import cProfile
import functools
import json
import os
import threading
import time

PROFILE = os.environ.get("CPROF", "1") != "0"
SKIP = 25
_tls = threading.local()
_profiles: list = []
_lock = threading.Lock()
_state = {"on": False, "serves": 0, "counted": 0, "cpu0": None, "cpu1": None, "wall0": None, "wall1": None}


def _prof() -> cProfile.Profile:
    p = getattr(_tls, "p", None)
    if p is None:
        p = _tls.p = cProfile.Profile()
        _tls.depth = 0
        with _lock:
            _profiles.append(p)
    return p


def _wrap(mod, name: str, counting: str = "") -> None:
    f = getattr(mod, name)

    @functools.wraps(f)
    def w(*a, **k):
        if counting == "serve":
            _state["serves"] += 1
            if _state["serves"] == SKIP and not _state["on"]:
                _state["on"] = True
                _state["cpu0"], _state["wall0"] = time.process_time(), time.perf_counter()
            elif _state["on"]:
                _state["counted"] += 1
        if not (PROFILE and _state["on"]) or getattr(_tls, "depth", 0):
            out = f(*a, **k)
        else:
            p = _prof()
            _tls.depth = 1
            p.enable()
            try:
                out = f(*a, **k)
            finally:
                p.disable()
                _tls.depth = 0
        if counting == "last" and _state["on"]:
            _state["cpu1"], _state["wall1"] = time.process_time(), time.perf_counter()
        return out

    setattr(mod, name, w)


def install() -> None:
    import sys

    # The driver's globals: ``install`` is called by ``solo._rank_main``.
    driver = sys._getframe(1).f_globals
    from tensorwire.rpc import _autograd_engine as E
    import tensorwire.rpc as R

    for n in ("import_tensor", "export_tensor", "backward", "create", "fetch", "assign", "accumulate"):
        _wrap(E, n)
    _wrap(E, "serve", "serve")
    _wrap(E, "owner_call", "last")
    for n in ("_serve", "_create", "_fetch"):
        _wrap(R, n)
    orig = driver["timed"]
    calls = [0]

    def timed(step, n):
        calls[0] += 1
        if calls[0] != 2:
            return orig(step, n)
        _state["on"] = True
        _state["counted"] = n
        p = _prof()
        _tls.depth = 1
        c0, w0 = time.process_time(), time.perf_counter()
        if PROFILE:
            p.enable()
        try:
            return orig(step, n)
        finally:
            if PROFILE:
                p.disable()
            _state["cpu0"], _state["cpu1"] = c0, time.process_time()
            _state["wall0"], _state["wall1"] = w0, time.perf_counter()
            _tls.depth = 0
            _state["on"] = False

    driver["timed"] = timed


def reset_all() -> None:
    pass


def dump(rank: int) -> None:
    import pstats

    out = os.environ.get("CPROF_OUT", "/tmp/cprof")
    steps = max(1, _state["counted"])
    rec = {"rank": rank, "steps": steps}
    if _state["cpu0"] is not None and _state["cpu1"] is not None:
        rec["cpu_us_per_step"] = (_state["cpu1"] - _state["cpu0"]) / steps * 1e6
        rec["wall_us_per_step"] = (_state["wall1"] - _state["wall0"]) / steps * 1e6
    if PROFILE and _profiles:
        st = pstats.Stats(_profiles[0])
        for p in _profiles[1:]:
            st.add(p)
        st.dump_stats(f"{out}.{rank}.prof")
        rec["calls_per_step"] = st.total_calls / steps
        rec["prim_calls_per_step"] = st.prim_calls / steps
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(rec, f)
