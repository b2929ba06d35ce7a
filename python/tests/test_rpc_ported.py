"""PyTorch's own RPC tests (``rpc_test.py``'s ``RpcTestCommon`` and ``RpcTest``), run against
``tensorwire.rpc`` in one world of four processes (``ported_fixture.World``): each pytest test
is one of PyTorch's, by its name, run on every rank. The bodies are in ``rpc_ported_bodies.py``
with what changed and what was not ported; the tests that fail because tensorwire.rpc lacks
a feature are strict xfails here, with the reason."""

from __future__ import annotations

import inspect

import pytest

import rpc_ported_bodies as bodies
from ported_fixture import World

#: Ported tests that fail, and why (strict: one that starts passing fails the run).
XFAIL: dict[str, str] = {
}


@pytest.fixture(scope="module")
def world():
    w = World(bodies.__name__)
    yield w
    w.close()


def _params():
    for name in bodies.PORTED:
        marks = []
        if name in XFAIL:
            marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[name]))
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_pytorch_rpc_test(world, name):
    method = getattr(bodies.RpcTest, name)
    # A body that starts the default process group itself expects none (PyTorch runs it in
    # new processes): the world's kept group is destroyed first.
    fresh_pg = "dist.init_process_group(" in inspect.getsource(method)
    world.run(name, getattr(method, "setup_rpc", False), fresh_pg)


def test_the_ported_counts_are_as_reported():
    # The closing note's figures come from these tables; a test moving between them changes
    # the figures (and this line).
    changed = [n for n, s in bodies.PORTED.items() if s != "unchanged"]
    assert len(bodies.PORTED) + len(bodies.NOT_PORTED) > 200
    assert set(XFAIL) <= set(bodies.PORTED)
    assert all(s.startswith("changed: ") for s in (bodies.PORTED[n] for n in changed))
