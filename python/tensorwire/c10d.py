"""The ``"tensorwire"`` process-group backend for ``torch.distributed``.

Importing this module registers the backend for CPU tensors::

    import torch.distributed as dist
    import tensorwire.c10d  # noqa: F401  (registers "tensorwire")

    dist.init_process_group("tensorwire", init_method="env://")

Every collective runs on tensorwire's Rust process group (``tensorwire._native``): the ranks meet
through the store c10d hands the backend, prove the cluster secret (``TENSORWIRE_SECRET``) and
talk over shared memory on one host and TCP between hosts. Contiguous CPU tensors are read and
written in place; others are copied in and out. Work handles raise torch's own errors
(``DistBackendError``, ``DistNetworkError``, ``DistStoreError``) from ``wait()``.

CUDA tensors are refused: use ``init_process_group("cpu:tensorwire,cuda:nccl")``.

Where this backend differs from gloo, deliberately:

- ``ReduceOp.AVG`` is supported (gloo refuses it); ``PREMUL_SUM`` is not (as gloo).
- A receive from any source (``dist.recv(t)`` without ``src``) cannot report its sender to
  c10d: torch's Python backend API does not forward ``Work.source_rank``. Use
  ``dist.recv(t, src=...)``, or the backend's ``recv_anysource`` work, whose ``source_rank()``
  tells.
"""

from __future__ import annotations

import datetime
import itertools
import os
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C import _distributed_c10d as _c10d
from torch._C._distributed_c10d import ProcessGroup as _C10dProcessGroup
from torch._C._distributed_c10d import ReduceOp

from tensorwire import _native

__all__ = [
    "TensorwireBackend",
    "TensorwireProcessGroup",
    "BACKEND_NAME",
    "new_group",
    "process_group_factory",
]

BACKEND_NAME = "tensorwire"

_REDUCE_OPS = {
    ReduceOp.SUM: "SUM",
    ReduceOp.PRODUCT: "PRODUCT",
    ReduceOp.MIN: "MIN",
    ReduceOp.MAX: "MAX",
    ReduceOp.AVG: "AVG",
    ReduceOp.BAND: "BAND",
    ReduceOp.BOR: "BOR",
    ReduceOp.BXOR: "BXOR",
    ReduceOp.PREMUL_SUM: "PREMUL_SUM",
}

_DTYPES = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}

_warned_insecure = False


def _torch_error(e: _native.TensorwireError) -> Exception:
    """torch's exception for a native failure, with tensorwire's message."""
    kind, message = e.args[0], e.args[1]
    if kind == "argument":
        # gloo's own argument checks raise RuntimeError (c10::Error); so does this backend.
        return RuntimeError(message)
    if kind == "unsupported":
        return RuntimeError(message)
    if kind == "network":
        return dist.DistNetworkError(message)
    if kind == "store":
        return dist.DistStoreError(message)
    return dist.DistBackendError(message)


def _seconds(timeout) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout)
    # c10d passes its "no timeout" sentinel as a zero or negative duration.
    return seconds if seconds > 0 else None


def _call(fn, *args):
    """Runs a native call that issues work, mapping its error at the call."""
    try:
        return fn(*args)
    except _native.TensorwireError as e:
        raise _torch_error(e) from e


class _Work(dist._Work):
    """A c10d work handle over a native one: ``wait()`` raises the mapped error."""

    def __init__(
        self,
        native: _native.Work,
        result: Optional[list] = None,
        after: Optional[Callable[[], None]] = None,
    ):
        super().__init__()
        self._native = native
        self._result = result if result is not None else []
        self._after = after
        self._source: Optional[int] = None

    def wait(self, timeout=None) -> bool:
        try:
            source = self._native.wait(_seconds(timeout))
        except _native.TensorwireError as e:
            raise _torch_error(e) from e
        if source is not None:
            self._source = source
        after, self._after = self._after, None
        if after is not None:
            after()
        return True

    def is_completed(self) -> bool:
        return self._native.is_completed()

    def is_success(self) -> bool:
        return self._native.is_success()

    def exception(self) -> Optional[Exception]:
        """The failure as torch's exception (not raised), once the operation ended with one;
        ``None`` while it runs or after it succeeded. Never waits."""
        native = self._native.exception()
        return None if native is None else _torch_error(native)

    def result(self) -> list:
        """The tensors the operation wrote (after ``wait()``)."""
        return self._result

    def source_rank(self) -> int:
        """The rank a receive from any source got its message from (after ``wait()``)."""
        if self._source is None:
            self.wait()
        if self._source is None:
            raise RuntimeError("source_rank() is only known for a receive from any source")
        return self._source

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()

        def ended() -> None:
            try:
                self.wait()
            except Exception as e:  # handed to the future's waiters
                future.set_exception(e)
            else:
                future.set_result(self._result)

        if self._after is None:
            # Success completes the future from Rust; a failure goes through ended().
            self._native.resolve(future, self._result, ended)
        else:
            self._native.add_done_callback(ended)
        return future


