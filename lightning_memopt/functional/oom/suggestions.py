"""Ranked suggestions for getting a failed step to fit: one small rule per tip, applied in a fixed order."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_memopt.functional.precision import fsdp2_policy
from lightning_memopt.utilities.checks import is_finite_number
from lightning_memopt.utilities.formatting import format_bytes

if TYPE_CHECKING:
    from lightning_memopt.functional.oom.schema import Suggestion

__all__ = ["RULES", "Facts", "Tip", "suggest_fixes"]


def _fraction(part: float | None, whole: float | None) -> float | None:
    if part is None or whole is None or not (is_finite_number(part) and is_finite_number(whole)) or not whole:
        return None
    return part / whole


def percent(part: float | None, whole: float | None) -> str:
    """``part`` as a whole percentage of ``whole`` (``"42 %"``), ``"n/a"`` when either is unknown or zero."""
    fraction = _fraction(part, whole)
    return "n/a" if fraction is None else f"{100 * fraction:.0f} %"


@dataclass(frozen=True)
class Facts:
    """The numbers at the failure that the rules read (see :func:`suggest_fixes` for the arguments)."""

    stage: str | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    device_total_bytes: int | None
    device_free_bytes: int | None
    requested_bytes: int | None
    params: int
    grads: int
    opt: int
    activations: int | None  # allocated bytes no model/optimizer tensor accounts for
    total: int | None  # allocated bytes, or the bytes counted where the device does not report them
    basis: str  # what ``total`` is, for the texts
    micro_batch_size: int | None
    accumulate: int
    world_size: int
    effective_batch_size: int | None
    precision: str | None
    allocator_conf: str
    device_type: str
    activation_checkpointing: bool | None
    sharding: Mapping[str, Any] = field(default_factory=dict)  # the report's `sharding` part; empty: not sharded
    lengths: tuple[Mapping[str, Any], ...] = ()  # the failing batch's `lengths` (from its padding masks)
    data_lengths: Mapping[str, Any] = field(default_factory=dict)  # the first training batches' lengths, sampled

    @property
    def training(self) -> bool:
        return self.stage == "train"

    @property
    def sharded(self) -> bool:
        return bool(self.sharding.get("sharded"))

    @property
    def fsdp1(self) -> bool:
        """Sharded by FSDP1 (``FSDPStrategy``), whose settings are the strategy's, not ``fully_shard``'s."""
        return self.sharding.get("kind") == "fsdp1"

    @property
    def shard_ranks(self) -> str:
        """The ranks the model is sharded over, in words."""
        size = self.sharding.get("data_parallel_size")
        return f"{size} ranks" if isinstance(size, int) else "its ranks"

    @property
    def activations_dominate(self) -> bool:
        fraction = _fraction(self.activations, self.total)
        return fraction is None or fraction >= 0.3


@dataclass(frozen=True)
class Tip:
    """One suggestion before ranking: bytes it frees (``None``: unknown), a tie-break priority, the texts."""

    saves: float | None
    priority: int
    action: str
    why: str


Rule = Callable[[Facts], Iterator[Tip]]


def _activations_why(f: Facts) -> str:
    if f.activations is None:
        return "Allocated memory is unknown on this device; activations usually dominate a training step."
    return (
        f"Activations and temporaries (allocated memory no parameter, gradient, optimizer state or buffer"
        f" accounts for) are {format_bytes(f.activations)} ({percent(f.activations, f.total)} of {f.basis})."
    )


def _activations_why_after_checkpointing(f: Facts) -> str:
    why = _activations_why(f)
    if f.activation_checkpointing:
        why += " Activation checkpointing is on already: what remains is the checkpointed inputs and one layer."
    return why


def _share_of_activations(f: Facts, share: float) -> float | None:
    return None if f.activations is None else f.activations * share


def huge_allocation(f: Facts) -> Iterator[Tip]:
    """One allocation of half the device or more: a shape to check, not a setting to change."""
    requested, capacity = f.requested_bytes, f.device_total_bytes
    if requested and capacity and requested >= 0.5 * capacity:
        yield Tip(
            requested,
            0,
            "Check the shape of the tensor being allocated: one allocation is too large for the device",
            f"A single allocation of {format_bytes(requested)} was requested, {percent(requested, capacity)}"
            f" of the device's {format_bytes(capacity)}. Typical causes: a [batch, seq, seq] attention matrix, a"
            " [batch, seq, vocab] logits tensor, or a shape bug (broadcasting two large vectors).",
        )


def activation_checkpointing(f: Facts) -> Iterator[Tip]:
    """Training where activations dominate, with checkpointing off."""
    if f.training and f.activations_dominate and not f.activation_checkpointing:
        how = (
            " (the `GradientCheckpointing` callback, or `model.activation_checkpointing_enable()` for Hugging"
            " Face models; `gradient_checkpointing_enable()` before transformers 5)"
        )
        if f.fsdp1:
            how = " on the blocks, inside FSDP's units (`FSDPStrategy(activation_checkpointing_policy={Block})`)"
        elif f.sharded:
            how = (
                " on the blocks, before `fully_shard` wraps them (the `GradientCheckpointing` callback does: its"
                " `setup` runs before `configure_model`; by hand, `checkpoint_wrapper` each block, then `fully_shard`)"
            )
        yield Tip(
            _share_of_activations(f, 0.6),
            2,
            "Enable activation checkpointing: recompute layer activations in backward instead of storing them" + how,
            _activations_why(f),
        )


def smaller_micro_batch(f: Facts) -> Iterator[Tip]:
    """Training where activations dominate: halve the micro-batch (keeping the effective batch), or at 1 shorten."""
    if not (f.training and f.activations_dominate):
        return
    micro = f.micro_batch_size
    ranks = max(f.world_size, 1)
    if micro and micro >= 2 and (f.effective_batch_size or 0) > micro * f.accumulate * ranks:
        yield Tip(  # AutoMicroBatch split each batch and gave up at its smallest micro-batch
            _share_of_activations(f, 0.5),
            3,
            f"Allow AutoMicroBatch smaller micro-batches: `min_micro_batch_size` {micro} -> {micro // 2} (it split"
            f" each batch into micro-batches and gave up at {micro}); the effective batch stays"
            f" {f.effective_batch_size}",
            _activations_why_after_checkpointing(f) + " Activation memory grows linearly with the micro-batch.",
        )
    elif micro and micro >= 2:
        half = micro // 2
        effective = micro * f.accumulate * ranks
        halved = half * 2 * f.accumulate * ranks
        keeps = f"stays {effective}" if halved == effective else f"goes from {effective} to {halved}"
        yield Tip(
            _share_of_activations(f, 0.5),
            3,
            f"Halve the micro-batch and double `accumulate_grad_batches`: batch size {micro} ->"
            f" {half}, `accumulate_grad_batches` {f.accumulate} -> {2 * f.accumulate}, so the effective batch"
            f" {keeps}",
            _activations_why_after_checkpointing(f) + " Activation memory grows linearly with the micro-batch.",
        )
    elif micro == 1:
        yield Tip(
            None,
            6,
            "Shorten the inputs (sequence length, image size, crop): the micro-batch is already 1",
            _activations_why_after_checkpointing(f),
        )


def mixed_precision(f: Facts) -> Iterator[Tip]:
    """Full precision on an accelerator where activations dominate."""
    precision = f.precision
    if f.activations_dominate and precision and precision.startswith(("32", "64")) and f.device_type != "cpu":
        if f.sharded and f.sharding.get("param_dtype"):
            return  # FSDP's own mixed precision is on: the trainer's 32-bit setting is right
        yield Tip(
            _share_of_activations(f, 0.5),
            4,
            _mixed_precision_action(f),
            f"Precision is {precision!r}: activations are stored in 32 bits; mixed precision stores most of them"
            " in 16.",
        )


def _mixed_precision_action(f: Facts) -> str:
    """How to turn mixed precision on: FSDP2's ``mp_policy`` or the trainer when sharded (not by FSDP1), else the
    trainer."""
    if f.sharded and not f.fsdp1:
        return (
            f"Train in mixed precision: `fully_shard(..., mp_policy={fsdp2_policy('bf16-mixed')})` in"
            " `configure_model`, or `Trainer(precision='bf16-mixed')`, not both"
        )
    return "Train in mixed precision: `Trainer(precision='bf16-mixed')` (or '16-mixed' on GPUs without bf16)"


def evaluation_batch(f: Facts) -> Iterator[Tip]:
    """Out of memory outside training: a smaller evaluation batch, outputs off the device, gradients freed."""
    stage = f.stage
    if f.training or stage is None:
        return
    yield Tip(
        _share_of_activations(f, 0.5),
        3,
        f"Lower the {stage} batch size (the {stage} DataLoader's `batch_size`) and keep step outputs off the"
        " device (`.detach().cpu()` before storing them)",
        f"The error happened in {stage}, where no gradients are stored: the batch and the outputs kept"
        " across steps take the memory.",
    )
    if f.grads:
        yield Tip(
            f.grads,
            5,
            "Free gradients before evaluation: `optimizer.zero_grad(set_to_none=True)`",
            f"{format_bytes(f.grads)} of gradients are still held while {stage} runs.",
        )


def optimizer_state(f: Facts) -> Iterator[Tip]:
    """Optimizer states a quarter of memory or more: shard them, or a lighter optimizer."""
    if not (f.total and f.opt and f.opt / f.total >= 0.25):
        return
    if f.sharded:
        yield Tip(
            f.opt / 2,
            5,
            f"Optimizer states are sharded over {f.shard_ranks} already: shard over twice the data-parallel ranks"
            + ("" if f.fsdp1 else " (more GPUs, `ModelParallelStrategy(data_parallel_size=...)`)")
            + ", "
            + _offload(f)
            + "or use an optimizer with less state (SGD with momentum, Adafactor, an 8-bit Adam)",
            f"This rank's optimizer-state shards hold {format_bytes(f.opt)} ({percent(f.opt, f.total)} of"
            f" {f.basis}), versus {format_bytes(f.params)} of parameter shards.",
        )
        return
    sharded = f.opt * (1 - 1 / f.world_size) if f.world_size > 1 else f.opt / 2
    if f.world_size > 1:
        action = (
            "Shard the optimizer state across ranks: `strategy='fsdp'` or `strategy='deepspeed_stage_2'`,"
            " or use a lighter optimizer"
        )
    else:
        action = (
            "Use an optimizer with less state: SGD with momentum (1 state per parameter instead of Adam's 2),"
            " Adafactor, or an 8-bit Adam; with several GPUs, shard it (`strategy='fsdp'`)"
        )
    yield Tip(
        sharded,
        5,
        action,
        f"Optimizer states hold {format_bytes(f.opt)} ({percent(f.opt, f.total)} of {f.basis}), versus"
        f" {format_bytes(f.params)} of parameters.",
    )


def parameters_and_gradients(f: Facts) -> Iterator[Tip]:
    """Parameters and gradients half of memory or more in training: shard them, or train fewer."""
    held = f.params + f.grads
    if not (f.total and held / f.total >= 0.5 and f.training):
        return
    if f.sharded:
        yield Tip(
            held / 2,
            7,
            f"Parameters and gradients are sharded over {f.shard_ranks} already: shard over twice the data-parallel"
            " ranks, " + _offload(f) + "or train fewer parameters (freeze layers, adapters)",
            f"This rank's parameter and gradient shards hold {format_bytes(held)} ({percent(held, f.total)} of"
            f" {f.basis}).",
        )
        return
    if f.world_size > 1:
        action = (
            "Shard parameters and gradients (`strategy='fsdp'`), or train fewer parameters (freeze layers, adapters)"
        )
    else:
        action = (
            "Train fewer parameters (freeze layers, use adapters/LoRA) or keep weights in 16 bits"
            " (`precision='bf16-true'`)"
        )
    yield Tip(
        held * (1 - 1 / f.world_size) if f.world_size > 1 else None,
        7,
        action,
        f"Parameters and gradients hold {format_bytes(held)} ({percent(held, f.total)} of {f.basis}).",
    )


def _offload(f: Facts) -> str:
    """The CPU-offload part of a sharded tip, empty when parameters are offloaded already."""
    if f.sharding.get("cpu_offload"):
        return ""
    if f.fsdp1:
        return "offload parameters and gradients to the CPU (`FSDPStrategy(cpu_offload=True)`), "
    return (
        "offload parameters, gradients and optimizer states to the CPU"
        " (`fully_shard(..., offload_policy=CPUOffloadPolicy())`), "
    )


def reshard_after_forward(f: Facts) -> Iterator[Tip]:
    """FSDP units that keep their gathered parameters from forward to backward: free them after forward."""
    kept = f.sharding.get("kept_unsharded") or []
    if not (f.sharded and f.training and f.sharding.get("reshard_after_forward") is False and kept):
        return
    names = ", ".join(f"`{name}`" for name in kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
    yield Tip(
        None,
        2,
        f"Pass `reshard_after_forward=True` to `fully_shard` for {names}: each unit then frees its gathered"
        " parameters after forward and gathers them again for backward",
        f"{len(kept)} of the inner FSDP units keep their whole (all-gathered) parameters from forward until"
        " backward, so every layer's whole weights are held at once at the peak; resharding costs one more"
        " all-gather per unit in backward.",
    )


def _unsharded_size(f: Facts) -> str:
    """The model's unsharded parameter size in parentheses, empty when the report does not give it."""
    if isinstance(f.sharding.get("unsharded_parameter_bytes"), int):
        return f" ({format_bytes(f.sharding['unsharded_parameter_bytes'])} unsharded)"
    return ""


