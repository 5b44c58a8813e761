"""Will it fit? A training step's peak memory, predicted before training, without the GPU and without the memory.

:func:`estimate_memory` runs two training steps of a fake twin of the model (fake CPU tensors: shapes and dtypes, no
data) in Lightning's order and counts the bytes of every tensor alive, to the byte on the CPU; for a CUDA target it
models what CUDA does differently and says so in :attr:`MemoryEstimate.assumptions`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_memopt.functional.planning import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_BLOCK_BYTES,
    PEAK_PARTS,
    FakeStepError,
    StepCount,
    count_training_steps,
    cuda_attention,
    cuda_autocast,
    kernel_scratch,
    use_foreach,
)
from lightning_memopt.utilities.checks import check_choice, check_positive_int
from lightning_memopt.utilities.formatting import format_bytes

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "ESTIMATE_PRECISIONS",
    "GPU_MEMORY",
    "MemoryEstimate",
    "MemoryEstimateError",
    "MemoryPlan",
    "PlanTrial",
    "estimate_memory",
    "parse_budget",
    "plan_memory",
]

#: Precisions :func:`estimate_memory` models (Lightning's strings).
ESTIMATE_PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
_DTYPES = {"16": torch.float16, "bf16": torch.bfloat16}
_PART_TEXT = {
    "parameters": "parameters",
    "buffers": "buffers",
    "batch": "batch",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations (forward, kept for backward)",
    "temporaries": "temporaries (backward, optimizer step)",
    "workspace": "cuBLAS workspaces",
}


class MemoryEstimateError(RuntimeError):
    """The step could not be estimated; the message says why and what to do."""


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate(StepCount):
    """Bytes of one training step, predicted by :func:`estimate_memory`.

    Attributes:
        peak_bytes: the most bytes alive at once over the simulated steps (for CUDA: allocated bytes, in 512-byte
            blocks, plus cuBLAS workspaces); what ``torch.cuda.max_memory_allocated`` would report.
        peak_phase: where the peak happens: ``"forward"``, ``"backward"`` or ``"optimizer step"``.
        peak_step: 0 or 1 (optimizer states appear at step 0; gradients of step 0 are alive in step 1's forward).
        at_peak: what the peak is made of (``parameters``, ``buffers``, ``batch``, ``gradients``,
            ``optimizer_states``, ``activations``, ``temporaries``, ``workspace``); adds up to ``peak_bytes``.
        parameter_bytes / buffer_bytes / gradient_bytes / optimizer_state_bytes / batch_bytes: the totals.
        phase_peaks: the highest count seen in each phase.
        device / precision: the target the estimate models.
        fake: whether it ran on fake tensors (``False``: a real step on the CPU, the fallback).
        assumptions: what was modelled and assumed, in words.
        seconds: how long the estimate took.
    """

    device: str
    precision: str
    fake: bool
    assumptions: tuple[str, ...] = ()
    seconds: float = 0.0
    steps: int = 2
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def activation_bytes(self) -> int:
        """Bytes the forward created that are alive at the peak (saved for backward, outputs, the loss)."""
        return self.at_peak.get("activations", 0)

    @property
    def temporary_bytes(self) -> int:
        """Bytes of backward and optimizer-step temporaries alive at the peak."""
        return self.at_peak.get("temporaries", 0)

    def table(self) -> str:
        """The breakdown as a plain-text table."""
        rows = [("at the peak", "bytes", "")]
        for part, nbytes in self.at_peak.items():
            if nbytes:
                rows.append((_PART_TEXT.get(part, part), format_bytes(nbytes), f"{nbytes / self.peak_bytes:6.1%}"))
        rows.append((f"peak ({self.peak_phase}, step {self.peak_step})", format_bytes(self.peak_bytes), "100.0%"))
        width = max(len(r[0]) for r in rows)
        lines = [f"{a:<{width}}  {b:>11}  {c}".rstrip() for a, b, c in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        totals = (
            f"totals: parameters {format_bytes(self.parameter_bytes)}"
            f" ({format_bytes(self.trainable_parameter_bytes)} trainable),"
            f" gradients {format_bytes(self.gradient_bytes)},"
            f" optimizer states {format_bytes(self.optimizer_state_bytes)}, batch {format_bytes(self.batch_bytes)}"
        )
        return "\n".join([*lines, totals])

    def __str__(self) -> str:
        how = "fake tensors" if self.fake else "a real CPU step"
        head = (
            f"Estimated peak memory of a training step on {self.device} at {self.precision}:"
            f" {format_bytes(self.peak_bytes)} ({how}, {self.seconds:.1f} s)"
        )
        notes = [f"  - {a}" for a in self.assumptions]
        return "\n".join([head, self.table(), *(["assumed:", *notes] if notes else [])])


def _is_lightning_module(module: nn.Module) -> bool:
    # by the class hierarchy, without importing Lightning for a plain nn.Module
    return any(
        cls.__name__ == "LightningModule" and cls.__module__.startswith(("lightning.pytorch", "pytorch_lightning"))
        for cls in type(module).__mro__
    )


def _loss_of(output: Any) -> Tensor:
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
    return output if output.dim() == 0 else output.float().sum()


def _call_module(module: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def _lightning_optimizers(module: nn.Module) -> list[torch.optim.Optimizer]:
    try:
        config = module.configure_optimizers()
    except Exception as err:
        raise MemoryEstimateError(
            f"`{type(module).__name__}.configure_optimizers()` failed outside a Trainer ({type(err).__name__}: {err})."
            " Pass `optimizer=` (e.g. `functools.partial(torch.optim.AdamW, lr=1e-4)`)."
        ) from err
    found: list[torch.optim.Optimizer] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.optim.Optimizer):
            found.append(value)
        elif isinstance(value, dict):
            collect(value.get("optimizer"))
        elif isinstance(value, (tuple, list)):
            for item in value:
                collect(item)

    collect(config)
    if not found:
        raise MemoryEstimateError(
            f"`{type(module).__name__}.configure_optimizers()` returned no optimizer ({config!r}). Pass `optimizer=`."
        )
    return found


def _make_optimizers(optimizer: Any, lightning: bool) -> Callable[[nn.Module], list[torch.optim.Optimizer]]:
    def make(model: nn.Module) -> list[torch.optim.Optimizer]:
        if optimizer is None:
            if lightning:
                return _lightning_optimizers(model)
            return [torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)]
        built = optimizer(p for p in model.parameters() if p.requires_grad)
        if not isinstance(built, torch.optim.Optimizer):
            raise MemoryEstimateError(
                f"`optimizer` must build a torch.optim.Optimizer from the parameters, got {type(built).__name__}."
                " Example: `optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)`."
            )
        return [built]

    return make


def _checkpointing_prepare(checkpointing: Any) -> Callable[[nn.Module], None] | None:
    if checkpointing is None or checkpointing is False:
        return None
    from lightning_memopt.callbacks.gradient_checkpointing import GradientCheckpointing

    if checkpointing is True:
        callback = GradientCheckpointing()
    elif isinstance(checkpointing, GradientCheckpointing):
        callback = GradientCheckpointing(checkpointing.modules, checkpointing.use_model_switch)
    else:
        callback = GradientCheckpointing(modules=checkpointing, use_model_switch=False)  # the blocks asked for

    def prepare(model: nn.Module) -> None:
        switches = callback._find_switches(model) if callback.use_model_switch and callback.modules is None else []
        if switches:
            for _, module, api in switches:
                if not getattr(module, api.is_on, False):
                    callback._enable_switch(module, api)
            return
        if not callback.wrap(model) and not callback.already_wrapped_names:
            raise MemoryEstimateError(
                f"`checkpointing`={checkpointing!r} matched no submodule of {type(model).__name__}. Pass the block"
                " classes or name patterns to checkpoint, e.g. `checkpointing=[nn.TransformerEncoderLayer]`."
            )

    return prepare


def estimate_memory(
    module: nn.Module,
    batch: Any,
    *,
    precision: str = "32-true",
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    device: str = "cuda",
    checkpointing: bool | Sequence[type[nn.Module] | str] | Any | None = None,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    fake: bool = True,
    steps: int = 2,
) -> MemoryEstimate:
    """Predict the peak memory of a training step, without allocating it and without a GPU.

    Runs ``steps`` training steps in Lightning's order (training step, ``zero_grad``, backward, optimizer step) on a
    fake twin of ``module``: fake CPU tensors have shapes and dtypes but no data, so a model that needs 16 GiB is
    estimated in a process of a few hundred MiB. The user's module is not changed. On the CPU the count equals a real
    step's bytes. For ``device="cuda"`` it models what CUDA does differently: attention through fused kernels (no
    ``L x L`` matrix), ``foreach`` optimizers, 512-byte allocator blocks and cuBLAS workspaces; not modelled: the
    CUDA context, the gap between reserved and allocated memory (fragmentation), cuDNN and NCCL buffers, DDP gradient
    buckets (about one more copy of the gradients per process). Leave a margin for them (:func:`plan_memory` does).

    Args:
        module: a ``LightningModule`` (its ``training_step`` and ``configure_optimizers`` run) or a plain
            ``nn.Module`` (called on the batch: ``module(**batch)`` for a dict, ``module(*batch)`` for a tuple).
        batch: one batch as the training step gets it, on the CPU (real tensors are faked; no data is copied).
        precision: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"`` (autocast around the training step, as Lightning
            does), ``"16-true"`` or ``"bf16-true"`` (weights and floating inputs cast).
        optimizer: ``optimizer(params) -> Optimizer``, e.g. ``functools.partial(torch.optim.SGD, lr=0.1,
            momentum=0.9)``; default: the LightningModule's ``configure_optimizers``, else ``AdamW``.
        device: ``"cuda"`` (modelled) or ``"cpu"``.
        checkpointing: ``True`` checkpoints as :class:`~lightning_memopt.GradientCheckpointing` does by default
            (the model's own switch, else PyTorch transformer layers); a list of block classes or name patterns, or a
            ``GradientCheckpointing``, chooses the blocks; ``None``/``False``: the model as it is.
        loss_fn: ``loss_fn(model, batch) -> loss`` instead of the training step; for a plain module the default is
            the output's ``.loss``, a scalar output itself, or the sum of the output.
        fake: ``False`` runs a real step on the CPU instead (the fallback for a step that cannot run on fake tensors;
            it allocates the memory, so use a small batch).
        steps: training steps to simulate (2 sees every peak: optimizer states appear at the first).

    Raises:
        MemoryEstimateError: the step cannot run on fake tensors (the message names the operator and the
            fallback), the optimizer cannot be built, or the training step returns no loss.

    Example:
        >>> model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
        >>> est = estimate_memory(model, torch.randn(32, 256), device="cpu")
        >>> est.parameter_bytes == 4 * (256 * 1024 + 1024 + 1024 * 10 + 10)
        True
        >>> est.optimizer_state_bytes == 2 * est.parameter_bytes + 4 * 4  # AdamW: two moments, a step per tensor
        True
    """
    check_choice("precision", precision, ESTIMATE_PRECISIONS)
    check_choice("device", device, ("cuda", "cpu"), hint="The CPU run models a CUDA target with `device='cuda'`.")
    check_positive_int("steps", steps)
    if not isinstance(module, nn.Module):
        raise ValueError(f"`module` must be an nn.Module (or LightningModule), got {type(module).__name__}.")
    if optimizer is not None and not callable(optimizer):
        raise ValueError(
            f"`optimizer` must be a callable that builds an optimizer from parameters, got {optimizer!r}."
            " Example: `optimizer=functools.partial(torch.optim.AdamW, lr=1e-4)`."
        )
    if not fake and any(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()]):
        raise ValueError(
            "`fake=False` runs a real CPU step, but the model is on the meta device (no data). Estimate it with"
            " `fake=True`, or build it on the CPU."
        )
    lightning = _is_lightning_module(module)
    cuda = device == "cuda"
    assumptions: list[str] = []
    kind, _, mode = precision.partition("-")
    dtype = _DTYPES.get(kind)

    if loss_fn is not None:

        def step_fn(model: nn.Module, b: Any, i: int) -> Tensor:
            return _loss_of(loss_fn(model, b))
    elif lightning:

        def step_fn(model: nn.Module, b: Any, i: int) -> Tensor:
            return _loss_of(model.training_step(b, i))
    else:

        def step_fn(model: nn.Module, b: Any, i: int) -> Tensor:
            return _loss_of(_call_module(model, b))

    checkpoint_prepare = _checkpointing_prepare(checkpointing)

    def prepare(model: nn.Module) -> None:
        model.train()
        if checkpoint_prepare is not None:
            checkpoint_prepare(model)

    def batch_fn(b: Any) -> Any:
        if mode == "true" and dtype is not None:
            return tree_map(lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t, b)
        return b

    def step_context() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if mode == "mixed" and dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=dtype))
        return stack

    foreach_set: list[bool] = []

    def prepare_optimizers(optimizers: list[torch.optim.Optimizer]) -> None:
        if cuda:
            foreach_set.append(use_foreach(optimizers))

    started = time.perf_counter()
    # the CUDA models hold for the whole run: checkpointing recomputes the forward inside backward (under autocast
    # when the forward was); cuda_autocast acts only where autocast is on
    with (
        warnings.catch_warnings(),
        cuda_attention() if cuda and fake else contextlib.nullcontext(),
        cuda_autocast() if cuda and mode == "mixed" else contextlib.nullcontext(),
    ):
        warnings.filterwarnings("ignore", message=".*self.log.*")
        warnings.filterwarnings("ignore", message=".*reference is not registered.*")
        try:
            counted = count_training_steps(
                module,
                batch,
                step_fn,
                _make_optimizers(optimizer, lightning),
                fake=fake,
                steps=steps,
                block_bytes=CUDA_BLOCK_BYTES if cuda else 1,
                scratch=kernel_scratch,
                prepare=prepare,
                step_context=step_context,
                prepare_optimizers=prepare_optimizers,
                batch_fn=batch_fn,
                dtype=dtype if mode == "true" else None,
            )
        except FakeStepError as err:
            raise MemoryEstimateError(
                f"{type(module).__name__}'s training step cannot be estimated on fake tensors: {err} Make that"
                " step shape-static, or estimate with a real CPU step at a small batch: `estimate_memory(...,"
                " fake=False, device='cpu')` (it allocates the memory)."
            ) from err
    seconds = time.perf_counter() - started
    at_peak = dict(counted.at_peak)
    peak = counted.peak_bytes
    if cuda:
        at_peak["workspace"] = CUBLAS_WORKSPACE_BYTES
        peak += CUBLAS_WORKSPACE_BYTES
        assumptions.append("CUDA allocator: every tensor in 512-byte blocks (allocated bytes, not reserved)")
        assumptions.append(f"cuBLAS workspaces {format_bytes(CUBLAS_WORKSPACE_BYTES)} (default config, not sm90)")
        if fake:
            assumptions.append("attention (scaled_dot_product_attention) through CUDA's fused kernels: no L x L matrix")
        if any(foreach_set):
            assumptions.append("optimizer foreach=True (torch's default on CUDA)")
        assumptions.append("not counted: CUDA context, reserved-but-unused memory, DDP gradient buckets, NCCL buffers")
    if mode == "mixed":
        lists = "CUDA's float32 list (layer_norm, softmax, sum, ...) in float32" if cuda else "the CPU's op lists"
        assumptions.append(f"autocast to {dtype} around the training step, {lists}")
    if not fake:
        assumptions.append("a real step on the CPU (fallback)")
    counts = {f.name: getattr(counted, f.name) for f in dataclasses.fields(StepCount)}
    counts.update(peak_bytes=peak, at_peak={k: at_peak[k] for k in (*PEAK_PARTS, "workspace") if k in at_peak})
    return MemoryEstimate(
        **counts,
        device=device,
        precision=precision,
        fake=fake,
        assumptions=tuple(assumptions),
        seconds=seconds,
        steps=steps,
    )


# ------------------------------------------------------------------------------------------------------------ plans

#: Memory torch reports for common GPUs (``total_memory`` of ``torch.cuda.get_device_properties``, GiB) and whether
#: they compute bf16 in hardware. The usable part is this minus the CUDA context and the plan's margin.
GPU_MEMORY: dict[str, tuple[float, bool]] = {
    "T4": (14.7, False),
    "V100-16GB": (15.8, False),
    "V100-32GB": (31.7, False),
    "A10G": (22.1, True),
    "L4": (22.0, True),
    "RTX3090": (23.7, True),
    "RTX4090": (23.6, True),
    "A100-40GB": (39.4, True),
    "A100-80GB": (79.1, True),
    "L40S": (44.4, True),
    "H100-80GB": (79.1, True),
    "H200": (139.8, True),
}
#: Memory the CUDA context and the kernels' code take on the device before any tensor (assumed; 0.3-1 GiB in practice).
CUDA_CONTEXT_BYTES = 512 * 1024**2
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}


def parse_budget(budget: int | float | str | None) -> tuple[int, str, bool | None]:
    """``(bytes, label, bf16 in hardware or None)`` of a budget: bytes, ``"40GB"``, ``"24GiB"`` or a GPU name.

    ``None`` reads the current CUDA device. ``GB`` is 10^9 bytes and ``GiB`` 2^30, as written.

    Example:
        >>> parse_budget("A100-40GB")[0] == int(39.4 * 1024**3), parse_budget("16GB")[:2]
        (True, (16000000000, '16GB'))
    """
    if budget is None:
        if not torch.cuda.is_available():
            raise ValueError(
                "`budget_bytes` is None and there is no CUDA device to read it from. Pass the device's memory, e.g."
                f" `budget_bytes='40GB'`, or a GPU name: {', '.join(GPU_MEMORY)}."
            )
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return int(props.total_memory), props.name, props.major >= 8
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise ValueError(f"`budget_bytes` must be bytes, a size such as '40GB' or a GPU name, got {budget!r}.")
    if isinstance(budget, (int, float)):
        if not math.isfinite(budget) or budget <= 0:
            raise ValueError(f"`budget_bytes` must be positive, got {budget!r}.")
        return int(budget), format_bytes(int(budget)), None
    names = {name.upper(): name for name in GPU_MEMORY}
    key = budget.strip().upper().replace(" ", "")
    if key in names:
        gib, bf16 = GPU_MEMORY[names[key]]
        return int(gib * 1024**3), names[key], bf16
    number = key.rstrip("KMGTIB")
    unit = key[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"`budget_bytes`={budget!r} is neither a size (e.g. '40GB', '24GiB', 8e9) nor a known GPU."
            f" Known GPUs: {', '.join(GPU_MEMORY)}."
        )
    return int(value * _UNITS[unit]), budget.strip(), None


@dataclass(frozen=True)
class PlanTrial:
    """One estimate :func:`plan_memory` ran: the settings, the bytes needed and whether they fit."""

    micro_batch_size: int
    precision: str
    checkpointing: bool
    needed_bytes: int
    fits: bool
    seconds: float


@dataclass(frozen=True)
class MemoryPlan:
    """What :func:`plan_memory` chose, why, and what it tried.

    ``trainer_kwargs()`` gives ``Trainer`` arguments through :attr:`preset` (precision plugin, accumulation,
    checkpointing); give the DataLoader :attr:`micro_batch_size`. When nothing fits, :attr:`feasible` is ``False``
    and :attr:`advice` says what would (8-bit optimizer states, or sharding over N GPUs).
    """

    feasible: bool
    effective_batch_size: int
    micro_batch_size: int | None
    accumulate_grad_batches: int | None
    precision: str
    gradient_checkpointing: bool
    budget_bytes: int
    budget_label: str
    usable_bytes: int
    margin: float
    devices: int
    num_nodes: int
    device: str
    estimate: MemoryEstimate | None
    trials: tuple[PlanTrial, ...]
    advice: str = ""
    preset: Any = None

    @property
    def batch_size(self) -> int | None:
        """The DataLoader's batch size per device (the micro-batch)."""
        return self.micro_batch_size

    def trainer_kwargs(self, **trainer_kwargs: Any) -> dict[str, Any]:
        """``Trainer`` arguments for the plan (see :meth:`MemoryPreset.trainer_kwargs`)."""
        if not self.feasible or self.preset is None:
            raise ValueError(f"No setting fits {self.budget_label}: {self.advice}")
        return self.preset.trainer_kwargs(**trainer_kwargs)

    def table(self) -> str:
        """What was tried, one row per estimate."""
        rows = [("micro-batch", "precision", "checkpointing", "needs", "fits")]
        for t in self.trials:
            rows.append(
                (
                    str(t.micro_batch_size),
                    t.precision,
                    "yes" if t.checkpointing else "no",
                    format_bytes(t.needed_bytes),
                    "yes" if t.fits else "no",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(f"{c:>{w}}" for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (
            f"Budget {self.budget_label}: {format_bytes(self.budget_bytes)},"
            f" usable {format_bytes(self.usable_bytes)} ("
            f"{'the CUDA context and ' if self.device == 'cuda' else ''}a {self.margin:.0%} margin left free)"
        )
        if self.feasible:
            assert self.estimate is not None
            world = self.devices * self.num_nodes
            verdict = (
                f"Plan: micro-batch {self.micro_batch_size} x accumulate {self.accumulate_grad_batches}"
                f"{f' x {world} devices' if world > 1 else ''} = {self.effective_batch_size}, {self.precision},"
                f" activation checkpointing {'on' if self.gradient_checkpointing else 'off'};"
                f" needs {format_bytes(self._needed(self.estimate))} of {format_bytes(self.usable_bytes)}"
            )
        else:
            verdict = f"Nothing fits: {self.advice}"
        return "\n".join([head, self.table(), verdict])

    def _needed(self, estimate: MemoryEstimate) -> int:
        return _needed_bytes(estimate, self.devices * self.num_nodes)


def _needed_bytes(estimate: MemoryEstimate, world: int) -> int:
    # DDP keeps its gradient buckets beside the gradients: about one more copy of them per process
    return estimate.peak_bytes + (estimate.gradient_bytes if world > 1 else 0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _advice(estimate: MemoryEstimate, usable: int, world: int, checkpointing: bool) -> str:
    import importlib.util

    needed = _needed_bytes(estimate, world)
    states = sum(estimate.at_peak.get(k, 0) for k in ("parameters", "buffers", "gradients", "optimizer_states"))
    rest = needed - states
    how = " and activation checkpointing" if checkpointing else ""
    text = (
        f"even micro-batch 1 with {estimate.precision}{how} needs {format_bytes(needed)};"
        f" the model states (parameters, gradients, optimizer states) alone take {format_bytes(states)}."
    )
    optimizer = estimate.at_peak.get("optimizer_states", 0)
    if optimizer and needed - 0.75 * optimizer <= usable:
        if importlib.util.find_spec("bitsandbytes") is not None:
            return (
                f"{text} 8-bit optimizer states (bitsandbytes, e.g. `bnb.optim.AdamW8bit`) would need about"
                f" {format_bytes(int(needed - 0.75 * optimizer))}: that fits."
            )
        text += (
            f" 8-bit optimizer states would need about {format_bytes(int(needed - 0.75 * optimizer))} and fit"
            " (install bitsandbytes);"
        )
    if usable > rest:
        shards = max(2, math.ceil(states / (usable - rest)))
        return (
            f"{text} Needs sharding: {shards} GPUs with FSDP (model states split {shards} ways, plus"
            f" {format_bytes(rest)} of activations and temporaries per GPU)."
        )
    return (
        f"{text} Even sharded, the activations and temporaries of one sample ({format_bytes(rest)}) exceed the"
        " usable memory: shorten the sequences or use a larger device."
    )


def plan_memory(
    module: nn.Module,
    batch_fn: Callable[[int], Any],
    *,
    effective_batch_size: int,
    budget_bytes: int | float | str | None = None,
    devices: int = 1,
    num_nodes: int = 1,
    margin: float = 0.1,
    precision: str = "auto",
    checkpointing: bool | str | Sequence[type[nn.Module] | str] = "auto",
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    device: str = "cuda",
    progress: Callable[[str], None] | None = None,
) -> MemoryPlan:
    """Choose micro-batch, accumulation, precision and checkpointing so a training step fits a memory budget.

    Every candidate is estimated with :func:`estimate_memory` at its own micro-batch (peaks are not linear in the
    batch, so nothing is extrapolated): first the whole per-device batch, then micro-batch 1, then a binary search
    over the divisors of the per-device batch (the effective batch is kept exactly). Activation checkpointing is
    chosen only when it at least doubles the micro-batch (it costs about a third more compute; halving the
    accumulation saves more). Under DDP one more copy of the gradients (the buckets) is counted per device.

    Args:
        module: as for :func:`estimate_memory`.
        batch_fn: ``batch_fn(micro_batch_size)`` -> a batch of that many samples (CPU tensors; they are faked).
        effective_batch_size: samples per optimizer step over all devices; kept exactly.
        budget_bytes: the device's memory: bytes, a size (``"40GB"``, ``"24GiB"``) or a GPU name from
            :data:`GPU_MEMORY` (``"A100-40GB"``); ``None`` reads the current CUDA device.
        devices / num_nodes: the data-parallel world (``effective_batch_size`` must divide by it).
        margin: fraction of the usable memory left free for what is not modelled (fragmentation, cuDNN, NCCL).
        precision: ``"auto"`` (``bf16-mixed`` where the GPU computes bf16, else ``16-mixed``; ``32-true`` for
            ``device="cpu"``; a budget given as a size says nothing about the GPU, so bf16 is assumed: pass
            ``precision="16-mixed"`` for a V100 or T4 given by size) or one precision to use.
        checkpointing: ``"auto"`` tries without and with; ``True``/``False`` or block classes/name patterns fix it.
            "Without" is the model as it is: a model that checkpoints itself (e.g. an HF model with gradient
            checkpointing enabled) stays checkpointed.
        optimizer / loss_fn / device: as for :func:`estimate_memory`.
        progress: called with one line per estimate (the CLI prints them).

    Returns:
        a :class:`MemoryPlan`; ``plan.trainer_kwargs()`` builds the Trainer arguments. When even micro-batch 1
        with the most saving settings does not fit, ``plan.feasible`` is ``False`` and ``plan.advice`` says what
        would (8-bit optimizer states, or FSDP over N GPUs).

    Example:
        >>> model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512))
        >>> plan = plan_memory(model, lambda b: torch.randn(b, 128, 512), effective_batch_size=64,
        ...                    budget_bytes="20MB", device="cpu")
        >>> plan.micro_batch_size, plan.accumulate_grad_batches, plan.precision
        (8, 8, '32-true')
        >>> print(plan.table())
        micro-batch  precision  checkpointing      needs  fits
        ------------------------------------------------------
                 64    32-true             no  72.02 MiB    no
                  1    32-true             no  10.27 MiB   yes
                  8    32-true             no  16.02 MiB   yes
                 16    32-true             no  24.02 MiB    no
    """
    from lightning_memopt.functional.presets import tier_for_memory
    from lightning_memopt.plugins.presets import MemoryPreset

    if not callable(batch_fn):
        raise ValueError(f"`batch_fn` must be a callable `batch_fn(micro_batch_size) -> batch`, got {batch_fn!r}.")
    check_positive_int("effective_batch_size", effective_batch_size)
    check_positive_int("devices", devices)
    check_positive_int("num_nodes", num_nodes)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"`margin` must be a fraction in [0, 1), got {margin!r}. `margin=0.1` keeps 10 % free.")
    check_choice("device", device, ("cuda", "cpu"))
    if precision != "auto":
        check_choice("precision", precision, ESTIMATE_PRECISIONS)
    world = devices * num_nodes
    if effective_batch_size % world:
        raise ValueError(
            f"`effective_batch_size`={effective_batch_size} must divide by devices x num_nodes = {world}: every device"
            f" gets the same batch. Use a multiple of {world}."
        )
    total, label, bf16 = parse_budget(budget_bytes)
    context = CUDA_CONTEXT_BYTES if device == "cuda" else 0
    usable = int((total - context) * (1 - margin))
    if usable <= 0:
        raise ValueError(
            f"`budget_bytes` ({format_bytes(total)}) leaves nothing once the CUDA context"
            f" ({format_bytes(context)}) and the margin are taken off. Pass the device's whole memory."
        )
    if precision == "auto":
        precision = "32-true" if device == "cpu" else ("16-mixed" if bf16 is False else "bf16-mixed")
    if checkpointing == "auto":
        options: list[Any] = [False, True]
    else:
        options = [checkpointing]
    per_device = effective_batch_size // world
    sizes = _divisors(per_device)
    trials: list[PlanTrial] = []
    estimates: dict[tuple[int, bool], MemoryEstimate] = {}

    def fits(size: int, option: Any) -> bool:
        est = estimate_memory(
            module,
            batch_fn(size),
            precision=precision,
            optimizer=optimizer,
            device=device,
            checkpointing=option or None,
            loss_fn=loss_fn,
        )
        needed = _needed_bytes(est, world)
        ok = needed <= usable
        trials.append(PlanTrial(size, precision, bool(option), needed, ok, est.seconds))
        estimates[(size, bool(option))] = est
        if progress is not None:
            progress(
                f"micro-batch {size:>5}, {precision}, checkpointing {'on' if option else 'off'}:"
                f" {format_bytes(needed):>11} {'fits' if ok else 'too much'} ({est.seconds:.1f} s)"
            )
        return ok

    def search(option: Any, candidates: list[int]) -> int | None:
        """The largest candidate that fits (the need grows with the micro-batch), or None."""
        if fits(candidates[-1], option):
            return candidates[-1]
        if len(candidates) == 1 or not fits(candidates[0], option):
            return None
        lo, hi = 0, len(candidates) - 1  # candidates[lo] fits, candidates[hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(candidates[mid], option):
                lo = mid
            else:
                hi = mid
        return candidates[lo]

    best: dict[bool, int | None] = {}
    last_option: Any = options[-1]
    for option in options:
        plain = best.get(False)
        # checkpointing is only worth it from twice the micro-batch that fits without it
        candidates = [s for s in sizes if plain is None or not option or s >= 2 * plain]
        if not candidates:
            break
        try:
            best[bool(option)] = search(option, candidates)
        except MemoryEstimateError as err:
            if checkpointing == "auto" and option and "matched no submodule" in str(err):
                last_option = False  # nothing to checkpoint: the plan is made without
                break
            raise
    plain, checkpointed = best.get(False), best.get(True)
    if checkpointed is not None and (plain is None or checkpointed >= 2 * plain):
        chosen, option = checkpointed, True
    elif plain is not None:
        chosen, option = plain, False
    else:
        chosen, option = None, bool(last_option)
    common = dict(
        effective_batch_size=effective_batch_size,
        precision=precision,
        budget_bytes=total,
        budget_label=label,
        usable_bytes=usable,
        margin=margin,
        devices=devices,
        num_nodes=num_nodes,
        device=device,
        trials=tuple(trials),
    )
    if chosen is None:
        smallest = estimates.get((1, bool(last_option))) or estimates[min(estimates)]
        return MemoryPlan(
            feasible=False,
            micro_batch_size=None,
            accumulate_grad_batches=None,
            gradient_checkpointing=bool(last_option),
            estimate=smallest,
            advice=_advice(smallest, usable, world, bool(last_option)),
            **common,
        )
    blocks = checkpointing if isinstance(checkpointing, (list, tuple)) else None
    preset = MemoryPreset.from_name(
        tier_for_memory(total / 1024**3)[1],
        effective_batch_size=effective_batch_size,
        micro_batch_size=chosen,
        devices=devices,
        num_nodes=num_nodes,
        precision=precision,
        gradient_checkpointing=option,
        checkpoint_modules=tuple(blocks) if option and blocks and all(isinstance(b, str) for b in blocks) else None,
        tier=label,
    )
    return MemoryPlan(
        feasible=True,
        micro_batch_size=chosen,
        accumulate_grad_batches=preset.accumulate_grad_batches,
        gradient_checkpointing=option,
        estimate=estimates[(chosen, option)],
        preset=preset,
        **common,
    )
