"""``torch.distributed.rpc``'s API on tensorwire's RPC agent, where a peer can run only what
this worker exposed.

Switch by changing one import::

    import tensorwire.rpc as rpc          # instead of: import torch.distributed.rpc as rpc

    @rpc.expose                           # peers may call it (on the callee)
    def scale(t, factor=2.0):
        return t * factor

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    y = rpc.rpc_sync("worker1", scale, args=(torch.ones(3),), kwargs={"factor": 3.0})
    fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
    r = rpc.remote("worker1", torch.ones, args=(4,))   # an RRef; r.to_here()
    rpc.shutdown()

What differs from PyTorch, deliberately:

- A function travels by its qualified name (``module.qualname``) and runs only if the callee
  exposed it (:func:`expose`: a function, a class, a module) or it is one of torch's tensor
  operations in :data:`DEFAULT_EXPOSED_TORCH_OPS`; anything else is refused with
  :class:`RefusedError` at the caller. Lambdas and local functions cannot be called.
- Arguments and results are decoded by an allow-listing unpickler: safe builtins, the globals
  torch's ``weights_only`` loading allows, and the classes the decoding worker exposed. A
  pickle naming anything else is refused (:class:`RefusedError`) before anything is run.
  ``init_rpc(..., trust_peers=True)`` restores PyTorch's behaviour (any function, any pickle)
  for clusters that trust every member, with a warning.
- Tensors travel beside the pickle, without a copy for contiguous CPU tensors (and for views
  that read little more than their own bytes, which keep their strides, as in PyTorch): do not
  write a tensor passed to ``rpc_async`` before its future completes. Device maps are validated as
  PyTorch does (and ``cpu`` to ``cpu`` maps work), but the Python layer carries CPU tensors
  only: a CUDA tensor raises ``RuntimeError``.
- Remote exceptions are raised at the caller with their type when it is a builtin exception,
  :class:`RefusedError` or an exposed class (else ``RuntimeError``), with the remote traceback
  in the message. Failures of the call itself (timeout, lost peer) raise ``RuntimeError``.
- RRefs travel inside arguments and results with PyTorch's fork semantics (the agent's
  reference counting); the proxies ``rref.rpc_sync()``, ``rref.rpc_async()`` and
  ``rref.remote()`` call public methods of exposed classes (and a tensor's default methods,
  :data:`DEFAULT_EXPOSED_TENSOR_METHODS`) on the owner.

How a call travels (one path, so that a layer such as distributed autograd can hook into it):
:func:`_encode` pickles the arguments (tensors and references beside the pickle),
:func:`_send` hands them to the agent with the future's completion (:func:`_future`); on the
callee, :func:`_serve` / :func:`_create` decode them (:func:`_decode_call`), run the function
(:func:`_invoke`) and encode the outcome (:func:`_returned`).
"""

from __future__ import annotations

import enum
import inspect
import os
import sys
import threading
import traceback
import types
import warnings
from typing import Any, Callable, Optional, Union

import torch

from tensorwire import _native
from tensorwire.rpc._exposed import (
    DEFAULT_EXPOSED_TENSOR_METHODS,
    DEFAULT_EXPOSED_TORCH_OPS,
    RefusedError,
    expose,
)
from tensorwire.rpc import _exposed, _serialize, functions
from tensorwire.rpc._types import WorkerInfo

__all__ = [
    "init_rpc",
    "shutdown",
    "rpc_sync",
    "rpc_async",
    "get_worker_info",
    "remote",
    "RRef",
    "WorkerInfo",
    "TensorPipeRpcBackendOptions",
    "BackendType",
    "expose",
    "RefusedError",
    "DEFAULT_EXPOSED_TORCH_OPS",
    "DEFAULT_EXPOSED_TENSOR_METHODS",
    "functions",
    "get_rpc_timeout",
    "UNSET_RPC_TIMEOUT",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "RpcBackendOptions",
    "constants",
]

from tensorwire.rpc import constants
from tensorwire.rpc.constants import (
    DEFAULT_INIT_TIMEOUT_SEC,
    DEFAULT_RPC_TIMEOUT_SEC,
    UNSET_RPC_TIMEOUT,
)

#: The bound on a graceful shutdown given ``timeout=0`` (PyTorch's default argument).
DEFAULT_SHUTDOWN_TIMEOUT_SEC: float = constants.DEFAULT_SHUTDOWN_TIMEOUT


