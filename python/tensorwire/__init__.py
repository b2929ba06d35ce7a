"""tensorwire for PyTorch users.

- ``import tensorwire.c10d`` registers the process-group backend ``"tensorwire"`` for CPU
  tensors, so ``torch.distributed.init_process_group("tensorwire")``, DDP and FSDP2 run on
  tensorwire's Rust runtime unchanged.
"""

from tensorwire._native import __version__

__all__ = ["__version__"]
