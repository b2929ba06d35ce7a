"""Type stubs of tensorwire's native module (Rust, pyo3)."""

from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

__version__: str

_T = TypeVar("_T")

class TensorwireError(RuntimeError):
    """A tensorwire failure. ``args`` is ``(kind, message, ranks)``: ``kind`` is one of
    ``"backend"``, ``"network"``, ``"store"``, ``"argument"``, ``"unsupported"`` or
    ``"timeout"``; ``ranks`` are the ranks the failure names (dead, missing, disagreeing)."""

class Work:
    """An operation issued on a group."""

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Waits without the GIL; returns the sender of a receive from any rank, else None."""
    def is_completed(self) -> bool: ...
    def is_success(self) -> bool: ...
    def exception(self) -> Optional[TensorwireError]:
        """The failure (not raised) once the operation ended with one, else None; never waits."""
    def add_done_callback(self, callback: Callable[[], object]) -> None: ...
    def resolve(self, future: object, value: object, otherwise: Callable[[], object]) -> None:
        """On success ``future.set_result(value)``, else ``otherwise()``."""

class ProcessGroupHandle:
    """One rank of a tensorwire process group."""

    @staticmethod
    def connect(
        store: object,
        rank: int,
        world_size: int,
        timeout: float,
        options: Sequence[tuple[str, str]],
    ) -> ProcessGroupHandle: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def name(self) -> str: ...
    def all_reduce(self, tensors: list[torch.Tensor], dtype: str, op: str) -> Work: ...
    def reduce(self, tensors: list[torch.Tensor], dtype: str, op: str, root: int) -> Work: ...
    def broadcast(self, tensors: list[torch.Tensor], root: int) -> Work: ...
    def all_gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]
    ) -> Work: ...
    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> Work: ...
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        counts: list[int],
        dtype: str,
        op: str,
    ) -> Work: ...
    def all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Work: ...
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
    ) -> Work: ...
    def gather(self, outputs: list[torch.Tensor], input: torch.Tensor, root: int) -> Work: ...
    def scatter(self, output: torch.Tensor, inputs: list[torch.Tensor], root: int) -> Work: ...
    def barrier(self) -> Work: ...
    def monitored_barrier(self, timeout: Optional[float], wait_all_ranks: bool) -> Work: ...
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work: ...
    def recv(self, tensors: list[torch.Tensor], src: Optional[int], tag: int) -> Work: ...
    def shutdown(self) -> None: ...

class WireBuffer:
    """Received tensor bytes as a writable buffer (``torch.frombuffer`` takes it as is)."""

    def __len__(self) -> int: ...

# ("returned", payload, buffers, rrefs) | ("raised", type, message, traceback) | a TensorwireError
CallOutcome = object
# serve/create(caller, function, payload, buffers, rrefs, target) ->
#   ("returned", ...) | ("raised", type, message, traceback) | ("future", torch.futures.Future)
ServeFn = Callable[[str, str, bytes, list[WireBuffer], list[PyRRef], object], tuple]

def check_worker_name(name: str) -> None:
    """Raises ``TensorwireError("argument", why)`` if ``name`` breaks the naming rule
    (``A-Z a-z 0-9 _ : -``, non-empty, shorter than 128)."""

def job_counts() -> tuple[int, int]:
    """``(jobs run in place, jobs queued for the GIL runners)`` in this process so far: a call
    served in a distributed autograd context, a backward pass or an owner's optimizer step runs
    on the runtime worker that read it when no runner would take it at once (the tests check
    the hand-offs by it)."""

def waiter_runs() -> int:
    """Runs of torch's engine (local passes of distributed autograd) in this process so far
    that the thread waiting in ``dist_autograd.backward`` ran itself while it waited (the
    passes the gradients coming back to this worker start), instead of a runtime worker."""

class Settler:
    """The done-callback the agent attaches to the future an ``async_execution`` function
    returned: it completes the call with the future's outcome."""

    def __call__(self, future: object) -> None: ...

