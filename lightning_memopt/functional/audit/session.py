"""The Trainer-free core of ``MemoryAudit``: :class:`AuditSession`, the state of one audit across a fit and every
decision it makes (the model audit, where stray copies are held, the leak samples, the DataLoader reports and the
texts of the findings).

The callback gives the session the model, the step and an ``emit`` function that writes one record
(``emit(reading, event, batch_idx, **keys)``, see ``docs/memory-log.md``); the session decides what to write and
what to warn. Tests drive it with a fake memory reader and a list as ``emit``. The maths of leaks lives in
:mod:`~lightning_memopt.functional.audit.leaks`, what a DataLoader costs in
:mod:`~lightning_memopt.functional.audit.loaders`.
"""

from __future__ import annotations

import gc
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol

import torch

from lightning_memopt.functional.audit.leaks import (
    GradFnHolder,
    Growth,
    HolderWatch,
    LeakSampler,
    grad_fn_holders,
    growth_message,
    leak_message,
    metric_states_requiring_grad,
    tensors_with_grad_fn,
)
from lightning_memopt.functional.audit.loaders import LoaderMemory, batch_bytes, loader_memory
from lightning_memopt.functional.batching import LengthSample
from lightning_memopt.functional.footprint import (
    Duplicates,
    Footprint,
    LiveTensor,
    Sharding,
    StorageKey,
    find_duplicates,
    find_storage_holders,
    iter_held_tensors,
    model_footprint,
    model_sharding,
    storage_key,
    tensor_names,
    unexplained_bytes,
)
from lightning_memopt.functional.footprint.storage import INSPECTION_ERRORS, tensor_types
from lightning_memopt.functional.oom.batch import batch_padding
from lightning_memopt.functional.precision import double_cast
from lightning_memopt.functional.readings.memory import MemoryReading
from lightning_memopt.utilities.formatting import format_bytes
from lightning_memopt.utilities.state import StateField, as_bool, as_int, as_list, load_state
from lightning_memopt.utilities.warnings import WarnOnce

__all__ = [
    "AuditMemory",
    "AuditSession",
    "Emit",
    "ModelAudit",
    "audit_model",
    "double_cast_message",
    "duplicates_message",
    "metric_states_message",
    "validation_findings",
    "where_held",
]

Signature = tuple[StorageKey, tuple[int, ...], str]


@dataclass(frozen=True)
class ModelAudit:
    """One audit of a model: its footprint, what the allocator holds beyond it, unowned tensors and stray copies."""

    footprint: Footprint
    device: str
    unexplained: int | None
    unowned: list[LiveTensor]
    duplicates: Duplicates
    sharding: Sharding | None = None  # how the parameters are sharded (``None``: not read)

    def fields(self, when: str, max_listed: int) -> dict[str, Any]:
        """The keys of an ``audit`` record after the reading (``docs/memory-log.md``)."""
        record: dict[str, Any] = {
            "audit": when,
            "footprint": self.footprint.as_dict(),
            "footprint_device_bytes": self.footprint.total_bytes(self.device),
            "unexplained_bytes": self.unexplained,
            "unowned_tensor_bytes": sum(t.bytes for t in self.unowned),
            "num_unowned_tensors": len(self.unowned),
            "largest_unowned": [t.as_dict(with_name=False) for t in self.unowned[:max_listed]],
        }
        if self.duplicates.num_tensors:
            record["duplicates"] = self.duplicates.as_dict()
        else:
            record["duplicates"] = None
        return record

    def metrics(self, with_duplicates: bool) -> dict[str, float]:
        """The logged ``memory/audit/*`` metrics; ``duplicate_bytes`` counts only when the copies are warned about."""
        metrics = {f"memory/audit/{k}_bytes": float(v) for k, v in self.footprint.bytes_by_category().items()}
        if self.unexplained is not None:
            metrics["memory/audit/unexplained_bytes"] = float(self.unexplained)
        metrics["memory/audit/duplicate_bytes"] = float(self.duplicates.bytes if with_duplicates else 0)
        return metrics

    def text(self, when: str) -> str:
        """The printed summary: the footprint table (this rank's shards of a sharded model, with the unsharded whole
        beside them), unexplained bytes and unowned live tensors."""
        title = f"MemoryAudit ({when.replace('_', ' ')}): model and optimizer footprint"
        lines = [title, self.footprint.table()]
        if self.sharding is not None and self.sharding.sharded:
            lines[0] = f"{title} of this rank"
            lines.append(f"model {self.sharding.text()}")
        if self.unexplained is not None:
            lines.append(
                f"unexplained allocated bytes on {self.device}: {format_bytes(self.unexplained)}"
                f" ({self.unexplained} bytes)"
            )
        lines.append(
            f"live tensors on {self.device} not owned by the model or optimizer: {len(self.unowned)},"
            f" {format_bytes(sum(t.bytes for t in self.unowned))}"
        )
        return "\n".join(lines)


