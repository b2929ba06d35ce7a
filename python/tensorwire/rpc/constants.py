"""``torch.distributed.rpc.constants``: the defaults of ``tensorwire.rpc``, by PyTorch's names."""

#: A call's timeout argument that means "the agent's default" (PyTorch's value).
UNSET_RPC_TIMEOUT: float = -1.0
#: The default call timeout in seconds (PyTorch's).
DEFAULT_RPC_TIMEOUT_SEC: float = 60.0
#: How long ``init_rpc`` waits for the whole group.
DEFAULT_INIT_TIMEOUT_SEC: float = 300.0
#: The bound on a graceful shutdown given ``timeout=0`` (PyTorch's default argument).
DEFAULT_SHUTDOWN_TIMEOUT: float = 300.0
#: PyTorch's default number of worker threads (accepted and ignored: see
#: ``TensorPipeRpcBackendOptions``).
DEFAULT_NUM_WORKER_THREADS: int = 16