class RpcAgent:
    """This process's tensorwire RPC agent (``tensorwire.rpc``)."""

    @staticmethod
    def start(
        name: str,
        rank: int,
        world_size: Optional[int],
        init_method: str,
        rpc_timeout: float,
        init_timeout: float,
        device_maps: list[tuple[str, list[tuple[str, str]]]],
        devices: list[str],
        serve: ServeFn,
        create: ServeFn,
        fetch: Callable[[object], tuple],
    ) -> RpcAgent:
        """Starts the agent and connects to the group (blocks without the GIL); the group's
        device maps are validated (``TensorwireError("device_map", ...)``). ``serve`` runs
        every call this worker receives (``target``: the value of a method call through an
        RRef proxy, else ``None``): ``("returned", payload, tensors, rrefs)``, ``("raised",
        type, message, traceback)`` or ``("future", f)`` with ``f`` completing with one of
        those; ``create`` runs a ``remote()`` creation (``("returned", value)`` is kept);
        ``fetch(value)`` pickles a kept value for ``to_here``."""
    def dist_autograd(self) -> PyDistAutograd:
        """Distributed autograd on this agent (``tensorwire.rpc.dist_autograd``)."""
    def me(self) -> tuple[str, int]: ...
    def worker(self, name: str) -> tuple[str, int]: ...
    def workers(self) -> list[tuple[str, int]]: ...
    def rpc_timeout(self) -> float: ...
    def set_rpc_timeout(self, seconds: float) -> None: ...
    def call(
        self,
        to: str,
        function: str,
        payload: bytes,
        tensors: list[torch.Tensor],
        rrefs: list[PyRRef],
        timeout: Optional[float],
        on_done: Callable[[CallOutcome], None],
    ) -> None:
        """Sends a call (``rrefs`` forked for ``to``); ``on_done(outcome)`` runs later on a
        thread of tensorwire's."""
    def call_wait(
        self,
        to: str,
        function: str,
        payload: bytes,
        tensors: list[torch.Tensor],
        rrefs: list[PyRRef],
        timeout: Optional[float],
    ) -> CallOutcome:
        """Sends a call as ``call`` does and waits for its outcome without the GIL
        (``rpc_sync``)."""
    def remote(
        self,
        to: str,
        function: str,
        payload: bytes,
        tensors: list[torch.Tensor],
        rrefs: list[PyRRef],
        timeout: Optional[float],
    ) -> PyRRef:
        """Creates a value on ``to`` and returns a reference to it at once."""
    def local_rref(self, value: object) -> PyRRef:
        """A reference to ``value``, owned here."""
    def shutdown(self, graceful: bool, timeout: float) -> None: ...

class PyRRef:
    """A remote reference to a Python value, counted by its owner."""

    def owner(self) -> tuple[str, int]: ...
    def is_owner(self) -> bool: ...
    def confirmed_by_owner(self) -> bool: ...
    def id(self) -> str: ...
    def fetch(self, timeout: Optional[float], on_done: Callable[[CallOutcome], None]) -> None:
        """Copies the value from its owner; ``on_done(outcome)`` runs later."""
    def fetch_wait(self, timeout: Optional[float]) -> CallOutcome:
        """Copies the value from its owner and waits for the outcome without the GIL
        (``to_here``)."""
    def call(
        self,
        function: str,
        payload: bytes,
        tensors: list[torch.Tensor],
        rrefs: list[PyRRef],
        timeout: Optional[float],
        on_done: Callable[[CallOutcome], None],
    ) -> None:
        """Calls the method ``function`` of the value, on its owner."""
    def remote(
        self,
        function: str,
        payload: bytes,
        tensors: list[torch.Tensor],
        rrefs: list[PyRRef],
        timeout: Optional[float],
    ) -> PyRRef:
        """Runs the method ``function`` of the value on its owner, which keeps the result."""
    def local_value(self) -> tuple:
        """On the owner: ``("returned", value)`` or ``("raised", type, message, traceback)``."""
    def created(self) -> None:
        """Waits until the owner created the value; raises the creation's failure."""