def audit_model(
    module: torch.nn.Module,
    footprint: Footprint,
    live: Sequence[LiveTensor],
    allocated_bytes: int | None,
    device: str,
    max_listed: int = 5,
    known: Iterable[Signature] = (),
) -> ModelAudit:
    """Audit ``module`` from its ``footprint`` and the ``live`` tensors (named with ``tensor_names``).

    ``known`` are the copies an earlier audit found (``Duplicates.signatures``): they still count after training
    moved the weights away from their values.

    Examples:
        >>> from lightning_memopt.functional.footprint import live_tensors, model_footprint, tensor_names
        >>> model = torch.nn.Linear(4, 2)
        >>> result = audit_model(model, model_footprint(model), live_tensors("cpu", tensor_names(model)), None, "cpu")
        >>> result.fields("fit_start", 5)["footprint_device_bytes"], result.unexplained
        (40, None)
    """
    unowned = [t for t in live if t.name is None]
    duplicates = find_duplicates(module, live, max_listed=max_listed, known=known)
    unexplained = unexplained_bytes(allocated_bytes, footprint, device)
    return ModelAudit(footprint, device, unexplained, unowned, duplicates, model_sharding(module))


def where_held(module: torch.nn.Module, dup: Duplicates) -> str:
    """Where the largest copies are held, as attribute paths from the LightningModule, in one sentence.

    Examples:
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 2)
        ...         self._hparams = {"backbone": torch.nn.Linear(2, 2)}
        >>> from lightning_memopt.functional.footprint import live_tensors, tensor_names
        >>> net = Net()
        >>> where_held(net, find_duplicates(net, live_tensors("cpu", tensor_names(net)), match_values=False))[:42]
        "Held at self._hparams['backbone']. That is"
    """
    try:
        found = find_storage_holders(module, [t.key for t in dup.largest if t.key is not None])
    except INSPECTION_ERRORS:
        found = {}
    paths = sorted(set(found.values()))
    if not paths:
        return "Where: not in an attribute of the LightningModule (a variable, a closure or another object holds them)."
    text = "Held at " + ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "") + "."
    names = sorted({m.group(1) for p in paths if (m := re.search(r"_hparams(?:_initial)?\[['\"](\w+)['\"]\]", p))})
    if names:
        ignore = ", ".join(f'"{n}"' for n in names)
        text += (
            " That is a copy kept by `save_hyperparameters()`: call"
            f" `self.save_hyperparameters(ignore=[{ignore}])` (the weights are in the checkpoint's `state_dict`"
            " already), or save only its configuration."
        )
    elif any("hparams" in p for p in paths):
        text += (
            " That is a copy kept by `save_hyperparameters()`: pass `ignore=[...]` with the module's argument"
            " name, or save only its configuration."
        )
    return text


def duplicates_message(rank: int, when: str, device: str, dup: Duplicates, held: str) -> str:
    """The duplicate-copies warning: how many, their bytes and dtypes, where they are held, the likely cause."""
    largest = ", ".join(
        f"{tuple(t.shape)} {t.dtype.replace('torch.', '')} {format_bytes(t.bytes)}" for t in dup.largest
    )
    return (
        f"MemoryAudit [rank {rank}] ({when.replace('_', ' ')}): {dup.num_tensors} tensors on {device}"
        f" ({format_bytes(dup.bytes)} = {dup.bytes} bytes, dtypes {', '.join(dup.dtypes)}) are not owned by the"
        f" model or optimizer but have the shapes of its parameters: {dup.fraction:.2f}x the parameters'"
        f" elements. {held} Likely cause: {dup.cause}. Largest: {largest}."
    )


