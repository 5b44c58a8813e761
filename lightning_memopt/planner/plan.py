"""Plans: the micro-batch, accumulation, precision and checkpointing that fit a memory budget.

:func:`plan_memory` returns numbers (a :class:`MemoryPlan`); :meth:`MemoryPreset.from_plan
<lightning_memopt.MemoryPreset.from_plan>` turns a plan into a preset and its Trainer arguments.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from lightning_memopt.functional.divisors import INT64_MAX, divisors
from lightning_memopt.functional.planning.sharding import child_roots, default_shard_blocks
from lightning_memopt.functional.presets import normalize_checkpoint_modules, tier_for_memory
from lightning_memopt.planner.budget import CUDA_CONTEXT_BYTES, GPU_COMPUTE_CAPABILITY, parse_budget
from lightning_memopt.planner.estimate import ESTIMATE_PRECISIONS, STAGES, MemoryEstimate
from lightning_memopt.planner.model_step import is_lightning_module, is_manual_optimization
from lightning_memopt.planner.search import (
    EvaluationPlan,
    GpusNeeded,
    PlanSettings,
    PlanTrial,
    Stage,
    most_estimates,
    needed_bytes,
    search_plan,
    split_needs,
    strategy_label,
)
from lightning_memopt.utilities.checks import check_choice, check_positive_int
from lightning_memopt.utilities.formatting import format_bytes, wrap_to_width

__all__ = ["PLAN_STRATEGIES", "MemoryPlan", "plan_memory"]

#: What ``plan_memory(strategy=...)`` accepts: ``"auto"`` (DDP where the model fits each rank, else FSDP2), or one.
PLAN_STRATEGIES = ("auto", "ddp", "fsdp2")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryPlan:
    """What :func:`plan_memory` chose, why, and what it tried: numbers only.

    Give the DataLoader :attr:`micro_batch_size` and build the Trainer arguments with
    ``MemoryPreset.from_plan(plan).trainer_kwargs()`` (precision plugin, accumulation, checkpointing, the memory
    callbacks of the budget's GPU-size tier). When nothing fits, :attr:`feasible` is ``False`` and :attr:`advice`
    says what would (8-bit optimizer states, or sharding over N GPUs). ``str(plan)`` is the report: the budget,
    :meth:`table` and the verdict, no line over 100 columns.

    Attributes:
        feasible: whether a setting fits.
        effective_batch_size: samples per optimizer step over all devices, as asked.
        micro_batch_size / accumulate_grad_batches: the chosen split per device (``None`` when nothing fits).
        precision / gradient_checkpointing: the chosen settings (when nothing fits: the most saving ones tried).
        checkpoint_modules: the blocks checkpointed, as given (``None``: the default blocks, or no checkpointing).
        budget_bytes / budget_label: the device's memory and its name or size as given.
        usable_bytes: the budget less the CUDA context (for CUDA) and the margin.
        margin / devices / num_nodes / device: as given to :func:`plan_memory`.
        preset_name: the preset of the budget's GPU-size tier (``max-savings`` up to 12 GiB, ``balanced`` up to 20,
            else ``max-speed``), the one :meth:`MemoryPreset.from_plan <lightning_memopt.MemoryPreset.from_plan>`
            builds.
        estimate: the :class:`MemoryEstimate` of the chosen setting (when nothing fits: of the smallest tried).
        trials: every estimate run, in order.
        advice: what would fit, when nothing does.
        strategy: how the ranks hold the model: ``"single device"``, ``"ddp"`` (every rank the whole model),
            ``"fsdp2"`` (sharded over :attr:`world_size` ranks, ``reshard_after_forward=True``) or
            ``"fsdp2 + cpu offload"`` (the last resort: parameters, gradients and optimizer states on the host).
        strategy_reason: why that strategy, in words.
        reshard_after_forward / cpu_offload: FSDP2's options in the plan (``None`` / ``False`` unless sharded).
        shard_blocks / shard_roots: the qualified names ``fully_shard`` is applied to, blocks first, then the roots
            (``""``: the module itself); ``None`` unless sharded, or when the LightningModule's ``configure_model``
            shards the model itself.
        gpus_needed: when nothing fits, the GPUs FSDP2 needs for micro-batch 1 (``None``: not even sharding helps);
            :attr:`gpus_needed_planned` says whether it was estimated (``False``: a lower bound from the model
            states, the estimate at that count did not fit or could not run).
        eval_stage: the evaluation planned (``plan_memory(evaluation=...)``: ``"validate"``, ``"test"`` or
            ``"predict"``), else ``None``.
        eval_batch_size: the largest evaluation batch per device that fits (the ``val``/``test``/``predict``
            DataLoader's), from the training micro-batch doubled up to 4 x the per-device batch; ``None`` when not
            planned or nothing fits (:attr:`eval_note` says why).
        eval_estimate / eval_trials: its estimate (``estimate_memory(stage=...)``) and every evaluation estimate run.
        eval_note: why no evaluation batch was planned, when one was asked for.
        policy_estimate: for an FSDP2 plan at ``bf16-mixed``/``16-mixed`` with the default sharding, the chosen
            setting estimated with FSDP2's own ``MixedPrecisionPolicy`` instead of autocast
            (``estimate_memory(mixed_precision_policy=True)``); offered in the report where it needs less:
            ``MemoryPreset.from_plan(plan, mixed_precision_policy=True)`` builds it.

    Examples:
        >>> model = nn.Linear(64, 64)
        >>> plan = plan_memory(model, lambda b: torch.randn(b, 64), effective_batch_size=8, budget="1GB",
        ...                    device="cpu")
        >>> plan.feasible, plan.micro_batch_size, plan.accumulate_grad_batches, len(plan.trials), plan.preset_name
        (True, 8, 1, 1, 'max-savings')
    """

    feasible: bool
    effective_batch_size: int
    micro_batch_size: int | None
    accumulate_grad_batches: int | None
    precision: str
    gradient_checkpointing: bool
    checkpoint_modules: tuple[type[nn.Module] | str, ...] | None
    budget_bytes: int
    budget_label: str
    usable_bytes: int
    margin: float
    devices: int
    num_nodes: int
    device: str
    preset_name: str
    estimate: MemoryEstimate | None
    trials: tuple[PlanTrial, ...]
    advice: str = ""
    strategy: str = "single device"
    strategy_reason: str = ""
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    shard_blocks: tuple[str, ...] | None = None
    shard_roots: tuple[str, ...] | None = None
    gpus_needed: int | None = None
    gpus_needed_planned: bool = False
    eval_stage: str | None = None
    eval_batch_size: int | None = None
    eval_estimate: MemoryEstimate | None = None
    eval_trials: tuple[PlanTrial, ...] = ()
    eval_note: str = ""
    policy_estimate: MemoryEstimate | None = None

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: ``devices x num_nodes`` (the ranks FSDP2 shards over, when sharded)."""
        return self.devices * self.num_nodes

    @property
    def sharded(self) -> bool:
        """Whether the plan shards the model with FSDP2."""
        return self.strategy.startswith("fsdp2")

    @property
    def preset_strategy(self) -> str | None:
        """``MemoryPreset.strategy`` for this plan: ``"fsdp2"`` (with or without CPU offload), ``"ddp"``, or ``None``
        on a single device."""
        if self.sharded:
            return "fsdp2"
        return "ddp" if self.strategy == "ddp" else None

    @property
    def batch_size(self) -> int | None:
        """The DataLoader's batch size per device (the micro-batch)."""
        return self.micro_batch_size

    def table(self) -> str:
        """What was tried, one row per estimate."""
        several = self.world_size > 1
        rows = [(*(("strategy",) if several else ()), "micro-batch", "accumulate", "precision", "checkpointing")]
        rows[0] += ("needs" + (" per rank" if several else ""), "fits")
        for t in self.trials:
            rows.append(
                (
                    *((t.strategy,) if several else ()),
                    str(t.micro_batch_size),
                    str(t.accumulate_grad_batches),
                    t.precision,
                    "yes" if t.gradient_checkpointing else "no",
                    format_bytes(t.needed_bytes),
                    "yes" if t.fits else "no",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(f"{c:>{w}}" for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def __str__(self) -> str:
        where = "the CUDA context and " if self.device == "cuda" else ""
        head = (
            f"Budget {self.budget_label}: {format_bytes(self.budget_bytes)},"
            f" usable {format_bytes(self.usable_bytes)} ({where}a {self.margin:.0%} margin left free)"
        )
        if self.feasible:
            assert self.estimate is not None
            world = self.world_size
            verdict = (
                f"Plan: {self._strategy_text()}micro-batch {self.micro_batch_size} x accumulate"
                f" {self.accumulate_grad_batches}{f' x {world} ranks' if world > 1 else ''} ="
                f" {self.effective_batch_size}, {self.precision},"
                f" activation checkpointing {'on' if self.gradient_checkpointing else 'off'};"
                f" needs {format_bytes(needed_bytes(self.estimate, world))}"
                f"{' per rank' if world > 1 else ''} of {format_bytes(self.usable_bytes)}"
            )
        else:
            verdict = f"Nothing fits: {self.advice}"
        texts = [head, verdict, *([f"Why: {self.strategy_reason}"] if self.strategy_reason else [])]
        if self.eval_stage is not None:
            texts.append(self._evaluation_text())
        if self.policy_estimate is not None and self.estimate is not None:
            texts.append(self._policy_text())
        wrapped = [wrap_to_width(text) for text in texts]
        return "\n".join([wrapped[0], self.table(), *wrapped[1:]])

    def _policy_text(self) -> str:
        assert self.policy_estimate is not None and self.estimate is not None
        policy, autocast = self.policy_estimate.peak_bytes, needed_bytes(self.estimate, self.world_size)
        head = (
            f"FSDP2's own mixed precision (MixedPrecisionPolicy, Trainer at 32-true) needs {format_bytes(policy)} per"
            f" rank at this setting, autocast {format_bytes(autocast)}"
        )
        if policy >= autocast:
            return head + ": autocast kept."
        return (
            f"{head}: `MemoryPreset.from_plan(plan, mixed_precision_policy=True)` builds it (its recipe sets"
            " mp_policy)."
        )

    def _evaluation_text(self) -> str:
        head = f"Evaluation (trainer.{self.eval_stage}): "
        if self.eval_batch_size is None or self.eval_estimate is None:
            return head + self.eval_note
        return (
            f"{head}batch {self.eval_batch_size} per device; needs {format_bytes(self.eval_estimate.peak_bytes)}"
            f"{' per rank' if self.world_size > 1 else ''} of {format_bytes(self.usable_bytes)}"
        )

    def _strategy_text(self) -> str:
        if self.sharded:
            offload = ", CPU offload" if self.cpu_offload else ""
            return f"FSDP2 over {self.world_size} ranks (reshard_after_forward={self.reshard_after_forward}{offload}), "
        return "DDP, " if self.strategy == "ddp" else ""


class _Budget(NamedTuple):
    """A budget resolved: its bytes and label, the usable bytes, the GPU it names and the precision it implies."""

    total: int
    label: str
    usable: int
    gpu: str | tuple[int, int] | None
    precision: str


def _resolve_budget(
    budget: int | float | str | None, gpu: str | tuple[int, int] | None, device: str, margin: float, precision: str
) -> _Budget:
    total, label, bf16 = parse_budget(budget)
    if gpu is None and label in GPU_COMPUTE_CAPABILITY:
        gpu = label
    elif gpu is None and budget is None:
        gpu = torch.cuda.get_device_capability()  # parse_budget read this device
    context = CUDA_CONTEXT_BYTES if device == "cuda" else 0
    usable = int((total - context) * (1 - margin))
    if usable <= 0:
        raise ValueError(
            f"`budget` ({format_bytes(total)}) leaves nothing once the CUDA context"
            f" ({format_bytes(context)}) and the margin are taken off. Pass the device's whole memory."
        )
    if precision == "auto":
        precision = _auto_precision(device, bf16)
    return _Budget(total, label, usable, gpu, precision)


def _auto_precision(device: str, bf16: bool | None) -> str:
    """The precision ``precision="auto"`` picks: float32 on the CPU, fp16 autocast on a GPU known to lack bf16, else
    bf16 autocast."""
    if device == "cpu":
        return "32-true"
    if bf16 is False:
        return "16-mixed"
    return "bf16-mixed"


def _micro_batches(per_device: int, manual: bool, report: Callable[[str], None]) -> list[int]:
    """The micro-batches to choose from (the divisors of the per-device batch; only the whole of it when the step
    cannot accumulate), announced in one line."""
    sizes = divisors(per_device)
    if manual:
        sizes = sizes[-1:]  # no accumulation: the whole per-device batch or nothing
    shown = _shown_sizes(sizes)
    report(
        f"per-device batch {per_device}: {len(sizes)} micro-batch{'es' if len(sizes) != 1 else ''} to choose from"
        f" ({shown}); at most {most_estimates(len(sizes))} estimates per checkpointing setting"
    )
    return sizes


def _shown_sizes(sizes: list[int]) -> str:
    """The sizes, comma-separated; past 8 of them, the first 4, an ellipsis and the last."""
    if len(sizes) <= 8:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]}"


def _label(estimate: MemoryEstimate, world: int) -> str:
    """The strategy an estimate modelled (see :func:`~lightning_memopt.planner.search.strategy_label`)."""
    sharding = estimate.sharding
    return strategy_label(world, sharding is not None, sharding is not None and sharding.cpu_offload)


def _reason(done: list[Stage], world: int, strategy: str) -> str:
    """Why the plan's strategy, in words (empty on a single device, or when nothing fits)."""
    final = done[-1]
    if world == 1 or final.chosen is None:
        return ""
    asked = f"`strategy='{strategy}'` as asked. " if strategy != "auto" else ""
    if not final.runs.sharded:
        return (
            f"{asked}DDP: the whole model fits on each of the {world} ranks at micro-batch {final.chosen}; it"
            " runs no all-gathers, so it is faster than sharding."
        )
    texts: list[str] = []
    if asked:
        texts.append(asked.strip())
    for stage in done[:-1]:
        name = "DDP" if not stage.runs.sharded else "FSDP2 without CPU offload"
        if stage.floor is not None:
            texts.append(
                f"{name} cannot fit: its parameters, gradients and gradient buckets alone need"
                f" {format_bytes(stage.floor)} per rank (not estimated)."
            )
            continue
        needed = format_bytes(needed_bytes(stage.smallest(), world))
        texts.append(f"{name} does not fit even the smallest micro-batch ({needed} per rank).")
    if final.runs.cpu_offload:
        texts.append(
            "CPU offload is the last resort: parameters, gradients and optimizer states live on the host, the"
            " optimizer step runs on the CPU and each unit's parameters are copied in for every forward and backward"
            " (slow)."
        )
    else:
        texts.append(
            f"FSDP2 shards parameters, gradients and optimizer states over {world} ranks"
            " (reshard_after_forward=True: each unit's parameters are gathered again for backward)."
        )
    return " ".join(texts)


def _advice(
    estimate: MemoryEstimate, usable: int, world: int, checkpointing: bool, micro: int, gpus: GpusNeeded | None
) -> str:
    """What would fit when the smallest micro-batch (``micro``, 1 unless the step cannot accumulate) does not
    (``estimate``): 8-bit optimizer states, FSDP2 over ``gpus``, or nothing but shorter samples or a larger device."""
    needed, states, rest = split_needs(estimate, world)
    how = " and activation checkpointing" if checkpointing else ""
    if world > 1:
        how += f", {_label(estimate, world)}"
    text = ""
    if micro > 1:
        text = (
            "manual optimization cannot accumulate gradients over micro-batches (Lightning refuses"
            " `accumulate_grad_batches` with it), so the whole per-device batch was estimated: "
        )
    text += (
        f"even micro-batch {micro} with {estimate.precision}{how} needs {format_bytes(needed)}"
        f"{' per rank' if world > 1 else ''}; the model states (parameters, gradients, optimizer states) alone"
        f" take {format_bytes(states)}."
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
    if gpus is None:
        return (
            f"{text} Even sharded, the activations and temporaries of one sample ({format_bytes(rest)}) exceed the"
            " usable memory: shorten the sequences or use a larger device."
        )
    if gpus.planned:
        return (
            f"{text} Needs sharding: FSDP2 over {gpus.number} GPUs fits micro-batch 1 (planned:"
            f" {format_bytes(gpus.needed)} per rank); plan again with `devices` x `num_nodes` = {gpus.number}."
        )
    return (
        f"{text} Needs sharding: at least {gpus.number} GPUs with FSDP2 (a lower bound: the model states split"
        f" {gpus.number} ways, plus {format_bytes(rest)} of activations and temporaries per GPU; not confirmed by an"
        f" estimate); plan again with `devices` x `num_nodes` = {gpus.number} to check."
    )


def _check_plan_arguments(
    batch_fn: Any,
    effective_batch_size: int,
    devices: int,
    num_nodes: int,
    margin: Any,
    device: str,
    precision: str,
    evaluation: Any = None,
) -> None:  # the checkpointing arguments are checked by _checkpointing
    if evaluation is not None:
        check_choice("evaluation", evaluation, STAGES[1:], hint="None plans no evaluation batch.")
    if not callable(batch_fn):
        raise ValueError(f"`batch_fn` must be a callable `batch_fn(micro_batch_size) -> batch`, got {batch_fn!r}.")
    check_positive_int("effective_batch_size", effective_batch_size)
    if effective_batch_size > INT64_MAX:
        raise ValueError(
            f"`effective_batch_size` must be at most 2**63 - 1 (the largest int64: torch and the samplers count"
            f" samples in it), got {effective_batch_size}."
        )
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


def _checkpointing(gradient_checkpointing: Any, checkpoint_modules: Any) -> tuple[bool | Literal["auto"], Any]:
    """``gradient_checkpointing`` checked and ``checkpoint_modules`` as a tuple (or ``None``)."""
    if not (isinstance(gradient_checkpointing, bool) or gradient_checkpointing == "auto"):
        raise ValueError(
            f"`gradient_checkpointing` must be True, False or 'auto' (try without and with), got"
            f" {gradient_checkpointing!r}. Name the blocks to checkpoint with `checkpoint_modules`."
        )
    modules = normalize_checkpoint_modules(checkpoint_modules)
    if gradient_checkpointing is False and modules is not None:
        raise ValueError(
            f"`checkpoint_modules`={modules!r} with `gradient_checkpointing=False`: nothing would be checkpointed."
            " Pass `gradient_checkpointing=True` (or 'auto') to checkpoint those blocks, or drop `checkpoint_modules`."
        )
    return gradient_checkpointing, modules


def plan_memory(
    module: nn.Module,
    batch_fn: Callable[[int], Any],
    *,
    effective_batch_size: int,
    budget: int | float | str | None = None,
    devices: int = 1,
    num_nodes: int = 1,
    margin: float = 0.1,
    precision: str = "auto",
    gradient_checkpointing: bool | Literal["auto"] = "auto",
    checkpoint_modules: Sequence[type[nn.Module] | str] | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    device: str = "cuda",
    progress: Callable[[str], None] | None = None,
    gpu: str | tuple[int, int] | None = None,
    strategy: str = "auto",
    shard_modules: Sequence[type[nn.Module] | str] | None = None,
    evaluation: str | None = None,
) -> MemoryPlan:
    """Choose micro-batch, accumulation, precision and checkpointing so a training step fits a memory budget.

    Every candidate is estimated with :func:`estimate_memory` at its own micro-batch and with the gradient
    accumulation it would run with (with accumulation the gradients stay alive through every micro-batch): first the
    whole per-device batch, then micro-batch 1; between them the need is taken as affine in the micro-batch and the
    largest divisor predicted to fit is estimated to verify it (a binary search below it where it does not fit). The
    effective batch is kept exactly. On several ranks DDP is skipped, before any estimate, when its parameters,
    gradients and gradient buckets alone exceed the usable memory. The chosen
    setting's own estimate, with its accumulation, fits the usable memory. A LightningModule with manual
    optimization cannot accumulate (Lightning refuses it), so only its whole per-device batch is estimated.
    Activation checkpointing is chosen only when it at least doubles the micro-batch (it costs about a third more
    compute; halving the accumulation saves more). Under DDP one more copy of the gradients (the buckets) is counted
    per device. The plan is numbers: ``MemoryPreset.from_plan(plan)`` builds the preset and its Trainer arguments.

    On ``devices x num_nodes`` > 1 ranks it also chooses how the ranks hold the model (``strategy="auto"``): DDP
    when the whole model fits each rank at some micro-batch (the single-device estimate plus DDP's gradient buckets;
    faster: no all-gathers); otherwise FSDP2 over all the ranks (``estimate_memory(world_size=...)``, per-block
    sharding, ``reshard_after_forward=True``); CPU offload of the shards only as the last resort. The same search
    runs for each (micro-batch, accumulation, checkpointing) and the effective batch (micro-batch x accumulation x
    ranks) is kept. When nothing fits, the advice plans the GPUs FSDP2 would need for micro-batch 1 (estimated at
    the first two counts of 2, 4, 8, ... from a lower bound; said to be a lower bound when that estimate does not
    fit).

    Args:
        module: as for :func:`estimate_memory`.
        batch_fn: ``batch_fn(micro_batch_size)`` -> a batch of that many samples (CPU tensors, which are faked, or
            meta tensors, which hold no memory at any size: the largest micro-batch is tried first).
        effective_batch_size: samples per optimizer step over all devices; kept exactly.
        budget: the device's memory: bytes, a size (``"40GB"``, ``"24GiB"``) or a GPU name from
            :data:`GPU_MEMORY` (``"A100-40GB"``); ``None`` reads the current CUDA device.
        devices: data-parallel devices per node (``effective_batch_size`` must divide by ``devices x num_nodes``).
        num_nodes: nodes.
        margin: fraction of the usable memory left free for what is not modelled (fragmentation, cuDNN, NCCL).
        precision: ``"auto"`` (``bf16-mixed`` where the GPU computes bf16, else ``16-mixed``; ``32-true`` for
            ``device="cpu"``; a budget given as a size says nothing about the GPU, so bf16 is assumed: pass
            ``precision="16-mixed"`` for a V100 or T4 given by size) or one precision to use.
        gradient_checkpointing: ``"auto"`` tries without and with; ``True``/``False`` fixes it. "Without" is the
            model as it is: a model that checkpoints itself (e.g. an HF model with gradient checkpointing enabled)
            stays checkpointed.
        checkpoint_modules: the blocks to checkpoint when checkpointing (module classes, class names or name
            patterns); ``None``: the default blocks, as :class:`~lightning_memopt.GradientCheckpointing` chooses.
        optimizer: as for :func:`estimate_memory`.
        loss_fn: as for :func:`estimate_memory`.
        device: as for :func:`estimate_memory`.
        progress: called with one line on the micro-batches to choose from, then one line per estimate (the CLI
            prints them); ``None`` logs them at INFO on the ``lightning_memopt.planner.plan`` logger.
        gpu: the target GPU for its cuBLAS workspace (see :func:`estimate_memory`); default: the GPU named by
            ``budget``, or the current CUDA device's when ``budget`` is ``None``.
        strategy: ``"auto"`` (DDP where it fits, else FSDP2, else FSDP2 with CPU offload), ``"ddp"`` or
            ``"fsdp2"`` (FSDP2 only, CPU offload where nothing else fits); needs ``devices x num_nodes`` > 1 unless
            ``"auto"``.
        shard_modules: the blocks FSDP2 shards (as for :func:`estimate_memory`); ``None``: the repeated blocks.
        evaluation: ``"validate"``, ``"test"`` or ``"predict"`` also plans that stage's batch per device (Lightning
            asks for none: evaluation holds no gradients or optimizer states, so it usually fits a larger batch): the
            largest that fits, from the training micro-batch doubled up to 4 x the per-device batch, at the planned
            precision (:attr:`MemoryPlan.eval_batch_size`). Not planned under FSDP2 (not modelled yet).

    Returns:
        a :class:`MemoryPlan`. When even micro-batch 1 with the most saving settings does not fit, ``plan.feasible``
        is ``False`` and ``plan.advice`` says what would (8-bit optimizer states, or FSDP2 over N GPUs).

    Examples:
        >>> model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512))
        >>> plan = plan_memory(model, lambda b: torch.randn(b, 128, 512), effective_batch_size=64,
        ...                    budget="20MB", device="cpu")
        >>> plan.micro_batch_size, plan.accumulate_grad_batches, plan.precision
        (8, 8, '32-true')
        >>> print(plan.table())
        micro-batch  accumulate  precision  checkpointing      needs  fits
        ------------------------------------------------------------------
                 64           1    32-true             no  72.02 MiB    no
                  1          64    32-true             no  10.27 MiB   yes
                  8           8    32-true             no  17.02 MiB   yes
    """
    _check_plan_arguments(batch_fn, effective_batch_size, devices, num_nodes, margin, device, precision, evaluation)
    gradient_checkpointing, modules = _checkpointing(gradient_checkpointing, checkpoint_modules)
    world = devices * num_nodes
    _check_strategy(strategy, world, shard_modules)
    limit = _resolve_budget(budget, gpu, device, margin, precision)
    report = progress if progress is not None else _log.info
    per_device = effective_batch_size // world
    sizes = _micro_batches(per_device, loss_fn is None and is_manual_optimization(module), report)
    settings = PlanSettings(
        module,
        batch_fn,
        limit.usable,
        limit.precision,
        device,
        gpu=limit.gpu,
        optimizer=optimizer,
        loss_fn=loss_fn,
        progress=report,
        checkpoint_modules=modules,
        shard_modules=shard_modules,
    )
    found = search_plan(
        settings,
        effective=effective_batch_size,
        world=world,
        sizes=sizes,
        gradient_checkpointing=gradient_checkpointing,
        strategy=strategy,
        evaluation=evaluation,
    )
    done, final = found.done, found.final
    chosen, checkpointed = final.chosen, final.checkpointed
    if chosen is None:
        estimate = final.smallest()
        # the advice speaks of the model states on the GPU: of the last estimate without CPU offload
        on_gpu = [stage for stage in done if not stage.runs.cpu_offload][-1].smallest()
        advice = _advice(on_gpu, limit.usable, world, checkpointed, sizes[0], found.gpus)
    else:
        estimate, advice = final.runs.estimates[(chosen, checkpointed)], ""
    gpus = found.gpus
    return MemoryPlan(
        feasible=chosen is not None,
        effective_batch_size=effective_batch_size,
        micro_batch_size=chosen,
        accumulate_grad_batches=None if chosen is None else per_device // chosen,
        precision=limit.precision,
        gradient_checkpointing=checkpointed,
        checkpoint_modules=modules if checkpointed else None,
        budget_bytes=limit.total,
        budget_label=limit.label,
        usable_bytes=limit.usable,
        margin=margin,
        devices=devices,
        num_nodes=num_nodes,
        device=device,
        preset_name=tier_for_memory(limit.total / 1024**3)[1],
        estimate=estimate,
        trials=tuple(t for stage in done for t in stage.runs.trials),
        advice=advice,
        strategy=final.runs.strategy,
        strategy_reason=_reason(done, world, strategy),
        **_sharding_fields(module, estimate, shard_modules),
        gpus_needed=gpus.number if gpus is not None else None,
        gpus_needed_planned=gpus is not None and gpus.planned,
        **_evaluation_fields(found.evaluation),
        policy_estimate=found.policy,
    )


def _evaluation_fields(planned: EvaluationPlan | None) -> dict[str, Any]:
    """The plan's ``eval_*`` fields (none when no evaluation stage was asked for)."""
    if planned is None:
        return {}
    return {
        "eval_stage": planned.stage,
        "eval_batch_size": planned.size,
        "eval_estimate": planned.estimate,
        "eval_trials": planned.trials,
        "eval_note": planned.note,
    }


def _check_strategy(strategy: Any, world: int, shard_modules: Any) -> None:
    check_choice("strategy", strategy, PLAN_STRATEGIES)
    if strategy != "auto" and world == 1:
        raise ValueError(
            f"`strategy`={strategy!r} needs several ranks, but `devices` x `num_nodes` = 1. Pass `devices` (GPUs per"
            " node) and `num_nodes`, or leave `strategy='auto'`."
        )
    if shard_modules is not None and (world == 1 or strategy == "ddp"):
        raise ValueError(
            f"`shard_modules`={shard_modules!r} names the blocks FSDP2 shards, but this plan never shards"
            f" (`devices` x `num_nodes` = {world}, `strategy`={strategy!r}). Drop `shard_modules`, or plan for"
            " several GPUs."
        )


def _sharding_fields(module: nn.Module, estimate: MemoryEstimate, shard_modules: Any) -> dict[str, Any]:
    """FSDP2's options and the blocks and roots sharded (``None`` when ``configure_model`` shards itself)."""
    sharding = estimate.sharding
    if sharding is None:
        return {}
    fields: dict[str, Any] = {
        "reshard_after_forward": sharding.reshard_after_forward,
        "cpu_offload": sharding.cpu_offload,
    }
    if sharding.source != "configure_model":
        blocks = default_shard_blocks(module, shard_modules)
        roots = [""]
        if is_lightning_module(module):
            roots = child_roots(module, blocks)
        fields.update(shard_blocks=tuple(blocks), shard_roots=tuple(roots))
    return fields
