"""What this worker lets its peers run and unpickle: functions, classes and modules it exposed,
and torch's tensor operations by default."""

from __future__ import annotations

import builtins
import types
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


class RefusedError(RuntimeError):
    """A call or a value refused by the worker that was to run or decode it: a function it did
    not expose, or a pickle naming a class or function outside its allow-list."""


#: torch's tensor operations every worker exposes without being asked (by these names, as
#: ``rpc_sync(to, torch.add, ...)`` sends them). They compute on tensors and construct them;
#: none reads files, imports or runs code it is given.
DEFAULT_EXPOSED_TORCH_OPS: tuple[str, ...] = (
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "pow", "neg",
    "abs", "exp", "log", "sqrt", "sin", "cos", "tanh", "sigmoid", "relu", "clamp",
    "matmul", "mm", "bmm", "mv", "dot", "outer", "t", "transpose", "reshape", "flatten",
    "cat", "stack", "sum", "mean", "prod", "cumsum", "argmax", "argmin", "eq", "ne", "lt",
    "le", "gt", "ge", "equal", "allclose", "isclose", "where", "clone", "ones", "zeros",
    "ones_like", "zeros_like", "full", "full_like", "empty", "arange", "linspace", "eye",
    "tensor", "nonzero",
)

#: The methods of a tensor held in an ``RRef`` that peers may call through the proxies
#: (``rref.rpc_sync().size()``) without anything exposed: torch's default operations above
#: and a tensor's own read-only queries and views.
DEFAULT_EXPOSED_TENSOR_METHODS: frozenset[str] = frozenset(
    op for op in DEFAULT_EXPOSED_TORCH_OPS if hasattr(torch.Tensor, op)
) | frozenset(
    (
        "size", "dim", "numel", "view", "view_as", "contiguous", "item", "tolist", "float",
        "double", "int", "long", "bool", "detach", "unsqueeze", "squeeze", "expand",
        "repeat", "max", "min", "norm", "add_", "mul_", "sub_", "div_", "fill_", "zero_",
        "copy_",
    )
)

_functions: dict[str, Callable[..., Any]] = {}
_classes: dict[str, type] = {}
_modules: dict[str, types.ModuleType] = {}
# id(function object) -> the name it is called by, for objects whose own names do not say it
# (torch's builtins call themselves ``torch._VariableFunctionsClass.add``).
_names_by_id: dict[int, str] = {}

for _op in DEFAULT_EXPOSED_TORCH_OPS:
    _fn = getattr(torch, _op)
    _functions[f"torch.{_op}"] = _fn
    _names_by_id[id(_fn)] = f"torch.{_op}"


#: tensorwire's own functions that every worker runs for its peers, by name -> (module,
#: attribute), imported on first use: each checks its arguments itself (the distributed
#: optimizer's constructor accepts only references to tensors the worker owns; a proxy's call
#: in an autograd context runs only what a proxy's call may run).
_INTERNAL: dict[str, tuple[str, str]] = {
    "tensorwire.rpc.optim._new_local_optimizer": ("tensorwire.rpc.optim", "_new_local_optimizer"),
    "tensorwire.rpc._invoke_on_rref": ("tensorwire.rpc", "_invoke_on_rref"),
    "tensorwire.rpc._rref_backward": ("tensorwire.rpc", "_rref_backward"),
}


def qualified_name(obj: Any) -> str:
    """The name ``obj`` is called by on other workers: ``module.qualname``. Lambdas and
    functions defined inside functions have none (expose a module-level function instead)."""
    known = _names_by_id.get(id(obj))
    if known is not None:
        return known
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise ValueError(
            f"{obj!r} cannot be called remotely: tensorwire.rpc calls a function by its "
            "qualified name, so it must be defined at module level (not a lambda or a local "
            "function) and exposed on the callee (tensorwire.rpc.expose)"
        )
    return f"{module}.{qualname}"


def expose(obj: T) -> T:
    """Lets peers call ``obj`` on this worker, and (for a class) send and receive its
    instances. Use it as a decorator or call it, on the callee (and, for classes and
    exception types, on whoever decodes them):

    - a function: peers may call it;
    - a class: peers may construct it, call its public methods by ``module.Class.method``,
      and send its instances as arguments and results; an exception class is raised with its
      type at the caller;
    - a module: every public function and class *defined in* that module (not those it
      imported) is exposed as above.

    Returns ``obj`` unchanged.
    """
    if isinstance(obj, types.ModuleType):
        _modules[obj.__name__] = obj
    elif isinstance(obj, type):
        _classes[qualified_name(obj)] = obj
    elif callable(obj):
        _functions[qualified_name(obj)] = obj
    else:
        raise TypeError(f"tensorwire.rpc.expose takes a function, a class or a module, not {obj!r}")
    return obj