class BackendType(enum.Enum):
    """The backends ``init_rpc`` accepts: ``TENSORPIPE`` (PyTorch's name, kept so that code
    naming it runs) and ``TCP`` both mean tensorwire's TCP agent (shared memory on one host).
    PyTorch's own ``torch.distributed.rpc.BackendType.TENSORPIPE`` is accepted as well."""

    TENSORPIPE = "TENSORPIPE"
    TCP = "TCP"


class RpcBackendOptions:
    """The base of backend options (PyTorch's ``RpcBackendOptions``): ``init_method`` and
    ``rpc_timeout``."""

    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC, init_method: str = "env://"):
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method


def _is_backend_options(options: Any) -> bool:
    if isinstance(options, RpcBackendOptions):
        return True
    try:
        from torch.distributed.rpc import RpcBackendOptions as TorchOptions
    except ImportError:  # torch built without distributed
        return False
    return isinstance(options, TorchOptions)


def _is_tensorpipe_options(options: Any) -> bool:
    if isinstance(options, TensorPipeRpcBackendOptions):
        return True
    try:
        from torch.distributed.rpc import TensorPipeRpcBackendOptions as TorchOptions
    except ImportError:
        return False
    return isinstance(options, TorchOptions)


def _to_device_map(device_map: dict) -> dict[torch.device, torch.device]:
    """A device map with ``torch.device`` keys and values (ints are CUDA indices), refusing
    two sources mapped to one target (PyTorch's check and wording)."""
    full: dict[torch.device, torch.device] = {}
    reverse: dict[torch.device, torch.device] = {}
    for k, v in device_map.items():
        k, v = torch.device(k), torch.device(v)
        if v in reverse:
            raise ValueError(
                "`device_map` only supports 1-to-1 mapping, "
                f"trying to map {k} and {reverse[v]} to {v}"
            )
        full[k] = v
        reverse[v] = k
    return full


