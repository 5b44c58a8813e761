"""How :func:`~lightning_memopt.planner.estimate_memory` trains the user's model: loss, optimizers, checkpointing."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_memopt.utilities.checks import check_bool

__all__ = [
    "EVALUATION_HOOKS",
    "MemoryEstimateError",
    "StandInTrainer",
    "checkpointing_prepare",
    "evaluation_step_function",
    "is_lightning_module",
    "is_manual_optimization",
    "make_optimizers",
    "manual_optimization",
    "manual_step_function",
    "step_function",
]


class MemoryEstimateError(RuntimeError):
    """The step could not be estimated; the message says why and what to do.

    Raised by :func:`~lightning_memopt.estimate_memory` (and :func:`~lightning_memopt.plan_memory`) when the step
    cannot run on fake tensors (the cause is a :class:`~lightning_memopt.functional.planning.FakeStepError`), the
    optimizer cannot be built, the training step returns no loss, or the checkpointing matches no submodule.

    Examples:
        >>> try:
        ...     raise MemoryEstimateError("the training step returned str, not a loss tensor.")
        ... except RuntimeError as err:
        ...     print(err)
        the training step returned str, not a loss tensor.
    """


def is_lightning_module(module: nn.Module) -> bool:
    """Whether ``module`` is a LightningModule, by its class hierarchy (Lightning is not imported for a plain module).

    Examples:
        >>> is_lightning_module(nn.Linear(2, 2))
        False
    """
    return any(
        cls.__name__ == "LightningModule" and cls.__module__.startswith(("lightning.pytorch", "pytorch_lightning"))
        for cls in type(module).__mro__
    )


def is_manual_optimization(module: nn.Module) -> bool:
    """Whether ``module`` is a LightningModule that optimizes itself (``automatic_optimization = False``).

    Examples:
        >>> is_manual_optimization(nn.Linear(2, 2))
        False
    """
    return is_lightning_module(module) and not getattr(module, "automatic_optimization", True)


def _loss_of(output: Any) -> Tensor:
    """The loss in a step's output: ``output["loss"]``, ``output.loss``, ``output[0]`` or the output; summed if not
    a scalar."""
    if isinstance(output, dict) and "loss" in output:
        output = output["loss"]
    elif getattr(output, "loss", None) is not None and not isinstance(output, Tensor):
        output = output.loss
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        output = output[0]
    if not isinstance(output, Tensor):
        raise MemoryEstimateError(
            f"the training step returned {type(output).__name__}, not a loss tensor. Return the loss (or a dict with"
            " 'loss'), or pass `loss_fn=`."
        )
    if output.dim() == 0:
        return output
    return output.float().sum()


def _call_module(module: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def step_function(
    loss_fn: Callable[[nn.Module, Any], Tensor] | None, lightning: bool
) -> Callable[[nn.Module, Any, int], Tensor]:
    """``step_fn(model, batch, batch_idx) -> loss``: ``loss_fn``, else ``training_step``, else the model's call.

    Examples:
        >>> step = step_function(None, lightning=False)
        >>> step(nn.Linear(3, 2), torch.ones(4, 3), 0).shape  # the output summed to a scalar
        torch.Size([])
    """
    if loss_fn is not None:
        return lambda model, batch, batch_idx: _loss_of(loss_fn(model, batch))
    if lightning:
        # a LightningModule (found by its class hierarchy): its training_step, as the Trainer calls it
        return lambda model, batch, batch_idx: _loss_of(cast(Any, model).training_step(batch, batch_idx))
    return lambda model, batch, batch_idx: _loss_of(_call_module(model, batch))


class StandInTrainer:
    """What ``configure_optimizers`` may ask its Trainer during an estimate, answered from the estimate's arguments.

    A warmup schedule reads ``self.trainer.estimated_stepping_batches`` (Lightning's GLUE tutorial); the optimizer's
    memory does not depend on the answer, only on the optimizer being built. The estimate runs ``steps`` optimizer
    steps of one epoch on ``world_size`` devices of one node, as rank 0. Anything else a Trainer has is an
    ``AttributeError`` that names the attribute.

    Examples:
        >>> trainer = StandInTrainer(steps=2, accumulate_grad_batches=4, world_size=8, precision="bf16-mixed")
        >>> trainer.estimated_stepping_batches, trainer.num_training_batches, trainer.world_size, trainer.global_step
        (2, 8, 8, 0)
    """

    def __init__(self, *, steps: int, accumulate_grad_batches: int, world_size: int, precision: str) -> None:
        self.max_steps = self.estimated_stepping_batches = steps
        self.num_training_batches = steps * accumulate_grad_batches
        self.accumulate_grad_batches = accumulate_grad_batches
        self.world_size = self.num_devices = world_size
        self.precision = precision
        self.max_epochs, self.num_nodes = 1, 1
        self.current_epoch = self.global_step = self.global_rank = self.local_rank = self.node_rank = 0
        self.is_global_zero, self.training = True, True
        self.sanity_checking = self.fast_dev_run = False
        self.logger, self.datamodule = None, None
        self.loggers: list[Any] = []
        self.callbacks: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"the stand-in Trainer of the estimate has no `{name}` (it answers estimated_stepping_batches, max_steps,"
            " max_epochs, world_size, num_devices, accumulate_grad_batches, precision and the like)"
        )


def _configure_optimizers(module: nn.Module, trainer: StandInTrainer | None) -> Any:
    """``module.configure_optimizers()``, with ``trainer`` as its Trainer while it runs (a module attached to a real
    Trainer keeps it)."""
    attached = getattr(module, "_trainer", None)
    if trainer is None or attached is not None:
        return cast(Any, module).configure_optimizers()
    cast(Any, module).trainer = trainer
    try:
        return cast(Any, module).configure_optimizers()
    finally:
        cast(Any, module).trainer = None


#: The LightningModule hook each evaluation stage runs (Lightning's ``trainer.validate/test/predict``).
EVALUATION_HOOKS = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}


def _overrides(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s class defines ``name`` itself, above Lightning's own LightningModule."""
    for cls in type(module).__mro__:
        if cls.__name__ == "LightningModule":
            return False
        if name in vars(cls):
            return True
    return False


#: The Python-only alternative an evaluation error offers (the command line has no loss function to pass).
_LOSS_FN_INSTEAD = ", or pass `loss_fn=` (run in inference mode)"


def evaluation_step_function(
    stage: str, loss_fn: Callable[[nn.Module, Any], Any] | None, module: nn.Module
) -> Callable[[nn.Module, Any, int], Any]:
    """``step_fn(model, batch, batch_idx) -> output`` of an evaluation ``stage``: ``loss_fn``, else the
    LightningModule's ``validation_step``/``test_step``/``predict_step``, else the model's call.

    Raises:
        MemoryEstimateError: a LightningModule without the stage's step (Lightning would skip the stage or fail).

    Examples:
        >>> step = evaluation_step_function("validate", None, nn.Linear(3, 2))
        >>> step(nn.Linear(3, 2), torch.ones(4, 3), 0).shape
        torch.Size([4, 2])
    """
    if loss_fn is not None:
        return lambda model, batch, batch_idx: loss_fn(model, batch)
    if not is_lightning_module(module):
        return lambda model, batch, batch_idx: _call_module(model, batch)
    hook = EVALUATION_HOOKS[stage]
    if stage != "predict" and not _overrides(module, hook):  # predict_step calls the module by default
        raise MemoryEstimateError(
            f"`stage`={stage!r}, but {type(module).__name__} has no `{hook}`: Lightning would not run the stage."
            f" Define `{hook}`{_LOSS_FN_INSTEAD}."
        )
    return lambda model, batch, batch_idx: getattr(model, hook)(batch, batch_idx)


def _lightning_optimizers(
    module: nn.Module, schedulers: list[Any] | None = None, trainer: StandInTrainer | None = None
) -> list[torch.optim.Optimizer]:
    """The optimizers of ``module.configure_optimizers()`` (any of Lightning's return forms), run against ``trainer``;
    its LR schedulers are appended to ``schedulers``."""
    try:
        config = _configure_optimizers(module, trainer)
    except Exception as err:  # the user's hook, run without a real Trainer: the documented answer is `optimizer=`
        raise MemoryEstimateError(
            f"`{type(module).__name__}.configure_optimizers()` failed outside a Trainer ({type(err).__name__}: {err})."
            " Pass `optimizer` (e.g. `functools.partial(torch.optim.AdamW, lr=1e-4)`)."
        ) from err
    found: list[torch.optim.Optimizer] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.optim.Optimizer):
            found.append(value)
        elif isinstance(value, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            if schedulers is not None:
                schedulers.append(value)
        elif isinstance(value, dict):
            collect(value.get("optimizer"))
            collect(value.get("scheduler", value.get("lr_scheduler")))
        elif isinstance(value, (tuple, list)):
            for item in value:
                collect(item)

    collect(config)
    if not found:
        raise MemoryEstimateError(
            f"`{type(module).__name__}.configure_optimizers()` returned no optimizer ({config!r}). Pass `optimizer`."
        )
    return found


def make_optimizers(
    optimizer: Callable[[Any], torch.optim.Optimizer] | None,
    lightning: bool,
    schedulers: list[Any] | None = None,
    trainer: StandInTrainer | None = None,
) -> Callable[[nn.Module], list[torch.optim.Optimizer]]:
    """``make(model) -> optimizers``: ``optimizer(trainable parameters)``, else ``configure_optimizers()`` of a
    LightningModule (run against ``trainer``; its LR schedulers are appended to ``schedulers``), else ``AdamW`` over
    the trainable parameters.

    Examples:
        >>> [type(o).__name__ for o in make_optimizers(None, lightning=False)(nn.Linear(2, 2))]
        ['AdamW']
    """

    def make(model: nn.Module) -> list[torch.optim.Optimizer]:
        if optimizer is None:
            if lightning:
                return _lightning_optimizers(model, schedulers, trainer)
            return [torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)]
        built = optimizer(p for p in model.parameters() if p.requires_grad)
        if not isinstance(built, torch.optim.Optimizer):
            raise MemoryEstimateError(
                f"`optimizer` must build a torch.optim.Optimizer from the parameters, got {type(built).__name__}."
                " Example: `optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)`."
            )
        return [built]

    return make