def units_per_block(f: Facts) -> Iterator[Tip]:
    """FSDP2 with the whole model as one unit: every parameter is gathered at once; shard per block."""
    if not (f.sharded and f.training and f.sharding.get("kind") == "fsdp2" and f.sharding.get("num_units") == 1):
        return
    yield Tip(
        None,
        2,
        "Apply `fully_shard` to each block (transformer layer, residual block) in `configure_model`, then to the"
        " root: each unit then gathers only its own parameters",
        "The model is one FSDP unit: forward and backward gather all of its parameters at once"
        + _unsharded_size(f)
        + ", so sharding saves nothing at the peak.",
    )


def fragmentation(f: Facts) -> Iterator[Tip]:
    """Reserved but unallocated memory at least a tenth of reserved and the request: expandable segments."""
    if f.reserved_bytes is None or f.allocated_bytes is None:
        return
    cached = f.reserved_bytes - f.allocated_bytes
    if (
        f.reserved_bytes
        and cached >= max(0.1 * f.reserved_bytes, f.requested_bytes or 0)
        and "expandable_segments:true" not in f.allocator_conf.replace(" ", "").lower()
        and f.device_type == "cuda"
    ):
        yield Tip(
            cached,
            1,
            "Reduce fragmentation: set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (or `PYTORCH_ALLOC_CONF`"
            " on torch >= 2.8) before the process starts",
            f"{format_bytes(cached)} ({percent(cached, f.reserved_bytes)} of reserved) was reserved by PyTorch but"
            f" not allocated when {format_bytes(f.requested_bytes)} could not be found in one piece.",
        )