def _to_device(device: Any) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"`set_devices` expect a list of CUDA devices, but got device type {device.type}."
        )
    return device


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """The options of ``init_rpc``, with the fields of PyTorch's class of this name (an object
    of PyTorch's own class works as well):

    - ``init_method``: where the group meets (``env://``, ``tcp://host:port``,
      ``file:///path``); default ``env://``;
    - ``rpc_timeout``: the default call timeout in seconds (zero: none); default 60;
    - ``num_worker_threads``: accepted and ignored (functions run on tensorwire's blocking
      threads, as many as calls in flight, and ``async_execution`` functions hold none);
    - ``device_maps`` (``{worker: {source: target}}``, devices as ints, strings or
      ``torch.device``), ``devices``, ``set_device_map``, ``set_devices``: PyTorch's checks
      when set, and the whole group's maps validated by the agent at ``init_rpc`` (PyTorch's
      rules and messages, ``ValueError``). The Python layer carries CPU tensors only, so on a
      machine without CUDA only ``cpu`` to ``cpu`` maps pass.
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = 16,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = "env://",
        device_maps: Optional[dict] = None,
        devices: Optional[list] = None,
        _transports: Any = None,
        _channels: Any = None,
    ):
        super().__init__(rpc_timeout=rpc_timeout, init_method=init_method)
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[str, dict[torch.device, torch.device]] = {
            to: _to_device_map(m) for to, m in (device_maps or {}).items()
        }
        self.devices: list[torch.device] = [_to_device(d) for d in (devices or [])]

    def set_device_map(self, to: str, device_map: dict) -> None:
        """Adds entries to the map of calls to worker ``to`` (incremental, as PyTorch's): a
        source already mapped elsewhere is refused (``ValueError``)."""
        full = _to_device_map(device_map)
        current = self.device_maps.setdefault(to, {})
        for k, v in full.items():
            if k in current and v != current[k]:
                raise ValueError(
                    "`set_device_map` only supports 1-to-1 mapping, trying"
                    f" to map {k} to {v} and {current[k]}"
                )
        current.update(full)

    def set_devices(self, devices: list) -> None:
        """The CUDA devices this worker uses."""
        self.devices = [_to_device(d) for d in devices]


_lock = threading.Lock()
_agent: Optional[_native.RpcAgent] = None
# Set once init_rpc has recorded this worker's agent. A peer that finished its own init_rpc
# first may call here while the native start is still returning; its call waits for this
# (a served function may use the module, e.g. get_worker_info()).
_ready = threading.Event()
_trusted = False
_me: Optional[WorkerInfo] = None
# Distributed autograd (tensorwire.rpc._autograd_engine, once imported): calls made while one
# of its contexts is current on the calling thread go through it, so that they are recorded.
_autograd: Any = None


def _require_agent() -> _native.RpcAgent:
    agent = _agent
    if agent is None:
        raise RuntimeError("RPC has not been initialized. Call tensorwire.rpc.init_rpc first.")
    return agent


def _runtime_error(e: BaseException) -> BaseException:
    """torch's exception for a native failure: ``ValueError`` for invalid device maps (as
    PyTorch's validation), else ``RuntimeError`` (as PyTorch's RPC)."""
    if isinstance(e, _native.TensorwireError):
        cls = ValueError if e.args and e.args[0] == "device_map" else RuntimeError
        err = cls(e.args[1] if len(e.args) > 1 else str(e))
        err.__cause__ = e
        return err
    return e


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: Optional[int] = None,
    rpc_backend_options: Any = None,
    *,
    trust_peers: bool = False,
) -> None:
    """Starts this worker's agent and connects it to the group, as PyTorch's ``init_rpc``.

    ``rank = -1`` takes ``RANK`` from the environment; ``world_size = None`` makes the group
    dynamic (workers join and leave), as in PyTorch. Under torchrun, ``env://`` joins the
    store its agent serves, as PyTorch's workers do. ``rpc_backend_options`` is a
    :class:`TensorPipeRpcBackendOptions` (ours or PyTorch's). The cluster secret comes from
    ``TENSORWIRE_SECRET`` (the same on every worker). ``trust_peers=True`` lets any peer run
    any importable function here and send any pickle, as PyTorch's RPC does: only for clusters
    that trust every member (warned about).
    """
    global _agent, _trusted, _me
    if backend is not None:
        # PyTorch's enum of the same name works as well.
        if not (isinstance(backend, enum.Enum) and type(backend).__name__ == "BackendType"):
            raise TypeError(
                f"Argument backend must be a member of BackendType, but got {type(backend).__name__}"
            )
        if backend.name not in BackendType.__members__:
            raise ValueError(f"tensorwire.rpc has no backend {backend.name}; use TENSORPIPE or TCP")
    if rpc_backend_options is not None:
        if not _is_backend_options(rpc_backend_options):
            raise TypeError(
                "Argument rpc_backend_options must be an instance of RpcBackendOptions, but got "
                f"{type(rpc_backend_options).__name__}"
            )
        if backend is None and not _is_tensorpipe_options(rpc_backend_options):
            raise TypeError(f"Could not infer backend for options {rpc_backend_options}")
    if rank is None or rank < 0:
        try:
            rank = int(os.environ["RANK"])
        except (KeyError, ValueError):
            raise ValueError("init_rpc: give rank, or set RANK in the environment") from None
    options = rpc_backend_options if rpc_backend_options is not None else TensorPipeRpcBackendOptions()
    device_maps = [
        (to, [(_device_name(s), _device_name(t)) for s, t in m.items()])
        for to, m in (getattr(options, "device_maps", None) or {}).items()
        if m
    ]
    devices = [_device_name(d) for d in getattr(options, "devices", None) or []]
    init_method = getattr(options, "init_method", None) or "env://"
    rpc_timeout = float(getattr(options, "rpc_timeout", DEFAULT_RPC_TIMEOUT_SEC))
    if rpc_timeout < 0:
        rpc_timeout = DEFAULT_RPC_TIMEOUT_SEC
    with _lock:
        if _agent is not None:
            raise RuntimeError("RPC is already initialized")
        if trust_peers:
            warnings.warn(
                "tensorwire.rpc: trust_peers=True lets every member of the group run any "
                "importable function on this worker and send it any pickle (arbitrary code). "
                "Use it only in a cluster that trusts every member.",
                RuntimeWarning,
                stacklevel=2,
            )
        _trusted = bool(trust_peers)
        try:
            agent = _native.RpcAgent.start(
                name,
                rank,
                world_size,
                init_method,
                rpc_timeout,
                DEFAULT_INIT_TIMEOUT_SEC,
                device_maps,
                devices,
                _serve,
                _create,
                _fetch,
            )
        except _native.TensorwireError as e:
            raise _runtime_error(e) from e
        _me = WorkerInfo(*agent.me())
        _agent = agent
        _ready.set()


def _device_name(device: Any) -> str:
    """A device as the agent names it (``cpu``, ``cuda:0``; an int is a CUDA index)."""
    return str(torch.device(device))


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Stops this worker's agent. ``graceful``: once no call is in flight anywhere in the
    group (every worker calls ``shutdown``), within ``timeout`` seconds (``0``:
    :data:`DEFAULT_SHUTDOWN_TIMEOUT_SEC`); else at once, failing pending calls."""
    global _agent, _me
    agent = _require_agent()
    seconds = float(timeout) if timeout and timeout > 0 else DEFAULT_SHUTDOWN_TIMEOUT_SEC
    try:
        agent.shutdown(graceful, seconds)
    except _native.TensorwireError as e:
        raise _runtime_error(e) from e
    finally:
        with _lock:
            _ready.clear()
            _agent = None
            _me = None


def get_worker_info(worker_name: Optional[str] = None) -> WorkerInfo:
    """The worker named ``worker_name`` (``None``: this worker)."""
    agent = _require_agent()
    if worker_name is None:
        return WorkerInfo(*agent.me())
    try:
        return WorkerInfo(*agent.worker(worker_name))
    except _native.TensorwireError as e:
        raise RuntimeError(
            f"Unknown destination worker {worker_name}: could not find destination "
            f"({e.args[1]})"
        ) from e


def _worker_name(to: Union[str, int, WorkerInfo], agent: _native.RpcAgent) -> str:
    if isinstance(to, WorkerInfo) or hasattr(to, "name") and hasattr(to, "id"):
        return to.name
    if isinstance(to, str):
        return to
    if isinstance(to, int):
        for name, id in agent.workers():
            if id == to:
                return name
        raise RuntimeError(f"Unknown destination worker id {to}")
    raise ValueError(f"Cannot get WorkerInfo from name {to!r}: give a worker name, id or WorkerInfo")


def _timeout(timeout: Optional[float]) -> Optional[float]:
    if timeout is None or timeout < 0:
        return None
    return float(timeout)


def _remote_exception(worker: WorkerInfo, exc_type: str, message: str, trace: str) -> BaseException:
    """The exception a remote function raised, as PyTorch re-raises it: its type when this
    worker knows it as safe, else ``RuntimeError``; the message says where and carries the
    remote traceback."""
    shown = exc_type.removeprefix("builtins.")
    text = f"On {worker}:\n{shown}: {message}\n{trace}"
    cls = _exposed.exception_type(exc_type)
    if cls is not None:
        try:
            return cls(text)
        except Exception as e:
            # PyTorch's words when the type cannot be built from a message.
            return RuntimeError(
                f"Failed to create original exception type. Error msg was {e} "
                f"Original exception on remote side was {text}"
            )
    return RuntimeError(text)


def get_rpc_timeout() -> float:
    """The default call timeout in seconds (PyTorch's ``get_rpc_timeout``; zero: none)."""
    return _require_agent().rpc_timeout()


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Changes the default call timeout (PyTorch's private ``_set_rpc_timeout``); calls already
    sent keep theirs."""
    _require_agent().set_rpc_timeout(float(rpc_timeout))


# --- the call path -----------------------------------------------------------------------------


def _encode(args: Optional[tuple], kwargs: Optional[dict]) -> tuple[bytes, list, list]:
    """A call's arguments as they travel: ``(payload, tensors, native references)``."""
    return _serialize.dumps((tuple(args or ()), dict(kwargs or {})))


def _send(
    to: Union[str, int, WorkerInfo],
    function: str,
    encoded: tuple[bytes, list, list],
    timeout: Optional[float],
    target: Optional["RRef"] = None,
) -> torch.futures.Future:
    """Sends one call of ``function`` (to worker ``to``, or on ``target``'s value on its
    owner) and returns the future of its decoded result: the one place every call leaves."""
    agent = _require_agent()
    payload, tensors, rrefs = encoded
    try:
        if target is None:
            worker = _worker_name(to, agent)
            callee = WorkerInfo(*agent.worker(worker))
        else:
            callee = target.owner()
        fut, on_done = _future(callee)
        if target is None:
            agent.call(worker, function, payload, tensors, rrefs, _timeout(timeout), on_done)
        else:
            target._native.call(function, payload, tensors, rrefs, _timeout(timeout), on_done)
    except _native.TensorwireError as e:
        raise _runtime_error(e) from e
    return fut


def _call_raw(
    to: Union[str, int, WorkerInfo],
    function: str,
    payload: bytes,
    tensors: list,
    timeout: Optional[float] = UNSET_RPC_TIMEOUT,
    rrefs: Optional[list] = None,
) -> torch.futures.Future:
    """Sends ``function`` with an already pickled ``payload`` (the hostile-peer tests use it
    to send hand-made pickles through the real wire path)."""
    return _send(to, function, (payload, tensors, list(rrefs or [])), timeout)


def _function_name(func: Union[Callable[..., Any], str]) -> str:
    return func if isinstance(func, str) else _exposed.qualified_name(func)


_FunctionType = types.FunctionType


def _bind(func: Any, args: Optional[tuple]) -> tuple[Any, tuple]:
    """A method bound to an instance travels as its class's function with the instance as
    the first argument (the instance's class must be exposed on the callee, as any value's);
    a class method travels as itself."""
    if type(func) is _FunctionType:
        return func, tuple(args or ())
    owner = getattr(func, "__self__", None)
    if inspect.ismethod(func) and not isinstance(owner, type):
        return func.__func__, (owner, *(args or ()))
    return func, tuple(args or ())


def rpc_async(
    to: Union[str, int, WorkerInfo],
    func: Union[Callable[..., Any], str],
    args: Optional[tuple] = None,
    kwargs: Optional[dict] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> torch.futures.Future:
    """Calls ``func(*args, **kwargs)`` on worker ``to`` and returns a ``torch.futures.Future``
    of its result (``then``, ``wait``, ``value`` and ``torch.futures.wait_all`` work).
    ``func`` is a function exposed on the callee, one of :data:`DEFAULT_EXPOSED_TORCH_OPS`,
    or its qualified name. ``timeout`` in seconds; ``0``: none; negative: the default.
    ``RRef`` arguments are forked for the callee."""
    context = _autograd.current_id() if _autograd is not None else None
    if context is not None:
        return _autograd.rpc_async(context, to, func, args, kwargs, timeout)
    func, args = _bind(func, args)
    return _send(to, _function_name(func), _encode(args, kwargs), timeout)


def rpc_sync(
    to: Union[str, int, WorkerInfo],
    func: Union[Callable[..., Any], str],
    args: Optional[tuple] = None,
    kwargs: Optional[dict] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Calls ``func(*args, **kwargs)`` on worker ``to`` and returns its result (see
    :func:`rpc_async`); raises the remote exception or the call's failure."""
    context = _autograd.current_id() if _autograd is not None else None
    if context is not None:
        # Recorded by distributed autograd.
        return _autograd.rpc_sync(context, to, func, args, kwargs, timeout)
    # As rpc_async(...).wait(), without the future: this thread waits for the reply (the GIL
    # released) and decodes it itself, one thread hand-over less.
    func, args = _bind(func, args)
    payload, tensors, rrefs = _encode(args, kwargs)
    agent = _require_agent()
    try:
        worker = _worker_name(to, agent)
        callee = WorkerInfo(*agent.worker(worker))
        outcome = agent.call_wait(worker, _function_name(func), payload, tensors, rrefs, _timeout(timeout))
    except _native.TensorwireError as e:
        raise _runtime_error(e) from e
    return _decoded(outcome, callee, _trusted)


def remote(
    to: Union[str, int, WorkerInfo],
    func: Union[Callable[..., Any], str],
    args: Optional[tuple] = None,
    kwargs: Optional[dict] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> "RRef":
    """Runs ``func(*args, **kwargs)`` on worker ``to``, which keeps the result, and returns an
    :class:`RRef` to it at once (``func`` as for :func:`rpc_async`). A failure of ``func`` is
    raised by ``to_here`` and ``local_value``."""
    context = _autograd.current_id() if _autograd is not None else None
    if context is not None:
        return _autograd.remote(context, to, func, args, kwargs, timeout)
    agent = _require_agent()
    worker = _worker_name(to, agent)
    func, args = _bind(func, args)
    payload, tensors, rrefs = _encode(args, kwargs)
    try:
        native = agent.remote(worker, _function_name(func), payload, tensors, rrefs, _timeout(timeout))
    except _native.TensorwireError as e:
        raise _runtime_error(e) from e
    return RRef(_native_rref=native)


def _decoded(outcome: Any, callee: WorkerInfo, trusted: bool) -> Any:
    """The value of a native outcome: ``("returned", payload, buffers, rrefs)`` decoded, or
    raises for ``("raised", type, message, traceback)`` or a failure."""
    if isinstance(outcome, BaseException):
        raise _runtime_error(outcome)
    if outcome[0] == "returned":
        return _serialize.loads(outcome[1], outcome[2], outcome[3], trusted=trusted, origin=callee.name)
    raise _remote_exception(callee, outcome[1], outcome[2], outcome[3])


def _future(callee: WorkerInfo) -> tuple[torch.futures.Future, Callable[[Any], None]]:
    """A future and the ``on_done`` that completes it from a native outcome (see
    :func:`_decoded`)."""
    fut: torch.futures.Future = torch.futures.Future()
    trusted = _trusted

    def on_done(outcome: Any) -> None:
        try:
            try:
                value = _decoded(outcome, callee, trusted)
            except Exception as e:
                fut.set_exception(e)
            else:
                fut.set_result(value)
        except Exception as e:  # noqa: BLE001 - the future must complete
            if not fut.done():
                fut.set_exception(e)

    return fut, on_done


# --- serving ---------------------------------------------------------------------------------


def _decode_call(caller: str, payload: bytes, buffers: list, rrefs: list) -> tuple[tuple, dict]:
    """A call's arguments, decoded with this worker's allow-list."""
    decoded = _serialize.loads(payload, buffers, rrefs, trusted=_trusted, origin=caller)
    if not (
        isinstance(decoded, tuple)
        and len(decoded) == 2
        and isinstance(decoded[0], tuple)
        and isinstance(decoded[1], dict)
    ):
        raise RefusedError(f"malformed arguments from {caller}")
    return decoded


def _resolve(function: str, target: Any) -> Callable[..., Any]:
    """What a call runs: an exposed function, or a method of ``target`` (a reference's value)
    this worker lets peers call; anything under ``trust_peers=True``."""
    if target is None and not _trusted:
        # An exposed function, found first as ``resolve_function`` finds it, without naming
        # this worker for an error first.
        fn = _exposed._functions.get(function)
        if fn is not None and callable(fn):
            return fn
    me = _me
    worker = str(me) if me is not None else "this worker"
    if target is not None:
        if _trusted:
            return getattr(target, function)
        return _exposed.resolve_method(target, function, worker)
    if _trusted:
        return _import_by_name(function)
    return _exposed.resolve_function(function, worker)


def _invoke(
    caller: str, function: str, payload: bytes, buffers: list, rrefs: list, target: Any
) -> tuple[Any, bool]:
    """Runs a call from ``caller``: resolves the function, decodes the arguments, runs it.
    Returns its result and whether that is a future whose value is the call's result (an
    :func:`functions.async_execution` function)."""
    fn = _resolve(function, target)
    args, kwargs = _decode_call(caller, payload, buffers, rrefs)
    result = fn(*args, **kwargs)
    if not functions.is_async_execution(fn):
        return result, False
    if not isinstance(result, torch._C.Future):
        raise RuntimeError(
            "Functions decorated with @rpc.async_function must return a "
            f"torch.futures.Future object, but got {type(result)}"
        )
    return result, True


def _raised(e: BaseException) -> tuple:
    cls = type(e)
    trace = "".join(traceback.format_exception(e))
    return ("raised", f"{cls.__module__}.{cls.__qualname__}", str(e), trace)


def _raised_here(e: BaseException) -> tuple:
    """:func:`_raised` for a function a peer called here that raised: the callee also writes
    the failure to its ``sys.stderr``, as PyTorch's workers do."""
    raised = _raised(e)
    print(f"On {_me}:\n{e!r}\n{raised[3]}", file=sys.stderr, flush=True)
    return raised


def _returned(value: Any) -> tuple:
    """A result as it travels back: ``("returned", payload, tensors, rrefs)``."""
    return ("returned", *_serialize.dumps(value))


def _kept(value: Any) -> tuple:
    """A ``remote()`` result as its owner keeps it."""
    return ("returned", value)


def _later(fut: torch.futures.Future, settle: Callable[[Any], tuple]) -> tuple:
    """``("future", f)``: the agent replies when ``f``, completing with ``fut``'s outcome
    (``settle(value)`` or the exception), does."""

    def outcome(done: torch.futures.Future) -> tuple:
        try:
            return settle(done.wait())
        except Exception as e:  # noqa: BLE001 - the caller gets it
            return _raised(e)

    return ("future", fut.then(outcome))


def _wait_ready() -> None:
    """Waits (the GIL released) until init_rpc has recorded the agent that serves this call."""
    if _agent is None:
        _ready.wait(DEFAULT_INIT_TIMEOUT_SEC)


def _serve(
    caller: str, function: str, payload: bytes, buffers: list, rrefs: list, target: Any
) -> tuple:
    """A call from ``caller`` (on a blocking thread, with the GIL), of a function or of a
    method of ``target``: ``("returned", payload, tensors, rrefs)``, ``("raised", type,
    message, traceback)`` or ``("future", f)``."""
    _wait_ready()
    try:
        result, later = _invoke(caller, function, payload, buffers, rrefs, target)
        return _later(result, _returned) if later else _returned(result)
    except Exception as e:
        return _raised_here(e)


def _create(
    caller: str, function: str, payload: bytes, buffers: list, rrefs: list, target: Any
) -> tuple:
    """A ``remote()`` creation from ``caller``: ``("returned", value)`` (kept here by the
    agent as the reference's value), ``("raised", ...)`` or ``("future", f)``."""
    _wait_ready()
    try:
        result, later = _invoke(caller, function, payload, buffers, rrefs, target)
        return _later(result, _kept) if later else _kept(result)
    except Exception as e:
        return _raised_here(e)


def _fetch(value: Any) -> tuple:
    """A reference's value pickled for ``to_here``."""
    try:
        return _returned(value)
    except Exception as e:
        return _raised(e)


# --- references ------------------------------------------------------------------------------


class RRef:
    """A reference to a value owned by a worker (PyTorch's ``RRef``): made by :func:`remote`
    (the value is created on ``to``), by ``RRef(value)`` (owned here), or received inside
    arguments and results. The owner keeps the value while any worker holds a reference (the
    agent's distributed reference counting, with PyTorch's fork protocol: a reference sent to
    another worker is forked for it, and the sender's is kept until the owner confirmed the
    fork).
    """

    __slots__ = ("_native", "__weakref__")

    def __init__(self, value: Any = None, type_hint: Any = None, *, _native_rref: Any = None):
        if _native_rref is None:
            _native_rref = _require_agent().local_rref(value)
        self._native = _native_rref

    def owner(self) -> WorkerInfo:
        """The worker that owns the value."""
        return WorkerInfo(*self._native.owner())

    def owner_name(self) -> str:
        """The owner's name."""
        return self._native.owner()[0]

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._native.is_owner()

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has confirmed this worker's reference (always true on the
        owner)."""
        return self._native.confirmed_by_owner()

    def local_value(self) -> Any:
        """The value itself, on its owner (a creation still running is waited for); raises
        the exception the creating function raised; ``RuntimeError`` on another worker."""
        try:
            outcome = self._native.local_value()
        except _native.TensorwireError as e:
            raise _runtime_error(e) from e
        if outcome[0] == "returned":
            return outcome[1]
        raise _remote_exception(self.owner(), outcome[1], outcome[2], outcome[3])

    def _fetch_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> torch.futures.Future:
        context = _autograd.current_id() if _autograd is not None else None
        if context is not None:
            return _autograd.fetch_async(context, self, timeout)
        fut, on_done = _future(self.owner())
        try:
            self._native.fetch(_timeout(timeout), on_done)
        except _native.TensorwireError as e:
            raise _runtime_error(e) from e
        return fut

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """The value: on its owner the value itself (:meth:`local_value`, as PyTorch's
        ``to_here``), elsewhere a copy pickled on the owner now; raises the exception the
        creating function raised."""
        if _agent is None:
            # Shut down here: say so, whatever the owner's state (else the owner's own
            # shutdown, seen first, would decide the message; a race in the ported tests).
            raise RuntimeError("RPC is no longer running on this worker")
        if self.is_owner():
            # PyTorch returns the owner's value itself (so a tensor fetched there is the key
            # of its gradients in a distributed autograd context); in a context too (see
            # _autograd.fetch_async).
            return self.local_value()
        if _autograd is not None and _autograd.current_id() is not None:
            # Recorded by distributed autograd, through _fetch_async.
            return self._fetch_async(timeout).wait()
        # As _fetch_async(timeout).wait(), without the future (see rpc_sync).
        owner = self.owner()
        try:
            outcome = self._native.fetch_wait(_timeout(timeout))
        except _native.TensorwireError as e:
            raise _runtime_error(e) from e
        return _decoded(outcome, owner, _trusted)

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> "_RRefProxy":
        """A proxy whose methods run on the value, on its owner, and return their results:
        ``rref.rpc_sync().method(*args)`` (the value's class exposed there, or a tensor)."""
        return _RRefProxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> "_RRefProxy":
        """As :meth:`rpc_sync`, returning a ``torch.futures.Future`` of the result."""
        return _RRefProxy(self, "async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> "_RRefProxy":
        """As :meth:`rpc_sync`, keeping the result on the owner: returns an :class:`RRef`."""
        return _RRefProxy(self, "remote", timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Runs the backward pass from the value, a tensor (PyTorch's ``RRef.backward``), on
        the owner: with ``dist_autograd_ctx_id`` (``-1``: none), distributed autograd's
        backward in that context (:func:`tensorwire.rpc.dist_autograd.backward`), else local
        autograd's (the owner's reference only). Raises ``RuntimeError`` (PyTorch's
        messages)."""
        if self.is_owner():
            _rref_backward(self, dist_autograd_ctx_id, retain_graph)
            return
        if dist_autograd_ctx_id == -1:
            raise RuntimeError(
                "User RRefs require 'dist_autograd_ctx_id' to be specified in autograd mode"
            )
        args = (self, int(dist_autograd_ctx_id), bool(retain_graph))
        rpc_sync(self.owner(), _rref_backward, args=args)

    def _get_future(self) -> torch.futures.Future:
        """A future completed once the owner created the value (PyTorch's private
        ``_get_future``); it carries the creation's failure (a timeout, a lost owner)."""
        fut: torch.futures.Future = torch.futures.Future()
        try:
            self._native.created()
        except _native.TensorwireError as e:
            fut.set_exception(_runtime_error(e))
        else:
            fut.set_result(None)
        return fut

    def __reduce__(self):
        raise RuntimeError(
            "Can not pickle rref in python pickler, rref can only be pickled when using RPC "
            "(tensorwire.rpc sends RRefs inside the arguments and results of its calls)"
        )

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}({self._native.id()}, owner={self.owner_name()})"


class _RRefProxy:
    """``rref.rpc_sync()`` / ``rpc_async()`` / ``remote()``: attribute access gives a function
    that calls that method on the reference's value, on its owner."""

    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref: RRef, mode: str, timeout: float):
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def method(*args: Any, **kwargs: Any) -> Any:
            context = _autograd.current_id() if _autograd is not None else None
            if context is not None:
                # In a distributed autograd context the call is a tracked one (its tensors
                # that require grad are recorded both ways), as PyTorch's proxies are calls of
                # a function on the owner: the reference travels as an argument.
                owner = rref.owner_name()
                call = (rref, name, args, kwargs)
                if mode == "remote":
                    return _autograd.remote(context, owner, _invoke_on_rref, call, None, timeout)
                if mode == "sync":
                    return _autograd.rpc_sync(context, owner, _invoke_on_rref, call, None, timeout)
                return _autograd.rpc_async(context, owner, _invoke_on_rref, call, None, timeout)
            encoded = _encode(args, kwargs)
            if mode == "remote":
                payload, tensors, rrefs = encoded
                try:
                    native = rref._native.remote(name, payload, tensors, rrefs, _timeout(timeout))
                except _native.TensorwireError as e:
                    raise _runtime_error(e) from e
                return RRef(_native_rref=native)
            fut = _send(rref.owner_name(), name, encoded, timeout, target=rref)
            return fut.wait() if mode == "sync" else fut

        method.__name__ = name
        return method


def _invoke_on_rref(rref: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """A proxy's call made in a distributed autograd context, on the reference's owner
    (tensorwire exposes it on every worker): runs method ``name`` of the value, with the same
    rule as a proxy's call outside a context (:func:`_resolve`)."""
    if not isinstance(rref, RRef) or not rref.is_owner():
        raise _exposed.RefusedError("a proxy call names a reference this worker does not own")
    if not isinstance(name, str) or not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise _exposed.RefusedError("malformed proxy call")
    return _resolve(name, rref.local_value())(*args, **kwargs)


def _rref_backward(rref: Any, dist_autograd_ctx_id: int, retain_graph: bool) -> None:
    """:meth:`RRef.backward` on the reference's owner (tensorwire exposes it on every worker,
    for the users' references)."""
    if not isinstance(rref, RRef) or not rref.is_owner():
        raise _exposed.RefusedError("a backward call names a reference this worker does not own")
    value = rref.local_value()
    if not isinstance(value, torch.Tensor):
        raise RuntimeError("RRef should contain a tensor for .backward()")
    if dist_autograd_ctx_id == -1:
        torch.autograd.backward(value, retain_graph=bool(retain_graph))
    else:
        from tensorwire.rpc import dist_autograd

        dist_autograd.backward(int(dist_autograd_ctx_id), [value], retain_graph=bool(retain_graph))


_serialize.register_rref_type(RRef, lambda native: RRef(_native_rref=native))


def _import_by_name(name: str) -> Callable[..., Any]:
    """The object called ``name`` (``trust_peers=True`` only: it imports what it names)."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise RefusedError(f"no function {name!r} on this worker")
