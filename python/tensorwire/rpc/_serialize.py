"""Arguments and results as they travel: a pickle with every tensor taken out of it, and an
allow-listing unpickler for what peers send.

Tensors are not pickled: each is replaced by a persistent id ``("tensor", index, dtype, shape,
requires_grad)`` and its bytes travel beside the message (contiguous CPU tensors are sent where
they lie, without a copy). The receiver rebuilds each tensor over the received bytes
(``torch.frombuffer``). A non-contiguous view keeps its strides, as in PyTorch's RPC:
``("strided", span id, shape, strides, requires_grad)``, the span being the stretch of storage
it reads, sent without a copy when that stretch is small (under ``VIEW_SPAN_BYTES``) or under
twice the view's bytes (a transpose, a permutation, a narrow of a small tensor); any other view
travels as a contiguous copy. The receiver checks that the strides read nothing outside the
span. A sparse COO tensor travels as its two dense
parts, ``("sparse_coo", indices id, values id, size, coalesced, requires_grad)`` with the parts'
ids as above, and is rebuilt with torch's invariant checks on (indices within the size, a
coalesced claim true), so a peer's malformed one is refused (``RefusedError``) before anything
uses it. Other layouts (CSR, quantized, ...) are refused at the sender.

Remote references are not pickled either: each ``RRef`` becomes ``("rref", index)`` and the
agent's own reference travels beside the message, forked for the destination by the agent (the
fork protocol is the agent's, as PyTorch's is its RRef context's). Pickling an ``RRef``
anywhere else fails, as in PyTorch.

Decoding is allow-listed: a pickle may name only safe builtin containers and scalars, the
globals torch's ``weights_only`` loading allows (``torch._weights_only_unpickler`` and
``torch.serialization.add_safe_globals``), tensorwire.rpc's own types, and the classes and
functions this worker exposed (a function passed as a value is one peers may call anyway). Anything else is refused before it is looked up, so loading a hostile pickle
runs nothing (``trust_peers=True`` at ``init_rpc`` lifts the allow-list, as PyTorch's RPC
does).
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any, Callable, Sequence

import torch

from tensorwire.rpc import _exposed
from tensorwire.rpc._exposed import RefusedError

PROTOCOL = 5

_SAFE_BUILTINS = frozenset(
    f"builtins.{n}"
    for n in (
        "dict", "list", "tuple", "set", "frozenset", "bytearray", "bytes", "str", "int",
        "float", "complex", "bool", "slice", "range",
    )
) | frozenset(("collections.OrderedDict", "collections.deque", "collections.Counter"))

_DTYPES: dict[str, torch.dtype] = {
    name: value
    for name, value in vars(torch).items()
    if isinstance(value, torch.dtype)
}
#: Each dtype's name as a pickle names it (``float32``, not ``torch.float32``).
_DTYPE_NAMES: dict[torch.dtype, str] = {}
for _name, _dtype in _DTYPES.items():
    _DTYPE_NAMES.setdefault(_dtype, str(_dtype).removeprefix("torch."))
del _name, _dtype

#: Types ``persistent_id`` answers ``None`` for at once: the pickler asks it about every object
#: it writes (the parts of each persistent id included), and these are never tensors or
#: references.
_PLAIN_TYPES = frozenset((str, int, float, bool, bytes, tuple, list, dict, type(None)))
_Tensor = torch.Tensor
_STRIDED = torch.strided


def _torch_allowed() -> dict[str, Any]:
    from torch import _weights_only_unpickler as w

    allowed = dict(w._get_allowed_globals())
    user = getattr(w, "_get_user_allowed_globals", None)
    if user is not None:
        allowed.update(user())
    return allowed


_torch_globals: dict[str, Any] | None = None


def _own_types() -> dict[str, Any]:
    from tensorwire.rpc._types import WorkerInfo

    return {
        f"{t.__module__}.{t.__qualname__}": t for t in (WorkerInfo, RefusedError)
    }


def check_carried(t: torch.Tensor) -> None:
    """Raises if ``t`` is a tensor tensorwire.rpc does not carry: one off the CPU, or of a
    layout other than dense (strided) and sparse COO, or quantized."""
    if t.is_cpu and t.layout is _STRIDED and not t.is_quantized:
        # The common case, in three attribute reads (``t.device`` makes an object).
        return
    if t.device.type != "cpu":
        raise RuntimeError(
            f"tensorwire.rpc carries CPU tensors; this one is on {t.device}: move it to the "
            "CPU first (device maps are validated at init_rpc, but the Python layer does not "
            "carry CUDA tensors yet)"
        )
    if t.layout not in (torch.strided, torch.sparse_coo) or t.is_quantized:
        raise ValueError(
            f"tensorwire.rpc carries dense and sparse COO tensors, not {t.layout} ones"
            + (" (quantized)" if t.is_quantized else "")
        )


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with its lazy conjugation and negation applied (dense tensors only)."""
    check_carried(t)
    if t.layout != torch.strided:
        raise ValueError(f"a {t.layout} tensor travels as its parts (sparse_parts)")
    t = t.detach()
    # (Each ``resolve_*`` is an op of torch's dispatcher even when it has nothing to do; the
    # bits are read without one.)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _prepare(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it travels: detached, contiguous, on the CPU (dense tensors only)."""
    t = _resolved(t)
    return t if t.is_contiguous() else t.contiguous()