def double_cast_message(rank: int, precision: str, param_dtype: str) -> str:
    """The warning for a Trainer's autocast precision on top of FSDP2's ``MixedPrecisionPolicy`` (see ``double_cast``).

    Examples:
        >>> double_cast_message(0, "bf16-mixed", "torch.bfloat16").split(":")[0]
        'MemoryAudit [rank 0]'
    """
    return (
        f"MemoryAudit [rank {rank}]: `Trainer(precision={precision!r})` and the model's FSDP"
        f" `MixedPrecisionPolicy(param_dtype={param_dtype})` both lower precision: FSDP casts the parameters per unit"
        " and autocast casts every operation again. Keep one: `Trainer(precision='32-true')` with the policy, or"
        " drop `mp_policy` from `fully_shard` in `configure_model`."
    )


def validation_findings(rank: int, outputs: Any, batch_idx: int, grad_enabled: bool) -> list[tuple[str, str]]:
    """``(key, warning)`` for a ``validation_step`` that returned tensors with autograd history or left grad on.

    Examples:
        >>> [key for key, _ in validation_findings(0, {"out": torch.ones(1, requires_grad=True) * 2}, 0, True)]
        ['validation-graph', 'validation-grad-enabled']
    """
    found = []
    count, nbytes = tensors_with_grad_fn(outputs)
    if count:
        found.append(
            (
                "validation-graph",
                f"MemoryAudit [rank {rank}]: validation_step (batch {batch_idx}) returned {count} tensors with"
                f" autograd history ({format_bytes(nbytes)} plus their graphs): validation code ran with grad"
                " enabled (`torch.enable_grad()`/`set_grad_enabled(True)`) and built graphs. Detach what you"
                " return, or compute under `torch.no_grad()`.",
            )
        )
    if grad_enabled:
        found.append(
            (
                "validation-grad-enabled",
                f"MemoryAudit [rank {rank}]: grad is enabled after validation_step (batch {batch_idx}):"
                " something called `torch.set_grad_enabled(True)` in validation code, so every validation"
                " forward builds an autograd graph. Use `with torch.enable_grad():` around the part that needs it.",
            )
        )
    return found


def metric_states_message(rank: int, found: Sequence[str]) -> str:
    """The warning for metric states that hold tensors requiring grad (from ``metric_states_requiring_grad``)."""
    return (
        f"MemoryAudit [rank {rank}]: metric states hold tensors that require grad: {', '.join(found)}."
        " Each `update` keeps its autograd graph alive until `reset`: pass detached tensors"
        " (`metric.update(preds.detach(), target)`)."
    )


def _sample(value: Any) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError("not a [step, bytes] pair")
    return as_int(0)(value[0]), as_int(0)(value[1])


#: The saved leak check: losing it only restarts the leak window (and may warn about a leak a second time).
_STATE = {
    "leak_samples": StateField(as_list(_sample), "a list of [step, bytes] pairs of non-negative ints", default=[]),
    "leak_reported": StateField(as_bool, "a bool", default=False),
}


def _module_global_keys() -> set[StorageKey | None]:
    """The storages of tensors that modules keep as globals (a library's constants): reachable, never garbage.

    Module namespaces only, not what their containers hold: the cost is the number of module-level names, not the
    size of the data a process keeps."""
    wanted = tensor_types()
    namespaces = [vars(m) for m in list(sys.modules.values()) if isinstance(getattr(m, "__dict__", None), dict)]
    values = chain.from_iterable(list(namespace.values()) for namespace in namespaces)
    return {storage_key(v) for v in values if type(v) in wanted}


