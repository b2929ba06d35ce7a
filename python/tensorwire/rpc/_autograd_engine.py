"""torch's autograd as the local engine of tensorwire's distributed autograd, and the calls made
inside a context.

The protocol (contexts, send and recv records, which gradient goes where, completion, release,
lost peers) is decided in tensorwire's core and driven by the native module
(``python/src/rpc/autograd.rs``); this module only does what torch must do on request:

- ``import_tensor`` / ``export_tensor`` / ``receive``: the tensors a message brought that
  required grad on their sender become the outputs of one *recv function*, a node of torch's
  graph named as PyTorch's (``torch::distributed::autograd::RecvRpcBackward``): the gradient
  torch computes for each goes back to the sender; a tensor sent is handed over as bytes, and
  the native side keeps the tensor itself (its *send function*: a gradient that comes back for
  it starts a local pass from it);
- ``backward``: one local pass of torch's engine from given roots and seed gradients over the
  leaves and recv functions they reach, keeping the graph (FAST mode may run a send function
  once per gradient that reaches it); gradients are returned to the native side, which
  accumulates them in the context, never in ``.grad``;
- ``serve`` / ``create`` / ``fetch``: a call, a ``remote()`` creation or a ``to_here()`` made
  in a context, with the context current on the serving thread (so calls the function makes
  are recorded in it too, as in PyTorch).

Calls made in a context carry their tensors in two lists: those that require grad (tracked:
recorded, their gradients flow back) and the others (beside the pickle, as ``tensorwire.rpc``
sends them); ``tracked_at`` says where each tracked tensor goes in the pickle's tensor list.
"""

from __future__ import annotations

import io
import math
import struct
import threading
import weakref
from typing import Any, Optional, Sequence

import torch
from torch.autograd import Function
from torch.autograd.graph import GradientEdge, _engine_run_backward
from torch.overrides import has_torch_function

# (Imported once here, not in each function that uses them: a ``from package import name``
# inside a function runs importlib's ``_handle_fromlist`` in Python at every call, about twenty
# times a step. ``tensorwire.rpc`` is initialized before this module, its submodule, is.)
from tensorwire import _native, rpc
from tensorwire.rpc import _serialize
from tensorwire.rpc._exposed import RefusedError
from tensorwire.rpc._types import WorkerInfo

_tls = threading.local()


def current_id() -> Optional[int]:
    """The id of the context current on this thread, if any."""
    return getattr(_tls, "context_id", None)


def set_current(context_id: Optional[int]) -> Optional[int]:
    """Makes ``context_id`` current on this thread; returns the one it replaces."""
    previous = current_id()
    _tls.context_id = context_id
    return previous


# --- the engine ---------------------------------------------------------------------------


#: The element types a tracked tensor (or a gradient) may have, by their code in the packed
#: form of a sparse one.
_PACKED_DTYPES = ("float16", "bfloat16", "float32", "float64")
_PACKED_MAGIC = b"twsp"
#: magic, version, coalesced, values dtype code, padding, number of dimensions, sparse
#: dimensions, number of specified elements; then the size, one u64 per dimension.
_PACKED_HEADER = struct.Struct("<4sBBBBIIQ")
_PACKED_VERSION = 1