#: A view travels as the span of storage it reads while that span is under this many bytes, or
#: under twice the view's own bytes (PyTorch's RPC sends a view's whole storage below 8 KiB or
#: twice the view's bytes, and a copy otherwise; the span is never more than the storage).
VIEW_SPAN_BYTES = 8 * 1024


def _span(t: torch.Tensor) -> int:
    """How many elements of its storage the non-empty strided tensor ``t`` reads, from its
    first (torch's strides are never negative)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _travels_as_view(t: torch.Tensor) -> bool:
    """Whether the non-contiguous dense tensor ``t`` travels as a view of its storage's span
    (its strides kept, no copy at the sender) rather than as a contiguous copy."""
    if t.numel() == 0:
        return False
    span = _span(t)
    return span * t.element_size() < VIEW_SPAN_BYTES or span < 2 * t.numel()


def sparse_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A sparse COO tensor's ``(indices, values, coalesced)``, the parts dense and contiguous
    (uncoalesced tensors travel as they are: coalescing is the receiver's choice, as in
    torch)."""
    check_carried(t)
    with torch.no_grad():
        indices, values = t._indices(), t._values()
    return _prepare(indices), _prepare(values), bool(t.is_coalesced())


def build_sparse(
    indices: torch.Tensor, values: torch.Tensor, size: tuple, coalesced: bool, origin: str
) -> torch.Tensor:
    """The sparse COO tensor of these parts, checked as torch checks one with
    ``check_invariants=True`` (and the shapes of the parts first): ``RefusedError`` naming
    ``origin`` for one that is malformed (an index out of range, a false coalesced claim, parts
    that do not fit the size), never a tensor that would crash whatever reads it."""
    problem = None
    if indices.dtype != torch.int64 or indices.dim() != 2:
        problem = f"its indices are {indices.dtype} of shape {tuple(indices.shape)}, not a 2-D int64 tensor"
    elif values.dim() < 1 or values.shape[0] != indices.shape[1]:
        problem = (
            f"it has {indices.shape[1]} indices but values of shape {tuple(values.shape)}"
        )
    elif len(size) != indices.shape[0] + values.dim() - 1 or tuple(values.shape[1:]) != tuple(
        size[indices.shape[0]:]
    ):
        problem = (
            f"indices of shape {tuple(indices.shape)} and values of shape "
            f"{tuple(values.shape)} do not make a tensor of size {tuple(size)}"
        )
    if problem is None:
        # The indices are checked and kept as a copy of ours: received bytes may lie in the
        # sender's shared memory (a private mapping of its slab), which a hostile peer on this
        # host could still write after the check.
        indices = indices.clone()
        try:
            return torch.sparse_coo_tensor(
                indices, values, size, check_invariants=True, is_coalesced=coalesced
            )
        except (RuntimeError, ValueError, TypeError, OverflowError) as e:
            problem = str(e)
    raise RefusedError(f"a malformed sparse tensor from {origin}: {problem}")


#: The Python class of remote references and how to make one from a received native reference
#: (set by ``tensorwire.rpc``, which defines the class).
_rref_type: type | None = None
_wrap_rref: Callable[[Any], Any] | None = None


def register_rref_type(cls: type, wrap: Callable[[Any], Any]) -> None:
    """Makes ``cls`` (whose instances hold the agent's reference as ``_native``) travel as a
    reference, rebuilt at the receiver by ``wrap(native)``."""
    global _rref_type, _wrap_rref
    _rref_type, _wrap_rref = cls, wrap


