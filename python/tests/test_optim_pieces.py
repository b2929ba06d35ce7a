"""The owner's side of ``DistributedOptimizer`` in one process (no workers): which optimizers
step through PyTorch's functional counterpart (``torch.distributed.optim``'s
``functional_optim_map``, as PyTorch's ``DistributedOptimizer`` does), with the class's own
settings, and that they compute what the class computes, bit for bit."""

from __future__ import annotations

import sys
import threading
import warnings

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


def test_building_a_functional_optimizer_warns_nothing():
    # torch's functional constructors force a TorchScript deprecation warning on; none is used.
    params = _params(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for cls, kwargs in MAPPED:
            assert dist_optim._as_functional(cls, cls(params, **kwargs), params) is not None
    assert [str(w.message) for w in seen] == []


def test_building_functional_optimizers_in_threads_leaves_other_threads_warnings_alone():
    # ``warnings.catch_warnings`` swaps process-wide state: built under one (ours or torch's),
    # a warning another thread raises meanwhile can be swallowed, or the filters left changed.
    warm = _params(0)  # torch's lazy imports (sympy's) add filters of their own: done first
    dist_optim._as_functional(torch.optim.SGD, torch.optim.SGD(warm, lr=0.1), warm)
    filters, showwarning = list(warnings.filters), warnings.showwarning
    shown: list[str] = []

    def show(message, *rest, **kw) -> None:
        shown.append(str(message))

    warnings.showwarning = show
    warnings.simplefilter("always")
    set_filters = list(warnings.filters)
    stop = threading.Event()
    built: list[int] = []

    def build() -> None:
        params = _params(0)
        while not stop.is_set():
            dist_optim._as_functional(torch.optim.SGD, torch.optim.SGD(params, lr=0.1), params)
            built.append(1)

    threads = [threading.Thread(target=build) for _ in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave inside each other's constructions
    try:
        for t in threads:
            t.start()
        sent = 0
        while sent < 2000 or len(built) < 1000:  # both sides well inside each other's windows
            warnings.warn(f"mine {sent}", UserWarning)
            sent += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
        after_show, after_filters = warnings.showwarning, list(warnings.filters)
        warnings.filters[:] = filters
        warnings.showwarning = showwarning
        warnings._filters_mutated()
    assert [m for m in shown if m.startswith("mine ")] == [f"mine {i}" for i in range(sent)]
    assert not [m for m in shown if not m.startswith("mine ")]
    # Still as this thread set them: nobody restored a stale copy over them.
    assert after_show is show and after_filters == set_filters