def other_users(f: Facts) -> Iterator[Tip]:
    """A tenth of the device or more held outside this process's caching allocator."""
    total, free, reserved = f.device_total_bytes, f.device_free_bytes, f.reserved_bytes
    if reserved is None or not total or free is None:
        return
    others = total - free - reserved
    if others >= 0.1 * total:
        yield Tip(
            others,
            8,
            "Free the device of other users: another process, or non-PyTorch allocations (CUDA context, NCCL,"
            " cuDNN workspaces), hold memory (`nvidia-smi` lists the processes)",
            f"{format_bytes(others)} ({percent(others, total)} of the device) is used outside this"
            " process's caching allocator.",
        )


def padding(f: Facts) -> Iterator[Tip]:
    """A failing batch padded beyond its longest sample, or mostly padding: the input, not a setting, to change."""
    if not f.lengths:
        return
    found = max(f.lengths, key=lambda lengths: float(lengths.get("padding_share") or 0))
    padded_to, longest, given = found.get("padded_to"), found.get("longest"), found.get("padding_share")
    if not (isinstance(padded_to, int) and isinstance(longest, int) and isinstance(given, float) and padded_to):
        return
    share = given
    where = f"`{found.get('path')}`: {found.get('samples')} samples padded to {padded_to}"
    if longest < padded_to:
        yield Tip(
            _share_of_activations(f, 1 - longest / padded_to),
            1,
            'Pad each batch to its longest sample, not to `max_length` (`padding="longest"`, or a collate that pads'
            " to the batch's longest)",
            f"{where}, the longest has {longest}: {100 * (1 - longest / padded_to):.0f} % of the length is padding"
            " in every sample, and activations grow at least linearly with it.",
        )
    elif share >= 0.2:
        yield Tip(
            _share_of_activations(f, share),
            2,
            "Batch samples of similar length: `TokenBudgetBatchSampler` (a budget per length bucket, planned by"
            " `plan_token_budget`) or Hugging Face's `group_by_length`",
            f"{where}, from {found.get('shortest')} to {longest} long (median {found.get('median')}):"
            f" {100 * share:.0f} % of the batch's positions are padding.",
        )