class _Pickler(pickle.Pickler):
    """Pickles a value with its tensors and references taken out (see the module's docs).

    With ``split`` (a call in a distributed autograd context), a tensor that requires grad is
    not prepared: it is put in ``tensors`` as it is, whatever its layout, and its position in
    ``tracked_at`` (the engine exports it and records it as sent)."""

    def __init__(self, file: io.BytesIO, split: bool = False):
        super().__init__(file, protocol=PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.tracked_at: list[int] = []
        self.rrefs: list[Any] = []
        self._split = split
        self._seen: dict[int, tuple] = {}
        self._held: list[Any] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _PLAIN_TYPES:
            return None
        if _rref_type is not None and type(obj) is _rref_type:
            pid = self._seen.get(id(obj))
            if pid is None:
                pid = ("rref", len(self.rrefs))
                self.rrefs.append(obj._native)
                self._held.append(obj)
                self._seen[id(obj)] = pid
            return pid
        if not isinstance(obj, _Tensor):
            return None
        pid = self._seen.get(id(obj))
        if pid is None:
            requires_grad = bool(obj.requires_grad)
            if self._split and requires_grad:
                check_carried(obj)
                self.tracked_at.append(len(self.tensors))
                pid = self._add(obj, True)
            elif obj.layout == torch.sparse_coo:
                indices, values, coalesced = sparse_parts(obj)
                pid = (
                    "sparse_coo", self._add(indices, False), self._add(values, False),
                    tuple(obj.shape), coalesced, requires_grad,
                )
            else:
                t = _resolved(obj)
                if t.is_contiguous():
                    pid = self._add(t, requires_grad)
                elif _travels_as_view(t):
                    span = t.as_strided((_span(t),), (1,), t.storage_offset())
                    pid = ("strided", self._add(span, False), tuple(t.shape), t.stride(), requires_grad)
                else:
                    pid = self._add(t.contiguous(), requires_grad)
            # Keeps `obj` alive, so that its id is not reused by another tensor meanwhile.
            self._held.append(obj)
            self._seen[id(obj)] = pid
        return pid

    def _add(self, t: torch.Tensor, requires_grad: bool) -> tuple:
        dtype = _DTYPE_NAMES.get(t.dtype) or str(t.dtype).removeprefix("torch.")
        pid = ("tensor", len(self.tensors), dtype, tuple(t.shape), requires_grad)
        self.tensors.append(t)
        return pid


def dumps(value: Any) -> tuple[bytes, list[torch.Tensor], list[Any]]:
    """``value`` pickled, the contiguous CPU tensors and the native references the pickle
    refers to by index. A scalar (``None``, ``bool``, ``int``, ``float``, ``str``) or a tuple
    of them, which holds neither, is pickled by the C pickler alone, to the same bytes (no
    :class:`_Pickler`, whose ``persistent_id`` is a Python call per object: an owner's
    ``None`` result, a distributed optimizer step's arguments)."""
    kind = type(value)
    if kind in _FLAT_SCALARS or (kind is tuple and all(type(v) in _FLAT_SCALARS for v in value)):
        return pickle.dumps(value, protocol=PROTOCOL), [], []
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(value)
    return buf.getvalue(), p.tensors, p.rrefs


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, payload: bytes, buffers: Sequence[Any], rrefs: Sequence[Any], trusted: bool, origin: str
    ):
        super().__init__(io.BytesIO(payload))
        self._buffers = buffers
        self._rrefs = rrefs
        self._rref_objects: dict[int, Any] = {}
        self._tensors: dict[int, torch.Tensor] = {}
        self._sparse_tensors: dict[tuple[int, int], torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}
        self._trusted = trusted
        self._origin = origin

    def find_class(self, module: str, name: str) -> Any:
        if self._trusted:
            return super().find_class(module, name)
        global _torch_globals
        full = f"{module}.{name}"
        if full in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if _torch_globals is None:
            _torch_globals = _torch_allowed()
        found = _torch_globals.get(full)
        if found is None:
            found = _own_types().get(full)
        if found is None:
            found = _exposed.exposed_class(full)
        if found is None:
            # A function passed as a value (``rpc_sync(to, apply, args=(Cls.method, rref))``):
            # only one peers may call here anyway.
            found = _exposed.exposed_callable(full)
        if found is None:
            raise RefusedError(
                f"refused to unpickle {full} from {self._origin}: it is neither a safe builtin, "
                "nor allowed by torch's weights_only rules, nor a class this worker exposed "
                "(tensorwire.rpc.expose)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "rref":
            return self._rref(pid[1])
        if isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "sparse_coo":
            return self._sparse(pid)
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "strided":
            return self._strided(pid)
        return self._dense(pid)

    def _strided(self, pid: tuple) -> torch.Tensor:
        """A view over a received span of storage, its shape and strides checked to read
        nothing outside the span."""
        _, span_id, shape, strides, requires_grad = pid
        if not (
            isinstance(span_id, tuple) and len(span_id) == 5 and span_id[4] is False
            and isinstance(span_id[3], tuple) and len(span_id[3]) == 1
            and isinstance(shape, tuple) and isinstance(strides, tuple)
            and len(shape) == len(strides)
            and all(type(d) is int and 0 <= d < 1 << 63 for d in shape + strides)
            and type(requires_grad) is bool
        ):
            raise RefusedError(f"a malformed tensor view from {self._origin}: {pid!r}")
        key = (span_id[1], shape, strides, requires_grad)
        cached = self._views.get(key)
        if cached is not None:
            return cached
        span = self._dense(span_id)
        if isinstance(self._buffers[span_id[1]], torch.Tensor):
            raise RefusedError(f"a tensor view from {self._origin} over a tracked tensor: {pid!r}")
        reads = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        if reads > span.numel():
            raise RefusedError(
                f"a tensor view from {self._origin} of shape {shape} and strides {strides} "
                f"reads {reads} elements of a span of {span.numel()}"
            )
        t = span.as_strided(shape, strides, span.storage_offset())
        if requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        self._views[key] = t
        return t

    def _sparse(self, pid: tuple) -> torch.Tensor:
        _, indices_id, values_id, size, coalesced, requires_grad = pid
        if not (
            isinstance(size, tuple)
            and all(type(d) is int and 0 <= d < 1 << 63 for d in size)
            and type(coalesced) is bool
            and type(requires_grad) is bool
        ):
            raise RefusedError(f"a malformed sparse tensor reference from {self._origin}: {pid!r}")
        for part in (indices_id, values_id):
            # The parts are plain buffers, never tracked tensors (a tracked sparse tensor
            # travels whole, through the engine).
            if not (
                isinstance(part, tuple) and len(part) == 5 and part[4] is False
                and type(part[1]) is int and 0 <= part[1] < len(self._buffers)
                and not isinstance(self._buffers[part[1]], torch.Tensor)
            ):
                raise RefusedError(f"a malformed sparse tensor reference from {self._origin}: {pid!r}")
        key = (indices_id[1], values_id[1])
        cached = self._sparse_tensors.get(key)
        if cached is not None:
            return cached
        parts = [self._dense(indices_id), self._dense(values_id)]
        t = build_sparse(parts[0], parts[1], size, coalesced, self._origin)
        if requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        self._sparse_tensors[key] = t
        return t

    def _dense(self, pid: Any) -> torch.Tensor:
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "tensor"
            and type(pid[1]) is int
            and 0 <= pid[1] < len(self._buffers)
            and pid[2] in _DTYPES
            and isinstance(pid[3], tuple)
            and all(type(d) is int and d >= 0 for d in pid[3])
            and type(pid[4]) is bool
        ):
            raise RefusedError(f"a malformed tensor reference from {self._origin}: {pid!r}")
        _, index, dtype_name, shape, requires_grad = pid
        cached = self._tensors.get(index)
        if cached is not None:
            return cached
        dtype = _DTYPES[dtype_name]
        buf = self._buffers[index]
        if isinstance(buf, torch.Tensor):
            # Made by distributed autograd's engine from a tracked tensor (it records its
            # gradient when it required grad on the sender).
            if buf.dtype != dtype or tuple(buf.shape) != shape:
                raise RefusedError(
                    f"a tracked tensor from {self._origin} is {buf.dtype} of shape "
                    f"{tuple(buf.shape)}, the pickle says {dtype} of shape {shape}"
                )
            self._tensors[index] = buf
            return buf
        if math.prod(shape) * dtype.itemsize != len(buf):
            raise RefusedError(
                f"a tensor from {self._origin} of shape {shape} and {dtype} came with "
                f"{len(buf)} bytes"
            )
        if len(buf) == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype).view(shape)
        if requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        self._tensors[index] = t
        return t


    def _rref(self, index: Any) -> Any:
        if not (type(index) is int and 0 <= index < len(self._rrefs)) or _wrap_rref is None:
            raise RefusedError(f"a malformed reference from {self._origin}: {index!r}")
        rref = self._rref_objects.get(index)
        if rref is None:
            rref = self._rref_objects[index] = _wrap_rref(self._rrefs[index])
        return rref