def checkpointing_prepare(
    gradient_checkpointing: bool, checkpoint_modules: Sequence[type[nn.Module] | str] | None = None
) -> Callable[[nn.Module], None] | None:
    """``prepare(model)`` that turns activation checkpointing on as asked; ``None`` when it is off.

    Without ``checkpoint_modules`` as :class:`~lightning_memopt.GradientCheckpointing` does by default (the model's
    own switch, else PyTorch transformer layers); with block classes or name patterns, those blocks (wrapped even
    where the model has a switch). ``prepare`` raises :class:`MemoryEstimateError` when nothing is checkpointed.

    Examples:
        >>> checkpointing_prepare(False) is None
        True
        >>> checkpointing_prepare(True, ["missing.*"])(nn.Sequential(nn.Linear(2, 2)))
        Traceback (most recent call last):
        ...
        lightning_memopt.planner.model_step.MemoryEstimateError: `checkpoint_modules`=('missing.*',) matched no ...
    """
    from lightning_memopt.functional.checkpointing import wrap_checkpointing
    from lightning_memopt.functional.presets import normalize_checkpoint_modules

    check_bool("gradient_checkpointing", gradient_checkpointing, hint="Name the blocks with `checkpoint_modules`.")
    modules = normalize_checkpoint_modules(checkpoint_modules)
    if not gradient_checkpointing:
        if modules is not None:
            raise ValueError(
                f"`checkpoint_modules`={modules!r} with `gradient_checkpointing=False`: nothing would be"
                " checkpointed. Pass `gradient_checkpointing=True` to checkpoint those blocks, or drop"
                " `checkpoint_modules`."
            )
        return None

    def prepare(model: nn.Module) -> None:
        # as the callback does at setup, `use_cache` off included (a cache filled in a checkpointed block breaks its
        # recomputation); the twin is thrown away after the estimate, so nothing is given back
        handle = wrap_checkpointing(model, modules)
        if handle.used_switch or handle.wrapped_names or handle.already_wrapped_names:
            return
        what = f"`checkpoint_modules`={modules!r}" if modules else "`gradient_checkpointing=True` (the default blocks)"
        raise MemoryEstimateError(
            f"{what} matched no submodule of {type(model).__name__}. Pass the block classes or name patterns to"
            " checkpoint, e.g. `checkpoint_modules=[nn.TransformerEncoderLayer]`."
        )

    return prepare


