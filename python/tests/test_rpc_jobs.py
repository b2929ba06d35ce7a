"""Python work that blocks never holds up work queued behind it: a served function that waits
for a call arriving right after it, and a future's callback that waits for another reply
(tensorwire runs served calls and reply completions as queued jobs; see python/src/gil.rs)."""

from __future__ import annotations

import threading

import torch

import tensorwire.rpc as rpc
from harness import run_world

ROUNDS = 30

_events: dict[int, threading.Event] = {}
_events_lock = threading.Lock()


def _event(key: int) -> threading.Event:
    with _events_lock:
        return _events.setdefault(key, threading.Event())


@rpc.expose
def wait_for(key: int) -> int:
    # Blocks this served call until the call that sets `key` has run.
    assert _event(key).wait(60), f"event {key} was never set: the call setting it did not run"
    return key


@rpc.expose
def set_event(key: int) -> None:
    _event(key).set()


@rpc.expose
def plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@rpc.expose
def job_counts() -> tuple[int, int]:
    from tensorwire import _native

    return _native.job_counts()


def _world(rank: int, world: int) -> None:
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    if rank == 0:
        # Served calls: the blocking one and the one that releases it leave back to back, so
        # they often queue together on the callee.
        for key in range(ROUNDS):
            blocked = rpc.rpc_async("worker1", wait_for, args=(key,))
            releasing = rpc.rpc_async("worker1", set_event, args=(key,))
            assert releasing.wait() is None
            assert blocked.wait() == key

        # Completions: a callback of one reply waits for another reply that arrives with it.
        for i in range(ROUNDS):
            first = rpc.rpc_async("worker1", plus_one, args=(torch.tensor([i]),))
            second = rpc.rpc_async("worker1", plus_one, args=(torch.tensor([i + 100]),))
            seen: list = []
            done = threading.Event()

            def callback(f: torch.futures.Future, second=second, seen=seen, done=done) -> None:
                seen.append((f.value().item(), second.wait().item()))
                done.set()

            first.then(callback)
            assert done.wait(60), f"round {i}: the callback waiting for the second reply never finished"
            assert seen == [(i + 1, i + 101)]
    rpc.shutdown()


def test_blocked_python_work_never_holds_up_work_queued_behind_it():
    run_world(_world, 2)


def _one_at_a_time(rank: int, world: int) -> None:
    from tensorwire.rpc import dist_autograd

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 0:
        calls = 40
        before = rpc.rpc_sync("worker1", job_counts)
        with dist_autograd.context() as context_id:
            for i in range(calls):
                x = torch.tensor([float(i)], requires_grad=True)
                y = rpc.rpc_sync("worker1", plus_one, args=(x,))
                assert y.item() == i + 1
            dist_autograd.backward(context_id, [y.sum()])
        here, queued = (a - b for a, b in zip(rpc.rpc_sync("worker1", job_counts), before))
        # Each call in the context reached an idle callee: the worker that read it ran it,
        # with no runner woken for it (and so did the backward pass's gradient). A job queued
        # now and then (a value dropped off the GIL, a runner still about) may take one
        # call's turn; plain calls (`job_counts`) are queued.
        assert here >= calls // 2, f"only {here} of {calls} calls in a context ran in place ({queued} queued)"
    rpc.shutdown()


def test_calls_in_a_context_served_one_at_a_time_run_on_the_worker_that_read_them():
    run_world(_one_at_a_time, 2)


@rpc.expose
def times_three(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _waiter_runs_the_pass_that_comes_back(rank: int, world: int) -> None:
    from tensorwire import _native
    from tensorwire.rpc import dist_autograd

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 0:
        rounds = 20
        before = _native.waiter_runs()
        from tensorwire.rpc import _autograd_engine as engine

        for i in range(rounds):
            x = torch.full((3,), float(i), requires_grad=True)
            # The pass that comes back runs with no context current, as on a runtime worker
            # (a hook's calls are not recorded in the waiting thread's context), which the
            # waiting thread has current again once it returns.
            seen: list = []
            x.register_hook(lambda g, seen=seen: seen.append(engine.current_id()))
            with dist_autograd.context() as context_id:
                y = rpc.rpc_sync("worker1", times_three, args=(x * x,))
                dist_autograd.backward(context_id, [y.sum()])
                assert seen == [None] and engine.current_id() == context_id
                # x's gradient is the pass that came back (worker1's answer carried the
                # gradient for x * x): run here, by the thread that waited, and exact.
                assert torch.equal(dist_autograd.get_gradients(context_id)[x], 6 * x.detach())
        ran = _native.waiter_runs() - before
        # Each backward's second pass came back while this thread waited idle; a run that
        # found it not parked yet went the usual way (a runtime worker), which is allowed.
        assert ran >= rounds // 2, f"only {ran} of {rounds} passes that came back ran on the waiting thread"
        assert ran <= rounds
    rpc.shutdown()


def test_the_thread_waiting_in_backward_runs_the_pass_that_comes_back_to_it():
    run_world(_waiter_runs_the_pass_that_comes_back, 2)
