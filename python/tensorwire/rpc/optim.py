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

As in PyTorch, an owner steps the optimizers PyTorch has a functional counterpart of (SGD,
Adam, AdamW, Adadelta, RMSprop, Rprop, Adamax: ``torch.distributed.optim``'s
``functional_optim_map``; not Adagrad, whose counterpart fails on a parameter without a
gradient) through that counterpart, with the gradients handed over as a list:
the same update, without ``Optimizer.step``'s wrappers (its profiler record and its step
hooks), and ``.grad`` is not set on the owner's parameters. Unlike PyTorch, it gets the
class's own settings (its checks and its defaults, where the two differ), and an optimizer
with a setting the counterpart lacks (``differentiable``, ``capturable``) steps as the class.
Other optimizers run ``optimizer.step()`` over the parameters' ``.grad``, set from the
context.

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
import inspect
import threading
import types
import weakref
from typing import Any, Optional

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
    when its trainer is lost (the owner releases the values a lost worker referred to).
    ``functional``: ``optim`` is PyTorch's functional counterpart of the class
    (:func:`_functional_class`), stepped with the gradients as a list."""

    def __init__(self, optim: Any, params: list[torch.Tensor], functional: bool = False):
        self.optim = optim
        self.params = params
        self.functional = functional
        _live.add(self)


#: The classes stepped through their functional counterpart where PyTorch's map has one: those
#: checked to compute what the class computes, bit for bit (``tests/test_optim_pieces.py``).
#: Not Adagrad: its functional class fails on a parameter the pass gave no gradient.
_FUNCTIONAL_CLASSES = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adadelta,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.Adamax,
)


def _functional_class(cls: type) -> Optional[type]:
    """The functional optimizer PyTorch's ``DistributedOptimizer`` runs on an owner in place
    of ``cls`` (``torch.distributed.optim.utils.functional_optim_map``; not while TorchScript
    is disabled, as in PyTorch), for the classes of :data:`_FUNCTIONAL_CLASSES`, or ``None``.
    It computes the same update through the same ``torch.optim._functional`` function,
    without ``Optimizer.step``'s wrappers (its profiler record, its hooks, the grad mode),
    and does not set ``.grad``: about 19 us a step instead of 50 for SGD over a Linear(256)'s
    two parameters (alone, hot; ``docs/bench/python/twentieth-C/owner_step.py``)."""
    if cls not in _FUNCTIONAL_CLASSES:
        return None
    try:
        from torch.distributed.optim.utils import functional_optim_map
    except ImportError:  # torch built without distributed, or a torch without the map
        return None
    if not getattr(getattr(torch.jit, "_state", None), "_enabled", True):
        return None
    return functional_optim_map.get(cls)


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
    optim = cls(params, *args, **kwargs)
    functional = _as_functional(cls, optim, params)
    if functional is not None:
        return _LocalOptimizer(functional, params, functional=True)
    return _LocalOptimizer(optim, params)


def _as_functional(cls: type, optim: torch.optim.Optimizer, params: list) -> Any:
    """``optim``'s functional counterpart (:func:`_functional_class`) with ``optim``'s very
    settings, or ``None`` where there is none or it cannot have them. The class is built
    first in any case, so that its own checks of the arguments raise as they would; its
    settings (``optim.defaults``: what was given and the class's defaults, which are not all
    the functional class's: SGD's learning rate is 1e-3, its functional class's 1e-2) are
    handed over by name; a setting only the class has (``differentiable``, ``capturable``,
    ...) that is not the class's default keeps the class."""
    functional = _functional_class(cls)
    if functional is None:
        return None
    try:
        takes = inspect.signature(functional.__init__).parameters
        defaults = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None
    settings = {}
    for key, value in optim.defaults.items():
        if key in takes:
            settings[key] = value
        elif key in defaults and defaults[key].default is not inspect.Parameter.empty:
            if not _same_setting(value, defaults[key].default):
                return None
        elif key in defaults:
            return None
    if all(p.device.type == "cpu" for p in params):
        # What torch makes of ``None`` (its default: pick per step) for CPU tensors, decided
        # once here: no foreach or fused kernels (they are for CUDA and other devices). Else
        # each step asks ``_default_to_fused_or_foreach``, ten Python calls.
        for key in ("foreach", "fused"):
            if key in settings and settings[key] is None:
                settings[key] = False
    try:
        return _construct_quietly(functional, params, settings)
    except (TypeError, ValueError):
        return None  # settings it refuses: the class steps


# A functional class's constructor warns that TorchScript support for functional optimizers is
# deprecated, forcing the warning on with ``warnings.catch_warnings()``; no TorchScript is used
# here. ``catch_warnings`` swaps the process's filter list and is not thread-safe (owners build
# optimizers on the agent's threads, beside the user's own), so neither torch's nor a
# ``catch_warnings`` of ours may run: each class's ``__init__`` is rebuilt once, over a copy of
# its module's globals in which that one function does nothing.
_QUIET_NAME = "_scripted_functional_optimizer_deprecation_warning"
_quiet_inits: dict = {}
_quiet_lock = threading.Lock()


def _quiet_init(functional: type) -> Any:
    """``functional.__init__`` without its deprecation warning, or the plain ``__init__``
    where it does not call that function by name (a torch that renamed it: it then warns)."""
    with _quiet_lock:
        init = _quiet_inits.get(functional)
        if init is None:
            init = original = functional.__init__
            if isinstance(original, types.FunctionType) and _QUIET_NAME in original.__code__.co_names:
                namespace = dict(original.__globals__)
                namespace[_QUIET_NAME] = lambda *args, **kwargs: None
                init = types.FunctionType(
                    original.__code__, namespace, original.__name__, original.__defaults__, original.__closure__
                )
                init.__kwdefaults__ = original.__kwdefaults__
            _quiet_inits[functional] = init
        return init


def _construct_quietly(functional: type, params: list, settings: dict) -> Any:
    optim = functional.__new__(functional)
    _quiet_init(functional)(optim, params, **settings)
    return optim


def _same_setting(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a setting that does not compare is not the default
        return False


def _local(value: Any) -> _LocalOptimizer:
    if not isinstance(value, _LocalOptimizer):
        raise RefusedError("not a distributed optimizer's reference")
    return value


def _ready(value: Any) -> None:
    # A creation that raised raises here, at the caller, with its type (see owner_call).
    _local(value)


def _step(value: Any, context_id: int) -> None:
    local = _local(value)
    # By the tensors' ids (the same objects): a dict keyed by the tensors calls
    # ``Tensor.__hash__``, a Python function, for every key and every lookup.
    grads = {id(leaf): grad for leaf, grad in dist_autograd._gradient_pairs(context_id)}
    with _step_lock:
        if local.functional:
            local.optim.step([grads.get(id(p)) for p in local.params])
            return
        for p in local.params:
            p.grad = grads.get(id(p))
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