#: ``None`` pickled, as :func:`dumps` pickles it.
_NONE = pickle.dumps(None, protocol=PROTOCOL)
_FLAT_ONE = b"\x00T"
_FLAT_CALL = b"\x00C"
_FLAT_SCALARS = frozenset((str, int, float, bool, type(None)))


def dumps_flat(value: Any) -> Any:
    """``value`` as a flat payload, or ``None`` when it is not one of the two flat shapes of a
    call in a distributed autograd context: one tensor that requires grad (a stage's result;
    the payload is two bytes, nothing pickled), or a call's ``(args, {})`` whose arguments are
    tensors that require grad (each once) and scalars (``str``, ``int``, ``float``, ``bool``,
    ``None``; only they are pickled, by the C pickler, with no persistent ids). Every tensor
    travels as a tracked one, in order: ``(payload, tensors)``. A flat payload begins with a
    zero byte, which no pickle does (protocol 2 and later begin with ``PROTO``, 0x80);
    :func:`loads` reads both shapes and refuses a peer's malformed one."""
    if type(value) is _Tensor:
        if not value.requires_grad:
            return None
        check_carried(value)
        return _FLAT_ONE, [value]
    if not (
        type(value) is tuple and len(value) == 2 and type(value[0]) is tuple
        and type(value[1]) is dict and not value[1]
    ):
        return None
    scalars: list = []
    slots: list[int] = []
    tensors: list = []
    for i, a in enumerate(value[0]):
        kind = type(a)
        if kind in _FLAT_SCALARS:
            scalars.append(a)
        elif kind is _Tensor and a.requires_grad and not any(a is t for t in tensors):
            slots.append(i)
            tensors.append(a)
        else:
            return None
    for t in tensors:
        check_carried(t)
    return _FLAT_CALL + pickle.dumps((tuple(scalars), tuple(slots)), protocol=PROTOCOL), tensors