def _one_or_list(values: list[Any]) -> Any:
    """Lightning's return form: ``None`` for none, the value for one, else the list."""
    if not values:
        return None
    return values[0] if len(values) == 1 else list(values)


def _toggle_optimizer(raw: list[Any], saved: dict[Tensor, bool], optimizer: Any) -> None:
    """Lightning's toggle: only the parameters of ``optimizer`` keep ``requires_grad``; ``saved`` keeps the rest."""
    saved.clear()
    params = [p for opt in raw for group in opt.param_groups for p in group["params"]]
    for param in params:
        if param not in saved:
            saved[param] = param.requires_grad
            param.requires_grad = False
    for group in getattr(optimizer, "optimizer", optimizer).param_groups:
        for param in group["params"]:
            param.requires_grad = saved[param]


def _untoggle_optimizer(saved: dict[Tensor, bool], optimizer: Any) -> None:
    for param, requires_grad in saved.items():
        param.requires_grad = requires_grad
    saved.clear()


def manual_optimization(schedulers: list[Any]) -> Callable[[nn.Module, list[Any], Callable[..., None]], None]:
    """``bind(model, optimizers, backward)``: what a manually optimized ``training_step`` asks its LightningModule
    for, given to the model that runs (it has no Trainer).

    ``self.optimizers()`` returns ``optimizers`` (Lightning's ``LightningOptimizer``-like wrappers; with
    ``use_pl_optimizer=False`` the optimizers themselves), ``self.manual_backward(loss)`` is ``backward(loss)``,
    ``self.lr_schedulers()`` returns ``schedulers`` (from ``configure_optimizers``) and ``self.toggle_optimizer`` /
    ``self.untoggle_optimizer`` switch ``requires_grad`` as Lightning's do. Only the twin that runs is changed.
    """

    def bind(model: nn.Module, optimizers: list[Any], backward: Callable[..., None]) -> None:
        raw = [getattr(o, "optimizer", o) for o in optimizers]
        saved: dict[Tensor, bool] = {}
        bound = vars(model)  # instance attributes: the class's methods (which need a Trainer) stay as they are
        bound["optimizers"] = lambda use_pl_optimizer=True: _one_or_list(optimizers if use_pl_optimizer else raw)
        bound["manual_backward"] = lambda loss, *args, **kwargs: backward(loss, *args, **kwargs)
        bound["lr_schedulers"] = lambda: _one_or_list(schedulers)
        bound["toggle_optimizer"] = functools.partial(_toggle_optimizer, raw, saved)
        bound["untoggle_optimizer"] = functools.partial(_untoggle_optimizer, saved)

    return bind


def manual_step_function() -> Callable[[nn.Module, Any, int], Any]:
    """``step_fn(model, batch, batch_idx)``: a manually optimized ``training_step``, whose output is not a loss to
    backpropagate (it may return nothing)."""
    return lambda model, batch, batch_idx: cast(Any, model).training_step(batch, batch_idx)
