"""Building an out-of-memory report (:class:`~lightning_memopt.functional.oom.schema.OOMReport`) without a Trainer.

The caller (``OOMReporter``) reads what only it can reach (the memory reading, first; the trainer's position
and settings through small readers) and hands the rest over as values and readers. Every part is read through
a :class:`SectionGuard`: by default a failure raises; the callback's guard notes it in ``report_errors`` and
lets the part fall back, so one broken part never costs the whole report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar, cast

import torch
from torch import nn
from typing_extensions import TypedDict

from lightning_memopt.functional import footprint as fp
from lightning_memopt.functional.micro_batch.retry import MicroBatchFacts, micro_batch_facts
from lightning_memopt.functional.oom.environment import allocator_settings, collect_environment, collect_versions
from lightning_memopt.functional.oom.message import parse_oom_message
from lightning_memopt.functional.oom.schema import (
    REPORT_FORMAT,
    BatchSection,
    ChainedError,
    CheckpointingState,
    ConfigSection,
    DataLengths,
    ErrorSection,
    HoldersSection,
    MemorySection,
    OOMReport,
    ShardingSection,
    SnapshotSection,
    Suggestion,
    WhenSection,
)
from lightning_memopt.functional.oom.sections import (
    LiveTensorLike,
    batch_section,
    checkpointing_state,
    describe_error,
    error_chain,
    fill_holders,
    hparams_as_json,
    lengths_from,
    memory_section,
    memory_summary,
)
from lightning_memopt.functional.oom.suggestions import suggest_fixes
from lightning_memopt.functional.readings.memory import MemoryReading
from lightning_memopt.utilities.oom import find_in_traceback
from lightning_memopt.utilities.redaction import redact_secrets

__all__ = [
    "ReportSources",
    "SectionGuard",
    "TrainerPosition",
    "TrainerSettings",
    "build_oom_report",
    "failure_memory",
    "failure_position",
    "suggestions_for",
]

_T = TypeVar("_T")


class SectionGuard:
    """Reads the parts of a report; a failure of a type in ``catch`` is noted and the part falls back.

    ``guard(label, read, fallback)`` returns ``read()``; when that raises one of ``catch``, it appends
    ``"<label>: <error!r>"`` to :attr:`problems` (the report's ``report_errors``) and returns ``fallback(error)``.
    Anything else propagates. The default ``catch=()`` lets every failure through.

    Examples:
        >>> guard = SectionGuard(catch=(ZeroDivisionError,))
        >>> guard("ratio", lambda: 1 / 0, lambda err: None), guard.problems
        (None, ["ratio: ZeroDivisionError('division by zero')"])
    """

    def __init__(self, catch: tuple[type[Exception], ...] = ()) -> None:
        self.catch = catch
        self.problems: list[str] = []

    def __call__(self, label: str, read: Callable[[], _T], fallback: Callable[[Exception], _T]) -> _T:
        try:
            return read()
        except self.catch as err:
            self.problems.append(f"{label}: {err!r}")
            return fallback(err)


class TrainerPosition(TypedDict):
    """Where the trainer was (read by the caller); becomes part of ``when``."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    world_size: int
    fn: str | None
    stage: str | None
    epoch: int
    global_step: int


class TrainerSettings(TypedDict):
    """The trainer's settings (read by the caller); become part of ``config``."""

    precision: str
    accumulate_grad_batches: int
    world_size: int
    strategy: str
    accelerator: str
    num_devices: int
    num_nodes: int
    device_ids: str


def _nothing(err: Exception) -> None:
    return None


def _no_batch(err: Exception) -> BatchSection:
    return {}


def _snapshot_failed(err: Exception) -> SnapshotSection:
    return {"path": None, "reason": f"writing it failed: {err!r}"}


def _not_recorded() -> SnapshotSection:
    return {"path": None, "reason": "allocator history was not recorded (pass `record_history=True`)."}


def _never_checkpointed(module: nn.Module) -> bool:
    return False


@dataclass(frozen=True)
class ReportSources:
    """Readers of what :func:`build_oom_report` needs beyond the exception; tests pass fakes.

    Args:
        settings: The trainer's settings.
        optimizers: The optimizers (for the footprint and the tensors' names).
        is_checkpointed: Whether a module is wrapped for activation checkpointing.
        snapshot: Writes the allocator snapshot and returns the ``snapshot`` part (see ``take_snapshot``).
        memory_summary: The allocator's summary of a device.
        environment: The allow-listed environment.
        allocator: The allocator settings.
        versions: The versions of the stack.
        live_tensors: The live tensors on a device, largest first (``footprint.live_tensors``).
        sharding: How the model is sharded (``footprint.model_sharding``).
        lengths_fn: The user's ``lengths_fn`` (``OOMReporter(lengths_fn=...)``): a padding mask of the failing
            batch, read into ``batch.lengths`` in place of what its own masks say.
        data_lengths: The first training batches' lengths as sampled (``batch.data_lengths``).
    """

    settings: Callable[[], TrainerSettings]
    optimizers: Callable[[], Sequence[Any]] = tuple
    is_checkpointed: Callable[[nn.Module], bool] = _never_checkpointed
    snapshot: Callable[[], SnapshotSection] = _not_recorded
    memory_summary: Callable[[torch.device], str | None] = memory_summary
    environment: Callable[[], dict[str, str]] = collect_environment
    allocator: Callable[[], dict[str, str | None]] = allocator_settings
    versions: Callable[[], dict[str, str | None]] = collect_versions
    live_tensors: Callable[..., Sequence[LiveTensorLike]] = fp.live_tensors
    sharding: Callable[[nn.Module], fp.Sharding] = fp.model_sharding
    #: ``lengths_fn(batch)`` -> a padding mask of the failing batch, for a batch without masks of its own
    lengths_fn: Callable[[Any], Any] | None = None
    #: the first training batches' lengths (``batch.data_lengths``); ``None``: none sampled
    data_lengths: Callable[[], DataLengths | None] = lambda: None


def _no_memory(err: Exception) -> MemorySection:
    return {}


def failure_memory(read: Callable[[], MemoryReading], guard: SectionGuard | None = None) -> MemorySection:
    """The ``memory`` part as ``read()`` gives it (empty if that fails and ``guard`` catches it). Read it first:
    gathering the rest of the report allocates."""
    if guard is None:
        guard = SectionGuard()
    return guard("memory reading", lambda: memory_section(read()), _no_memory)


def failure_position(
    read_position: Callable[[], TrainerPosition],
    *,
    device: torch.device,
    traceback: TracebackType | None,
    run_id: str | None,
    clock: Callable[[], float] = time.time,
    guard: SectionGuard | None = None,
) -> WhenSection:
    """The ``when`` part: ``clock()``, what ``read_position`` says and the local ``batch_idx`` of the traceback.

    If ``read_position`` fails (and ``guard`` catches it), ``when`` keeps ``time``, ``rank`` 0, ``world_size`` 1
    and ``run_id``.
    """
    if guard is None:
        guard = SectionGuard()
    when: WhenSection = {"time": clock(), "rank": 0, "world_size": 1, "run_id": run_id}

    def read() -> None:
        position = read_position()
        when.update(cast(WhenSection, {**position, "batch_idx": None, "device": str(device)}))
        found = find_in_traceback(traceback, "batch_idx")
        if found is not None and isinstance(found.value, int):
            when["batch_idx"] = found.value

    guard("training position", read, _nothing)
    return when


def _config(
    sources: ReportSources,
    micro_batch_size: int | None,
    stage: str | None,
    guard: SectionGuard,
    batch_size: int | None = None,
    data_parallel_size: int | None = None,
) -> ConfigSection:
    config: ConfigSection = {}

    def read_settings() -> None:
        settings = sources.settings()
        accumulate, world_size = settings["accumulate_grad_batches"], settings["world_size"]
        effective = None
        samples = batch_size or micro_batch_size  # the whole batch, when a micro-batch of it failed
        if samples:  # ranks that see other samples: all of them, or the sharding's data-parallel ones (not TP)
            effective = samples * (data_parallel_size or world_size) * (accumulate if stage == "train" else 1)
        config.update(
            ConfigSection(
                precision=settings["precision"],
                accumulate_grad_batches=accumulate,
                micro_batch_size=micro_batch_size,
                effective_batch_size=effective,
                strategy=settings["strategy"],
                accelerator=settings["accelerator"],
                num_devices=settings["num_devices"],
                num_nodes=settings["num_nodes"],
                device_ids=settings["device_ids"],
            )
        )

    def read_versions() -> None:
        config["allocator"] = sources.allocator()
        config["versions"] = sources.versions()

    guard("configuration", read_settings, _nothing)
    guard("versions", read_versions, _nothing)
    return config


def _checkpointing_on(checkpointing: CheckpointingState | None) -> bool | None:
    """Whether the reported activation checkpointing is on; ``None`` when it was not reported."""
    if checkpointing is None:
        return None
    return checkpointing.get("on")


def suggestions_for(report: OOMReport, device_type: str) -> list[Suggestion]:
    """:func:`~lightning_memopt.functional.oom.suggestions.suggest_fixes` fed from the parts of ``report``."""
    memory = report.get("memory", {})
    holders = report.get("holders", {})
    config = report.get("config", {})
    allocator = config.get("allocator") or {}
    checkpointing = config.get("activation_checkpointing")
    sharding = report.get("sharding")
    data_parallel = None
    if sharding:
        data_parallel = sharding.get("data_parallel_size")
    return suggest_fixes(
        stage=report["when"].get("stage"),
        allocated_bytes=memory.get("allocated_bytes"),
        reserved_bytes=memory.get("reserved_bytes"),
        device_total_bytes=memory.get("device_total_bytes") or memory.get("message_device_total_bytes"),
        device_free_bytes=memory.get("device_free_bytes"),
        requested_bytes=memory.get("message_requested_bytes"),
        bytes_by_category=holders.get("bytes_by_category"),
        unexplained_bytes=holders.get("unexplained_bytes"),
        micro_batch_size=config.get("micro_batch_size"),
        accumulate_grad_batches=config.get("accumulate_grad_batches"),
        world_size=int(data_parallel or report["when"].get("world_size") or 1),
        effective_batch_size=config.get("effective_batch_size"),
        precision=config.get("precision"),
        allocator_conf=allocator.get("PYTORCH_ALLOC_CONF") or allocator.get("PYTORCH_CUDA_ALLOC_CONF"),
        device_type=device_type,
        activation_checkpointing=_checkpointing_on(checkpointing),
        sharding=report.get("sharding"),
        lengths=report.get("batch", {}).get("lengths"),
        data_lengths=report.get("batch", {}).get("data_lengths"),
    )


def _read_lengths(batch: BatchSection, exception: BaseException, sources: ReportSources, guard: SectionGuard) -> None:
    """``batch.lengths`` from the user's ``lengths_fn``, and ``batch.data_lengths`` as sampled (what fails goes to
    ``report_errors``)."""
    lengths_fn = sources.lengths_fn

    def read() -> None:
        if lengths_fn is None:
            return
        lengths = lengths_from(exception.__traceback__, lengths_fn)
        if lengths:
            batch["lengths"] = lengths

    guard("sample lengths (lengths_fn)", read, _nothing)
    sampled = guard("sampled lengths", sources.data_lengths, _nothing)
    if sampled:
        batch["data_lengths"] = sampled


def _read_chain(error: ErrorSection, exception: BaseException, guard: SectionGuard) -> list[ChainedError]:
    """``error.chain``, set only where ``exception`` has one (a lone exception's report is as before 0.2)."""
    chain = guard("chained exceptions", lambda: error_chain(exception), _nothing)
    if chain:
        error["chain"] = chain
    return chain or []


def _message_numbers(text: str, chain: list[ChainedError]) -> dict[str, int | None]:
    """The numbers of the error message; those it lacks from the nearest chained message that has them (the
    out-of-memory error a wrapper was raised from)."""
    numbers = parse_oom_message(text)
    for entry in chain:
        found = parse_oom_message(entry["message"])
        numbers = {k: found[k] if v is None else v for k, v in numbers.items()}
    return numbers


def _micro_batch_size(facts: MicroBatchFacts | None, report: OOMReport) -> int | None:
    """The size of the micro-batch that failed: AutoMicroBatch's when it ran one, else the failing batch's."""
    if facts is not None:
        return facts.micro_batch_size
    return report["batch"].get("micro_batch_size")


def build_oom_report(
    exception: BaseException,
    *,
    when: WhenSection,
    memory: MemorySection,
    device: torch.device,
    module: nn.Module,
    sources: ReportSources,
    message: str | None = None,
    max_listed: int = 20,
    checkpointing_at_start: CheckpointingState | None = None,
    guard: SectionGuard | None = None,
) -> OOMReport:
    """The report of ``exception``, in the order of :class:`~lightning_memopt.functional.oom.schema.OOMReport`,
    with credentials redacted (:func:`~lightning_memopt.utilities.redaction.redact_secrets`).

    The exceptions ``exception`` was raised from or while handling are listed in ``error.chain``
    (:func:`~lightning_memopt.functional.oom.sections.error_chain`), their messages redacted like the rest; a
    number the message does not give (``memory.message_*``) is read from the nearest chained message that does,
    so a wrapped out-of-memory error keeps its "Tried to allocate ...".

    Args:
        exception: The out-of-memory error; its traceback gives the location, ``batch`` and ``batch_idx``.
        when: The ``when`` part (:func:`failure_position`).
        memory: The memory reading at the failure (``MemoryReading.as_dict()``), taken before anything else.
        device: The failing device.
        module: The model (footprint, activation checkpointing, ``hparams``).
        sources: Readers of the rest.
        message: The exception's text. Default: ``str(exception)``.
        max_listed: How many of the largest live tensors to list (0: no ``holders.top_tensors``).
        checkpointing_at_start: Activation checkpointing as seen at train start; reported (with
            ``seen="at train start"``) when it is off at the failure of a training step but was on then.
        guard: Reads each part; its ``problems`` become ``report_errors``. Default: failures raise.
    """
    if guard is None:
        guard = SectionGuard()
    text = str(exception) if message is None else message
    memory = cast(MemorySection, dict(memory))
    # The other required keys are set below, in the order of `OOMReport`; a part is read where its key goes.
    report = cast(
        OOMReport,
        {
            "format": REPORT_FORMAT,
            "when": when,
            "error": describe_error(exception, text),
            "batch": guard("failing batch", lambda: batch_section(exception.__traceback__), _no_batch),
            "memory": memory,
        },
    )
    chain = _read_chain(report["error"], exception, guard)
    _read_lengths(report["batch"], exception, sources, guard)

    def read_summary() -> None:
        memory["summary"] = sources.memory_summary(device)

    def read_message() -> None:
        memory.update(cast(MemorySection, {f"message_{k}": v for k, v in _message_numbers(text, chain).items()}))

    guard("memory summary", read_summary, _nothing)
    guard("error message numbers", read_message, _nothing)
    holders: HoldersSection = {"device": str(device)}
    guard(
        "who holds memory",
        lambda: fill_holders(
            holders,
            device,
            module,
            list(sources.optimizers()),
            memory.get("allocated_bytes"),
            max_listed,
            sources.live_tensors,
        ),
        _nothing,
    )
    report["holders"] = holders
    facts = micro_batch_facts(exception)  # AutoMicroBatch's last micro-batch: the frames hold only its slice
    micro = _micro_batch_size(facts, report)
    whole = facts.batch_size if facts is not None else None
    sharding = guard("sharding", lambda: sources.sharding(module), _nothing)
    data_parallel = sharding.data_parallel_size if sharding is not None and sharding.sharded else None
    config = report["config"] = _config(sources, micro, when.get("stage"), guard, whole, data_parallel)

    def read_checkpointing() -> None:
        state = checkpointing_state(module, sources.is_checkpointed)
        at_start = checkpointing_at_start if when.get("stage") == "train" else None
        if not state["on"] and at_start and at_start["on"]:
            # on at train start, given back by its callback before this report
            state = cast(CheckpointingState, {**at_start, "seen": "at train start"})
        config["activation_checkpointing"] = state

    def read_hparams() -> None:
        report["hparams"] = hparams_as_json(module)

    def read_environment() -> None:
        report["environment"] = sources.environment()

    def read_suggestions() -> None:
        report["suggestions"] = suggestions_for(report, device.type)

    guard("activation checkpointing", read_checkpointing, _nothing)
    if sharding is not None and sharding.sharded:  # only a sharded model has the part
        found = {**sharding.as_dict(), "strategy": config.get("strategy")}
        report["sharding"] = cast(ShardingSection, {k: found[k] for k in ShardingSection.__annotations__ if k in found})
    guard("hyperparameters", read_hparams, _nothing)
    guard("environment", read_environment, _nothing)
    guard("suggestions", read_suggestions, _nothing)
    report["snapshot"] = guard("allocator snapshot", sources.snapshot, _snapshot_failed)
    report["report_errors"] = guard.problems
    # One pass over everything gathered: credentials inside any value (env, hparams, config, messages) go.
    return cast(OOMReport, redact_secrets(report))
