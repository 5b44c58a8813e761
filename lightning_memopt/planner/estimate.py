"""Will it fit? A training step's peak memory, predicted before training, without the GPU and without the memory."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_memopt.functional.planning import (
    CUDA_BLOCK_BYTES,
    DEFAULT_COMPUTE_CAPABILITY,
    FakeStepError,
    StepCount,
    attention_assumption,
    count_evaluation_steps,
    count_training_steps,
    cuda_attention,
    cuda_autocast,
    cuda_dropout,
    fake_kernel_outputs,
    kernel_scratch,
    use_foreach,
)
from lightning_memopt.functional.planning.sharding import (
    OFFLOADED_LABELS,
    PlannedSharding,
    child_roots,
    collective_labels,
    default_shard_blocks,
    describe_sharding,
    fake_process_group,
    is_sharded,
    set_reshard_after_forward,
    shard_model,
)
from lightning_memopt.planner.assumptions import assumptions, cublas_workspace
from lightning_memopt.planner.budget import gpu_compute_capability
from lightning_memopt.planner.model_step import (
    MemoryEstimateError,
    StandInTrainer,
    checkpointing_prepare,
    evaluation_step_function,
    is_lightning_module,
    is_manual_optimization,
    make_optimizers,
    manual_optimization,
    manual_step_function,
    step_function,
)
from lightning_memopt.utilities.checks import check_bool, check_choice, check_positive_int
from lightning_memopt.utilities.formatting import format_bytes, wrap_to_width

__all__ = ["ESTIMATE_PRECISIONS", "STAGES", "MemoryEstimate", "estimate_memory"]

#: The stages :func:`estimate_memory` estimates a step of (Lightning's ``trainer.fit/validate/test/predict``).
STAGES = ("fit", "validate", "test", "predict")
_STEP_NAMES = {
    "fit": "training step",
    "validate": "validation step",
    "test": "test step",
    "predict": "prediction step",
    "generate": "`generate` call",
}
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
    "unsharded_parameters": "unsharded parameters (all-gathered by FSDP2)",
    "communication": "all-gather / reduce-scatter buffers",
}
_EVALUATION_PART_TEXT = {"activations": "activations and outputs (forward)", "workspace": "cuBLAS workspace"}
#: The logger fake tensors report a failing operator on (with its traceback) before the error is raised.
_FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate(StepCount):
    """Bytes of one training step, predicted by :func:`estimate_memory`.

    ``str(estimate)`` is the report: a head line, :meth:`table` and the assumptions.

    Attributes:
        peak_bytes: the most bytes alive at once over the simulated steps (for CUDA: allocated bytes, in 512-byte
            blocks, plus cuBLAS workspaces); what ``torch.cuda.max_memory_allocated`` would report.
        peak_phase: where the peak happens: ``"forward"``, ``"backward"`` or ``"optimizer step"``.
        peak_step: 0 or 1 (optimizer states appear at step 0; gradients of step 0 are alive in step 1's forward).
        peak_micro_batch: with gradient accumulation, 0 for the first micro-batch of an optimizer step and 1 for a
            later one (its backward adds into the gradients kept since the first).
        accumulate_grad_batches: micro-batches per optimizer step (as given).
        at_peak: what the peak is made of (``parameters``, ``buffers``, ``batch``, ``gradients``,
            ``optimizer_states``, ``activations``, ``temporaries``, ``workspace``; sharded: also
            ``unsharded_parameters`` and ``communication``); adds up to ``peak_bytes``.
        parameter_bytes: the parameters' bytes (sharded: one rank's shards, padded as FSDP2 pads them).
        trainable_parameter_bytes: the bytes of the parameters that train.
        buffer_bytes: the buffers' bytes.
        gradient_bytes: the gradients' bytes.
        optimizer_state_bytes: the optimizer states' bytes.
        batch_bytes: the batch's bytes.
        phase_peaks: the highest count seen in each phase.
        device: the target device the estimate models.
        precision: the precision the estimate models.
        fake: whether it ran on fake tensors (``False``: a real step on the CPU, the fallback).
        assumptions: what was modelled and assumed, in words.
        seconds: how long the estimate took.
        steps: how many training steps were simulated.
        extra: free-form details (not compared).
        world_size: ranks the model is sharded over (1: not sharded); every byte above is one rank's.
        sharding: how the model is sharded (``None`` with ``world_size=1``): its FSDP2 units, options and the
            unsharded parameter bytes; ``str(sharding)`` describes it.
        apart_peak_bytes: with CPU offload, the most bytes on the host (:attr:`offloaded_bytes`).
        stage: the step estimated: ``"fit"`` (training) or ``"validate"``, ``"test"``, ``"predict"`` (evaluation: no
            gradients or optimizer states; ``peak_phase`` is ``"forward"``), or ``"generate"``
            (:func:`~lightning_memopt.planner.generation.estimate_generation`).

    Examples:
        >>> est = estimate_memory(nn.Linear(64, 64, bias=False), torch.randn(32, 64), device="cpu")
        >>> est.peak_phase, est.at_peak["parameters"] == est.parameter_bytes == 4 * 64 * 64
        ('optimizer step', True)
    """

    device: str
    precision: str
    fake: bool
    assumptions: tuple[str, ...] = ()
    seconds: float = 0.0
    steps: int = 2
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    world_size: int = 1
    sharding: PlannedSharding | None = None
    stage: str = "fit"

    @property
    def unsharded_parameter_bytes(self) -> int:
        """The parameters' bytes before sharding (the whole model); ``parameter_bytes`` without sharding."""
        return self.sharding.unsharded_parameter_bytes if self.sharding is not None else self.parameter_bytes

    @property
    def offloaded_bytes(self) -> int:
        """With CPU offload, the most bytes held on the host (sharded parameters, gradients, optimizer states and
        the optimizer step's temporaries); they are not in ``peak_bytes``. 0 without offload."""
        return self.apart_peak_bytes

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
        texts = _PART_TEXT if self.stage == "fit" else {**_PART_TEXT, **_EVALUATION_PART_TEXT}
        for part, nbytes in self.at_peak.items():
            if nbytes:
                rows.append((texts.get(part, part), format_bytes(nbytes), f"{nbytes / self.peak_bytes:6.1%}"))
        where = f"{self.peak_phase}, step {self.peak_step}"
        if self.accumulate_grad_batches > 1 and self.peak_phase != "optimizer step":
            where += f", {'first' if self.peak_micro_batch == 0 else 'a later'} micro-batch"
        rows.append((f"peak ({where})", format_bytes(self.peak_bytes), "100.0%"))
        width = max(len(r[0]) for r in rows)
        lines = [f"{a:<{width}}  {b:>11}  {c}".rstrip() for a, b, c in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        unsharded = ""
        if self.sharding:
            unsharded = f", {format_bytes(self.unsharded_parameter_bytes)} unsharded"
        totals = (
            f"totals{' per rank' if self.sharding else ''}: parameters {format_bytes(self.parameter_bytes)}"
            f" ({format_bytes(self.trainable_parameter_bytes)} trainable{unsharded}),"
            f" gradients {format_bytes(self.gradient_bytes)},"
            f" optimizer states {format_bytes(self.optimizer_state_bytes)}, batch {format_bytes(self.batch_bytes)}"
        )
        if self.sharding is not None and self.sharding.cpu_offload:
            totals += f"; on the host (CPU offload, not in the peak): {format_bytes(self.offloaded_bytes)} at most"
        return wrap_to_width("\n".join([*lines, totals]))

    def __str__(self) -> str:
        how = "fake tensors" if self.fake else "a real CPU step"
        per_rank = " per rank" if self.sharding is not None else ""
        head = (
            f"Estimated peak memory{per_rank} of a {_STEP_NAMES[self.stage]} on {self.device} at {self.precision}:"
            f" {format_bytes(self.peak_bytes)} ({how}, {self.seconds:.1f} s)"
        )
        sharding = [f"sharding: {self.sharding}"] if self.sharding is not None else []
        notes = [f"  - {a}" for a in self.assumptions]
        return wrap_to_width("\n".join([head, *sharding, self.table(), *(["assumed:", *notes] if notes else [])]))


def _check_arguments(
    module: Any,
    batch: Any,
    precision: str,
    optimizer: Any,
    device: str,
    steps: int,
    fake: bool,
    accumulate: int,
    manual: bool,
) -> None:
    check_choice("precision", precision, ESTIMATE_PRECISIONS)
    check_choice("device", device, ("cuda", "cpu"), hint="The CPU run models a CUDA target with `device='cuda'`.")
    check_positive_int("steps", steps)
    check_positive_int("accumulate_grad_batches", accumulate)
    if manual and accumulate > 1:
        raise ValueError(
            f"`accumulate_grad_batches`={accumulate} with manual optimization: Lightning refuses it too"
            f" ({type(module).__name__}.automatic_optimization is False). Accumulate inside `training_step` and"
            " estimate with `accumulate_grad_batches=1`."
        )
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
    if not fake and any(isinstance(t, Tensor) and t.device.type == "meta" for t in tree_flatten(batch)[0]):
        raise ValueError(
            "`fake=False` runs a real CPU step, but the batch is on the meta device (no data). Estimate it with"
            " `fake=True`, or give a CPU batch."
        )


def estimate_memory(
    module: nn.Module,
    batch: Any,
    *,
    precision: str = "32-true",
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    device: str = "cuda",
    gradient_checkpointing: bool = False,
    checkpoint_modules: Sequence[type[nn.Module] | str] | None = None,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    fake: bool = True,
    steps: int = 2,
    accumulate_grad_batches: int = 1,
    gpu: str | tuple[int, int] | None = None,
    world_size: int = 1,
    reshard_after_forward: bool | None = None,
    cpu_offload: bool = False,
    shard_modules: Sequence[type[nn.Module] | str] | None = None,
    stage: str = "fit",
    mixed_precision_policy: bool = False,
) -> MemoryEstimate:
    """Predict the peak memory of a training step (or an evaluation step), without allocating it and without a GPU.

    Runs ``steps`` training steps in Lightning's order (training step, ``zero_grad``, backward, optimizer step) on a
    fake twin of ``module``: fake CPU tensors have shapes and dtypes but no data, so a model that needs 16 GiB is
    estimated in a process of a few hundred MiB. The user's module is not changed. On the CPU the count equals a real
    step's bytes. For ``device="cuda"`` it models what CUDA does differently: attention through fused kernels (no
    ``L x L`` matrix), CUDA's autocast float32 list, ``foreach`` optimizers, 512-byte allocator blocks and cuBLAS
    workspaces; not modelled: the CUDA context, the gap between reserved and allocated memory (fragmentation), cuDNN
    and NCCL buffers, DDP gradient buckets (about one more copy of the gradients per process). Leave a margin for
    them (:func:`plan_memory` does).

    With ``accumulate_grad_batches`` the step is Lightning's accumulated one: the gradients made by the first
    micro-batch are alive through every later micro-batch, whose backward adds into them (two micro-batches per
    optimizer step are run; later ones repeat the second's memory exactly). A LightningModule with manual
    optimization (``automatic_optimization = False``) runs its own ``training_step``: ``self.optimizers()`` gives the
    optimizers of ``configure_optimizers`` (or ``optimizer``'s), ``self.manual_backward`` is counted as backward,
    ``self.lr_schedulers()``, ``self.toggle_optimizer`` and ``self.untoggle_optimizer`` work without a Trainer.

    Args:
        module: a ``LightningModule`` (its ``training_step`` and ``configure_optimizers`` run) or a plain
            ``nn.Module`` (called on the batch: ``module(**batch)`` for a dict, ``module(*batch)`` for a tuple).
            Built under ``with torch.device("meta"):`` it holds no weights: a model of any size is estimated.
        batch: one batch as the training step gets it, on the CPU (real tensors are faked; no data is copied) or
            on the meta device (``torch.empty(..., device="meta")``: shapes only, nothing allocated at any size).
        precision: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"`` (autocast around the training step, as Lightning
            does), ``"16-true"`` or ``"bf16-true"`` (weights and floating inputs cast).
        optimizer: ``optimizer(params) -> Optimizer``, e.g. ``functools.partial(torch.optim.SGD, lr=0.1,
            momentum=0.9)``; default: the LightningModule's ``configure_optimizers``, else ``AdamW``.
        device: ``"cuda"`` (modelled) or ``"cpu"``.
        gradient_checkpointing: ``True`` checkpoints as :class:`~lightning_memopt.GradientCheckpointing` does (the
            model's own switch, else PyTorch transformer layers, or the ``checkpoint_modules``); ``False``: the model
            as it is (a model that checkpoints itself stays checkpointed).
        checkpoint_modules: the blocks to checkpoint: module classes, class names or name patterns (wrapped even
            where the model has a switch); ``None``: the default blocks. Needs ``gradient_checkpointing=True``.
        loss_fn: ``loss_fn(model, batch) -> loss`` instead of the training step; for a plain module the default is
            the output's ``.loss``, a scalar output itself, or the sum of the output.
        fake: ``False`` runs a real step on the CPU instead (the fallback for a step that cannot run on fake tensors;
            it allocates the memory, so use a small batch).
        steps: optimizer steps to simulate (2 sees every peak: optimizer states appear at the first).
        accumulate_grad_batches: micro-batches per optimizer step, as Lightning's ``Trainer`` argument (``batch`` is
            one micro-batch).
        gpu: the target GPU for ``device="cuda"``: a name from :data:`~lightning_memopt.planner.GPU_MEMORY`
            (``"H100-80GB"``) or a compute capability (``(9, 0)``); it sets the cuBLAS workspace (32 MiB on compute
            capability 9.0, else 8 MiB + 128 KiB, each; ``CUBLAS_WORKSPACE_CONFIG`` in the environment overrides
            both). ``None``: not 9.0.
        world_size: ranks the model is sharded over with FSDP2 (``fully_shard``), as Lightning's
            ``ModelParallelStrategy(data_parallel_size=world_size)`` does; 1: not sharded (the single-device
            estimate). Every byte of the result is then one rank's. The run stays in this process: a fake process
            group of ``world_size`` ranks (no communication) and a fake twin sharded with rank 0's shapes; no process
            group may be initialised already. A LightningModule whose ``configure_model`` calls ``fully_shard`` is
            sharded by it (``self.device_mesh`` is Lightning's mesh: ``"data_parallel"`` of ``world_size``,
            ``"tensor_parallel"`` of 1); any other model per block (the ``shard_modules``, else the children holding
            parameters of every ``ModuleList``/``Sequential``), then at the root (a LightningModule: each of its
            children, which its ``training_step`` may call without calling ``self``).
        reshard_after_forward: FSDP2's option: ``True`` frees a unit's all-gathered parameters after its forward
            (gathered again for backward), ``False`` keeps them to the backward; ``None``: ``True`` for the default
            sharding, as ``configure_model`` set it otherwise. Needs ``world_size`` > 1.
        cpu_offload: FSDP2 with ``CPUOffloadPolicy``: the sharded parameters, their gradients and the optimizer
            states live on the host, the optimizer step runs there; they are counted in
            :attr:`MemoryEstimate.offloaded_bytes`, not in ``peak_bytes``. With a ``configure_model`` that shards,
            give its ``fully_shard`` the policy too (the bytes are counted as offloaded either way). Needs
            ``world_size`` > 1.
        shard_modules: the blocks the default sharding shards (module classes, class names or name patterns, as
            ``checkpoint_modules``); ``None``: the repeated blocks. Needs ``world_size`` > 1 and a model that
            ``configure_model`` does not shard.
        stage: ``"fit"`` (a training step) or ``"validate"``, ``"test"``, ``"predict"``: the evaluation step
            Lightning's loop runs (eval and inference mode, no gradients or optimizer; ``trainer.predict``'s
            predictions kept on the CPU). Training-only arguments are refused with an evaluation stage.
        mixed_precision_policy: FSDP2's own mixed precision instead of autocast: the default sharding's
            ``fully_shard`` gets ``MixedPrecisionPolicy(param_dtype=<precision's dtype>, reduce_dtype=float32)`` and
            the step runs without autocast (the Trainer at ``precision="32-true"``). Needs ``world_size`` > 1,
            ``precision`` ``"bf16-mixed"`` or ``"16-mixed"`` and a model that ``configure_model`` does not shard.

    Returns:
        a :class:`MemoryEstimate`; ``print(estimate)`` shows its breakdown and assumptions.

    Raises:
        ValueError: an argument is not one the function takes (the message names it),
            ``accumulate_grad_batches`` > 1 with manual optimization, or ``world_size`` > 1 while a process group is
            initialised.
        MemoryEstimateError: the step cannot run on fake tensors (the message names the operator and the
            fallback), the optimizer cannot be built, the training step returns no loss, or the checkpointing matches
            no submodule.

    Examples:
        >>> model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
        >>> est = estimate_memory(model, torch.randn(32, 256), device="cpu")
        >>> est.parameter_bytes == 4 * (256 * 1024 + 1024 + 1024 * 10 + 10)
        True
        >>> est.optimizer_state_bytes == 2 * est.parameter_bytes + 4 * 4  # AdamW: two moments, a step per tensor
        True
        >>> sharded = estimate_memory(model, torch.randn(32, 256), device="cpu", world_size=2)
        >>> sharded.parameter_bytes * 2 == sharded.unsharded_parameter_bytes == est.parameter_bytes
        True
    """
    manual = stage == "fit" and loss_fn is None and is_manual_optimization(module)
    _check_arguments(module, batch, precision, optimizer, device, steps, fake, accumulate_grad_batches, manual)
    _check_stage(stage, optimizer, gradient_checkpointing, accumulate_grad_batches, world_size)
    if fake and stage == "fit":
        _refuse_sparse_gradients(module)
    lightning = is_lightning_module(module)
    param_dtype = _policy_dtype(mixed_precision_policy, precision, world_size)
    sharded = _ShardedRun(world_size, reshard_after_forward, cpu_offload, shard_modules, lightning, param_dtype)
    autocast = "32-true" if param_dtype is not None else precision  # FSDP2 owns precision: no autocast
    cuda = device == "cuda"
    # checks `gpu` before the run; evaluation runs no backward, whose thread has a workspace of its own
    workspace_bytes, workspace_text = cublas_workspace(gpu, threads=2 if stage == "fit" else 1)
    schedulers: list[Any] = []
    hooks = _StepHooks(
        autocast,
        cuda,
        checkpointing_prepare(gradient_checkpointing, checkpoint_modules),
        world_size > 1,
        training=stage == "fit",
    )
    mode, dtype = hooks.mode, hooks.dtype
    corrections = fake_kernel_outputs("cuda" if cuda else "cpu")
    capability = DEFAULT_COMPUTE_CAPABILITY
    if gpu is not None:
        capability = gpu_compute_capability(gpu)[0]
    attending = _attention_context(cuda and fake, capability)
    trainer = StandInTrainer(
        steps=steps, accumulate_grad_batches=accumulate_grad_batches, world_size=world_size, precision=precision
    )
    common: dict[str, Any] = {
        "fake": fake,
        "steps": steps,
        "block_bytes": CUDA_BLOCK_BYTES if cuda else 1,
        "scratch": kernel_scratch,
        "outputs": corrections,
        "step_context": hooks.step_context,
        "batch_fn": hooks.cast_batch,
        "dtype": dtype if mode == "true" else None,
    }
    started = time.perf_counter()
    # the CUDA models hold for the whole run: checkpointing recomputes the forward inside backward (under autocast
    # when the forward was); cuda_autocast acts only where autocast is on
    with (
        warnings.catch_warnings(),
        _quiet_fake_tensor_log(),
        attending as attention,
        _autocast_context(cuda and mode == "mixed"),
        _dropout_context(cuda and fake),
        sharded.process_group(),
    ):
        warnings.filterwarnings("ignore", message=".*self.log.*")
        warnings.filterwarnings("ignore", message=".*reference is not registered.*")
        try:
            if stage == "fit":
                counted = count_training_steps(
                    module,
                    batch,
                    _training_step_function(manual, loss_fn, lightning),
                    make_optimizers(optimizer, lightning, schedulers, trainer),
                    prepare=sharded.prepare(hooks.prepare),
                    prepare_optimizers=hooks.prepare_optimizers,
                    accumulate_grad_batches=accumulate_grad_batches,
                    manual=_manual_optimization(manual, schedulers),
                    labels=sharded.labels,
                    apart=sharded.apart,
                    **common,
                )
            else:
                counted = count_evaluation_steps(
                    module,
                    batch,
                    evaluation_step_function(stage, loss_fn, module),
                    prepare=hooks.prepare,
                    keep_outputs=stage == "predict" and not cuda,  # trainer.predict moves them to the host
                    **common,
                )
        except FakeStepError as err:
            fix = err.hint or "Make that step shape-static there,"
            raise MemoryEstimateError(
                f"{type(module).__name__}'s {_STEP_NAMES[stage]} cannot be estimated on fake tensors: {err} {fix} or"
                " estimate with a real CPU step at a small batch: `estimate_memory(..., fake=False, device='cpu')`"
                " (it allocates the memory)."
            ) from err
    seconds = time.perf_counter() - started
    counts = {f.name: getattr(counted, f.name) for f in dataclasses.fields(StepCount)}
    if cuda:  # the workspaces are taken once, beside every tensor
        counts["peak_bytes"] = counted.peak_bytes + workspace_bytes
        counts["at_peak"] = {**counted.at_peak, "workspace": workspace_bytes}
    return MemoryEstimate(
        **counts,
        device=device,
        precision=precision,
        fake=fake,
        assumptions=assumptions(
            cuda=cuda,
            fake=fake,
            foreach=any(hooks.foreach_set),
            mode=mode,
            dtype=dtype,
            workspace=workspace_text,
            accumulate=counted.accumulate_grad_batches,
            attention=_attention_text(attention, capability),
            corrections=corrections.assumptions(),
            manual=manual,
            world_size=world_size,
            cpu_offload=cpu_offload,
            stage=stage,
            param_dtype=param_dtype,
        )
        + tuple(hooks.notes),
        seconds=seconds,
        steps=steps,
        world_size=world_size,
        sharding=sharded.sharding,
        stage=stage,
    )


def _attention_context(on: bool, capability: tuple[int, int]) -> contextlib.AbstractContextManager[dict[str, int]]:
    """The CUDA attention kernels' memory (:func:`cuda_attention`) when ``on``, else a context giving an empty dict."""
    if on:
        return cuda_attention(capability)
    return contextlib.nullcontext({})


def _autocast_context(on: bool) -> contextlib.AbstractContextManager:
    """CUDA's float32 autocast functions (:func:`cuda_autocast`) when ``on``, else a context doing nothing."""
    if on:
        return cuda_autocast()
    return contextlib.nullcontext()


def _dropout_context(on: bool) -> contextlib.AbstractContextManager:
    """CUDA's dropout mask (:func:`cuda_dropout`) when ``on``, else a context doing nothing."""
    if on:
        return cuda_dropout()
    return contextlib.nullcontext()


def _training_step_function(
    manual: bool, loss_fn: Callable[[nn.Module, Any], Tensor] | None, lightning: bool
) -> Callable[[nn.Module, Any, int], Tensor]:
    """The training step to count: the model's own under manual optimization, else :func:`step_function`'s."""
    if manual:
        return manual_step_function()
    return step_function(loss_fn, lightning)


def _manual_optimization(
    manual: bool, schedulers: list[Any]
) -> Callable[[nn.Module, list[Any], Callable[..., None]], None] | None:
    """The manual optimization hooks (:func:`manual_optimization`) under manual optimization, else ``None``."""
    if manual:
        return manual_optimization(schedulers)
    return None


def _attention_text(attention: dict[str, int], capability: tuple[int, int]) -> str | None:
    """The assumption on the attention kernels that ran, ``None`` when none ran."""
    if attention:
        return attention_assumption(attention, capability)
    return None


def _refuse_sparse_gradients(module: nn.Module) -> None:
    """An embedding with ``sparse=True`` makes sparse gradients, which the fake step does not model: the estimate
    stops naming it and the real-step fallback."""
    sparse = [name for name, m in module.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise MemoryEstimateError(
            f"`{sparse[0]}` ({type(module.get_submodule(sparse[0])).__name__} with sparse=True) makes sparse"
            " gradients, which the fake training step does not model. Estimate with a real CPU step at a small"
            " batch: `estimate_memory(..., fake=False, device='cpu')` (it allocates the memory)."
        )


def _check_stage(stage: Any, optimizer: Any, checkpointing: Any, accumulate: int, world_size: int) -> None:
    check_choice("stage", stage, STAGES, hint="'fit' estimates a training step, the others Lightning's evaluation.")
    if stage == "fit":
        return
    given = {
        "optimizer": optimizer is not None,
        "gradient_checkpointing": checkpointing is True,
        "accumulate_grad_batches": accumulate != 1,
        "world_size": world_size != 1,
    }
    for name, on in given.items():
        if on:
            why = "is not modelled for evaluation yet" if name == "world_size" else "applies to training only"
            raise ValueError(f"`{name}` {why}, but `stage`={stage!r}. Drop `{name}`, or estimate `stage='fit'`.")


class _ShardedRun:
    """How a sharded estimate (``world_size`` > 1) shards the twin: the fake process group around the run, the
    sharding after the step hooks' preparation, and what the counter is told (FSDP2's buffers, the offloaded parts).
    With ``world_size`` 1 it does nothing: the estimate is the single-device one."""

    def __init__(
        self,
        world_size: int,
        reshard_after_forward: bool | None,
        cpu_offload: bool,
        shard_modules: Sequence[type[nn.Module] | str] | None,
        lightning: bool,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        _check_sharding(world_size, reshard_after_forward, cpu_offload, shard_modules)
        self.world_size, self.reshard, self.cpu_offload = world_size, reshard_after_forward, cpu_offload
        self.param_dtype = param_dtype
        self.shard_modules = tuple(shard_modules) if shard_modules is not None else None
        self.lightning = lightning
        self.mesh: Any = None
        self.sharding: PlannedSharding | None = None
        on = world_size > 1
        self.labels = collective_labels if on else None
        self.apart = OFFLOADED_LABELS if on and cpu_offload else ()

    def process_group(self) -> contextlib.AbstractContextManager:
        if self.world_size > 1:
            return self._fake_group()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _fake_group(self) -> Any:
        with fake_process_group(self.world_size) as mesh:
            self.mesh = mesh
            try:
                yield
            finally:
                self.mesh = None

    def prepare(self, base: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        if self.world_size == 1:
            return base

        def prepare(model: nn.Module) -> None:
            base(model)  # checkpointing before sharding, the order FSDP2 needs
            self.shard(model)

        return prepare

    def shard(self, model: nn.Module) -> None:
        """Shard ``model`` as its ``configure_model`` does, else per block and at the root."""
        if self.lightning:
            self._configure_model(model)
        if is_sharded(model):
            given = f"`shard_modules`={self.shard_modules!r}" if self.shard_modules is not None else None
            given = given or ("`mixed_precision_policy`" if self.param_dtype is not None else None)
            if given is not None:
                raise ValueError(
                    f"{given} shapes the default sharding, but {type(model).__name__}.configure_model shards the"
                    f" model itself. Drop {given.partition('=')[0]} (or set it in `configure_model`'s `fully_shard`)."
                )
            if self.reshard is not None:
                set_reshard_after_forward(model, self.reshard)
            source, reshard = "configure_model", self.reshard
        else:
            blocks = default_shard_blocks(model, self.shard_modules)
            # a training_step calls its submodules more often than `self(...)`: each child of a LightningModule is a
            # root of its own (a root's own parameters are gathered only when it is called)
            roots = [""]
            if self.lightning:
                roots = child_roots(model, blocks)
            reshard = True if self.reshard is None else self.reshard
            shard_model(
                model,
                self.mesh,
                blocks,
                reshard_after_forward=reshard,
                cpu_offload=self.cpu_offload,
                roots=roots,
                param_dtype=self.param_dtype,
            )
            source = "default children" if self.lightning else "default"
        self.sharding = describe_sharding(model, self.world_size, source, reshard, self.cpu_offload, self.param_dtype)

    def _configure_model(self, model: nn.Module) -> None:
        """Lightning's ``configure_model`` with what ``ModelParallelStrategy`` gives it: ``self.device_mesh``."""
        model._device_mesh = self.mesh  # what `LightningModule.device_mesh` returns
        try:
            model.configure_model()  # type: ignore[operator]
        except Exception as err:  # the user's hook, run outside a Trainer: say which hook failed
            raise MemoryEstimateError(
                f"`{type(model).__name__}.configure_model()` failed on the fake twin with a fake device mesh of"
                f" {self.world_size} ranks ({type(err).__name__}: {err})."
            ) from err


def _policy_dtype(policy: Any, precision: str, world_size: int) -> torch.dtype | None:
    """The ``param_dtype`` of FSDP2's ``MixedPrecisionPolicy`` for ``mixed_precision_policy=True`` (``None``: off)."""
    check_bool("mixed_precision_policy", policy, hint="True: FSDP2 casts the parameters instead of autocast.")
    if not policy:
        return None
    if world_size == 1 or precision not in ("bf16-mixed", "16-mixed"):
        raise ValueError(
            f"`mixed_precision_policy=True` is FSDP2's own mixed precision: it needs `world_size` > 1 and a `precision`"
            f" of 'bf16-mixed' or '16-mixed' (its compute dtype), got world_size={world_size},"
            f" precision={precision!r}."
        )
    return _DTYPES[precision.partition("-")[0]]


def _check_sharding(world_size: Any, reshard_after_forward: Any, cpu_offload: Any, shard_modules: Any) -> None:
    check_positive_int("world_size", world_size, hint="The ranks the model is sharded over; 1: not sharded.")
    if reshard_after_forward is not None:
        check_bool("reshard_after_forward", reshard_after_forward, hint="None: FSDP2's default for the sharding.")
    check_bool("cpu_offload", cpu_offload)
    if shard_modules is not None:
        entries = (shard_modules,) if isinstance(shard_modules, (str, type)) else shard_modules
        if (
            not isinstance(entries, Sequence)
            or not entries
            or not all(
                (isinstance(e, str) and e) or (isinstance(e, type) and issubclass(e, nn.Module)) for e in entries
            )
        ):
            raise ValueError(
                f"`shard_modules` must be a non-empty list of module classes, class names or name patterns, or None,"
                f" got {shard_modules!r}. Example: ['Block', 'encoder.layers.*']."
            )
    given = {
        "reshard_after_forward": reshard_after_forward is not None,
        "cpu_offload": cpu_offload,
        "shard_modules": shard_modules is not None,
    }
    named = [name for name, on in given.items() if on]
    if world_size == 1 and named:
        raise ValueError(
            f"`{named[0]}` shapes a sharded estimate, but `world_size`=1 does not shard. Pass `world_size` > 1 (the"
            f" number of GPUs FSDP2 shards over), or drop `{named[0]}`."
        )


#: Said where an evaluation estimate ran ``nn.TransformerEncoder`` without its nested-tensor fast path.
NESTED_TENSOR_NOTE = (
    "nn.TransformerEncoder without its nested-tensor fast path (evaluation with a padding mask): padded positions"
    " are counted, which the real step's nested tensors skip (the estimate is that much higher)"
)


class _StepHooks:
    """How each simulated step is prepared for ``precision`` on the target: the model's mode and checkpointing, the
    batch's dtype, autocast around the step and (for CUDA) the ``foreach`` optimizers."""

    def __init__(
        self,
        precision: str,
        cuda: bool,
        checkpoint: Callable[[nn.Module], None] | None,
        sharded: bool = False,
        training: bool = True,
    ) -> None:
        kind, _, self.mode = precision.partition("-")  # "bf16-mixed": autocast; "bf16-true": weights and inputs cast
        self.dtype = _DTYPES.get(kind)
        self.cuda, self.checkpoint, self.sharded, self.training = cuda, checkpoint, sharded, training
        self.foreach_set: list[bool] = []
        #: what preparing the model changed from the real step, said among the estimate's assumptions
        self.notes: list[str] = []

    def prepare(self, model: nn.Module) -> None:
        model.train(self.training)  # Lightning's evaluation loops run the model in eval mode
        if not self.training:
            self._without_nested_tensors(model)
        if self.checkpoint is not None:
            self.checkpoint(model)

    def _without_nested_tensors(self, model: nn.Module) -> None:
        """``nn.TransformerEncoder`` in evaluation packs a padded batch into nested tensors (its fast path), which
        fake tensors cannot hold: the model that runs keeps the padded batch instead, and the assumptions say so."""
        encoders = [m for m in model.modules() if isinstance(m, nn.TransformerEncoder) and m.use_nested_tensor]
        for encoder in encoders:
            encoder.use_nested_tensor = False
        if encoders and NESTED_TENSOR_NOTE not in self.notes:
            self.notes.append(NESTED_TENSOR_NOTE)

    def cast_batch(self, batch: Any) -> Any:
        if self.mode != "true" or self.dtype is None:
            return batch
        dtype = self.dtype

        def cast(t: Any) -> Any:
            if isinstance(t, Tensor) and t.is_floating_point():
                return t.to(dtype)
            return t

        return tree_map(cast, batch)

    def step_context(self) -> contextlib.AbstractContextManager:
        if self.mode == "mixed" and self.dtype is not None:
            return torch.autocast("cpu", dtype=self.dtype)
        return contextlib.nullcontext()

    def prepare_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        # Over FSDP2's DTensor shards, CUDA's multi-tensor kernels step in place: a real step on an H200 peaked
        # within 0.3 % of the per-tensor model, while the fake foreach path over DTensors allocates what the CPU's
        # fallback kernels do (several times the shards). So a sharded CUDA step is modelled per tensor.
        if self.cuda and not self.sharded:
            self.foreach_set.append(use_foreach(optimizers))


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Any:
    """Drop the traceback fake tensors log for a failing operator while the estimate runs: the error itself is raised
    (and reported) as it is, once. The logger is given back as it was."""
    logger = logging.getLogger(_FAKE_TENSOR_LOGGER)
    drop = _DropRecords()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
