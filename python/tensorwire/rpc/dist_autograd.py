"""``torch.distributed.autograd`` on tensorwire's RPC agent: distributed autograd in PyTorch's
FAST mode, with torch's own autograd computing on every worker.

Switch by changing one import::

    from tensorwire.rpc import dist_autograd     # instead of: import torch.distributed.autograd as dist_autograd

    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync("worker1", torch.mul, args=(x, w))   # x or w requires grad
        loss = y.sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)       # {tensor: gradient}, this worker's

Every ``rpc_sync``, ``rpc_async`` and ``remote`` made on a thread while a context is current
(and every call the called function makes in turn, and ``rref.to_here()``) records a *send* at
the caller and a *recv* at the callee for the tensors that require grad, for arguments and
results alike. :func:`backward` runs torch's engine on this worker from the roots, sends each
gradient that reaches a recv back to its sender, which runs torch's engine from the matching
send, and so on; it returns once every worker the pass reached is done. Gradients accumulate in
the context of the worker that holds the tensor (:func:`get_gradients`), never in ``.grad``.

A tensor that arrives in a context and required grad on its sender (an argument at the callee,
a result at the caller) is, as in PyTorch, no leaf: it is an output of its message's recv
function, a node of torch's graph whose ``name()`` is
``torch::distributed::autograd::RecvRpcBackward`` (its ``grad_fn``; ``is_leaf`` is false, its
``.grad`` stays ``None``, with torch's warning for a non-leaf, and it may be written in place,
which torch then records). It shares the received bytes (no copy).

The protocol is tensorwire's core state machine (``tensorwire_core::autograd``): context ids
carry a capability that only the workers a context reached know (a peer cannot join or release
another's context by guessing its id), each peer may make this worker hold a bounded number of
contexts, and a worker that is lost drops every context it took part in on every survivor at
once: a backward running in one fails naming it, and nothing waits for it.

A gradient a peer sends must match the tensor it is for: the same shape and dtype (a worker
that sends one of another dtype is dropped as misbehaved, as for another shape). torch's
engine casts every gradient to its input's dtype, and a tensor keeps its dtype on the wire, so
an honest peer's gradient always has the dtype of the tensor this worker sent; none is cast.

Sparse COO tensors are supported as in PyTorch's TensorPipe agent: as arguments and results,
tracked or not, and as gradients, which a context sums by torch's ``AccumulateGrad`` rules
(sparse and sparse stay sparse, sparse and dense make a dense gradient). What a peer sends is
rebuilt with torch's sparse invariant checks, so a malformed one is refused, not used.

Where this differs from PyTorch: a backward that fails on some worker without losing it (its
engine raised) is reported once every piece of work it started has answered, and leaves the
context usable; a call's unused result contributes zero and never holds the backward up.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tensorwire import _native, rpc
from tensorwire.rpc import _autograd_engine

__all__ = ["context", "backward", "get_gradients"]


def _native_ad() -> Any:
    try:
        return _autograd_engine.native()
    except _native.TensorwireError as e:
        raise rpc._runtime_error(e) from e


def _raise(e: BaseException) -> None:
    raise rpc._runtime_error(e) from e


class context:
    """A distributed autograd context, current on this thread while the ``with`` block runs;
    yields its id. Leaving the block releases it here at once and tells every worker it
    reached, without waiting for their answers (as PyTorch does: its cleanup messages are not
    waited for either); they drop it when the release reaches them."""

    def __enter__(self) -> int:
        if _autograd_engine.current_id() is not None:
            raise RuntimeError(
                "Already have an autograd context id for this thread (nested contexts are not "
                "supported)"
            )
        try:
            self.autograd_context = _native_ad().new_context()
        except _native.TensorwireError as e:
            _raise(e)
        _autograd_engine.set_current(self.autograd_context)
        return self.autograd_context

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        _autograd_engine.set_current(None)
        try:
            _native_ad().release(self.autograd_context)
        except _native.TensorwireError as e:
            # A context dropped by a failure (a lost worker) is gone already: nothing to
            # release, and the failure was raised where it happened.
            if exc_type is None and "Could not find autograd context" not in str(e):
                _raise(e)


def backward(context_id: int, roots: list, retain_graph: bool = False) -> None:
    """Runs the backward pass of ``context_id`` from ``roots`` (scalar tensors that require
    grad, held here) and returns once every worker it reached is done. Gradients accumulate
    in the context. Without ``retain_graph`` a second backward in the context is refused.
    Raises ``RuntimeError`` (PyTorch's messages) for bad roots or an unknown context, and
    for a failed pass, naming the worker at fault."""
    if not isinstance(roots, (list, tuple)):
        raise TypeError(f"roots must be a list of tensors, not {type(roots).__name__}")
    for r in roots:
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"roots must be tensors, not {type(r).__name__}")
    try:
        _native_ad().backward(int(context_id), list(roots), bool(retain_graph))
    except _native.TensorwireError as e:
        _raise(e)


def get_gradients(context_id: int) -> dict:
    """The gradients this worker accumulated in ``context_id``: ``{tensor: gradient}`` for
    the tensors that require grad and were reached here (parameters, inputs)."""
    return {leaf: grad for leaf, grad in _gradient_pairs(context_id)}


def _gradient_pairs(context_id: int) -> list:
    """:func:`get_gradients` as ``[(tensor, gradient)]``."""
    try:
        return _native_ad().gradients(int(context_id))
    except _native.TensorwireError as e:
        _raise(e)


class _Context:
    """What ``_retrieve_context``, ``_current_context`` and ``_new_context`` return (PyTorch's
    ``DistAutogradContext``): the id, and what the context holds on this worker, read from
    the native driver's records (a send function is a record of the driver, not a node of
    torch's graph: see :class:`_SendFunction`; a recv function is a node of torch's graph)."""

    def __init__(self, context_id: int):
        self._id = context_id

    def _context_id(self) -> int:
        return self._id

    def _known_worker_ids(self) -> set:
        """The ranks of the workers this worker sent to or received from in the context
        (every call made in it counts, tensors that require grad or not): those its release
        is sent to."""
        try:
            return set(_native_ad().known_workers(self._id))
        except _native.TensorwireError as e:
            _raise(e)

    def _send_functions(self) -> dict:
        """``{autograd message id: _SendFunction}``: one per message that carried tensors
        requiring grad out of this worker in the context."""
        try:
            rows = _native_ad().send_functions(self._id)
        except _native.TensorwireError as e:
            _raise(e)
        return {m: _SendFunction(m, peer, tensors) for m, peer, tensors in rows}

    def _recv_functions(self) -> dict:
        """``{autograd message id: recv function}``: one per message that brought tensors
        requiring grad into this worker in the context, the node of torch's graph those
        tensors are the outputs of (``torch::distributed::autograd::RecvRpcBackward``, a
        received tensor's ``grad_fn``, as in PyTorch)."""
        try:
            rows = _native_ad().recv_functions(self._id)
        except _native.TensorwireError as e:
            _raise(e)
        return {m: _recv_function(m, peer, tensors) for m, peer, tensors in rows}

    def __repr__(self) -> str:
        return f"DistAutogradContext({self._id})"


def _gradient_edge(t: torch.Tensor) -> tuple:
    """``(node, input number)``: where a gradient for ``t`` enters this worker's graph, as
    torch's ``next_functions`` give it (a leaf's ``AccumulateGrad`` node; a sparse leaf's is
    reached through a clone, as sparse tensors have no views)."""
    try:
        edge = torch.autograd.graph.get_gradient_edge(t)
        return (edge.node, edge.output_nr)
    except (RuntimeError, NotImplementedError):
        with torch.enable_grad():
            return t.clone().grad_fn.next_functions[0]


class _SendFunction:
    """A send function of a context on this worker (PyTorch's ``SendRpcBackward``): the
    tensors requiring grad that one message carried to ``to``. tensorwire's driver keeps
    them under the message's id; a gradient that comes back for them starts a local pass
    from them, entering the graph at ``next_functions`` (each tensor's gradient edge, in
    the order sent, as torch's ``next_functions`` give them)."""

    def __init__(self, message_id: int, to: int, tensors: list):
        self.message_id = message_id
        self.to = to
        self.tensors = tuple(tensors)

    @staticmethod
    def name() -> str:
        return "torch::distributed::autograd::SendRpcBackward"

    @property
    def next_functions(self) -> tuple:
        return tuple(_gradient_edge(t) for t in self.tensors)

    def __repr__(self) -> str:
        return f"<SendRpcBackward message {self.message_id} to rank {self.to}>"


def _recv_function(message_id: int, sender: int, tensors: list) -> Any:
    """The recv function of the message ``message_id``: the node of torch's graph its tensors
    were given when they arrived (``_autograd_engine.receive``), or, for a message whose
    tensors never reached the Python layer (a call refused before it ran), its record."""
    for t in tensors:
        node = getattr(t, "_tensorwire_recv", None)
        if node is not None:
            return node
    return _RecvFunction(message_id, sender, tensors)


class _RecvFunction:
    """The record of a recv function whose tensors were given no node of torch's graph (see
    :func:`_recv_function`): the tensors requiring grad that one message brought from
    ``sender``."""

    def __init__(self, message_id: int, sender: int, tensors: list):
        self.message_id = message_id
        self.sender = sender
        self.tensors = tuple(tensors)
        self.next_functions: tuple = ()

    @staticmethod
    def name() -> str:
        return "torch::distributed::autograd::RecvRpcBackward"

    def __repr__(self) -> str:
        return f"<RecvRpcBackward message {self.message_id} from rank {self.sender}>"


def _new_context() -> _Context:
    """A new context, made current on this thread without a ``with`` block (PyTorch's
    ``_new_context``); :func:`_release_context` releases it."""
    ctx = context()
    return _Context(ctx.__enter__())


def _release_context(context_id: int) -> None:
    """Releases ``context_id`` here and on every worker it reached (PyTorch's
    ``_release_context``); it stops being current on this thread if it was.
    ``RuntimeError`` for a context this worker does not hold."""
    if _autograd_engine.current_id() == context_id:
        _autograd_engine.set_current(None)
    try:
        _native_ad().release(int(context_id))
    except _native.TensorwireError as e:
        _raise(e)


def _get_debug_info() -> dict:
    """PyTorch's ``_get_debug_info``: ``num_autograd_contexts`` (the contexts this worker
    holds) and ``num_current_backward_passes`` (those with backward work running here now),
    as strings."""
    contexts, passes = _native_ad().debug_info()
    return {"num_current_backward_passes": str(passes), "num_autograd_contexts": str(contexts)}


def _retrieve_context(context_id: int) -> _Context:
    """The context ``context_id`` held here; ``RuntimeError`` if this worker holds none."""
    try:
        _native_ad().check_context(int(context_id))
    except _native.TensorwireError as e:
        _raise(e)
    return _Context(int(context_id))


def _current_context() -> _Context:
    """The context current on this thread; ``RuntimeError`` if there is none."""
    context_id: Optional[int] = _autograd_engine.current_id()
    if context_id is None:
        raise RuntimeError("Current thread doesn't have a valid autograd context. Please wrap "
                           "your code using: `with torch.distributed.autograd.context() as context_id` "
                           "to generate a valid context")
    return _retrieve_context(context_id)


def _is_valid_context(context_id: int) -> bool:
    """Whether this worker holds ``context_id``."""
    return bool(_native_ad().has_context(int(context_id)))


def _context_count() -> int:
    """How many contexts this worker holds (its own and those calls brought in)."""
    return int(_native_ad().context_count())