def cap_max_length(f: Facts) -> Iterator[Tip]:
    """The failing batch padded far beyond the length 99 % of the data fits in (sampled from the first batches)."""
    p99 = f.data_lengths.get("p99")
    padded = [int(found["padded_to"]) for found in f.lengths if isinstance(found.get("padded_to"), int)]
    if not isinstance(p99, int) or not padded or max(padded) < 1.25 * p99:
        return
    padded_to = max(padded)
    yield Tip(
        _share_of_activations(f, 1 - p99 / padded_to),
        1,
        f"Cap `max_length` at {p99}: 99 % of the samples fit in it (the 1 % longer are truncated)",
        f"This batch is padded to {padded_to}; 99 % of the {f.data_lengths.get('samples')} samples of the first"
        f" {f.data_lengths.get('batches')} training batches are at most {p99} long (the longest"
        f" {f.data_lengths.get('longest')}).",
    )


#: The rules, in the order their tips are collected (ties in the ranking keep this order).
RULES: tuple[Rule, ...] = (
    huge_allocation,
    padding,
    cap_max_length,
    units_per_block,
    reshard_after_forward,
    activation_checkpointing,
    smaller_micro_batch,
    mixed_precision,
    evaluation_batch,
    optimizer_state,
    parameters_and_gradients,
    fragmentation,
    other_users,
)