class PyDistAutograd:
    """Distributed autograd on this worker's agent, with torch's engine
    (``tensorwire.rpc.dist_autograd``). Context ids are ints; every method that reaches the
    protocol releases the GIL."""

    def new_context(self) -> int:
        """A new context made here; its id."""
    def release(self, context: int) -> None:
        """Releases a context here at once and tells every worker it reached, without waiting
        for their answers (as PyTorch does); they drop it when the release reaches them."""
    def has_context(self, context: int) -> bool: ...
    def check_context(self, context: int) -> None:
        """Raises PyTorch's "Could not find autograd context" error unless held here."""
    def context_count(self) -> int: ...
    def debug_info(self) -> tuple[int, int]:
        """(contexts held here, contexts with backward work running here)."""
    def known_workers(self, context: int) -> list[int]:
        """The ranks of the workers ``context`` reached from here."""
    def send_functions(self, context: int) -> list[tuple[int, int, list[Any]]]:
        """``[(message id, receiver's rank, tensors)]`` of ``context``'s send functions here."""
    def recv_functions(self, context: int) -> list[tuple[int, int, list[Any]]]:
        """``[(message id, sender's rank, tensors)]`` of ``context``'s recv functions here."""
    def call(
        self,
        context: int,
        to: str,
        function: str,
        payload: bytes,
        tensors: list[torch.Tensor],
        rrefs: list[PyRRef],
        tracked_at: list[int],
        tracked: list[torch.Tensor],
        timeout: Optional[float],
        on_done: Callable[[object], None],
    ) -> None:
        """A call in a context: ``tracked`` (tensors that require grad) go at ``tracked_at``
        in the pickle's tensor list, ``tensors`` fill the rest; ``on_done(outcome)`` gets
        ``("returned", payload, buffers, rrefs, tracked_at, tracked)``, ``("raised", type, message,
        traceback)`` or an exception."""
    def call_wait(
        self,
        context: int,
        to: str,
        function: str,
        payload: bytes,
        tensors: list[torch.Tensor],
        rrefs: list[PyRRef],
        tracked_at: list[int],
        tracked: list[torch.Tensor],
        timeout: Optional[float],
    ) -> object:
        """:meth:`call`, waited for without the GIL: returns the outcome ``on_done`` would get."""
    def remote(
        self,
        context: int,
        to: str,
        function: str,
        payload: bytes,
        tensors: list[torch.Tensor],
        rrefs: list[PyRRef],
        tracked_at: list[int],
        tracked: list[torch.Tensor],
        timeout: Optional[float],
    ) -> PyRRef:
        """``remote()`` in a context."""
    def fetch(
        self, context: int, rref: PyRRef, timeout: Optional[float], on_done: Callable[[object], None]
    ) -> None:
        """``to_here()`` in a context (its value's tensors that require grad are tracked)."""
    def owner_call(
        self,
        rref: PyRRef,
        function: str,
        payload: bytes,
        tensors: list[torch.Tensor],
        timeout: Optional[float],
        on_done: Callable[[CallOutcome], None],
    ) -> None:
        """Runs one of tensorwire's own owner-side functions on ``rref``'s value, on its
        owner (the distributed optimizer's)."""
    def owner_call_all(
        self,
        rrefs: list[PyRRef],
        function: str,
        payload: bytes,
        tensors: list[torch.Tensor],
        timeout: Optional[float],
        meanwhile: Callable[[], _T],
    ) -> tuple[_T, list[CallOutcome]]:
        """Runs one of tensorwire's own owner-side functions on each of ``rrefs``' values, on
        their owners, all at once; then ``meanwhile()`` here; then waits once (the GIL
        released) for every answer: ``meanwhile``'s result and the outcomes, in order."""
    def backward(self, context: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
        """Runs the backward pass from scalar roots; returns once every worker is done."""
    def gradients(self, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This worker's gradients in the context: ``[(tensor, gradient)]``."""