def pack_sparse(t: torch.Tensor) -> torch.Tensor:
    """A sparse COO tensor (a tracked one, or a gradient) as the engine hands it to the wire: one
    ``uint8`` tensor, a header (the values' dtype, the size, the sparse dimensions, the number
    of elements, whether it is coalesced) then the int64 indices and the values. The wire
    carries tracked tensors as dense ones, and a gradient has no pickle beside it to say its
    layout, so the layout travels in the bytes; dense tracked tensors are never ``uint8`` (an
    integer tensor cannot require grad), so the form is unambiguous."""
    indices, values, coalesced = _serialize.sparse_parts(t)
    name = str(values.dtype).removeprefix("torch.")
    if name not in _PACKED_DTYPES:
        raise ValueError(
            f"a sparse tensor of torch.{name} requires grad: distributed autograd carries "
            "float16, bfloat16, float32 and float64 tensors"
        )
    header = _PACKED_HEADER.pack(
        _PACKED_MAGIC, _PACKED_VERSION, int(coalesced), _PACKED_DTYPES.index(name), 0,
        t.dim(), t.sparse_dim(), t._nnz(),
    ) + struct.pack(f"<{t.dim()}Q", *t.shape)
    header += bytes(-len(header) % 8)  # the indices start 8-byte aligned
    return torch.cat([
        torch.frombuffer(bytearray(header), dtype=torch.uint8),
        _bytes_of(indices),
        _bytes_of(values),
    ])


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat ``uint8`` view (a copy only for a single element
    broadcast with stride 0, which counts as contiguous: ``torch.sparse.sum``'s gradient of a
    one-element tensor is one)."""
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def unpack_sparse(buffer: Any) -> torch.Tensor:
    """The sparse COO tensor :func:`pack_sparse` packed, checked as ``tensorwire.rpc`` checks
    one it receives (``RefusedError`` for a malformed one: an index out of range, a false
    coalesced claim, bytes that do not add up)."""
    origin = "a peer (a tracked sparse tensor or gradient)"
    view = memoryview(buffer).cast("B")
    n = len(view)
    if n < _PACKED_HEADER.size:
        raise RefusedError(f"a packed sparse tensor from {origin} of {n} bytes, shorter than its header")
    magic, version, coalesced, code, _, ndim, sparse_dim, nnz = _PACKED_HEADER.unpack_from(view)
    if magic != _PACKED_MAGIC or version != _PACKED_VERSION or coalesced > 1 or code >= len(_PACKED_DTYPES):
        raise RefusedError(f"a uint8 tensor from {origin} that is no packed sparse tensor")
    if not 1 <= sparse_dim <= ndim or ndim > 64:
        raise RefusedError(f"a packed sparse tensor from {origin} of {ndim} dimensions, {sparse_dim} sparse")
    start = _PACKED_HEADER.size + 8 * ndim
    if n < start:
        raise RefusedError(f"a packed sparse tensor from {origin} cut short in its size")
    size = struct.unpack_from(f"<{ndim}Q", view, _PACKED_HEADER.size)
    if any(d >= 1 << 63 for d in size):
        raise RefusedError(f"a packed sparse tensor from {origin} of size {size}, beyond int64")
    start += -start % 8
    dtype = _serialize._DTYPES[_PACKED_DTYPES[code]]
    itemsize = dtype.itemsize
    dense = math.prod(size[sparse_dim:])
    want = start + 8 * sparse_dim * nnz + itemsize * nnz * dense
    if want != n:
        raise RefusedError(f"a packed sparse tensor from {origin} of {n} bytes; its header says {want}")
    middle = start + 8 * sparse_dim * nnz
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    indices = raw[start:middle].view(torch.int64).view(sparse_dim, nnz)
    values = raw[middle:].view(dtype).view(nnz, *size[sparse_dim:])
    return _serialize.build_sparse(indices, values, tuple(size), bool(coalesced), origin)


def import_tensor(dtype: str, shape: tuple, buffer: Any, requires_grad: bool) -> torch.Tensor:
    """A received tensor over its bytes (no copy). ``uint8`` is the packed form of a sparse COO
    tensor (:func:`pack_sparse`). A dense one is no view (a tensor of its own over the
    buffer's storage): :func:`receive` makes one that required grad on its sender (marked
    so) an output of its message's recv function, and torch forbids writing in place into a
    view that a function with several outputs returned, which PyTorch's received tensors
    allow."""
    if dtype == "uint8":
        t = unpack_sparse(buffer)
    else:
        dt = _serialize._DTYPES[dtype]
        n = len(buffer)
        if n == 0:
            t = torch.empty(shape, dtype=dt)
        else:
            if n != dt.itemsize * math.prod(shape):
                raise ValueError(f"a received tensor of shape {tuple(shape)} over {n} bytes of {dtype}")
            # ``resize_`` to the buffer's own element count gives the flat tensor its shape in
            # place (contiguous, over the same storage, no view): one op of torch's dispatcher
            # where ``set_(t.untyped_storage(), 0, shape)`` took two calls.
            t = torch.frombuffer(buffer, dtype=dt).resize_(shape)
    if requires_grad:
        # Its gradient goes back to the sender, once :func:`receive` has given it its node.
        t._tensorwire_received = True
    return t


def _recv_forward(ctx: Any, anchor: torch.Tensor, received: list) -> tuple:
    # The received tensors themselves become the outputs (they are no inputs, so torch sets
    # their gradient function in place: the same objects, no copy). The node keeps weak
    # references: a tensor's node referring to the tensor would make a cycle.
    ctx.received = [weakref.ref(t) for t in received]
    return tuple(received)


def _recv_backward(ctx: Any, *grads: Any) -> tuple:
    # The gradients are taken before the node runs (``backward`` hooks it); nothing flows on.
    return None, None


#: The recv function of a message: a ``torch.autograd.Function`` made on purpose under the name
#: whose backward node reports PyTorch's, ``torch::distributed::autograd::RecvRpcBackward``
#: (torch names a Function's node after the class, plus ``Backward``), so that a received
#: tensor's ``grad_fn``, and the ``next_functions`` that lead to it, read as in PyTorch. Its
#: input is one shared empty leaf (:data:`_RECV_ANCHOR`): torch records a Function's node only
#: when an input requires grad; PyTorch's node has no next functions, this one has that
#: leaf's, which no pass of :func:`backward` runs (its gradient is ``None``).
_RecvRpc = type(
    "torch::distributed::autograd::RecvRpc",
    (Function,),
    {
        "__module__": __name__,
        "__doc__": "The recv function of a message (see the module's ``_RecvRpc``).",
        "forward": staticmethod(_recv_forward),
        "backward": staticmethod(_recv_backward),
    },
)
_RECV_NODE = _RecvRpc._backward_cls
#: The node torch makes for a leaf that requires grad (its ``variable`` is the leaf).
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad
_RECV_ANCHOR = torch.empty(0, requires_grad=True)


def receive(tracked: Sequence[Any]) -> None:
    """Gives the tensors of one message that required grad on their sender (those
    :func:`import_tensor` marked, in order) their recv function: one node of torch's graph,
    whose outputs they become, in place (as PyTorch's ``RecvRpcBackward``; grad mode does
    not matter, as it does not for PyTorch's). Each keeps its node in ``_tensorwire_recv``
    (a context's ``_recv_functions`` gives it)."""
    received = [t for t in tracked if getattr(t, "_tensorwire_received", False) and t.grad_fn is None]
    if not received:
        return
    if torch.is_grad_enabled():
        _RecvRpc.apply(_RECV_ANCHOR, received)
    else:
        with torch.enable_grad():
            _RecvRpc.apply(_RECV_ANCHOR, received)
    node = received[0].grad_fn
    for t in received:
        t._tensorwire_recv = node


def export_tensor(t: torch.Tensor) -> tuple:
    """``(dtype name, shape, contiguous CPU tensor without graph, t.requires_grad)`` of a
    tensor to send (a sparse COO one packed: :func:`pack_sparse`)."""
    if t.layout == torch.sparse_coo:
        packed = pack_sparse(t)
        return "uint8", tuple(packed.shape), packed, t.requires_grad
    prepared = _serialize._prepare(t)
    dtype = prepared.dtype
    if dtype == torch.uint8:
        # uint8 on the wire is the packed form: no tensor that requires grad (nor any gradient)
        # is a dense uint8 one, and none may be taken for a packed one.
        raise ValueError("a dense uint8 tensor cannot travel as a tracked tensor or a gradient")
    return _serialize._DTYPE_NAMES[dtype], tuple(prepared.shape), prepared, t.requires_grad


def _leaves(outputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any], list[int], list[Any]]:
    """The leaves that require grad reached from ``outputs`` (an output that is a leaf
    included), each once, in the order found; the ``AccumulateGrad`` node of each; the
    outputs that are leaves whose node torch does not give (a sparse leaf: its gradient edge
    is found through a view, which sparse tensors do not have) and that no other output
    reaches, by index: their gradient is their seed, taken without a pass; and the recv
    functions reached (:data:`_RecvRpc`'s nodes: the walk stops there, their gradients go
    back to the senders)."""
    leaves: list[torch.Tensor] = []
    nodes: list[Any] = []
    recvs: list[Any] = []
    seen_leaves: set[int] = set()
    seen_nodes: set[int] = set()
    held: list[Any] = []  # keeps nodes alive, so that their ids stay theirs
    stack: list[Any] = []

    def add_leaf(t: torch.Tensor, node: Any) -> None:
        if id(t) not in seen_leaves:
            seen_leaves.add(id(t))
            leaves.append(t)
            nodes.append(node)

    leaf_outputs = []
    for i, o in enumerate(outputs):
        if o.grad_fn is None:
            leaf_outputs.append(i)
        else:
            stack.append(o.grad_fn)
    push = stack.append
    while stack:
        node = stack.pop()
        key = id(node)
        if key in seen_nodes:
            continue
        seen_nodes.add(key)
        held.append(node)
        kind = type(node)
        if kind is _ACCUMULATE_GRAD:
            # (Only this kind has a ``variable``: asking another for it raises, which costs.)
            variable = node.variable
            if isinstance(variable, torch.Tensor):
                add_leaf(variable, node)
        elif kind is _RECV_NODE:
            recvs.append(node)
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None:
                push(nxt)
    unhooked = []
    for i in leaf_outputs:
        o = outputs[i]
        if id(o) in seen_leaves:
            continue
        try:
            node = torch.autograd.graph.get_gradient_edge(o).node
        except (RuntimeError, NotImplementedError):
            unhooked.append(i)
            continue
        add_leaf(o, node)
    return leaves, nodes, unhooked, recvs


def _captured(
    outputs: list[torch.Tensor], grads: list[torch.Tensor], leaves: list[torch.Tensor], nodes: list[Any],
    recvs: list[Any],
) -> tuple[list[Optional[torch.Tensor]], list[Optional[tuple]]]:
    """The gradient of each leaf, and the gradients that reach each recv function in
    ``recvs`` (one per output, ``None`` for an output none reached), in one pass of torch's
    engine from ``outputs`` with ``grads``, keeping the graph, each leaf's ``AccumulateGrad``
    node run as PyTorch's distributed engine runs it (its ``DistAccumulateGradCaptureHook``):
    the node's pre hooks first (they may change the gradient), then the gradient is taken for
    the context, then the node's post hooks; the gradient never lands in ``.grad``.

    The pass runs every leaf's node (``torch.autograd.backward`` with the leaves as inputs, not
    ``torch.autograd.grad``, which captures the gradients without running the nodes or their
    hooks). A pre hook added here last, for this pass only, takes the gradient as the user's
    pre hooks left it and hands the node none, so nothing is accumulated into ``.grad``. The
    node's post hooks are then called with ``(None,)``; each is wrapped (:func:`_post_hooks`)
    so that in this pass it sees the gradient taken instead, as PyTorch's hook gives it
    (``grad_inputs`` is ``()``, as in PyTorch). The hooks are keyed to this pass on this
    thread (torch runs a CPU graph on the thread that started it), so a pass on another
    thread over the same leaves (a parameter server's trainers) is left to its own hooks, and
    a plain ``loss.backward()`` elsewhere is untouched. So every leaf must be on the CPU
    (``backward`` captures a pass with a leaf on a device with ``torch.autograd.grad``,
    without the nodes' hooks).

    A recv function is run as PyTorch's ``RecvRpcBackward`` is: what reaches it (after the
    hooks of the tensors it made) is taken, by a pre hook of this pass (its own backward
    hands nothing on).
    """
    got: list[Optional[torch.Tensor]] = [None] * len(leaves)
    recv_got: list[Optional[tuple]] = [None] * len(recvs)
    token = object()
    # The gradient each node's post hooks see in this pass, by their dict's id.
    given: dict[int, torch.Tensor] = {}
    posts = [_post_hooks(node) for node in nodes]

    def taking(i: int) -> Any:
        hooks = posts[i]

        def take(grad_outputs: tuple) -> Optional[tuple]:
            if getattr(_tls, "capture", None) is not token:
                return None
            got[i] = grad_outputs[0]
            if hooks:
                given[id(hooks)] = grad_outputs[0]
            return (None,)

        return take

    def taking_recv(j: int) -> Any:
        def take(grad_outputs: tuple) -> None:
            if getattr(_tls, "capture", None) is token:
                recv_got[j] = grad_outputs

        return take

    handles = [node.register_prehook(taking(i)) for i, node in enumerate(nodes)]
    handles += [node.register_prehook(taking_recv(j)) for j, node in enumerate(recvs)]
    previous = getattr(_tls, "capture", None), getattr(_tls, "given", None)
    _tls.capture, _tls.given = token, given
    try:
        _run_backward(outputs, grads, leaves, nodes, recvs)
    finally:
        _tls.capture, _tls.given = previous
        for h in handles:
            h.remove()
    return got, recv_got


def _run_backward(
    outputs: list[torch.Tensor], grads: list[torch.Tensor], inputs: list[torch.Tensor], nodes: list[Any],
    recvs: list[Any],
) -> None:
    """``torch.autograd.backward(outputs, grads, retain_graph=True, inputs=inputs)`` without
    its Python preamble (``_make_grads``, which checks each seed against its root in Python):
    every seed is a root's ones (``backward``), or a peer's gradient for a tensor this worker
    sent, whose shape and dtype the native driver checked against that tensor before the pass
    ran (a mismatch is the peer's violation); torch's engine checks them again as it starts
    (``validate_outputs`` on the roots). Tensor subclasses that override torch functions go
    through ``torch.autograd.backward``, as they would.

    ``nodes[i]`` is the ``AccumulateGrad`` node of leaf ``inputs[i]``: the leaves (and the
    roots that are leaves) are handed to the engine as their gradient edges (:func:`_edges`);
    so is each recv function of ``recvs`` (one edge of it marks the node to run)."""
    recv_edges = tuple(GradientEdge(node, 0) for node in recvs)
    if has_torch_function(tuple(outputs) + tuple(inputs)):
        torch.autograd.backward(outputs, grads, retain_graph=True, inputs=list(inputs) + list(recv_edges))
        return
    roots, edges = _edges(outputs, inputs, nodes)
    _engine_run_backward(
        roots, tuple(grads), True, False, edges + recv_edges, allow_unreachable=True, accumulate_grad=True
    )


def _edges(outputs: list[torch.Tensor], leaves: list[torch.Tensor], nodes: list[Any]) -> tuple[tuple, tuple]:
    """``outputs`` with each leaf among them replaced by its gradient edge, and the edges of
    ``leaves`` (``nodes[i]`` is the ``AccumulateGrad`` node of ``leaves[i]``).

    torch's engine binding finds a leaf tensor's edge while it holds the GIL, under the leaf's
    autograd lock, and an op on the same leaf on another thread (the GIL released) may hold
    that lock while it waits for the GIL to reach the node's Python object (torch 2.15's
    ``weak_intrusive_ptr<Node>::lock``): two handlers running passes over one received tensor
    at once deadlocked that way. An edge given as such is used as it is, under no lock."""
    node_of = {id(leaf): node for leaf, node in zip(leaves, nodes)}
    roots = tuple(
        GradientEdge(node_of[id(o)], 0) if o.grad_fn is None and id(o) in node_of else o for o in outputs
    )
    return roots, tuple(GradientEdge(node, 0) for node in nodes)


def _no_post_hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
    return None


def _no_pre_hook(grad_outputs: tuple) -> None:
    return None


def _has_node_hooks(node: Any) -> bool:
    """Whether ``node`` has Python pre or post hooks of its own (``node.register_prehook``,
    ``node.register_hook``; a tensor's own hooks are not the node's). torch keeps each kind in
    one dict that only a hook's handle refers to: a hook is added and removed to reach it
    (which leaves the node an empty dict of that kind if it had none). The probe is taken out
    of the dict directly (what ``handle.remove()`` does, without its method call and its loop
    over extra dicts, which a node's hook handle has none of)."""
    handle = node.register_prehook(_no_pre_hook)
    hooks = handle.hooks_dict_ref()
    del hooks[handle.id]
    if hooks:
        return True
    handle = node.register_hook(_no_post_hook)
    hooks = handle.hooks_dict_ref()
    del hooks[handle.id]
    return bool(hooks)


def _grads(
    outputs: list[torch.Tensor], grads: list[torch.Tensor], leaves: list[torch.Tensor], nodes: list[Any],
    recvs: list[Any],
) -> tuple[list[Optional[torch.Tensor]], list[Optional[tuple]]]:
    """As :func:`_captured`, without running the leaves' ``AccumulateGrad`` nodes nor the recv
    functions: one pass of torch's engine that captures the gradients reaching them (as
    ``torch.autograd.grad``: the tensors' own hooks run before, the nodes' hooks do not), the
    leaves and the recv functions' outputs given as gradient edges (:func:`_edges`). Every seed
    is checked as :func:`_run_backward` says. Tensor subclasses that override torch functions
    go through ``torch.autograd.grad``, as they would."""
    roots, edges = _edges(outputs, leaves, nodes)
    widths = [len(node.received) for node in recvs]
    edges += tuple(GradientEdge(node, k) for node, n in zip(recvs, widths) for k in range(n))
    if has_torch_function(tuple(outputs) + tuple(leaves)) or not all(t.is_cpu for t in outputs):
        got = list(torch.autograd.grad(roots, edges, grads, retain_graph=True, allow_unused=True))
    else:
        got = list(_engine_run_backward(
            roots, tuple(grads), True, False, edges, allow_unreachable=True, accumulate_grad=False
        ))
    recv_got: list[Optional[tuple]] = []
    at = len(leaves)
    for n in widths:
        recv_got.append(tuple(got[at:at + n]))
        at += n
    del got[len(leaves):]
    return got, recv_got


def _post_hooks(node: Any) -> Any:
    """``node``'s Python post hooks, each wrapped once so that in a pass of :func:`_captured`
    it sees the gradient the pass took (``_tls.given``) rather than the ``None`` the node ran
    with; outside such a pass a wrapped hook sees what torch gives it. torch keeps a node's
    Python post hooks in one dict, which a hook's handle refers to: a hook is added and
    removed to reach it (which leaves the node an empty dict of hooks if it had none)."""
    handle = node.register_hook(_no_post_hook)
    hooks = handle.hooks_dict_ref()
    handle.remove()
    if hooks is None:
        return {}
    for key, hook in list(hooks.items()):
        if not getattr(hook, "_tensorwire_given", False):
            hooks[key] = _given_gradient(hook, id(hooks))
    return hooks


def _given_gradient(hook: Any, key: int) -> Any:
    """``hook``, a post hook of the node whose hooks' dict has id ``key``, called with the
    gradient a pass of :func:`_captured` on this thread took for the node, if there is one."""

    def run(grad_inputs: tuple, grad_outputs: tuple) -> Any:
        given = getattr(_tls, "given", None)
        if given is not None and key in given:
            grad_outputs = (given[key],)
        return hook(grad_inputs, grad_outputs)

    run._tensorwire_given = True  # type: ignore[attr-defined]
    return run


def _relayed(outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> Optional[list]:
    """A pass whose every root is a received tensor as it arrived (an output of its recv
    function: a tensor received and sent on, as a pipeline's middle worker relays the gradient
    of its input), answered without torch's engine: each root's gradient is its seed, the
    seeds of a root given twice summed (as the engine sums them), ``[(tensor, gradient,
    True)]`` as :func:`backward` gives it. Only where nothing could make the engine's answer
    differ: plain tensors (no subclass), no hook on a root (``register_hook``,
    ``retain_grad``) nor on its recv function, and seeds of the roots' very shape, dtype,
    device and (dense) layout, which the engine would pass on unchanged; else ``None``, and the
    engine runs. A pass over nothing but the hand-over of a gradient (measured alone: about
    55 us through the engine's walk and run) costs one loop."""
    got: dict[int, tuple] = {}
    checked: set[int] = set()
    for o, g in zip(outputs, grads):
        node = o.grad_fn
        if (
            type(node) is not _RECV_NODE or type(o) is not torch.Tensor or type(g) is not torch.Tensor
            or o._backward_hooks or o.retains_grad or o.layout != torch.strided or g.layout != torch.strided
            or g.dtype != o.dtype or g.shape != o.shape or g.device != o.device
        ):
            return None
        if id(node) not in checked:
            if _has_node_hooks(node):
                return None
            checked.add(id(node))
        if id(o) in got:
            got[id(o)] = (o, got[id(o)][1] + g, True)
        else:
            got[id(o)] = (o, g, True)
    return list(got.values())


def backward(roots: list, seeds: list) -> list:
    """One local pass from ``roots`` with ``seeds`` (``None``: ones, for a scalar), keeping the
    graph: ``[(tensor, gradient, received)]`` for every leaf it reached (``received`` false)
    and every received tensor whose recv function it reached with a gradient for it
    (``received`` true: its gradient is sent back). Where a leaf's ``AccumulateGrad`` node or
    a recv function has hooks of its own, the nodes run, their hooks as in PyTorch's
    distributed engine (:func:`_captured`); else (the common case) the gradients are captured
    without running them (:func:`_grads`: no Python called back per node)."""
    outputs, grads = [], []
    for root, seed in zip(roots, seeds):
        if not root.requires_grad:
            continue
        outputs.append(root)
        grads.append(torch.ones_like(root) if seed is None else seed)
    if not outputs:
        return []
    relayed = _relayed(outputs, grads)
    if relayed is not None:
        return relayed
    leaves, nodes, unhooked, recvs = _leaves(outputs)
    seeded: dict[int, Any] = {}
    for i in unhooked:
        o = outputs[i]
        if id(o) in seeded:
            seeded[id(o)] = (o, seeded[id(o)][1] + grads[i])
        else:
            seeded[id(o)] = (o, grads[i])
    if unhooked:
        kept = [i for i in range(len(outputs)) if i not in set(unhooked)]
        outputs, grads = [outputs[i] for i in kept], [grads[i] for i in kept]
    recv_got: list[Optional[tuple]] = []
    if not leaves and not recvs:
        got = []
    elif all(leaf.is_cpu for leaf in leaves) and any(map(_has_node_hooks, nodes + recvs)):
        got, recv_got = _captured(outputs, grads, leaves, nodes, recvs)
    else:
        # No node hook to run (the common case), or a leaf on a device (its node runs on that
        # device's autograd thread, where the hook keyed to this thread would not take its
        # gradient): the gradients are captured without running the nodes, as
        # ``torch.autograd.grad`` captures them (the tensors' own hooks run; a recv
        # function's gradients, one edge per output).
        got, recv_got = _grads(outputs, grads, leaves, nodes, recvs)
    leaves = leaves + [o for o, _ in seeded.values()]
    got = got + [g for _, g in seeded.values()]
    # The received tensors that got a gradient, after the leaves (a tensor the native side
    # no longer holds has no record left to answer for: its gradient is dropped).
    for node, taken in zip(recvs, recv_got):
        if taken is None:
            continue
        for ref, g in zip(node.received, taken):
            t = ref()
            if g is not None and t is not None:
                leaves.append(t)
                got.append(g)
    # How many leaves each gradient object reached (``(a + b).sum()`` gives a and b one).
    uses: dict[int, int] = {}
    for g in got:
        if g is not None:
            uses[id(g)] = uses.get(id(g), 0) + 1
    out = []
    for leaf, g in zip(leaves, got):
        if g is None:
            continue
        received = getattr(leaf, "_tensorwire_recv", None) is not None
        if not received:
            g = _owned_gradient(g, leaf, shared=uses[id(g)] > 1)
        out.append((leaf, g, received))
    return out


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """c10's ``is_non_overlapping_and_dense``: the elements fill the storage they span once
    each, in some order of the dimensions."""
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def _obeys_layout_contract(grad: torch.Tensor, leaf: torch.Tensor) -> bool:
    """torch's ``obeys_layout_contract``: ``grad`` (dense) has the layout ``AccumulateGrad``
    would keep for ``leaf`` (the leaf's strides if it is dense, else contiguous)."""
    if leaf.layout == torch.strided:
        ls = leaf.stride()
        # The common case, answered without the walk below: a contiguous leaf (so
        # non-overlapping and dense) and a gradient of its very strides, none of them 0.
        if grad.stride() == ls and 0 not in ls and leaf.is_contiguous():
            return True
    if leaf.layout == torch.strided and _non_overlapping_and_dense(leaf):
        for size, gs, ls in zip(grad.shape, grad.stride(), leaf.stride()):
            if size != 1 and gs != ls:
                return False
            if size == 1 and gs == 0:
                return False
        return True
    return grad.is_contiguous()


def _owned_gradient(grad: torch.Tensor, leaf: torch.Tensor, shared: bool) -> torch.Tensor:
    """The gradient a context keeps for ``leaf``, as PyTorch's distributed autograd (its
    ``AccumulateGrad`` rules) keeps it: ``grad`` itself when it has the leaf's layout and no
    other leaf got it; else a copy in the leaf's layout. So what ``get_gradients`` returns is
    never an expanded view (``sum()``'s gradient) nor one tensor shared by two leaves, and can
    be written in place. A sparse COO gradient is kept over its own indices and values (a new
    tensor over them: torch's shallow copy) when both are contiguous and no other leaf got it,
    else cloned."""
    if grad.layout == torch.sparse_coo:
        if not shared and grad._indices().is_contiguous() and grad._values().is_contiguous():
            # Trusted parts (this worker's engine made them): no invariant checks, as torch's
            # _sparse_coo_tensor_unsafe.
            return torch.sparse_coo_tensor(
                grad._indices(), grad._values(), grad.shape, check_invariants=False
            )
        return grad.clone()
    if grad.layout != torch.strided:
        return grad
    if not shared and _obeys_layout_contract(grad, leaf):
        return grad
    if leaf.layout == torch.strided and _non_overlapping_and_dense(leaf):
        return torch.empty_strided(leaf.size(), leaf.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def accumulate(total: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A context's gradient for a leaf plus one more, as ``AccumulateGrad`` sums them: the same
    layouts stay (sparse and sparse is sparse, uncoalesced), a sparse sum and a dense gradient
    make a dense one. A new tensor: what ``get_gradients`` returned before is not changed."""
    if total.layout != torch.strided and grad.layout == torch.strided:
        return grad + total
    return total + grad


def assign(leaf: torch.Tensor, values: torch.Tensor) -> None:
    """Writes ``values`` into ``leaf`` in place."""
    with torch.no_grad():
        leaf.copy_(values)


# --- values in a context ------------------------------------------------------------------


def dumps_split(value: Any) -> tuple[bytes, list, list, list, list]:
    """``value`` pickled as ``tensorwire.rpc`` pickles it, its tensors split in two:
    ``(payload, untracked, native references, tracked_at, tracked)``; the tracked ones are the
    tensors that require grad, as they are (the native side records them as sent). A value
    of one of the flat shapes (a tensor that requires grad; a call's tracked tensors and
    scalars) is not pickled (:func:`_serialize.dumps_flat`)."""
    flat = _serialize.dumps_flat(value)
    if flat is not None:
        payload, tracked = flat
        return payload, [], [], list(range(len(tracked))), tracked
    buf = io.BytesIO()
    p = _serialize._Pickler(buf, split=True)
    p.dump(value)
    tensors, tracked_at = p.tensors, p.tracked_at
    if not tracked_at:
        return buf.getvalue(), tensors, p.rrefs, tracked_at, []
    if len(tracked_at) == len(tensors):
        return buf.getvalue(), [], p.rrefs, tracked_at, tensors
    at = set(tracked_at)
    plain = [t for i, t in enumerate(tensors) if i not in at]
    tracked = [tensors[i] for i in tracked_at]
    return buf.getvalue(), plain, p.rrefs, tracked_at, tracked


def merge(plain: Sequence[Any], tracked_at: Sequence[int], tracked: Sequence[Any], origin: str) -> list:
    """The pickle's tensor list again: untracked buffers and tracked tensors in their places."""
    if not tracked_at and not tracked:
        return list(plain)
    total = len(plain) + len(tracked)
    # (``tracked_at`` comes from the native side as a list of ints.)
    if not plain and list(tracked_at) == list(range(total)):
        return list(tracked)
    if len(tracked_at) != len(tracked) or any(
        type(i) is not int or not 0 <= i < total for i in tracked_at
    ) or any(a >= b for a, b in zip(tracked_at, tracked_at[1:])):
        raise RefusedError(f"malformed tracked tensor positions from {origin}: {tracked_at!r}")
    out: list = []
    places = dict(zip(tracked_at, tracked))
    it = iter(plain)
    for i in range(total):
        out.append(places[i] if i in places else next(it))
    return out


def _run_in(
    context_id: int, caller: str, function: str, payload: bytes, plain: list, rrefs: list,
    tracked_at: list, tracked: list,
) -> Any:

    previous = set_current(context_id)
    try:
        buffers = merge(plain, tracked_at, tracked, caller)
        receive(tracked)
        result, later = rpc._invoke(caller, function, payload, buffers, rrefs, None)
        # An async_execution function's future is waited for here, in the context.
        return result.wait() if later else result
    finally:
        set_current(previous)


def serve(
    caller: str, context_id: int, function: str, payload: bytes, plain: list, rrefs: list,
    tracked_at: list, tracked: list,
) -> tuple:
    """A call from ``caller`` in ``context_id``: ``("returned", payload, untracked, rrefs,
    tracked_at, tracked)`` or ``("raised", type, message, traceback)``."""
    rpc._wait_ready()
    try:
        value = _run_in(context_id, caller, function, payload, plain, rrefs, tracked_at, tracked)
        return ("returned", *dumps_split(value))
    except Exception as e:
        return rpc._raised(e)


def create(
    caller: str, context_id: int, function: str, payload: bytes, plain: list, rrefs: list,
    tracked_at: list, tracked: list,
) -> tuple:
    """A ``remote()`` creation from ``caller`` in ``context_id``: ``("returned", value)`` or
    ``("raised", ...)``."""
    rpc._wait_ready()
    try:
        return ("returned", _run_in(context_id, caller, function, payload, plain, rrefs, tracked_at, tracked))
    except Exception as e:
        return rpc._raised(e)


def fetch(value: Any) -> tuple:
    """A reference's value for ``to_here()`` in a context, its tensors that require grad
    tracked."""
    try:
        return ("returned", *dumps_split(value))
    except Exception as e:
        return rpc._raised(e)


# --- tensorwire's own functions on a reference's owner ------------------------------------

#: What ``owner_call`` may run on a reference's value, by name: tensorwire's own functions
#: only (modules register theirs on import; peers cannot add any).
OWNER_FUNCTIONS: dict[str, Any] = {}


def owner_call(value: Any, function: str, payload: bytes, buffers: list, rrefs: list) -> tuple:
    """Runs ``OWNER_FUNCTIONS[function](value, *args)`` on a reference's owner:
    ``("returned", payload, tensors, rrefs)`` or ``("raised", type, message, traceback)``."""
    rpc._wait_ready()
    try:
        fn = _owner_function(function)
        args = _serialize.loads(payload, buffers, rrefs, trusted=False, origin="a reference holder")
        if not isinstance(args, tuple):
            raise RefusedError("malformed arguments for an owner-side function")
        return rpc._returned(fn(value, *args))
    except Exception as e:
        return rpc._raised(e)


def _owner_function(function: str) -> Any:
    """``OWNER_FUNCTIONS[function]``, or ``RefusedError`` for a name that is none of them."""
    if function.startswith("optim.") and function not in OWNER_FUNCTIONS:
        import tensorwire.rpc.optim  # noqa: F401 - registers the optimizer's functions
    fn = OWNER_FUNCTIONS.get(function)
    if fn is None:
        raise RefusedError(f"{function!r} is not one of tensorwire's owner-side functions")
    return fn


class Owners:
    """References and what a call to all their owners needs of them, taken once: which ones
    this worker owns, each owner, the native handles of the others and, with ``values``, the
    values this worker owns (a creation that failed raises here). A caller that calls the
    same owners again and again (``DistributedOptimizer.step``) keeps one: a call then asks
    the native side for none of it (``local_value`` is a round trip through the runtime, the
    GIL released and taken again)."""

    def __init__(self, rrefs: Sequence[Any], values: bool = True):
        self.rrefs = list(rrefs)
        self.mine = [r.is_owner() for r in self.rrefs]
        self.owners = [r.owner() for r in self.rrefs]
        self.others = [r._native for r, m in zip(self.rrefs, self.mine) if not m]
        self.values: Optional[dict] = None
        if values:
            self.values = {i: r.local_value() for i, r in enumerate(self.rrefs) if self.mine[i]}

    def value(self, i: int) -> Any:
        """The value of the ``i``-th reference, which this worker owns."""
        return self.rrefs[i].local_value() if self.values is None else self.values[i]


def owner_call_all(rrefs: Any, function: str, args: tuple, timeout: Any = -1.0) -> list:
    """Runs the owner-side function ``function`` on every one of ``rrefs``' values (a list of
    references, or :class:`Owners`), on their owners, in parallel, and waits for all: the
    results in ``rrefs``' order, or the first failure raised once every owner has answered.
    The calls to other owners are sent first; the values this worker owns are then run on
    this thread (with the arguments as they are: tensorwire's own functions do not change
    them) while the other owners run theirs; then one native wait, the GIL released, takes
    every answer. An owner's failure reads as it would through a call
    (:func:`tensorwire.rpc._decoded`), the local ones included."""
    owners = rrefs if isinstance(rrefs, Owners) else Owners(rrefs, values=False)
    mine = owners.mine
    payload, tensors, _ = _serialize.dumps(tuple(args))

    def here() -> list:
        out = []
        for i, m in enumerate(mine):
            if m:
                try:
                    out.append(rpc._returned(_owner_function(function)(owners.value(i), *args)))
                except Exception as e:  # noqa: BLE001 - its outcome, as the owner's answer carries it
                    out.append(rpc._raised(e))
        return out

    try:
        own, theirs = native().owner_call_all(
            owners.others, function, payload, tensors, rpc._timeout(timeout), here
        )
    except _native.TensorwireError as e:
        raise rpc._runtime_error(e) from e
    trusted = rpc._trusted
    results: list = []
    first: Optional[BaseException] = None
    own_it, their_it = iter(own), iter(theirs)
    for owner, m in zip(owners.owners, mine):
        try:
            results.append(rpc._decoded(next(own_it) if m else next(their_it), owner, trusted))
        except Exception as e:  # noqa: BLE001 - raised below, once all were seen
            results.append(None)
            if first is None:
                first = e
    if first is not None:
        raise first
    return results


def owner_call_async(rref: Any, function: str, args: tuple, timeout: Any = -1.0) -> torch.futures.Future:
    """Runs the owner-side function ``function`` on ``rref``'s value, on its owner."""
    fut, on_done = rpc._future(rref.owner())
    payload, tensors, _ = _serialize.dumps(tuple(args))
    try:
        native().owner_call(rref._native, function, payload, tensors, rpc._timeout(timeout), on_done)
    except _native.TensorwireError as e:
        raise rpc._runtime_error(e) from e
    return fut


# --- calls made in a context, at the caller ---------------------------------------------


def native() -> Any:
    """This worker's native distributed autograd (RPC must be initialized)."""
    agent = rpc._agent
    if agent is None:
        agent = rpc._require_agent()  # raises
    return agent.dist_autograd()


def _decode(outcome: Any, worker: str, callee: Any, trusted: bool) -> Any:
    """The value a tracked call's outcome carries, or raises what it carries (``callee``: the
    ``(name, id)`` of the worker called, made a :class:`WorkerInfo` only for an exception)."""
    if isinstance(outcome, BaseException):
        raise rpc._runtime_error(outcome)
    if outcome[0] == "returned":
        _, payload, plain, rrefs, tracked_at, tracked = outcome
        tensors = merge(plain, tracked_at, tracked, worker)
        receive(tracked)
        return _serialize.loads(payload, tensors, rrefs, trusted=trusted, origin=worker)
    raise rpc._remote_exception(WorkerInfo(*callee), outcome[1], outcome[2], outcome[3])


def _outcome_future(worker: str, callee: Any) -> tuple[torch.futures.Future, Any]:
    """A future and the ``on_done`` that completes it from a tracked call's outcome
    (``callee`` as :func:`_decode` takes it)."""
    fut: torch.futures.Future = torch.futures.Future()
    trusted = rpc._trusted

    def on_done(outcome: Any) -> None:
        try:
            value = _decode(outcome, worker, callee, trusted)
        except Exception as e:  # noqa: BLE001 - the future carries it
            fut.set_exception(e)
        else:
            fut.set_result(value)

    return fut, on_done


def _prepare_call(to: Any, func: Any, args: Any, kwargs: Any) -> tuple:
    agent = rpc._require_agent()
    worker = rpc._worker_name(to, agent)
    try:
        # ``(name, id)``: a :class:`WorkerInfo` is made of it only for an exception.
        callee = agent.worker(worker)
    except _native.TensorwireError as e:
        raise rpc._runtime_error(e) from e
    func, args = rpc._bind(func, args)
    encoded = dumps_split((tuple(args or ()), dict(kwargs or {})))
    return worker, callee, rpc._function_name(func), encoded


def rpc_async(context_id: int, to: Any, func: Any, args: Any, kwargs: Any, timeout: Any) -> torch.futures.Future:
    """``rpc_async`` inside ``context_id``: the send and the recv of its tensors (and of its
    result's) are recorded."""
    worker, callee, name, (payload, plain, rrefs, tracked_at, tracked) = _prepare_call(to, func, args, kwargs)
    fut, on_done = _outcome_future(worker, callee)
    try:
        native().call(
            context_id, worker, name, payload, plain, rrefs, tracked_at, tracked, rpc._timeout(timeout), on_done
        )
    except _native.TensorwireError as e:
        raise rpc._runtime_error(e) from e
    return fut


def rpc_sync(context_id: int, to: Any, func: Any, args: Any, kwargs: Any, timeout: Any) -> Any:
    """``rpc_sync`` inside ``context_id``: as :func:`rpc_async` and a wait, without the future
    (this thread waits for the reply, the GIL released, and decodes it itself)."""
    worker, callee, name, (payload, plain, rrefs, tracked_at, tracked) = _prepare_call(to, func, args, kwargs)
    try:
        outcome = native().call_wait(
            context_id, worker, name, payload, plain, rrefs, tracked_at, tracked, rpc._timeout(timeout)
        )
    except _native.TensorwireError as e:
        raise rpc._runtime_error(e) from e
    return _decode(outcome, worker, callee, rpc._trusted)


def remote(context_id: int, to: Any, func: Any, args: Any, kwargs: Any, timeout: Any) -> Any:
    """``remote`` inside ``context_id``."""
    worker, _, name, (payload, plain, rrefs, tracked_at, tracked) = _prepare_call(to, func, args, kwargs)
    try:
        made = native().remote(
            context_id, worker, name, payload, plain, rrefs, tracked_at, tracked, rpc._timeout(timeout)
        )
    except _native.TensorwireError as e:
        raise rpc._runtime_error(e) from e
    return rpc.RRef(_native_rref=made)


def fetch_async(context_id: int, rref: Any, timeout: Any) -> torch.futures.Future:
    """``rref.to_here()`` inside ``context_id``: the value's tensors that require grad are
    tracked, so their gradients reach the owner; on the owner, the value itself (its graph
    carries the gradients, as in PyTorch)."""
    if rref.is_owner():
        fut: torch.futures.Future = torch.futures.Future()
        try:
            fut.set_result(rref.local_value())
        except Exception as e:  # noqa: BLE001 - the future carries it
            fut.set_exception(e)
        return fut
    owner = rref.owner()
    fut, on_done = _outcome_future(owner.name, (owner.name, owner.id))
    try:
        native().fetch(context_id, rref._native, rpc._timeout(timeout), on_done)
    except _native.TensorwireError as e:
        raise rpc._runtime_error(e) from e
    return fut


def _install() -> None:
    """Calls made inside a context go through this module (``tensorwire.rpc``'s hook)."""
    import sys

    rpc._autograd = sys.modules[__name__]


_install()
