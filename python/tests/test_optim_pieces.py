"""The owner's side of ``DistributedOptimizer`` in one process (no workers): which optimizers
step through PyTorch's functional counterpart (``torch.distributed.optim``'s
``functional_optim_map``, as PyTorch's ``DistributedOptimizer`` does), with the class's own
settings, and that they compute what the class computes, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tensorwire.rpc import optim as dist_optim

# (class, arguments): each mapped class, some with settings that are not the defaults.
MAPPED = [
    (torch.optim.SGD, {}),  # the class's lr (1e-3), not the functional class's (1e-2)
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.05, "amsgrad": True}),
    (torch.optim.Adadelta, {"rho": 0.95}),
    (torch.optim.RMSprop, {"lr": 0.05, "momentum": 0.5, "centered": True}),
    (torch.optim.Rprop, {"lr": 0.05}),
    (torch.optim.Adamax, {}),  # the class's lr (2e-3), not the functional class's (1e-3)
]


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g).requires_grad_(), torch.randn(3, generator=g).requires_grad_()]


@pytest.mark.parametrize("cls,kwargs", MAPPED, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_mapped_optimizer_steps_functionally_as_the_class_does(cls, kwargs):
    mine, theirs = _params(0), _params(0)
    optim = cls(mine, **kwargs)
    functional = dist_optim._as_functional(cls, optim, mine)
    assert functional is not None and type(functional).__name__.startswith("_Functional")
    # On CPU tensors torch's per-step choice of kernels (``None``) is made once: none.
    assert functional.foreach is False and getattr(functional, "fused", False) is False
    reference = cls(theirs, **kwargs)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=g) for p in mine]
        if step == 2:
            grads[1] = None  # a parameter the pass did not reach
        functional.step(grads)
        for p, grad in zip(theirs, grads):
            p.grad = grad
        reference.step()
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in mine)  # as in PyTorch: no .grad on the owner


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (torch.optim.SGD, {"lr": 0.1, "differentiable": True}),
        (torch.optim.Adam, {"lr": 0.1, "capturable": True}),
        (torch.optim.Adam, {"lr": 0.1, "decoupled_weight_decay": True}),
    ],
    ids=["sgd-differentiable", "adam-capturable", "adam-decoupled"],
)
def test_a_setting_only_the_class_has_keeps_the_class(cls, kwargs):
    params = _params(0)
    assert dist_optim._as_functional(cls, cls(params, **kwargs), params) is None


def test_an_unmapped_optimizer_keeps_the_class():
    params = _params(0)
    assert dist_optim._as_functional(torch.optim.LBFGS, torch.optim.LBFGS(params), params) is None
    # Mapped by PyTorch, but its functional class fails on a parameter without a gradient.
    assert dist_optim._as_functional(torch.optim.Adagrad, torch.optim.Adagrad(params), params) is None

    class Mine(torch.optim.SGD):
        pass

    assert dist_optim._as_functional(Mine, Mine(params, lr=0.1), params) is None