def suggest_fixes(
    *,
    stage: str | None,
    allocated_bytes: int | None = None,
    reserved_bytes: int | None = None,
    device_total_bytes: int | None = None,
    device_free_bytes: int | None = None,
    requested_bytes: int | None = None,
    bytes_by_category: Mapping[str, int] | None = None,
    unexplained_bytes: int | None = None,
    micro_batch_size: int | None = None,
    accumulate_grad_batches: int | None = None,
    world_size: int = 1,
    effective_batch_size: int | None = None,
    precision: str | None = None,
    allocator_conf: str | None = None,
    device_type: str = "cuda",
    activation_checkpointing: bool | None = None,
    sharding: Mapping[str, Any] | None = None,
    lengths: Sequence[Mapping[str, Any]] | None = None,
    data_lengths: Mapping[str, Any] | None = None,
) -> list[Suggestion]:
    """Ranked suggestions for getting the failed step to fit, derived from the numbers at the failure.

    Each suggestion is a dict with ``rank`` (1 = try first), ``action`` (what to change), ``why`` (the
    numbers that point to it) and ``saves_bytes`` (a rough estimate of the memory it frees, or ``None``).
    Suggestions with an estimate come first, largest first; the rest keep a fixed order of usefulness.
    Each tip comes from one rule of :data:`RULES`.

    ``unexplained_bytes`` (allocated minus parameters, gradients, optimizer states and buffers) is read as
    activations and temporaries of the step.

    Args:
        stage: Where it failed: ``"train"``, ``"validate"``, ``"test"``, ``"predict"`` or ``"sanity_check"``.
        allocated_bytes: Allocated device bytes at the failure.
        reserved_bytes: Bytes the caching allocator held at the failure.
        device_total_bytes: Total device memory.
        device_free_bytes: Free device memory as the driver reported it.
        requested_bytes: Size of the allocation that failed (from the error message).
        bytes_by_category: ``parameters``, ``gradients``, ``optimizer_states``, ``buffers`` bytes on the device.
        unexplained_bytes: Allocated bytes no model/optimizer tensor accounts for.
        micro_batch_size: Samples per batch on this rank.
        accumulate_grad_batches: The trainer's gradient accumulation.
        world_size: Data-parallel ranks.
        effective_batch_size: Samples per optimizer step over the ranks; larger than ``micro_batch_size *
            accumulate_grad_batches * world_size`` when ``AutoMicroBatch`` split each batch (the tip then lowers its
            ``min_micro_batch_size``: the accumulation is its own).
        precision: The trainer's precision string (``"32-true"``, ``"bf16-mixed"``, ...).
        allocator_conf: The allocator settings in effect (``PYTORCH_ALLOC_CONF`` or the CUDA form).
        device_type: ``"cuda"``, ``"mps"``, ``"cpu"``, ...
        activation_checkpointing: whether activation checkpointing was on (``None``: unknown). When it was,
            it is not suggested again.
        sharding: The report's ``sharding`` part (``None``: not sharded). Under sharding the tips say so: no
            "shard it" that is done already; more data-parallel ranks, CPU offload, ``reshard_after_forward=True``
            and checkpointing before ``fully_shard`` instead.
        lengths: The failing batch's ``lengths`` (per padding mask: ``padded_to``, ``longest``, ``padding_share``,
            ...): a batch padded beyond its longest sample, or mostly padding, gets a tip about the input.
        data_lengths: The first training batches' lengths (``batches``, ``samples``, ``p99``, ``longest``): a batch
            padded to 1.25x their 99th percentile or more gets the tip to cap ``max_length`` there.

    Examples:
        >>> tips = suggest_fixes(stage="train", allocated_bytes=10_000, reserved_bytes=10_500,
        ...     bytes_by_category={"parameters": 1000, "gradients": 1000, "optimizer_states": 2000, "buffers": 0},
        ...     unexplained_bytes=6000, micro_batch_size=32, accumulate_grad_batches=1, precision="bf16-mixed")
        >>> [t["action"].split(":")[0] for t in tips][:2]
        ['Enable activation checkpointing', 'Halve the micro-batch and double `accumulate_grad_batches`']
    """
    cats = dict(bytes_by_category or {})
    params = cats.get("parameters", 0)
    grads = cats.get("gradients", 0)
    opt = cats.get("optimizer_states", 0)
    accounted = params + grads + opt + cats.get("buffers", 0)
    facts = Facts(
        stage=stage,
        allocated_bytes=allocated_bytes,
        reserved_bytes=reserved_bytes,
        device_total_bytes=device_total_bytes,
        device_free_bytes=device_free_bytes,
        requested_bytes=requested_bytes,
        params=params,
        grads=grads,
        opt=opt,
        activations=unexplained_bytes,
        total=allocated_bytes if allocated_bytes else (accounted + (unexplained_bytes or 0)) or None,
        # Shares are "of allocated" only where the device reported allocated bytes (not on the CPU).
        basis="allocated" if allocated_bytes else "the bytes counted",
        micro_batch_size=micro_batch_size,
        accumulate=accumulate_grad_batches or 1,
        world_size=world_size,
        effective_batch_size=effective_batch_size,
        precision=precision,
        allocator_conf=allocator_conf or "",
        device_type=device_type,
        activation_checkpointing=activation_checkpointing,
        sharding=dict(sharding or {}),
        lengths=tuple(lengths or ()),
        data_lengths=dict(data_lengths or {}),
    )
    tips = [tip for rule in RULES for tip in rule(facts)]
    saves = [None if tip.saves is None else max(int(tip.saves), 0) for tip in tips]
    order = sorted(range(len(tips)), key=lambda i: (saves[i] is None, -(saves[i] or 0), tips[i].priority))
    return [
        {"rank": rank, "action": tips[i].action, "why": tips[i].why, "saves_bytes": saves[i]}
        for rank, i in enumerate(order, start=1)
    ]
