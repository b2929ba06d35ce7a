"""``torch.distributed.optim.DistributedOptimizer`` on tensorwire's RPC agent: any
``torch.optim`` optimizer, run on each parameter's owner over the gradients a distributed
autograd context left there.

Switch by changing one import::

    from tensorwire.rpc.optim import DistributedOptimizer   # instead of: from torch.distributed.optim import ...

    opt = DistributedOptimizer(torch.optim.Adam, param_rrefs, lr=1e-3)
    with dist_autograd.context() as context_id:
        loss = ...
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)

Each owner of some of ``param_rrefs`` builds one local optimizer over its parameters (the
values the references point to) at construction; :meth:`DistributedOptimizer.step` steps every
owner's at once, in parallel, each with the gradients its worker holds in the context
(``dist_autograd.get_gradients``), and raises the first owner's exception after all have
answered. Steps on one owner run one at a time, as in PyTorch.

The optimizer class travels by name and the owner accepts only subclasses of
``torch.optim.Optimizer`` from ``torch.optim`` or classes it exposed
(``tensorwire.rpc.expose``). Owners are reached through the parameter references themselves:
only a worker that holds a reference to a parameter can put it in an optimizer.
"""

from __future__ import annotations

import importlib
import secrets
import threading
import weakref
from typing import Any

import torch

from tensorwire import rpc
from tensorwire.rpc import _autograd_engine, _exposed, dist_autograd
from tensorwire.rpc._exposed import RefusedError

__all__ = ["DistributedOptimizer"]

# --- the owner's side ----------------------------------------------------------------------

_lock = threading.Lock()
# Parameters handed in for an optimizer still being built, and the optimizers built, by the
# random token of the DistributedOptimizer that made them.
_collected: dict[str, list[torch.Tensor]] = {}
_local: dict[str, "_LocalOptimizer"] = {}
# PyTorch's _LocalOptimizer.global_lock: one step at a time on an owner.
_step_lock = threading.Lock()


class _LocalOptimizer:
    def __init__(self, optim: torch.optim.Optimizer, params: list[torch.Tensor]):
        self.optim = optim
        self.params = params


def _optimizer_class(name: str) -> type:
    """The optimizer class called ``name``: a ``torch.optim.Optimizer`` subclass from
    ``torch.optim`` or exposed on this worker, else ``RefusedError``."""
    cls: Any = _exposed.exposed_class(name)
    if cls is None and name.startswith("torch.optim."):
        module, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise RefusedError(
            f"{name!r} is not an optimizer this worker runs: a torch.optim.Optimizer subclass "
            "from torch.optim, or one it exposed (tensorwire.rpc.expose)"
        )
    return cls


def _collect(param: Any, token: str) -> None:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"DistributedOptimizer: a parameter reference holds {type(param).__name__}, not a tensor")
    with _lock:
        _collected.setdefault(token, []).append(param)


def _create(_: Any, token: str, class_name: str, args: tuple, kwargs: dict) -> None:
    with _lock:
        params = _collected.pop(token, [])
    if token in _local:
        raise RefusedError("this distributed optimizer was built on this worker already")
    cls = _optimizer_class(class_name)
    optim = cls(params, *args, **kwargs)
    with _lock:
        _local[token] = _LocalOptimizer(optim, params)


def _step(_: Any, token: str, context_id: int) -> None:
    local = _local.get(token)
    if local is None:
        raise RefusedError("no such distributed optimizer on this worker")
    grads = dist_autograd.get_gradients(context_id)
    with _step_lock:
        for p in local.params:
            p.grad = grads.get(p)
        local.optim.step()


def _drop(_: Any, token: str) -> None:
    with _lock:
        _collected.pop(token, None)
        _local.pop(token, None)


_autograd_engine.OWNER_FUNCTIONS.update(
    {
        "optim.collect": _collect,
        "optim.create": _create,
        "optim.step": _step,
        "optim.drop": _drop,
    }
)

# --- the trainer's side --------------------------------------------------------------------


def _wait_all(futures: list) -> list:
    """Waits for every future, then raises the first failure (so that no owner is still
    working when the caller sees an error)."""
    results, first = [], None
    for f in futures:
        try:
            results.append(f.wait())
        except Exception as e:  # noqa: BLE001 - re-raised below
            results.append(None)
            if first is None:
                first = e
    if first is not None:
        raise first
    return results


def _drop_everywhere(token: str, anchors: list) -> None:
    if rpc._agent is None:
        return
    for rref in anchors:
        try:
            _autograd_engine.owner_call_async(rref, "optim.drop", (token,))
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


class DistributedOptimizer:
    """Runs ``optimizer_class(params, *args, **kwargs)`` on each owner of the parameters
    ``params_rref`` refer to (PyTorch's ``DistributedOptimizer``). The constructor raises an
    owner's exception (a refused class, the optimizer's own ``__init__`` raising)."""

    def __init__(self, optimizer_class: type, params_rref: list, *args: Any, **kwargs: Any):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, not {optimizer_class!r}")
        class_name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
        if class_name.startswith("torch.optim.") and getattr(torch.optim, optimizer_class.__name__, None) is optimizer_class:
            class_name = f"torch.optim.{optimizer_class.__name__}"
        self._token = secrets.token_hex(16)
        by_owner: dict[str, list] = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner_name(), []).append(rref)
        # One reference per owner reaches its local optimizer.
        self._anchors = [refs[0] for refs in by_owner.values()]
        self._finalizer = weakref.finalize(self, _drop_everywhere, self._token, list(self._anchors))
        _wait_all([_autograd_engine.owner_call_async(r, "optim.collect", (self._token,)) for r in params_rref])
        _wait_all(
            [
                _autograd_engine.owner_call_async(a, "optim.create", (self._token, class_name, args, kwargs))
                for a in self._anchors
            ]
        )

    def step(self, context_id: int) -> None:
        """Steps every owner's optimizer with the gradients of ``context_id``, in parallel;
        raises the first owner's exception once all have answered."""
        _wait_all([_autograd_engine.owner_call_async(a, "optim.step", (self._token, int(context_id))) for a in self._anchors])
