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

Each local optimizer is the value of a reference the :class:`DistributedOptimizer` holds, as in
PyTorch: it lives while that object does. It also goes when its trainer is lost
(the owner releases whatever a lost worker referred to), so a trainer that dies leaves no
optimizer state behind on the parameter servers.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from typing import Any

import torch

from tensorwire import rpc
from tensorwire.rpc import _autograd_engine, _exposed, dist_autograd
from tensorwire.rpc._exposed import RefusedError

__all__ = ["DistributedOptimizer"]

# --- the owner's side ----------------------------------------------------------------------

# PyTorch's _LocalOptimizer.global_lock: one step at a time on an owner.
_step_lock = threading.Lock()
# The local optimizers alive on this worker (for tests and for whoever wonders where memory
# went): each lives exactly as long as the reference its trainer holds.
_live: "weakref.WeakSet[_LocalOptimizer]" = weakref.WeakSet()


class _LocalOptimizer:
    """An owner's optimizer over its parameters: the value of a reference its
    :class:`DistributedOptimizer` holds, so that it goes when that optimizer is dropped, and
    when its trainer is lost (the owner releases the values a lost worker referred to)."""

    def __init__(self, optim: torch.optim.Optimizer, params: list[torch.Tensor]):
        self.optim = optim
        self.params = params
        _live.add(self)


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


def _new_local_optimizer(class_name: str, params_rref: list, args: tuple, kwargs: dict) -> _LocalOptimizer:
    """Runs on an owner, through ``remote()`` (tensorwire exposes it on every worker): builds
    ``class_name(params, *args, **kwargs)`` over the values of ``params_rref``, references to
    tensors this worker owns; the caller can name only references it holds."""
    if not isinstance(params_rref, list) or not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise RefusedError("malformed arguments for a distributed optimizer")
    params = []
    for r in params_rref:
        if not isinstance(r, rpc.RRef) or not r.is_owner():
            raise RefusedError("a distributed optimizer's parameters must be references to tensors this worker owns")
        value = r.local_value()
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"DistributedOptimizer: a parameter reference holds {type(value).__name__}, not a tensor")
        params.append(value)
    cls = _optimizer_class(class_name)
    return _LocalOptimizer(cls(params, *args, **kwargs), params)


def _local(value: Any) -> _LocalOptimizer:
    if not isinstance(value, _LocalOptimizer):
        raise RefusedError("not a distributed optimizer's reference")
    return value


def _ready(value: Any) -> None:
    # A creation that raised raises here, at the caller, with its type (see owner_call).
    _local(value)


def _step(value: Any, context_id: int) -> None:
    local = _local(value)
    grads = dist_autograd.get_gradients(context_id)
    with _step_lock:
        for p in local.params:
            p.grad = grads.get(p)
        local.optim.step()


_autograd_engine.OWNER_FUNCTIONS.update({"optim.ready": _ready, "optim.step": _step})

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
        by_owner: dict[str, list] = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner_name(), []).append(rref)
        # One local optimizer per owner, the value of a reference held here (PyTorch's design):
        # dropping this object, or this worker being lost, releases them.
        self._locals = [
            rpc.remote(owner, _new_local_optimizer, args=(class_name, refs, tuple(args), dict(kwargs)))
            for owner, refs in by_owner.items()
        ]
        _wait_all([_autograd_engine.owner_call_async(r, "optim.ready", ()) for r in self._locals])
        # The owners and the local optimizers this worker owns, taken once (each lives as
        # long as its reference, which this object holds too): a step asks for none of them.
        self._owners = _autograd_engine.Owners(self._locals)

    def step(self, context_id: int) -> None:
        """Steps every owner's optimizer with the gradients of ``context_id``, in parallel;
        raises the first owner's exception once all have answered."""
        # One wait for every owner's answer; this worker's own optimizer (if any) steps on this
        # thread meanwhile (PyTorch's calls itself for it).
        _autograd_engine.owner_call_all(self._owners, "optim.step", (int(context_id),))
