"""tensorwire.rpc's own values that travel: ``WorkerInfo``."""

from __future__ import annotations

# (Imported here, not in ``__init__``: an import inside a function runs importlib's
# ``_handle_fromlist`` in Python at every call.)
from tensorwire import _native


class WorkerInfo:
    """A worker of the group: its ``name`` and ``id`` (its rank), as PyTorch's ``WorkerInfo``."""

    __slots__ = ("name", "id")

    def __init__(self, name: str, id: int):
        try:
            _native.check_worker_name(name)
        except _native.TensorwireError as e:
            raise RuntimeError(e.args[1]) from None
        self.name = name
        self.id = id

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self) -> int:
        return hash((self.name, self.id))

    def __reduce__(self):
        return (WorkerInfo, (self.name, self.id))
