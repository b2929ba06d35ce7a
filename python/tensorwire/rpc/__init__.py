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
- Tensors travel beside the pickle, without a copy for contiguous CPU tensors: do not write a
  tensor passed to ``rpc_async`` before its future completes. CUDA tensors and device maps are
  not supported yet.
- Remote exceptions are raised at the caller with their type when it is a builtin exception,
  :class:`RefusedError` or an exposed class (else ``RuntimeError``), with the remote traceback
  in the message. Failures of the call itself (timeout, lost peer) raise ``RuntimeError``.
- Not yet: RRefs inside arguments and results, the RRef proxies (``rref.rpc_sync()``, ...),
  ``functions.async_execution``; dynamic groups (``world_size=None``) are untested.
"""

from __future__ import annotations

import os
import threading
import traceback
import warnings
from typing import Any, Callable, Optional, Union

import torch

from tensorwire import _native
from tensorwire.rpc._exposed import DEFAULT_EXPOSED_TORCH_OPS, RefusedError, expose
from tensorwire.rpc import _exposed, _serialize
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
    "UNSET_RPC_TIMEOUT",
    "DEFAULT_RPC_TIMEOUT_SEC",
]

#: A call's timeout argument that means "the agent's default" (PyTorch's value).
UNSET_RPC_TIMEOUT: float = -1.0
#: The default call timeout (PyTorch's).
DEFAULT_RPC_TIMEOUT_SEC: float = 60.0
#: How long ``init_rpc`` waits for the whole group.
DEFAULT_INIT_TIMEOUT_SEC: float = 300.0
#: The bound on a graceful shutdown given ``timeout=0`` (PyTorch's default argument).
DEFAULT_SHUTDOWN_TIMEOUT_SEC: float = 300.0


class BackendType:
    """The backends ``init_rpc`` accepts: ``TENSORPIPE`` (PyTorch's name, kept so that code
    naming it runs) and ``TCP`` both mean tensorwire's TCP agent (shared memory on one host)."""

    TENSORPIPE = "TENSORPIPE"
    TCP = "TCP"


class TensorPipeRpcBackendOptions:
    """The options of ``init_rpc``, with the fields of PyTorch's class of this name (an object
    of PyTorch's own class works as well):

    - ``init_method``: where the group meets (``env://``, ``tcp://host:port``,
      ``file:///path``); default ``env://``;
    - ``rpc_timeout``: the default call timeout in seconds (zero: none); default 60;
    - ``num_worker_threads``: accepted and ignored (functions run on tensorwire's blocking
      threads, as many as calls in flight);
    - ``device_maps``, ``devices``, ``set_device_map``: accepted; a non-empty map is refused
      for now (``NotImplementedError``): device maps are not supported yet.
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
        self.num_worker_threads = num_worker_threads
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method
        self.device_maps = dict(device_maps or {})
        self.devices = list(devices or [])

    def set_device_map(self, to: str, device_map: dict) -> None:
        """Records the device map for calls to worker ``to`` (refused at ``init_rpc`` for now)."""
        self.device_maps.setdefault(to, {}).update(device_map)

    def set_devices(self, devices: list) -> None:
        """Records the devices this worker uses (refused at ``init_rpc`` for now)."""
        self.devices = list(devices)


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
    """torch's exception for a native failure (PyTorch's RPC raises ``RuntimeError``)."""
    if isinstance(e, _native.TensorwireError):
        err = RuntimeError(e.args[1] if len(e.args) > 1 else str(e))
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
    dynamic (workers join and leave), as in PyTorch. ``rpc_backend_options`` is a
    :class:`TensorPipeRpcBackendOptions` (ours or PyTorch's). The cluster secret comes from
    ``TENSORWIRE_SECRET`` (the same on every worker). ``trust_peers=True`` lets any peer run
    any importable function here and send any pickle, as PyTorch's RPC does: only for clusters
    that trust every member (warned about).
    """
    global _agent, _trusted, _me
    if backend is not None:
        backend_name = getattr(backend, "name", backend)
        if str(backend_name) not in (BackendType.TENSORPIPE, BackendType.TCP):
            raise ValueError(f"tensorwire.rpc has no backend {backend!r}; use TENSORPIPE or TCP")
    if rank is None or rank < 0:
        try:
            rank = int(os.environ["RANK"])
        except (KeyError, ValueError):
            raise ValueError("init_rpc: give rank, or set RANK in the environment") from None
    options = rpc_backend_options if rpc_backend_options is not None else TensorPipeRpcBackendOptions()
    device_maps = getattr(options, "device_maps", None) or {}
    devices = getattr(options, "devices", None) or []
    if any(device_maps.values()) or devices:
        raise NotImplementedError("tensorwire.rpc does not support device maps or devices yet")
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
                _serve,
                _create,
                _fetch,
            )
        except _native.TensorwireError as e:
            raise _runtime_error(e) from e
        _me = WorkerInfo(*agent.me())
        _agent = agent
        _ready.set()


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
        raise _runtime_error(e) from e