def _may_hold_garbage(live: Sequence[LiveTensor], alive: Any) -> bool:
    """Whether a live storage is neither named (owned by the model or optimizers), nor held by ``alive``, nor a
    module's global."""
    unowned = {t.key for t in live if t.name is None}
    if alive is not None:
        unowned -= {storage_key(tensor) for _, _, tensor in iter_held_tensors(alive)}
    return bool(unowned) and not unowned <= _module_global_keys()


#: Writes one record and returns it: ``emit(reading, event, batch_idx, **keys) -> record``.
Emit = Callable[..., Any]


class AuditMemory(Protocol):
    """The device an audit reads: :class:`~lightning_memopt.functional.readings.memory.DeviceMemory` or a fake."""

    device: torch.device
    has_device_memory: bool

    def read(self) -> MemoryReading: ...


class AuditSession:
    """The state of ``MemoryAudit`` across a fit and every decision it makes; raises what its checks raise.

    Args:
        memory: The training device's memory.
        sampler: The leak samples (:class:`LeakSampler`) and the time budget of their object walks.
        duplicate_fraction: Fraction of the parameters' elements stray copies must mirror before a warning.
        max_listed: How many of the largest unowned tensors / copies a record lists.
        collect_garbage: Whether to free unreachable objects before each audit (a full ``gc.collect()`` when it
            can change a finding, see :meth:`live`).
        rank: The rank, for the warnings.

    Examples:
        >>> from lightning_memopt.functional.readings.memory import DeviceMemory
        >>> records = []
        >>> session = AuditSession(DeviceMemory("cpu"), LeakSampler(3, 1, None), 0.5, 5, collect_garbage=False)
        >>> emit = lambda reading, event, batch_idx, **keys: records.append((event, keys.get("audit")))
        >>> session.audit(torch.nn.Linear(2, 2), [], "fit_start", emit).footprint.total_bytes()
        24
        >>> records
        [('audit', 'fit_start')]
    """

    def __init__(
        self,
        memory: AuditMemory,
        sampler: LeakSampler,
        duplicate_fraction: float,
        max_listed: int,
        collect_garbage: bool,
        rank: int = 0,
    ) -> None:
        self.memory = memory
        self.sampler = sampler
        self.holders = HolderWatch(sampler.window)
        #: The DataLoader audit of the fit: one :class:`LoaderMemory` per loader (its bytes once measured).
        self.loaders: list[LoaderMemory] = []
        #: The loaders whose first batch is not measured yet, by name.
        self.unmeasured: dict[str, Any] = {}
        #: the first training batches' lengths, for the max_length finding
        self.length_sample = LengthSample()
        self.host_total_bytes = 0
        self.duplicate_fraction = duplicate_fraction
        self.max_listed = max_listed
        self.collect_garbage = collect_garbage
        self.rank = rank
        #: What the audit found: each warned once per fit (:meth:`new_fit`), every fit.
        self.findings = WarnOnce(every_time=True)
        self.duplicates_seen: frozenset[Any] = frozenset()
        self.warn_duplicates = False
        #: The last ``audit`` record emitted (``fit_start`` or ``first_step``).
        self.last_audit: dict[str, Any] | None = None
        self.leak_reported = False
        #: The leak verdict that was warned about, if any.
        self.leak: Growth | None = None

    def state_dict(self) -> dict[str, Any]:
        """The leak samples and whether a leak was reported, for a checkpoint."""
        return {"leak_samples": [list(sample) for sample in self.sampler.samples], "leak_reported": self.leak_reported}

    def load_state_dict(self, state_dict: Any, owner: str = "MemoryAudit") -> None:
        """Restore :meth:`state_dict`'s values; a bad or missing one warns (naming ``owner``) and starts fresh.

        Both keys are harmless to lose: the leak window fills again (the last ``window`` samples are kept).
        """
        state = load_state(owner, state_dict, _STATE)
        self.sampler.samples.clear()
        self.sampler.samples.extend(state["leak_samples"])
        self.leak_reported = state["leak_reported"]

    def new_fit(self, resumed: bool) -> None:
        """Start a fit: findings warn again, loaders are audited afresh; a new run (not ``resumed``) also forgets its
        leak samples."""
        self.findings.reset()
        self.duplicates_seen = frozenset()
        self.loaders, self.unmeasured = [], {}
        self.length_sample = LengthSample()
        if not resumed:
            self.sampler.samples.clear()
            self.leak_reported, self.leak = False, None
        self.holders.samples.clear()
        self.sampler.restart()

    # ---------------------------------------------------------------- footprint and duplicates
    def audit(
        self,
        module: torch.nn.Module,
        optimizers: Sequence[Any],
        when: str,
        emit: Emit,
        precision: str | None = None,
        alive: Any = None,
    ) -> ModelAudit:
        """Audit the footprint and stray copies (``when``: ``fit_start``/``first_step``): emit the ``audit`` record
        and, once per fit, a ``duplicates`` warning (also warned). With the Trainer's ``precision``, a sharded model
        whose FSDP mixed precision autocast would cast again is warned about once per fit. ``alive``: what the
        caller still holds (the batch and the step's outputs), whose tensors cannot be garbage (see :meth:`live`)."""
        footprint = model_footprint(module, optimizers)
        live = self.live(tensor_names(module, optimizers), alive)
        reading = self.memory.read()
        device = str(self.memory.device)
        # Copies found at fit start still count after the first step moved the weights away from their values.
        result = audit_model(
            module, footprint, live, reading.allocated_bytes, device, self.max_listed, self.duplicates_seen
        )
        dup = result.duplicates
        self.duplicates_seen = dup.signatures
        self.warn_duplicates = dup.num_tensors > 0 and dup.fraction >= self.duplicate_fraction
        self.last_audit = emit(reading, "audit", None, **result.fields(when, self.max_listed))
        param_dtype = None if result.sharding is None else result.sharding.param_dtype
        if precision is not None and double_cast(precision, param_dtype):
            self.findings.warn("double-cast", double_cast_message(self.rank, precision, str(param_dtype)))
        if self.warn_duplicates:
            message = duplicates_message(self.rank, when, device, dup, where_held(module, dup))
            if self.findings.warn("duplicates", message):
                keys = {"duplicate_bytes": dup.bytes, "num_duplicate_tensors": dup.num_tensors}
                emit(reading, "warning", None, check="duplicates", message=message, **keys)
        return result

    def live(self, names: Mapping[StorageKey, str], alive: Any = None) -> list[LiveTensor]:
        """The live tensors on the device, ``names`` attached; unreachable ones freed first (``collect_garbage``).

        The full ``gc.collect()`` costs a pass over every object the process tracks, so it runs only when it can
        change what the audit finds: when the walk sees a storage on the device that nothing names, ``alive`` does
        not hold and no module keeps as a global. Without one, every tensor seen is held by the model, its
        optimizers, the caller or a module, so none is garbage and a collection would find the same tensors.
        """
        live = self.sampler.timed_walk(self.memory.device, names=names)
        if self.collect_garbage and _may_hold_garbage(live, alive):
            gc.collect()
            live = self.sampler.timed_walk(self.memory.device, names=names)
        return live

    # ---------------------------------------------------------------- dataloaders
    def start_loaders(self, named: Sequence[tuple[str, Any]], emit: Emit) -> None:
        """Report the settings of the fit's loaders (``(name, loader)``, see ``fit_loaders``) before their workers
        start; each one's bytes wait for its first batch (:meth:`measure_loader`)."""
        import psutil

        self.host_total_bytes = int(psutil.virtual_memory().total)
        self.unmeasured = dict(named)
        for name, loader in named:
            self._report_loader(name, loader, None, emit)

    def measure_loader(self, name: str, batch: Any, emit: Emit) -> LoaderMemory | None:
        """Report loader ``name`` with the bytes of its first ``batch``; ``None`` once measured (or not a loader)."""
        loader = self.unmeasured.pop(name, None)
        if loader is None:
            return None
        padding = [dict(found) for found in batch_padding(batch)]
        return self._report_loader(name, loader, batch_bytes(batch), emit, padding)

    def sample_lengths(self, batch: Any, emit: Emit) -> None:
        """Add a training batch's lengths to :attr:`length_sample`; once it has enough, rank zero warns (and emits) the
        ``max_length`` finding, if any."""
        sample = self.length_sample
        sample.add([dict(found) for found in batch_padding(batch)])
        if not sample.done or self.rank != 0:
            return
        finding = sample.finding("train")
        if finding is not None:
            message = f"MemoryAudit: {finding}"
            if self.findings.warn("loader-max-length", message):
                emit(self.memory.read(), "warning", None, check="dataloaders", message=message, loader="train")

    def _report_loader(
        self, name: str, loader: Any, nbytes: int | None, emit: Emit, padding: list[dict[str, Any]] | None = None
    ) -> LoaderMemory | None:
        """Audit one loader: emit its ``dataloaders`` record once measured; on rank zero warn (and emit) each
        finding once per fit."""
        info = loader_memory(
            loader,
            name,
            self.memory.device.type,
            host_total_bytes=self.host_total_bytes,
            evaluation=name.startswith("val"),
            batch_bytes=nbytes,
            padding=padding,
        )
        if info is None:
            return None
        self.loaders = [*(i for i in self.loaders if i.name != name), info]
        reading = self.memory.read()
        if nbytes is not None:
            emit(reading, "dataloaders", None, loader=info.as_dict(), host_total_bytes=self.host_total_bytes)
        if self.rank == 0:  # the loaders are the same on every rank: rank zero speaks for them
            for finding in info.findings:
                message = f"MemoryAudit: {finding}"
                if self.findings.warn(f"loader-{finding}", message):
                    emit(reading, "warning", None, check="dataloaders", message=message, loader=info.name)
        return info

    # ---------------------------------------------------------------- leaks
    def holder_sample(self, module: torch.nn.Module, step: int, batch_idx: int, emit: Emit) -> None:
        """The cheap leak check: attributes of ``module`` holding more tensors with autograd history every sample."""
        holders = grad_fn_holders(module)
        found = self.holders.add(step, holders)
        if found is not None:
            self._report_leak(batch_idx, found.growth, holders, found.describe(), emit)

    def leak_sample(self, module: torch.nn.Module, step: int, batch_idx: int, emit: Emit) -> None:
        """One memory sample (allocated bytes; on CPU live tensor bytes); a leak warning when the window grows."""
        memory = self.memory
        value = self._sampled_bytes()
        growth = None
        if value is not None:
            growth = self.sampler.add(step, value)
        if growth is not None:
            steps = [s for s, _ in self.sampler.samples]
            what = growth_message(growth, steps, memory.device, allocated=memory.has_device_memory)
            self._report_leak(batch_idx, growth, grad_fn_holders(module), what, emit)

    def _sampled_bytes(self) -> int | None:
        """The bytes a leak sample reads: allocated bytes where the device has them, else live tensor bytes."""
        memory = self.memory
        if memory.has_device_memory:
            return memory.read().allocated_bytes
        return self.sampler.live_bytes(memory.device)

    def _report_leak(self, batch_idx: int, growth: Growth, holders: list[GradFnHolder], what: str, emit: Emit) -> None:
        self.leak_reported, self.leak = True, growth
        message = leak_message(self.rank, what, holders)
        self.findings.warn("leak", message)
        keys = {
            "bytes_per_step": growth.bytes_per_step,
            "first_step": growth.first_step,
            "samples": list(self.sampler.samples),
            "grad_fn_holders": [{"path": h.path, "num_tensors": h.num_tensors, "bytes": h.bytes} for h in holders],
        }
        emit(self.memory.read(), "warning", batch_idx, check="leak", message=message, **keys)

    # ---------------------------------------------------------------- grad tracking
    def check_validation_outputs(self, outputs: Any, batch_idx: int) -> None:
        """Warn (once per fit each) about validation outputs with autograd history and grad left enabled."""
        for key, message in validation_findings(self.rank, outputs, batch_idx, torch.is_grad_enabled()):
            self.findings.warn(key, message)

    def check_metric_states(self, module: torch.nn.Module) -> None:
        """Warn (once per fit) about metric states holding tensors that require grad."""
        found = metric_states_requiring_grad(module)
        if found:
            self.findings.warn("metric-states-grad", metric_states_message(self.rank, found))
