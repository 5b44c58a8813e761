"""What ``MemoryAudit`` decides during a fit, without a Trainer: audits, leak samples, loader reports, findings.

:class:`AuditSession` holds the state of one audit across a fit. The callback gives it the model, the step and an
``emit`` function that writes one record (``emit(reading, event, batch_idx, **keys)``, see ``docs/memory-log.md``);
the session decides what to write and what to warn. Tests drive it with a fake memory reader and a list as ``emit``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from lightning_memopt.functional.audit import (
    LoaderWatch,
    ModelAudit,
    audit_model,
    duplicates_message,
    metric_states_message,
    validation_findings,
    where_held,
)
from lightning_memopt.functional.footprint import model_footprint, tensor_names
from lightning_memopt.functional.leak_watch import HolderWatch, LeakSampler, growth_message, leak_message
from lightning_memopt.functional.leaks import GradFnHolder, Growth, grad_fn_holders, metric_states_requiring_grad
from lightning_memopt.functional.loaders import LoaderMemory
from lightning_memopt.functional.memory import MemoryReading
from lightning_memopt.utilities.state import StateField, as_bool, as_int, as_list, load_state
from lightning_memopt.utilities.warnings import WarnOnce

__all__ = ["AuditMemory", "AuditSession", "Emit"]


def _sample(value: Any) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError("not a [step, bytes] pair")
    return as_int(0)(value[0]), as_int(0)(value[1])


#: The saved leak check: losing it only restarts the leak window (and may warn about a leak a second time).
_STATE = {
    "leak_samples": StateField(as_list(_sample), "a list of [step, bytes] pairs of non-negative ints", default=[]),
    "leak_reported": StateField(as_bool, "a bool", default=False),
}

#: Writes one record and returns it: ``emit(reading, event, batch_idx, **keys) -> record``.
Emit = Callable[..., Any]


class AuditMemory(Protocol):
    """The device an audit reads: :class:`~lightning_memopt.functional.memory.DeviceMemory` or a fake."""

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
        collect_garbage: Whether to run one full ``gc.collect()`` before each audit.
        rank: The rank, for the warnings.

    Example:
        >>> from lightning_memopt.functional.memory import DeviceMemory
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
        self.loaders = LoaderWatch(memory.device.type, 0)
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
        """Start a fit: findings warn again; a new run (not ``resumed``) also forgets its leak samples."""
        self.findings.reset()
        self.duplicates_seen = frozenset()
        if not resumed:
            self.sampler.samples.clear()
            self.leak_reported, self.leak = False, None
        self.holders.samples.clear()
        self.sampler.restart()

    # ---------------------------------------------------------------- footprint and duplicates
    def audit(self, module: torch.nn.Module, optimizers: Sequence[Any], when: str, emit: Emit) -> ModelAudit:
        """Audit the footprint and stray copies (``when``: ``fit_start``/``first_step``): emit the ``audit`` record
        and, once per fit, a ``duplicates`` warning (also warned)."""
        if self.collect_garbage:
            gc.collect()
        footprint = model_footprint(module, optimizers)
        live = self.sampler.timed_walk(self.memory.device, names=tensor_names(module, optimizers))
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
        if self.warn_duplicates:
            message = duplicates_message(self.rank, when, device, dup, where_held(module, dup))
            if self.findings.warn("duplicates", message):
                keys = {"duplicate_bytes": dup.bytes, "num_duplicate_tensors": dup.num_tensors}
                emit(reading, "warning", None, check="duplicates", message=message, **keys)
        return result

    # ---------------------------------------------------------------- dataloaders
    def new_loaders(self) -> LoaderWatch:
        """Forget the loaders of an earlier fit (at train start)."""
        self.loaders = LoaderWatch(self.memory.device.type, 0)
        return self.loaders

    def start_loaders(self, named: Sequence[tuple[str, Any]], emit: Emit) -> None:
        """Report the settings of the fit's loaders (``(name, loader)``, see ``fit_loaders``) before workers start."""
        import psutil

        self.loaders.host_total_bytes = int(psutil.virtual_memory().total)
        for info in self.loaders.start(named):
            self.report_loader(info, False, emit)

    def measure_loader(self, name: str, batch: Any, emit: Emit) -> str | None:
        """Report loader ``name`` with the bytes of its first ``batch``; the summary to print, if any."""
        info = self.loaders.measure(name, batch)
        return None if info is None else self.report_loader(info, True, emit)

    def report_loader(self, info: LoaderMemory, measured: bool, emit: Emit) -> str | None:
        """Emit a loader's ``dataloaders`` record once ``measured``; on rank zero warn (and emit) each finding once.
        Returns the summary to print (rank zero, measured), else ``None``."""
        reading = self.memory.read()
        if measured:
            emit(reading, "dataloaders", None, loader=info.as_dict(), host_total_bytes=self.loaders.host_total_bytes)
        if self.rank != 0:
            return None  # the loaders are the same on every rank: rank zero speaks for them
        for finding in info.findings:
            message = f"MemoryAudit: {finding}"
            if self.findings.warn(f"loader-{finding}", message):
                emit(reading, "warning", None, check="dataloaders", message=message, loader=info.name)
        return f"MemoryAudit: DataLoader {info.summary()}" if measured else None

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
        value = memory.read().allocated_bytes if memory.has_device_memory else self.sampler.live_bytes(memory.device)
        growth = None if value is None else self.sampler.add(step, value)
        if growth is not None:
            steps = [s for s, _ in self.sampler.samples]
            what = growth_message(growth, steps, memory.device, allocated=memory.has_device_memory)
            self._report_leak(batch_idx, growth, grad_fn_holders(module), what, emit)

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
