"""``msg16/solo.py`` (run with ``SOLO_HOOKS=timewrap``) with every worker's Python pieces timed (issue 48, seventeenth session):
the functions :mod:`timewrap` names are wrapped with accumulators of their inclusive time and
calls (``TW_CLOCK=cpu``: the thread's CPU time, so that other processes' preemption is not
counted; else wall time); worker0's are reset after the 20 warm-up steps, the callees' are not
(their figures include the setup). Each worker writes ``$TW_OUT.<rank>.json``::

    cd <tree> && TW_CLOCK=cpu TW_OUT=/tmp/cpu-new-1 \
        PYTHONPATH=<tree>/python:docs/bench/python/pieces17 python docs/bench/python/pieces17/solo_tw.py tensorwire 0 1000 STEPS.json
    python docs/bench/python/pieces17/cmp.py /tmp/cpu-base-1 /tmp/cpu-new-1 ...

(``timewrap.install_lines()`` in place of ``install()`` splits ``import_tensor`` by line: a
hooks module of your own that calls it.)
"""

from __future__ import annotations

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.join(_here, "..", "msg16")]
os.environ.setdefault("SOLO_HOOKS", "timewrap")

import solo  # noqa: E402  (found through the path set above)

if __name__ == "__main__":
    sys.exit(solo.main())
