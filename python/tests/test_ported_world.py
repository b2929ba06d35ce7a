"""``ported_fixture.World``, the world that runs PyTorch's ported test bodies: every rank sets
its fresh module state (PyTorch's new processes) before any rank starts the body, so a call
that another rank makes at the very start of a body is not wiped by the callee's reset.

The world used to reset each rank's state as that rank took the body: a rank that took it
late wiped what a faster rank's first call had recorded there (PyTorch's ``_set_rpc_done``
and ``known_context_ids``), and a body waiting for it (``_check_rpc_done``) or counting it
(``test_clean_context_during_backward``) hung or failed now and then. Here rank 1's reset
waits (at most :data:`RESET_WAIT_S`) for rank 0's first call before it resets: in a world
that resets as each rank takes the body, the call arrives during that wait and is wiped, and
the body fails; in this world no body runs during any reset, and the wait ends unanswered.
"""

from __future__ import annotations

import threading

import pytest

import ported_fixture
import tensorwire.rpc as rpc
from ported_fixture import World

#: How long rank 1's reset waits for a call from rank 0's body (none comes in a correct world).
RESET_WAIT_S = 2.0

#: What rank 0's body sent here, since this rank's last reset.
marks: list = []
#: Set once rank 0's call arrived here.
_called = threading.Event()


@rpc.expose
def _mark(token: str) -> None:
    marks.append(token)
    _called.set()


class RpcTest(ported_fixture.RpcAgentTestFixture):
    """One rank's bodies."""

    __test__ = False  # run by the world

    def test_start(self):
        """Starts RPC on every rank (the world starts it for a body that wants it)."""

    def test_a_call_at_the_start_of_a_body_is_kept(self):
        if self.rank == 0:
            rpc.rpc_sync("worker1", _mark, args=("from rank 0",))
        elif self.rank == 1:
            assert _called.wait(ported_fixture.TEST_DEADLINE_S)
            assert marks == ["from rank 0"], "the call was wiped by this rank's reset"


for _name in ("test_start", "test_a_call_at_the_start_of_a_body_is_kept"):
    getattr(RpcTest, _name).setup_rpc = True


def _fresh_state() -> None:
    global marks
    if rpc._agent is not None and rpc.get_worker_info().id == 1:
        _called.wait(RESET_WAIT_S)
    marks = []


@pytest.fixture(scope="module")
def world():
    w = World(__name__)
    yield w
    w.close()


def test_a_call_at_the_start_of_a_body_is_not_wiped_by_the_callees_reset(world):
    world.run("test_start", True)
    world.run("test_a_call_at_the_start_of_a_body_is_kept", True)
