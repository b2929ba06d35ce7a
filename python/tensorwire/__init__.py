"""tensorwire for PyTorch users.

- ``import tensorwire.c10d`` registers the process-group backend ``"tensorwire"`` for CPU
  tensors, so ``torch.distributed.init_process_group("tensorwire")``, DDP and FSDP2 run on
  tensorwire's Rust runtime unchanged.
- ``import tensorwire.rpc as rpc`` gives ``torch.distributed.rpc``'s API (``init_rpc``,
  ``rpc_sync``, ``rpc_async``, ``remote``, ``RRef``, ``shutdown``) on tensorwire's RPC agent,
  where a peer runs only what this worker exposed.
"""

from tensorwire._native import __version__

__all__ = ["__version__"]