class _Finished:
    """A native-shaped work that has already succeeded (an operation with nothing to do)."""

    def wait(self, timeout=None):
        return None

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def add_done_callback(self, callback):
        callback()

    def resolve(self, future, value, otherwise):
        future.set_result(value)


def _done(result: Optional[list] = None) -> _Work:
    return _Work(_Finished(), result)


class TensorwireBackend(_C10dBackend):
    """The ``"tensorwire"`` backend of one rank in one process group."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, group_name: str):
        super().__init__(rank, size)
        options = [("group_name", group_name)]
        if not os.environ.get("TENSORWIRE_SECRET"):
            global _warned_insecure
            if not _warned_insecure:
                warnings.warn(
                    "tensorwire: TENSORWIRE_SECRET is not set, so the ranks' connections are "
                    "not authenticated; set the same secret on every rank",
                    RuntimeWarning,
                    stacklevel=3,
                )
                _warned_insecure = True
            options.append(("insecure", "true"))
        debug = os.environ.get("TENSORWIRE_DEBUG") or os.environ.get("TORCH_DISTRIBUTED_DEBUG")
        if debug:
            options.append(("debug", debug.lower()))
        seconds = _seconds(timeout) or 30 * 60.0
        self._timeout = timeout
        try:
            self._pg = _native.ProcessGroupHandle.connect(store, rank, size, seconds, options)
        except _native.TensorwireError as e:
            raise _torch_error(e) from e

    # -- c10d's backend interface -------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def options(self):
        options = _C10dBackend.Options(BACKEND_NAME, timeout=self._timeout)
        return options

    @property
    def supports_splitting(self) -> bool:
        return True

    @property
    def supports_coalescing(self) -> bool:
        return False

    def _check(self, tensors, what: str) -> None:
        dtype = None
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}: expected tensors, got {type(t).__name__}")
            if not t.is_cpu:
                raise RuntimeError(
                    f"{what}: the tensorwire backend works on CPU tensors, not {t.device}; for "
                    "CUDA tensors initialize with backend=\"cpu:tensorwire,cuda:nccl\""
                )
            if t.layout != torch.strided:
                raise RuntimeError(f"{what}: the tensorwire backend does not take sparse tensors")
            if t.dtype not in _DTYPES:
                raise RuntimeError(f"{what}: the tensorwire backend does not support {t.dtype}")
            if dtype is None:
                dtype = t.dtype
            elif t.dtype != dtype:
                raise RuntimeError(f"{what}: tensors must all have the same type, got {dtype} and {t.dtype}")

    def _root(self, root: int, what: str) -> int:
        if not 0 <= root < self.size():
            raise RuntimeError(f"{what}: invalid root rank {root} for a group of {self.size()}")
        return root

    @staticmethod
    def _op(opts, what: str) -> str:
        op = _REDUCE_OPS.get(opts.reduceOp.op)
        if op is None or op == "PREMUL_SUM":
            raise RuntimeError(f"{what}: the tensorwire backend does not support {opts.reduceOp.op}")
        return op

    @staticmethod
    def _contiguous(tensors):
        """The tensors as contiguous ones, and what copies the results back."""
        out, back = [], []
        for t in tensors:
            if t.is_contiguous():
                out.append(t)
            else:
                c = t.contiguous()
                out.append(c)
                back.append((t, c))
        if not back:
            return out, None

        def copy_back() -> None:
            for t, c in back:
                t.copy_(c)

        return out, copy_back

    def allreduce(self, tensors, opts):
        self._check(tensors, "allreduce")
        op = self._op(opts, "allreduce")
        flat, back = self._contiguous(tensors)
        if not flat:
            return _done(tensors)
        return _Work(_call(self._pg.all_reduce, flat, str(flat[0].dtype), op), tensors, back)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        self._check(tensors, "reduce")
        op = self._op(opts, "reduce")
        root = self._root(opts.rootRank, "reduce")
        flat, back = self._contiguous(tensors)
        return _Work(_call(self._pg.reduce, flat, str(flat[0].dtype), op, root), tensors, back)

    def broadcast(self, tensors, opts):
        self._check(tensors, "broadcast")
        root = self._root(opts.rootRank, "broadcast")
        flat, back = self._contiguous(tensors)
        return _Work(_call(self._pg.broadcast, flat, root), tensors, back)

    def allgather(self, output_lists, inputs, opts):
        self._check(inputs, "allgather")
        if len(output_lists) != len(inputs):
            raise RuntimeError("allgather: requires an output list for every input tensor")
        outs, backs = [], []
        for outputs, inp in zip(output_lists, inputs):
            self._check(outputs, "allgather")
            if len(outputs) != self.size():
                raise RuntimeError(
                    f"allgather: the output list holds {len(outputs)} tensors for a group of {self.size()}"
                )
            for o in outputs:
                if o.dtype != inp.dtype or o.numel() != inp.numel():
                    raise RuntimeError("allgather: every output must match the input's type and size")
            flat, back = self._contiguous(outputs)
            outs.append(flat)
            if back:
                backs.append(back)
        ins, _ = self._contiguous(inputs)
        after = (lambda: [b() for b in backs]) if backs else None
        return _Work(_call(self._pg.all_gather, outs, ins), output_lists, after)

    def allgather_coalesced(self, output_lists, inputs, opts):
        # c10d's layout: output_lists[r][i] gets rank r's input i.
        self._check(inputs, "allgather_coalesced")
        per_input = [[output_lists[r][i] for r in range(self.size())] for i in range(len(inputs))]
        return self.allgather(per_input, inputs, opts)

    def all_gather_single(self, output, inp, opts):
        self._check([output, inp], "all_gather_into_tensor")
        if output.numel() != inp.numel() * self.size():
            raise RuntimeError(
                "all_gather_into_tensor: output tensor size must be equal to world_size times "
                "input tensor size"
            )
        (out,), back = self._contiguous([output])
        (i,), _ = self._contiguous([inp])
        return _Work(_call(self._pg.all_gather_into, out, i), [output], back)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Chain(works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts):
        self._check(outputs, "reduce_scatter")
        op = self._op(opts, "reduce_scatter")
        works = []
        for out, inputs in zip(outputs, input_lists):
            if len(inputs) != self.size():
                raise RuntimeError(
                    f"reduce_scatter: the input list holds {len(inputs)} tensors for a group of {self.size()}"
                )
            self._check(list(inputs) + [out], "reduce_scatter")
            counts = [t.numel() for t in inputs]
            if counts[self.rank()] != out.numel():
                raise RuntimeError("reduce_scatter: the output must match this rank's input in size")
            flat = torch.cat([t.reshape(-1) for t in inputs])
            works.append(self._reduce_scatter(out, flat, counts, op))
        return _Chain(works, outputs)

    def _reduce_scatter(self, output, flat, counts, op):
        (out,), back = self._contiguous([output])
        native = _call(self._pg.reduce_scatter, out, flat, counts, str(flat.dtype), op)
        return _Work(native, [output], back)

    def reduce_scatter_single(self, output, inp, opts):
        self._check([output, inp], "reduce_scatter_tensor")
        op = self._op(opts, "reduce_scatter_tensor")
        if inp.numel() != output.numel() * self.size():
            raise RuntimeError(
                "reduce_scatter_tensor: input tensor must be the same size as output size "
                "times world size"
            )
        (flat,), _ = self._contiguous([inp])
        return self._reduce_scatter(output, flat, [output.numel()] * self.size(), op)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Chain(works, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall(self, outputs, inputs, opts):
        self._check(list(outputs) + list(inputs), "alltoall")
        if len(outputs) != self.size() or len(inputs) != self.size():
            raise RuntimeError(f"alltoall: requires {self.size()} input and output tensors")
        outs, back = self._contiguous(outputs)
        ins, _ = self._contiguous(inputs)
        return _Work(_call(self._pg.all_to_all, outs, ins), outputs, back)

    def all_to_all_single(self, output, inp, output_splits, input_splits, opts):
        self._check([output, inp], "alltoall_base")
        size = self.size()

        def byte_splits(t, splits, what):
            row = t.element_size() * (t.numel() // t.size(0) if t.dim() and t.size(0) else 0)
            if not splits:
                if t.dim() == 0 or t.size(0) % size != 0:
                    raise RuntimeError(f"alltoall_base: {what} size is not divisible by the world size")
                return [t.size(0) // size * row] * size
            if len(splits) != size:
                raise RuntimeError(f"alltoall_base: {what} split sizes must have {size} entries")
            if sum(splits) != (t.size(0) if t.dim() else 0):
                raise RuntimeError(f"alltoall_base: {what} split sizes do not add up to its first dimension")
            return [s * row for s in splits]

        out_b = byte_splits(output, list(output_splits), "output")
        in_b = byte_splits(inp, list(input_splits), "input")
        (out,), back = self._contiguous([output])
        (i,), _ = self._contiguous([inp])
        return _Work(_call(self._pg.all_to_all_single, out, i, out_b, in_b), [output], back)

    alltoall_base = all_to_all_single

    def gather(self, output_lists, inputs, opts):
        self._check(inputs, "gather")
        root = self._root(opts.rootRank, "gather")
        if len(inputs) != 1:
            raise RuntimeError("gather: requires a single-element input list")
        outputs = []
        if self.rank() == root:
            if len(output_lists) != 1 or len(output_lists[0]) != self.size():
                raise RuntimeError(
                    f"gather: requires a single-element output list containing a list with {self.size()} tensors"
                )
            outputs = output_lists[0]
            self._check(list(outputs) + list(inputs), "gather")
            for o in outputs:
                if o.numel() != inputs[0].numel():
                    raise RuntimeError("gather: every output must match the input's size")
        elif output_lists and any(len(l) for l in output_lists):
            raise RuntimeError("gather: requires empty output on non-root")
        outs, back = self._contiguous(outputs)
        (i,), _ = self._contiguous(inputs)
        return _Work(_call(self._pg.gather, outs, i, root), output_lists, back)

    def scatter(self, outputs, input_lists, opts):
        self._check(outputs, "scatter")
        root = self._root(opts.rootRank, "scatter")
        if len(outputs) != 1:
            raise RuntimeError("scatter: requires a single-element output list")
        inputs = []
        if self.rank() == root:
            if len(input_lists) != 1 or len(input_lists[0]) != self.size():
                raise RuntimeError(
                    f"scatter: requires a single-element input list containing a list with {self.size()} tensors"
                )
            inputs = input_lists[0]
            self._check(list(inputs) + list(outputs), "scatter")
            for t in inputs:
                if t.numel() != outputs[0].numel():
                    raise RuntimeError("scatter: every input must match the output's size")
        elif input_lists and any(len(l) for l in input_lists):
            raise RuntimeError("scatter: requires empty input on non-root")
        (out,), back = self._contiguous(outputs)
        ins, _ = self._contiguous(inputs)
        return _Work(_call(self._pg.scatter, out, ins, root), outputs, back)

    def barrier(self, opts):
        return _Work(_call(self._pg.barrier))

    def monitored_barrier(self, opts, wait_all_ranks):
        return _Work(_call(self._pg.monitored_barrier, _seconds(opts.timeout), bool(wait_all_ranks)))

    def _peer(self, peer: int, what: str) -> int:
        if not 0 <= peer < self.size():
            raise RuntimeError(f"{what}: invalid rank {peer} for a group of {self.size()}")
        return peer

    @staticmethod
    def _tag(tag: int) -> int:
        if not 0 <= tag < 2**32:
            raise RuntimeError(f"tag {tag} is out of range (0 to 2**32 - 1)")
        return tag

    def send(self, tensors, dst, tag=0):
        self._check(tensors, "send")
        flat, _ = self._contiguous(tensors)
        return _Work(_call(self._pg.send, flat, self._peer(dst, "send"), self._tag(tag)), tensors)

    def recv(self, tensors, src, tag=0):
        self._check(tensors, "recv")
        flat, back = self._contiguous(tensors)
        return _Work(_call(self._pg.recv, flat, self._peer(src, "recv"), self._tag(tag)), tensors, back)

    def recv_anysource(self, tensors, tag=0):
        self._check(tensors, "recv")
        flat, back = self._contiguous(tensors)
        return _Work(_call(self._pg.recv, flat, None, self._tag(tag)), tensors, back)

    def split(self, store, ranks, opts):
        """A backend for the group of ``ranks`` (group ranks of this one), or ``None`` here."""
        ranks = list(ranks)
        if self.rank() not in ranks:
            return None
        name = f"{self._pg.name}/split-{'-'.join(map(str, ranks))}"
        timeout = getattr(opts, "_timeout", None) if opts is not None else None
        return TensorwireBackend(store, ranks.index(self.rank()), len(ranks), timeout or self._timeout, name)

    def shutdown(self) -> None:
        self._pg.shutdown()

    def abort(self) -> None:
        self._pg.shutdown()


class _Chain(dist._Work):
    """Several works as one (the coalesced forms): waits for each in order."""

    def __init__(self, works, result):
        super().__init__()
        self._works = works
        self._result = result

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> Optional[Exception]:
        return next((e for e in (w.exception() for w in self._works) if e is not None), None)

    def result(self) -> list:
        return self._result

    def get_future(self) -> torch.futures.Future:
        futures = [w.get_future() for w in self._works]
        result = self._result
        return torch.futures.collect_all(futures).then(lambda _: result) if futures else _done(result).get_future()


_DIST2_GROUPS = itertools.count()


def _options(kind):
    def make(opts):
        return opts if opts is not None else kind()

    return make


def _delegate(name: str, options, opts_at: int):
    """A method of :class:`TensorwireProcessGroup` that runs the backend's ``name`` with the
    arguments c10d passes (``opts_at``: where its options go; a missing one gets defaults)."""

    def method(self, *args, opts=None):
        args = list(args)
        if len(args) > opts_at:
            opts = args.pop(opts_at)
        return getattr(self._tensorwire, name)(*args, options(opts))

    method.__name__ = name
    method.__doc__ = f"The backend's ``{name}``: returns a work handle (see the class)."
    return method


class TensorwireProcessGroup(_C10dProcessGroup):
    """A process group on the tensorwire backend made the way ``torch.distributed._dist2``
    makes one (:func:`new_group`, :func:`process_group_factory`): not registered with
    ``torch.distributed``'s global state, used through its own methods or passed as ``group=``
    to ``torch.distributed``'s functions.

    Its operations return tensorwire's work handles themselves: ``wait(timeout)`` raises torch's
    error, ``is_completed()``, ``is_success()`` and ``exception()`` (the error, not raised) tell
    the operation's state without waiting, ``get_future()`` completes when it ends. (A group
    that only registers a Python backend, as ``init_process_group`` makes, hands out c10d's
    wrapper of the handle instead, which forwards ``wait`` and ``get_future`` but says
    ``is_completed() == False`` and ``exception() is None`` forever.)
    """

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, name: str):
        super().__init__(store, rank, size)
        self._tensorwire = TensorwireBackend(store, rank, size, timeout, name)
        self._set_default_backend(_C10dProcessGroup.BackendType.CUSTOM)
        self._register_backend(torch.device("cpu"), _C10dProcessGroup.BackendType.CUSTOM, self._tensorwire)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    allreduce = _delegate("allreduce", _options(_c10d.AllreduceOptions), 1)
    allreduce_coalesced = _delegate("allreduce_coalesced", _options(_c10d.AllreduceCoalescedOptions), 1)
    broadcast = _delegate("broadcast", _options(_c10d.BroadcastOptions), 1)
    reduce = _delegate("reduce", _options(_c10d.ReduceOptions), 1)
    allgather = _delegate("allgather", _options(_c10d.AllgatherOptions), 2)
    allgather_coalesced = _delegate("allgather_coalesced", _options(_c10d.AllgatherOptions), 2)
    all_gather_single = _delegate("all_gather_single", _options(_c10d.AllgatherOptions), 2)
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = _delegate(
        "allgather_into_tensor_coalesced", _options(_c10d.AllgatherOptions), 2
    )
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter = _delegate("reduce_scatter", _options(_c10d.ReduceScatterOptions), 2)
    reduce_scatter_single = _delegate("reduce_scatter_single", _options(_c10d.ReduceScatterOptions), 2)
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = _delegate(
        "reduce_scatter_tensor_coalesced", _options(_c10d.ReduceScatterOptions), 2
    )
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    alltoall = _delegate("alltoall", _options(_c10d.AllToAllOptions), 2)
    all_to_all_single = _delegate("all_to_all_single", _options(_c10d.AllToAllOptions), 4)
    alltoall_base = all_to_all_single
    gather = _delegate("gather", _options(_c10d.GatherOptions), 2)
    scatter = _delegate("scatter", _options(_c10d.ScatterOptions), 2)
    barrier = _delegate("barrier", _options(_c10d.BarrierOptions), 0)

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        """The backend's ``monitored_barrier`` (``timeout``: a ``timedelta``; ``None``: the group's)."""
        opts = _c10d.BarrierOptions()
        if timeout is not None:
            opts.timeout = timeout
        return self._tensorwire.monitored_barrier(opts, wait_all_ranks)

    def send(self, tensors, dst: int, tag: int = 0):
        """The backend's ``send``."""
        return self._tensorwire.send(tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        """The backend's ``recv``."""
        return self._tensorwire.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        """The backend's ``recv_anysource``."""
        return self._tensorwire.recv_anysource(tensors, tag)

    def shutdown(self) -> None:
        self._tensorwire.shutdown()

    def abort(self) -> None:
        self._tensorwire.abort()


def process_group_factory(
    store, rank: int, world_size: int, timeout: datetime.timedelta, device, **kwargs
) -> TensorwireProcessGroup:
    """``torch.distributed._dist2``'s ``ProcessGroupFactory`` for tensorwire: a
    :class:`TensorwireProcessGroup` of ``world_size`` ranks meeting through ``store``. ``device``
    must be a CPU device; a keyword argument other than ``group_name`` raises ``KeyError`` (as
    ``_dist2``'s factories refuse options they do not know)."""
    device = torch.device(device)
    if device.type != "cpu":
        raise RuntimeError(
            f"the tensorwire backend works on CPU tensors, not {device}; use nccl's factory for CUDA"
        )
    # Groups made on one store need names of their own; every rank makes them in one order.
    name = kwargs.pop("group_name", None) or f"dist2/{next(_DIST2_GROUPS)}"
    if kwargs:
        raise KeyError(f"unknown options for the tensorwire backend: {sorted(kwargs)}")
    return TensorwireProcessGroup(store, rank, world_size, timeout, str(name))


def new_group(
    timeout: datetime.timedelta = datetime.timedelta(minutes=30), device="cpu", **kwargs
) -> TensorwireProcessGroup:
    """``torch.distributed._dist2.new_group("tensorwire", timeout, device, **kwargs)``: a
    process group of the ranks that ``env://`` describes (``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK``, ``WORLD_SIZE``), not registered with ``torch.distributed``'s global state (which
    ``init_process_group`` sets up). See :class:`TensorwireProcessGroup`."""
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(iter(rendezvous("env://")))
    store.set_timeout(timeout)
    return process_group_factory(store, rank, world_size, timeout, device, **kwargs)


def _create(opts, backend_options):
    if opts.split_from is not None and isinstance(opts.split_from, TensorwireBackend):
        return opts.split_from.split(opts.store, opts.global_ranks_in_group, backend_options)
    return TensorwireBackend(
        opts.store,
        opts.group_rank,
        opts.group_size,
        opts.timeout,
        f"c10d/{opts.group_id}",
    )


def _register() -> None:
    if BACKEND_NAME.upper() in dist.Backend.__dict__:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
    try:  # torch versions that ship the experimental _dist2 API
        from torch.distributed import _dist2
    except ImportError:
        return
    if BACKEND_NAME not in getattr(_dist2, "_BACKENDS", {}):
        _dist2.register_backend(BACKEND_NAME, process_group_factory)


_register()