def _module_member(name: str) -> Any:
    """The public function or class ``name`` (``module.attr``) defined in an exposed module."""
    module_name, _, attr = name.rpartition(".")
    module = _modules.get(module_name)
    if module is None or attr.startswith("_"):
        return None
    member = module.__dict__.get(attr)
    if isinstance(member, (type, types.FunctionType)) and member.__module__ == module.__name__:
        return member
    return None


def exposed_class(name: str) -> type | None:
    """The exposed class called ``name``, if any."""
    cls = _classes.get(name)
    if cls is not None:
        return cls
    member = _module_member(name)
    return member if isinstance(member, type) else None


def resolve_function(name: str, worker: str) -> Callable[..., Any]:
    """The function (or class) a peer asked to run by ``name``; ``RefusedError`` unless this
    worker exposed it. Nothing is imported: only what was exposed can be found."""
    fn = _functions.get(name)
    if fn is None and name in _INTERNAL:
        import importlib

        module, attr = _INTERNAL[name]
        fn = getattr(importlib.import_module(module), attr)
    if fn is None:
        fn = exposed_class(name)
    if fn is None:
        fn = _module_member(name)
    if fn is None:
        owner, _, method = name.rpartition(".")
        cls = exposed_class(owner)
        if cls is not None and not method.startswith("_"):
            fn = getattr(cls, method, None)
    if fn is None or not callable(fn):
        raise RefusedError(
            f"{worker} refused to run {name!r}: it runs only the functions it exposed "
            "(tensorwire.rpc.expose) and torch's default tensor operations "
            "(tensorwire.rpc.DEFAULT_EXPOSED_TORCH_OPS)"
        )
    return fn


def resolve_method(target: Any, name: str, worker: str) -> Callable[..., Any]:
    """The method ``name`` of ``target`` (the value of a reference owned here) that a peer
    asked to run through a proxy (``rref.rpc_sync().name(...)``); ``RefusedError`` unless
    ``target``'s class is exposed (a public method), or ``target`` is a tensor and ``name`` one
    of :data:`DEFAULT_EXPOSED_TENSOR_METHODS`."""
    cls = type(target)
    if not hasattr(target, name):
        # As Python (and PyTorch's proxy) says it: nothing is run.
        raise AttributeError(f"'{cls.__name__}' object has no attribute '{name}'")
    allowed = False
    if not name.startswith("_"):
        if isinstance(target, torch.Tensor):
            allowed = name in DEFAULT_EXPOSED_TENSOR_METHODS
        else:
            try:
                allowed = exposed_class(qualified_name(cls)) is cls
            except ValueError:
                allowed = False
    method = getattr(target, name, None) if allowed else None
    if method is None or not callable(method):
        raise RefusedError(
            f"{worker} refused to run the method {name!r} of a {cls.__module__}."
            f"{cls.__qualname__}: through an RRef, peers run the public methods of exposed "
            "classes (tensorwire.rpc.expose) and a tensor's default methods "
            "(tensorwire.rpc.DEFAULT_EXPOSED_TENSOR_METHODS)"
        )
    return method


def exposed_callable(name: str) -> Callable[..., Any] | None:
    """The exposed function (or public method of an exposed class) called ``name``, if any:
    what :func:`resolve_function` finds, without raising."""
    try:
        return resolve_function(name, "")
    except RefusedError:
        return None


def exception_type(name: str) -> type[BaseException] | None:
    """The exception class a remote failure named, when this worker knows it as safe: a
    builtin exception, tensorwire.rpc's own, or an exposed class."""
    module, _, attr = name.rpartition(".")
    candidate: Any = None
    if module == "builtins":
        candidate = getattr(builtins, attr, None)
    elif name == f"{RefusedError.__module__}.{RefusedError.__qualname__}":
        candidate = RefusedError
    else:
        candidate = exposed_class(name)
    if isinstance(candidate, type) and issubclass(candidate, Exception):
        return candidate
    return None