def _worker_name(to: Union[str, int, WorkerInfo], agent: _native.RpcAgent) -> str:
    if isinstance(to, WorkerInfo) or hasattr(to, "name") and hasattr(to, "id"):
        return to.name
    if isinstance(to, str):
        return to
    if isinstance(to, int):
        for name, id in agent.workers():
            if id == to:
                return name
        raise ValueError(f"unknown worker id {to}")
    raise TypeError(f"a call's destination is a worker name, id or WorkerInfo, not {to!r}")


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
        except Exception:
            pass
    return RuntimeError(text)


def _call_raw(
    to: Union[str, int, WorkerInfo],
    function: str,
    payload: bytes,
    tensors: list,
    timeout: Optional[float] = UNSET_RPC_TIMEOUT,
) -> torch.futures.Future:
    """Sends ``function`` with an already pickled ``payload`` and its ``tensors`` and returns
    the future of the decoded result (the wire path every call takes)."""
    agent = _require_agent()
    worker = _worker_name(to, agent)
    try:
        callee = WorkerInfo(*agent.worker(worker))
    except _native.TensorwireError as e:
        raise _runtime_error(e) from e
    fut, on_done = _future(worker, callee)

    try:
        agent.call(worker, function, payload, tensors, _timeout(timeout), on_done)
    except _native.TensorwireError as e:
        raise _runtime_error(e) from e
    return fut


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
    or its qualified name. ``timeout`` in seconds; ``0``: none; negative: the default."""
    context = _autograd.current_id() if _autograd is not None else None
    if context is not None:
        return _autograd.rpc_async(context, to, func, args, kwargs, timeout)
    name = func if isinstance(func, str) else _exposed.qualified_name(func)
    payload, tensors = _serialize.dumps((tuple(args or ()), dict(kwargs or {})))
    return _call_raw(to, name, payload, tensors, timeout)


def rpc_sync(
    to: Union[str, int, WorkerInfo],
    func: Union[Callable[..., Any], str],
    args: Optional[tuple] = None,
    kwargs: Optional[dict] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Calls ``func(*args, **kwargs)`` on worker ``to`` and returns its result (see
    :func:`rpc_async`); raises the remote exception or the call's failure."""
    return rpc_async(to, func, args, kwargs, timeout).wait()


def _run(caller: str, function: str, payload: bytes, buffers: list) -> Any:
    """Runs a call from ``caller``: resolves ``function`` among what this worker exposed,
    decodes the arguments with the allow-list, and runs it."""
    me = _me
    worker = str(me) if me is not None else "this worker"
    if _trusted:
        fn = _import_by_name(function)
    else:
        fn = _exposed.resolve_function(function, worker)
    decoded = _serialize.loads(payload, buffers, trusted=_trusted, origin=caller)
    if not (
        isinstance(decoded, tuple)
        and len(decoded) == 2
        and isinstance(decoded[0], tuple)
        and isinstance(decoded[1], dict)
    ):
        raise RefusedError(f"malformed arguments from {caller}")
    args, kwargs = decoded
    return fn(*args, **kwargs)


def _raised(e: BaseException) -> tuple:
    cls = type(e)
    return ("raised", f"{cls.__module__}.{cls.__qualname__}", str(e), traceback.format_exc())


def _wait_ready() -> None:
    """Waits (the GIL released) until init_rpc has recorded the agent that serves this call."""
    if _agent is None:
        _ready.wait(DEFAULT_INIT_TIMEOUT_SEC)


