"""``lightning-memopt estimate`` from the parsed arguments to the printed estimate or plan."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_memopt.cli_estimate.batches import (
    batch_bytes,
    batch_source,
    describe_batch,
    parse_length_batch_shape,
)
from lightning_memopt.cli_estimate.classes import InitError, build
from lightning_memopt.cli_estimate.common import EstimateInputError, squash
from lightning_memopt.cli_estimate.config import read_sections
from lightning_memopt.cli_estimate.lengths import parse_buckets, read_lengths
from lightning_memopt.cli_estimate.memory import (
    MEMORY_SECTION,
    is_preset_section,
    memory_preset,
    memory_snippet,
    preset_checkpointing,
)
from lightning_memopt.cli_estimate.settings import (
    budget_setting,
    check_flags,
    checkpointing_setting,
    int_setting,
    optimizer_setting,
    precision_setting,
)
from lightning_memopt.utilities.formatting import wrap_to_width

__all__ = ["guarded", "progress", "run_estimate", "say"]


def say(line: str) -> None:
    """A note or warning on stderr, after ``lightning-memopt estimate:``, wrapped to 100 columns."""
    print(wrap_to_width(f"lightning-memopt estimate: {line}"), file=sys.stderr, flush=True)


def progress(line: str) -> None:
    """A progress line on stderr: one line per estimate, as the planner gives it (to follow with ``grep``)."""
    print(f"lightning-memopt estimate: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_torch_logs() -> Any:
    """Drop the records of torch's loggers while the estimate runs; the command says what failed in one line.

    torch logs a traceback (``torch._subclasses.fake_tensor``) when an operator fails on fake tensors, before the
    error reaches the command; the error itself is not lost (it becomes the command's one-line message).
    """
    import torch._subclasses.fake_tensor  # noqa: F401  (its logger exists from here on)

    def drop(record: logging.LogRecord) -> bool:
        return False

    names = [n for n in list(logging.root.manager.loggerDict) if n == "torch" or n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in names]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def run_estimate(args: argparse.Namespace) -> int:
    """The ``estimate`` subcommand; returns the exit code (0 fits or estimated, 1 nothing fits)."""
    with warnings.catch_warnings(record=True) as caught, quiet_torch_logs():
        warnings.simplefilter("always")
        try:
            return _run(args)
        finally:
            seen = set()
            for warning in caught:
                if issubclass(warning.category, DeprecationWarning):
                    continue
                message = squash(warning.message)
                if message not in seen:
                    seen.add(message)
                    say(f"warning: {message}")


#: The ``memory:`` keys that decide activation checkpointing.
_CHECKPOINTING_KEYS = frozenset({"gradient_checkpointing", "checkpoint_modules"})

_PLANNER_NAMES = {
    "`effective_batch_size`": "--effective-batch-size",
    "`margin`": "--margin",
    "`devices`": "--devices",
    "`num_nodes`": "--num-nodes",
    "`precision`": "--precision",
    "`gradient_checkpointing`": "--checkpointing",
    "`checkpoint_modules`": "--checkpointing",
    "`optimizer`": "--optimizer",
    "`stage`": "--stage",
}


#: The planner's Python examples, as the command line says them.
_PLANNER_EXAMPLES = {
    "`functools.partial(torch.optim.AdamW, lr=1e-4)`": "`--optimizer AdamW --optimizer.lr 1e-4`",
    ", or pass `loss_fn=` (run in inference mode)": "",
    "`estimate_memory(..., fake=False, device='cpu')` (it allocates the memory)": "`estimate_memory(model, batch,"
    " fake=False, device='cpu')` in Python (it allocates the memory; the command line runs fake tensors only)",
}


def _one_line(err: BaseException, budget_flag: str | None = None) -> str:
    """The planner's message on one line, its argument names replaced by the flags that set them."""
    text = squash(err)
    for name, flag in {**_PLANNER_NAMES, **_PLANNER_EXAMPLES, "`budget`": budget_flag or "the budget"}.items():
        text = text.replace(name, flag)
    return text


@dataclass
class _Settings:
    """What the flags and the config decide, before the model is built."""

    devices: int
    num_nodes: int
    budget: str | None
    budget_flag: str | None
    memory: dict[str, Any] | None
    preset: Any
    precision: str
    checkpointing: Any
    accumulate: int
    preset_batch: int | None
    strategy: str = "auto"

    @property
    def world(self) -> int:
        return self.devices * self.num_nodes

    @property
    def planning(self) -> bool:
        return self.budget is not None


def _settings(args: argparse.Namespace, trainer: dict[str, Any], memory: dict[str, Any] | None) -> _Settings:
    in_memory = memory if memory is not None else {}
    devices = args.devices or int_setting(trainer.get("devices")) or int_setting(in_memory.get("devices")) or 1
    num_nodes = args.num_nodes or int_setting(trainer.get("num_nodes")) or int_setting(in_memory.get("num_nodes")) or 1
    budget, budget_flag = budget_setting(args)
    planning = budget is not None
    if memory is not None and not is_preset_section(memory):
        say(
            f"note: the config's {MEMORY_SECTION}: section holds no MemoryPreset field (name, effective_batch_size,"
            " micro_batch_size, ...); it is not MemoryPresetCLI's and is ignored."
        )
        memory = None
    preset = None
    if memory is not None:
        preset = memory_preset(memory, devices, num_nodes, f"--config: {MEMORY_SECTION}")
    # when planning, what the memory: section leaves to the preset (null) the plan chooses; what it sets is kept
    written = {k for k, v in (memory or {}).items() if v is not None}
    accumulate, preset_batch = _accumulation(preset, trainer)
    return _Settings(
        devices=devices,
        num_nodes=num_nodes,
        budget=budget,
        budget_flag=budget_flag,
        memory=memory,
        preset=preset,
        precision=_precision(args, trainer, preset, written, planning),
        checkpointing=_checkpointing(args, preset, written, planning),
        accumulate=accumulate,
        preset_batch=preset_batch,
        strategy=_strategy(preset, trainer, devices * num_nodes),
    )


def _strategy(preset: Any, trainer: dict[str, Any], world: int) -> str:
    """``"fsdp2"`` when the preset or ``trainer.strategy`` (Lightning's ``ModelParallelStrategy``) shards, ``"ddp"``
    when the preset says so; else ``"auto"`` (the plan chooses; an estimate over several ranks is DDP's)."""
    if world == 1:
        return "auto"
    if preset is not None and preset.strategy is not None:
        return str(preset.strategy)
    given = trainer.get("strategy")
    if isinstance(given, dict):
        given = given.get("class_path")
    text = str(given).lower().replace("_", "")
    return "fsdp2" if "modelparallel" in text else "auto"


def _precision(
    args: argparse.Namespace, trainer: dict[str, Any], preset: Any, written: set[str], planning: bool
) -> str:
    """``--precision``, else the preset's (``auto`` when planning and the config leaves it open), else the Trainer's."""
    if args.precision is not None:
        return precision_setting(args.precision, "--precision")
    if preset is None:
        return precision_setting(trainer.get("precision") or "auto", "trainer.precision (config)")
    if planning and "precision" not in written:
        return "auto"
    precision = precision_setting(preset.precision, f"{MEMORY_SECTION}.precision (config)")
    if precision == "auto" and not planning and args.device == "cuda":
        say(
            f"note: {MEMORY_SECTION}.precision auto is estimated as bf16-mixed, what MemoryPrecision picks on a"
            " GPU that computes bf16 (compute capability 8.0+); pass --precision 16-mixed for an older GPU."
        )
        return "bf16-mixed"
    return precision


def _checkpointing(args: argparse.Namespace, preset: Any, written: set[str], planning: bool) -> Any:
    """``--checkpointing``, else what the preset turns on (the model as it is when estimating without it)."""
    if args.checkpointing is None and preset is not None and (not planning or written & _CHECKPOINTING_KEYS):
        checkpointing = preset_checkpointing(preset)
        return None if checkpointing is False and not planning else checkpointing
    return checkpointing_setting(args.checkpointing or "auto", planning=planning)


def _accumulation(preset: Any, trainer: dict[str, Any]) -> tuple[int, int | None]:
    """Micro-batches per optimizer step, and the batch the preset gives the DataLoader (``None`` without one)."""
    if preset is None:
        accumulate = trainer.get("accumulate_grad_batches")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            accumulate = 1
        return accumulate, None
    accumulate = preset.accumulate_grad_batches
    start = preset.auto_micro_batch_start  # with auto_micro_batch the step runs at the micro-batch it starts at
    if isinstance(start, int) and start < preset.batch_size:  # its micro-batches accumulate into one batch
        accumulate *= -(-preset.batch_size // start)
    return accumulate, start if isinstance(start, int) else preset.batch_size


def _run(args: argparse.Namespace) -> int:
    specs, trainer, memory = read_sections(args)
    check_flags(args)
    model_spec = specs["model"]
    if model_spec is None or not model_spec.get("class_path"):
        where = "the config's model section has no class_path; " if model_spec is not None else ""
        raise EstimateInputError(
            f"--model: {where}pass --model CLASS_PATH (the LightningModule, e.g."
            " examples.dreams.module.SpectraFineTuner), or --config FILE with model.class_path."
        )
    settings = _settings(args, trainer, memory)
    model = _build_model(model_spec)
    if args.lengths is not None:
        return _token_budget(args, settings, model, optimizer_setting(specs), model_spec)
    batch_fn, own_batch_size, source = batch_source(args, specs, model)
    params = list(model.parameters())
    out = [
        f"Model: {model_spec['class_path']} ({sum(p.numel() for p in params):,} parameters,"
        f" {sum(p.numel() for p in params if p.requires_grad):,} trainable)"
    ]
    run = _Run(args, settings, model, optimizer_setting(specs), batch_fn, source, out)
    batch_size = args.batch_size or settings.preset_batch or own_batch_size
    if settings.planning:
        return run.plan(batch_size)
    return run.estimate(batch_size)


def _token_budget(args: argparse.Namespace, settings: _Settings, model: Any, optimizer: Any, spec: dict) -> int:
    """``--lengths``: the table of the largest batch per length bucket (needs a budget and ``--batch-shape``)."""
    from lightning_memopt.planner import plan_token_budget

    if settings.budget is None or not args.batch_shape:
        raise EstimateInputError(
            "--lengths: the table of the largest batch per length bucket needs a budget (--gpu NAME or"
            " --device-memory SIZE) and the batch's shapes with the lengths in them (--batch-shape ids=B,L:int64)."
        )
    lengths = read_lengths(args.lengths)
    buckets = parse_buckets(args.length_buckets)
    if not isinstance(buckets, int) and len(buckets[0]) != len(lengths[0]):
        raise EstimateInputError(
            f"--length-buckets: buckets of {len(buckets[0])} length(s) but --lengths has {len(lengths[0])} per sample."
        )
    batch_fn = parse_length_batch_shape(args.batch_shape, len(lengths[0]))
    sharded = settings.strategy == "fsdp2"
    say(f"planning the largest batch per length bucket of {len(lengths):,} samples for {settings.budget}")
    started = time.perf_counter()
    plan = guarded(
        lambda: plan_token_budget(
            model, batch_fn, lengths, buckets=buckets, budget=settings.budget, margin=args.margin,
            precision=settings.precision, device=args.device, devices=1 if sharded else settings.world,
            world_size=settings.world if sharded else 1, optimizer=optimizer, progress=progress,
        ),
        model,
        "--batch-shape",
        settings.budget_flag,
    )  # fmt: skip
    say(f"{plan.estimates} estimates in {time.perf_counter() - started:.1f} s")
    lines = [f"Model: {spec['class_path']} ({sum(p.numel() for p in model.parameters()):,} parameters)", str(plan)]
    print(wrap_to_width("\n".join(lines)))
    if plan.table:  # code to paste: one line each, not wrapped
        print("\n# the table for TokenBudgetBatchSampler (lightning_memopt.data):")
        print(f"budget = {plan.table!r}\nsampler = TokenBudgetBatchSampler(lengths, budget=budget)")
    return 0 if plan.table else 1


def _build_model(model_spec: dict[str, Any]) -> Any:
    from torch import nn

    model = _build_on_meta(model_spec)
    if not isinstance(model, nn.Module):
        raise EstimateInputError(
            f"--model: {model_spec['class_path']} built a {type(model).__name__}, not a"
            " LightningModule or torch.nn.Module."
        )
    return model


@dataclass
class _Run:
    """The estimate, or the plan, of one model with its settings; ``out`` collects the lines printed at the end."""

    args: argparse.Namespace
    settings: _Settings
    model: Any
    optimizer: Any
    batch_fn: Callable[[int], Any]
    source: str
    out: list[str]

    def estimate(self, batch_size: int | None) -> int:
        from lightning_memopt.planner import estimate_memory

        if batch_size is None:
            raise EstimateInputError(
                "--batch-size: needed for the estimate (B of --batch-shape); or pass --gpu /"
                " --device-memory and --effective-batch-size to plan the micro-batch."
            )
        batch = self.batch_fn(batch_size)
        if self.args.device == "cuda":
            _check_fits_a_gpu(batch, batch_size, self.source)
        settings = self.settings
        estimate = guarded(
            lambda: estimate_memory(
                self.model,
                batch,
                precision="32-true" if settings.precision == "auto" else settings.precision,
                device=self.args.device,
                **self._stage_arguments(),
            ),
            self.model,
            self.source,
            settings.budget_flag,
        )
        lines = [*self.out, f"Batch {batch_size}: {self.source}: {describe_batch(batch)}"]
        lines += [*self._world_line(), str(estimate)]
        print(wrap_to_width("\n".join(lines)))
        return 0

    def _stage_arguments(self) -> dict[str, Any]:
        """``estimate_memory``'s arguments for the stage: the training ones for ``fit``, else the stage itself."""
        if self.args.stage == "fit":
            return self._training()
        return {"stage": self.args.stage}

    def _training(self) -> dict[str, Any]:
        """``estimate_memory``'s training arguments from the flags and the config (an evaluation stage has none)."""
        settings = self.settings
        return {
            "optimizer": self.optimizer,
            "gradient_checkpointing": settings.checkpointing is not None and settings.checkpointing is not False,
            "checkpoint_modules": _modules(settings.checkpointing),
            "accumulate_grad_batches": settings.accumulate,
            **self._sharding(),
        }

    def _sharding(self) -> dict[str, Any]:
        """``estimate_memory``'s sharding arguments: FSDP2 over the world when the config shards (the preset's
        options, else FSDP2's defaults)."""
        settings = self.settings
        if settings.strategy != "fsdp2":
            return {}
        preset = settings.preset
        if preset is None or preset.strategy != "fsdp2":
            return {"world_size": settings.world}
        return {
            "world_size": settings.world,
            "reshard_after_forward": preset.reshard_after_forward,
            "cpu_offload": preset.cpu_offload,
            "mixed_precision_policy": preset.mixed_precision_policy,
        }

    def _world_line(self) -> list[str]:
        """What the estimate's bytes are over several ranks: one FSDP2 rank's, or one DDP rank's."""
        world = self.settings.world
        if world == 1:
            return []
        if self.settings.strategy == "fsdp2":
            return [f"Strategy: FSDP2 over {world} ranks (the config shards): the bytes below are one rank's."]
        return [
            f"Strategy: DDP over {world} ranks (every rank holds the whole model): the bytes below are one rank's,"
            " without DDP's gradient buckets (about one more copy of the gradients). Plan with --gpu or"
            " --device-memory to let the planner choose DDP or FSDP2."
        ]

    def plan(self, batch_size: int | None) -> int:
        from lightning_memopt.planner import plan_memory

        settings, args = self.settings, self.args
        checkpointing = settings.checkpointing
        effective = self._effective_batch(batch_size)
        say(
            f"planning {type(self.model).__name__} for {settings.budget}, effective batch {effective}:"
            " one line per estimate"
        )
        started = time.perf_counter()
        plan = guarded(
            lambda: plan_memory(
                self.model,
                self.batch_fn,
                effective_batch_size=effective,
                budget=settings.budget,
                devices=settings.devices,
                num_nodes=settings.num_nodes,
                margin=args.margin,
                precision=settings.precision,
                gradient_checkpointing="auto" if checkpointing == "auto" else checkpointing is not False,
                checkpoint_modules=_modules(checkpointing),
                optimizer=self.optimizer,
                device=args.device,
                progress=progress,
                strategy=settings.strategy,
                evaluation=None if args.stage == "fit" else args.stage,
            ),
            self.model,
            self.source,
            settings.budget_flag,
        )
        count = len(plan.trials)
        say(f"{count} estimate{'s' if count != 1 else ''} in {time.perf_counter() - started:.1f} s")
        print(wrap_to_width("\n".join([*self.out, *self._plan_lines(plan)])))
        return 0 if plan.feasible else 1

    def _effective_batch(self, batch_size: int | None) -> int:
        """``--effective-batch-size``, else the preset's, else the batch x accumulation x devices."""
        args, settings = self.args, self.settings
        preset, world = settings.preset, settings.world
        effective = args.effective_batch_size
        if effective is None and preset is not None and preset.effective_batch_size is not None:
            effective = preset.effective_batch_size
            where = f"{MEMORY_SECTION}.effective_batch_size; --effective-batch-size sets it"
            self.out.append(f"Effective batch: {effective} ({where})")
        elif effective is None:
            if batch_size is None:
                raise EstimateInputError(
                    "--effective-batch-size: needed to plan (samples per optimizer step over all"
                    " devices); there is no batch size to take it from."
                )
            accumulate = settings.accumulate
            effective = batch_size * accumulate * world
            how = f"batch size {batch_size}" + (f" x accumulate {accumulate}" if accumulate > 1 else "")
            how += f" x {world} devices" if world > 1 else ""
            self.out.append(f"Effective batch: {effective} ({how}; --effective-batch-size sets it)")
            return _divisible(effective, world)
        if args.batch_size is not None:
            say("note: --batch-size is not used when planning; the plan chooses the micro-batch.")
        return _divisible(effective, world)

    def _plan_lines(self, plan: Any) -> list[str]:
        from lightning_memopt.utilities.formatting import format_bytes

        size = plan.micro_batch_size or 1
        role = "the micro-batch" if plan.feasible else "the smallest tried"
        lines = [f"Batch {size} ({role}): {self.source}: {describe_batch(self.batch_fn(size))}"]
        if plan.estimate is not None:
            if not plan.feasible:
                lines.append(
                    f"The smallest setting tried (micro-batch {size}, activation checkpointing"
                    f" {'on' if plan.gradient_checkpointing else 'off'}) does not fit"
                    f" {format_bytes(plan.usable_bytes)}:"
                )
            lines += [str(plan.estimate), ""]
        lines.append(str(plan))
        if plan.feasible:
            lines += ["", f"# the plan as MemoryPresetCLI's {MEMORY_SECTION}: section, to paste into the config:"]
            lines.append(memory_snippet(self.settings.memory, plan))
        if plan.feasible and plan.sharded:
            from lightning_memopt.presets import MemoryPreset

            lines += ["", MemoryPreset.from_plan(plan).configure_model_recipe]
        return lines


def _modules(checkpointing: Any) -> Any:
    """The block classes or names of a ``--checkpointing`` setting (``None`` for auto, on or off)."""
    return checkpointing if isinstance(checkpointing, (list, tuple)) else None


def _divisible(effective: int, world: int) -> int:
    if effective % world:
        raise EstimateInputError(
            f"--effective-batch-size: {effective} must divide by devices x num nodes = {world}"
            f" (every device gets the same batch); use a multiple of {world}."
        )
    return effective


def _check_fits_a_gpu(batch: Any, batch_size: int, source: str) -> None:
    """One line, before the estimate, for a batch whose tensors alone exceed the memory of the largest GPU known."""
    from lightning_memopt.planner import GPU_MEMORY
    from lightning_memopt.utilities.formatting import format_bytes

    name, (gib, _) = max(GPU_MEMORY.items(), key=lambda item: item[1][0])
    nbytes = batch_bytes(batch)
    if nbytes > gib * 1024**3:
        raise EstimateInputError(
            f"--batch-size: the batch of {batch_size} from {source} is {format_bytes(nbytes)} by itself, more than"
            f" the largest GPU known holds ({name}, {gib} GiB); nothing to estimate. Lower --batch-size, or plan"
            " with --effective-batch-size and --gpu to split it into micro-batches."
        )


def _build_on_meta(model_spec: dict[str, Any]) -> Any:
    """The model built on the meta device: its ``__init__`` allocates no weights, of any size (the estimate runs them
    as fake tensors). An ``__init__`` that needs data (``.item()``, ``.numpy()``, loading weights) fails there: then
    it is built on the CPU, with a note that its weights take memory (if it fails there too, that error is the one
    reported)."""
    import torch

    try:
        with torch.device("meta"):
            return build(model_spec, "--model")
    except InitError as err:  # the user's __init__ (an import or a class path fails the same way on the CPU)
        on_meta = err
    model = build(model_spec, "--model")
    say(
        f"note: {on_meta} on the meta device, where the model is built without memory; it was built on the CPU"
        " instead, which allocates its weights."
    )
    return model


def guarded(call: Callable[[], Any], model: Any, source: str, budget_flag: str | None) -> Any:
    """Run the estimate or the plan; what goes wrong in them becomes one line."""
    from lightning_memopt.planner import MemoryEstimateError

    try:
        return call()
    except EstimateInputError:
        raise
    except MemoryEstimateError as err:
        raise EstimateInputError(_one_line(err, budget_flag)) from None
    except Exception as err:  # the user's training step failed on the batch (the planner's arguments are checked)
        raise EstimateInputError(
            f"the training step of {type(model).__name__} failed on the batch from {source} ({type(err).__name__}:"
            f" {_one_line(err)}). Check the batch (--batch-shape) or the model's init args."
        ) from None
