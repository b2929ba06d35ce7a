"""``torch.distributed.rpc.functions``: :func:`async_execution`."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Marks ``fn`` as returning a ``torch.futures.Future`` whose value is the call's result
    (PyTorch's ``rpc.functions.async_execution``): the callee replies when the future
    completes, holding no thread meanwhile, so a function can wait for nested calls by
    chaining callbacks (``rpc.rpc_async(...).then(...)``). A function so marked that returns
    anything else fails the call with ``RuntimeError``.

    As in PyTorch, with ``@staticmethod`` or ``@classmethod`` put this decorator inside
    (closer to the function). The function is still called by its qualified name and must be
    exposed on the callee (:func:`tensorwire.rpc.expose`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    # PyTorch's marker attribute, so that code checking for it keeps working.
    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def is_async_execution(fn: Any) -> bool:
    """Whether ``fn`` (a function, or a method bound or not) was marked with
    :func:`async_execution`."""
    return getattr(fn, "_wrapped_async_rpc_function", None) is not None