class _ScalarUnpickler(pickle.Unpickler):
    """Reads a flat call's scalars: no global, no persistent id."""

    def find_class(self, module: str, name: str) -> Any:
        raise RefusedError(f"a flat payload names {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedError("a flat payload refers to a tensor by id")


def _loads_flat(payload: bytes, buffers: Sequence[Any], rrefs: Sequence[Any], origin: str) -> Any:
    """A flat payload's value (:func:`dumps_flat`), its tensors the tracked ones received."""
    if rrefs or not all(isinstance(b, _Tensor) for b in buffers):
        raise RefusedError(f"a flat payload from {origin} with untracked tensors or references")
    head = payload[:2]
    if head == _FLAT_ONE and len(payload) == 2:
        if len(buffers) != 1:
            raise RefusedError(f"a flat tensor from {origin} with {len(buffers)} tensors")
        return buffers[0]
    if head != _FLAT_CALL:
        raise RefusedError(f"a malformed flat payload from {origin}")
    try:
        decoded = _ScalarUnpickler(io.BytesIO(payload[2:])).load()
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle raises, or a global
        raise RefusedError(f"a malformed flat payload from {origin}: {e}") from None
    if not (
        type(decoded) is tuple and len(decoded) == 2
        and type(decoded[0]) is tuple and type(decoded[1]) is tuple
        and all(type(x) in _FLAT_SCALARS for x in decoded[0])
    ):
        raise RefusedError(f"a malformed flat payload from {origin}")
    scalars, slots = decoded
    total = len(scalars) + len(slots)
    if len(slots) != len(buffers) or not all(
        type(i) is int and 0 <= i < total for i in slots
    ) or any(a >= b for a, b in zip(slots, slots[1:])):
        raise RefusedError(f"malformed flat tensor positions from {origin}: {slots!r}")
    args: list = []
    tensors, rest = iter(buffers), iter(scalars)
    at = set(slots)
    for i in range(total):
        args.append(next(tensors) if i in at else next(rest))
    return tuple(args), {}


def loads(
    payload: bytes,
    buffers: Sequence[Any],
    rrefs: Sequence[Any] = (),
    *,
    trusted: bool,
    origin: str,
) -> Any:
    """Decodes what a peer sent (``origin`` names it in errors), with the tensors' buffers and
    the native references that came with it: ``RefusedError`` for anything outside the
    allow-list unless ``trusted``. A flat payload (:func:`dumps_flat`) is read without the
    pickle machinery."""
    if payload[:1] == b"\x00":
        return _loads_flat(payload, buffers, rrefs, origin)
    if payload == _NONE and not buffers and not rrefs:
        return None  # (an owner's answer to most calls: what unpickling it gives)
    return _Unpickler(payload, buffers, rrefs, trusted, origin).load()