def _serve(caller: str, function: str, payload: bytes, buffers: list) -> tuple:
    """A call from ``caller`` (on a blocking thread, with the GIL): ``("returned", payload,
    tensors)`` or ``("raised", type, message, traceback)``."""
    _wait_ready()
    try:
        out, tensors = _serialize.dumps(_run(caller, function, payload, buffers))
        return ("returned", out, tensors)
    except Exception as e:
        return _raised(e)


def _create(caller: str, function: str, payload: bytes, buffers: list) -> tuple:
    """A ``remote()`` creation from ``caller``: ``("returned", value)`` (kept here by the
    agent as the reference's value) or ``("raised", ...)``."""
    _wait_ready()
    try:
        return ("returned", _run(caller, function, payload, buffers))
    except Exception as e:
        return _raised(e)


def _fetch(value: Any) -> tuple:
    """A reference's value pickled for ``to_here``."""
    try:
        out, tensors = _serialize.dumps(value)
        return ("returned", out, tensors)
    except Exception as e:
        return _raised(e)


def _future(worker: str, callee: WorkerInfo) -> tuple[torch.futures.Future, Callable[[Any], None]]:
    """A future and the ``on_done`` that completes it from a native outcome."""
    fut: torch.futures.Future = torch.futures.Future()
    trusted = _trusted

    def on_done(outcome: Any) -> None:
        try:
            if isinstance(outcome, BaseException):
                result: Any = _runtime_error(outcome)
            elif outcome[0] == "returned":
                try:
                    value = _serialize.loads(
                        outcome[1], outcome[2], trusted=trusted, origin=worker
                    )
                except Exception as e:
                    result = e
                else:
                    fut.set_result(value)
                    return
            else:
                result = _remote_exception(callee, outcome[1], outcome[2], outcome[3])
            fut.set_exception(result)
        except Exception as e:  # noqa: BLE001 - the future must complete
            if not fut.done():
                fut.set_exception(e)

    return fut, on_done


class RRef:
    """A reference to a value owned by a worker (PyTorch's ``RRef``): made by :func:`remote`
    (the value is created on ``to``) or by ``RRef(value)`` (owned here). The owner keeps the
    value while any worker holds a reference (the agent's distributed reference counting).

    Not supported yet: RRefs inside arguments and results, the ``rpc_sync()``,
    ``rpc_async()`` and ``remote()`` proxies.
    """

    __slots__ = ("_native",)

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
        """Whether the owner has confirmed this worker's reference."""
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
        owner = self.owner()
        fut, on_done = _future(owner.name, owner)
        try:
            self._native.fetch(_timeout(timeout), on_done)
        except _native.TensorwireError as e:
            raise _runtime_error(e) from e
        return fut

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A copy of the value, pickled on its owner now (the value itself on the owner is
        :meth:`local_value`); raises the exception the creating function raised."""
        return self._fetch_async(timeout).wait()

    def __reduce__(self):
        raise TypeError("tensorwire.rpc does not send RRefs inside arguments or results yet")

    def __repr__(self) -> str:
        return f"RRef(owner={self.owner_name()})"


def remote(
    to: Union[str, int, WorkerInfo],
    func: Union[Callable[..., Any], str],
    args: Optional[tuple] = None,
    kwargs: Optional[dict] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef:
    """Runs ``func(*args, **kwargs)`` on worker ``to``, which keeps the result, and returns an
    :class:`RRef` to it at once (``func`` as for :func:`rpc_async`). A failure of ``func`` is
    raised by ``to_here`` and ``local_value``."""
    context = _autograd.current_id() if _autograd is not None else None
    if context is not None:
        return _autograd.remote(context, to, func, args, kwargs, timeout)
    agent = _require_agent()
    worker = _worker_name(to, agent)
    name = func if isinstance(func, str) else _exposed.qualified_name(func)
    payload, tensors = _serialize.dumps((tuple(args or ()), dict(kwargs or {})))
    try:
        native = agent.remote(worker, name, payload, tensors, _timeout(timeout))
    except _native.TensorwireError as e:
        raise _runtime_error(e) from e
    return RRef(_native_rref=native)


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
