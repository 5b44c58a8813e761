"""A manually optimized training step, counted: its optimizers' ``zero_grad``/``step`` and its backward in their
own phases of :class:`~.counter.LiveBytes` (see ``manual=`` of :func:`~.steps.count_training_steps`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_memopt.functional.planning.counter import LiveBytes
from lightning_memopt.utilities._torch_private import backward_outside_torch_function

__all__ = ["CountedOptimizer", "counted_backward"]


class CountedOptimizer:
    """An optimizer as a manually optimized step sees it (``self.optimizers()``): ``zero_grad`` and ``step`` are
    counted in their own phases, everything else is the optimizer's.

    Args:
        optimizer: the optimizer it stands for (:attr:`optimizer`, as Lightning's ``LightningOptimizer`` has it).
        counter: the running counter.
        states: called after every ``step`` (the optimizer states are labelled there).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, counter: LiveBytes, states: Callable[[], None]) -> None:
        self.optimizer = optimizer
        self._counter = counter
        self._states = states

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``, counted as the ``zero_grad`` phase."""
        phase, self._counter.phase = self._counter.phase, "zero_grad"
        try:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        finally:
            self._counter.phase = phase

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """The optimizer's ``step``, counted as the ``optimizer step`` phase."""
        phase, self._counter.phase = self._counter.phase, "optimizer step"
        try:
            if closure is not None:
                return self.optimizer.step(closure, **kwargs)
            return self.optimizer.step(**kwargs)
        finally:
            self._states()
            self._counter.phase = phase


def counted_backward(counter: LiveBytes, loss: Tensor, *args: Any, **kwargs: Any) -> None:
    """``loss.backward(*args, **kwargs)`` counted as the ``backward`` phase (a manually optimized step's)."""
    phase, counter.phase = counter.phase, "backward"
    try:
        if args or kwargs:
            loss.backward(*args, **kwargs)
        else:
            backward_outside_torch_function(loss)
    finally:
        counter.phase = phase
