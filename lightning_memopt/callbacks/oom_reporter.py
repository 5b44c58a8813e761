"""OOMReporter: one actionable out-of-memory report per failing rank."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from lightning_memopt.callbacks.gradient_checkpointing import is_checkpointed
from lightning_memopt.functional import footprint as fp
from lightning_memopt.functional.memory import read_memory, supports_device_memory
from lightning_memopt.functional.oom import (
    REPORT_FORMAT,
    allocator_settings,
    collect_environment,
    collect_versions,
    describe_batch,
    parse_oom_message,
    render_markdown,
    suggest_fixes,
)
from lightning_memopt.utilities import _torch_private
from lightning_memopt.utilities.checks import (
    check_bool,
    check_non_negative_int,
    check_path,
    check_positive_int,
    check_writable_dir,
)
from lightning_memopt.utilities.files import check_dir_creatable, write_text_atomic
from lightning_memopt.utilities.oom import find_in_traceback, is_out_of_memory_error
from lightning_memopt.utilities.redaction import redact_secrets
from lightning_memopt.utilities.run_id import RunIdCallback, ensure_run_id, run_id
from lightning_memopt.utilities.trainer import default_artifact_dir, trainer_device
from lightning_memopt.utilities.warnings import WarnOnce, log

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["OOMReporter"]

_HOW_TO_OPEN = (
    "Open https://pytorch.org/memory_viz in a browser and drop the file on the page (it stays on your machine),"
    " or run `python -m torch.cuda._memory_viz trace_plot {name} -o {stem}.html` and open the HTML file."
)
_MAX_REMEMBERED = 100
#: Module names listed in the report where checkpointing is on (the counts are always complete).
_MAX_LISTED = 20
#: Set on an exception object once it is reported, so the same error is never written twice.
_REPORTED_MARK = "_lightning_memopt_reported"


class OOMReporter(RunIdCallback):
    """Writes a JSON and a Markdown post-mortem on every rank where fit/validate/test/predict dies of out-of-memory.

    When the trainer stops on an out-of-memory error (see
    :func:`~lightning_memopt.utilities.oom.is_out_of_memory_error`: CUDA, MPS, XPU, ROCm, cuBLAS/cuDNN
    allocation failures, the host allocator), the failing rank writes ``oom_report_rank{r}.json`` and
    ``oom_report_rank{r}.md`` to ``dirpath``. The report holds

    * **when and where**: time, rank and world size, trainer function and stage, epoch, global step, batch
      index, the exception's type, message and location;
    * **the failing batch**: shapes, dtypes, devices and sizes of its tensors, read from the local ``batch`` of
      the innermost traceback frame that has one;
    * **memory at failure**: the :func:`~lightning_memopt.functional.memory.read_memory` fields, the
      allocator's ``memory_summary()`` where the backend has one, and the numbers in the error message;
    * **who holds memory**: parameter, gradient, optimizer-state and buffer bytes by dtype and device, the
      ``top_k_tensors`` largest live tensors on the device with their model/optimizer names where known, and
      "unexplained" bytes (allocated minus all of those: activations and temporaries);
    * **configuration**: precision, ``accumulate_grad_batches``, micro-batch and effective batch size,
      strategy, accelerator, devices, the allocator settings (``PYTORCH_ALLOC_CONF``,
      ``PYTORCH_CUDA_ALLOC_CONF``), whether activation checkpointing is on and for which modules, and the
      torch/Lightning/lightning-memopt versions;
    * **environment**: variables whose names start with an allowed prefix (``CUDA_``, ``NCCL_``, ``PYTORCH_``,
      ``TORCH_``, ``OMP_``, ...); any name containing KEY, TOKEN, SECRET, PASSWORD, CREDENTIAL or AUTH has its
      value replaced by ``<redacted>``;
    * **ranked suggestions** computed from those numbers (activation checkpointing is not suggested when it is on).

    With ``record_history=True`` on CUDA, the allocator's history (allocations, frees and their stack
    traces, the last ``max_entries`` events) is recorded from ``setup`` on, and ``oom_snapshot_rank{r}.pickle``
    is written at the failure; it opens in PyTorch's memory viewer (https://pytorch.org/memory_viz) and the
    report says how. Recording is switched off again at ``teardown`` and after an exception. Recording costs
    time on every allocation: use it to investigate, not in every run. Devices without it get one warning and
    the report without a snapshot.

    Measured cost (``python benchmarks/callback_overhead.py``: CPU, one thread, 1,000-step fits at a 32 ms
    step): nothing per step (no per-step hook) and under 0.2 ms once per fit (setup, train start), without
    ``record_history``.

    Guarantees:

    * The reporter never raises: whatever fails while the report is gathered is logged and listed in the
      report, and the original exception reaches the user unchanged (Lightning re-raises it).
    * Every out-of-memory error is reported once: an error object that was reported already (the same
      exception seen again) is not written twice, while a new error in the same process, e.g. a retry of
      the same step at a smaller batch, gets a report of its own (the earlier one is moved aside, see below).
    * Nothing is overwritten: if ``oom_report_rank{r}.*`` from an earlier failure exist in ``dirpath``, they are
      first renamed with the earlier report's UTC time as suffix (``oom_report_rank0-20250101T120000Z.json``),
      so the unsuffixed name always holds the newest report.
    * Only the failing rank writes, and it never communicates with the other ranks on the way: the
      directory (and anything else that needs all ranks) is resolved in ``setup``, so an error on one rank
      cannot turn into a hang. Under DDP the other ranks may wait in a collective until the launcher or the
      process group ends them; they write nothing.
    * The directory is checked in ``setup``: a ``dirpath`` that is a file, lies under a file or cannot be
      written is refused there, before the first step, not discovered at the failure. It is created only
      when a report is written. A report that cannot be written (a full disk) is logged and warned about,
      and the original error still reaches the caller.

    Args:
        dirpath: Directory of the reports; created when the first report is written. Default:
            ``<trainer.log_dir or default_root_dir>/oom``, resolved in ``setup``.
        record_history: Record CUDA allocator history and write an allocator snapshot at the failure.
        max_entries: How many allocator events the history keeps (a ring buffer).
        top_k_tensors: How many of the largest live tensors on the device to list (0 to skip the scan).

    Device requirements: works on every device. Allocator figures, ``memory_summary`` and snapshots need a
    backend that has them (CUDA; XPU and MPS partly); on CPU the report has host figures and ``null`` for
    device fields.

    Example:
        >>> reporter = OOMReporter(dirpath="oom_reports", top_k_tensors=10)
        >>> reporter.state_dict()
        {'reported_steps': [], 'num_reports': 0}
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        record_history: bool = False,
        max_entries: int = 100_000,
        top_k_tensors: int = 20,
    ) -> None:
        super().__init__()
        check_path("dirpath", dirpath)
        check_bool("record_history", record_history)
        check_positive_int("max_entries", max_entries, hint="It bounds how many allocator events are kept.")
        check_non_negative_int("top_k_tensors", top_k_tensors, hint="Use 0 to leave out the live-tensor list.")
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.record_history = record_history
        self.max_entries = max_entries
        self.top_k_tensors = top_k_tensors
        self._reported_steps: list[str] = []
        self._num_reports = 0
        self._recording = False
        self._resolved_dir: Path | None = None
        self._checkpointing_at_start: dict[str, Any] | None = None
        self._warn = WarnOnce()

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath)

    # ------------------------------------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Everything that may need the other ranks (``trainer.log_dir`` broadcasts) is resolved here, where all
        # ranks are present; `on_exception` runs on the failing rank alone and must not communicate.
        directory = Path(self.dirpath) if self.dirpath is not None else default_artifact_dir(trainer, "oom")
        self._resolved_dir = check_dir_creatable("dirpath", directory)
        self._checkpointing_at_start = None
        ensure_run_id(trainer)
        if not self.record_history or self._recording:
            return
        device = trainer_device(trainer)
        try:
            if device.type == "cuda" and _torch_private.supports_memory_history():
                self._recording = _torch_private.start_memory_history(self.max_entries)
        except Exception as err:
            self._warn.warn("history", f"OOMReporter: allocator history could not be started ({err!r}).")
            return
        if not self._recording:
            self._warn.warn(
                "history",
                f"OOMReporter(record_history=True): allocator history needs a CUDA device and a torch build that"
                f" records it; this run is on {device.type!r}. Reports are still written, without a snapshot.",
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Seen once, after every callback's setup: a callback that wrapped the model may unwrap it in its own
        # `on_exception` before this one reports.
        try:
            self._checkpointing_at_start = _checkpointing_state(pl_module)
        except Exception:
            self._checkpointing_at_start = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_history()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            if is_out_of_memory_error(exception):
                self._report(trainer, pl_module, exception)
        except Exception as err:  # never raise over the user's error
            log.error("OOMReporter: the out-of-memory report could not be written: %r", err)
        finally:
            # Lightning does not call `teardown` hooks after an exception: give the allocator state back here.
            self._stop_history()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"reported_steps": list(self._reported_steps), "num_reports": self._num_reports}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._reported_steps = list(state_dict.get("reported_steps", []))[-_MAX_REMEMBERED:]
        self._num_reports = int(state_dict.get("num_reports", 0))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_recording"] = False
        return state

    # ------------------------------------------------------------------------------------------------ internals

    def _stop_history(self) -> None:
        if not self._recording:
            return
        self._recording = False
        try:
            _torch_private.stop_memory_history()
        except Exception as err:
            log.warning("OOMReporter: allocator history could not be stopped: %r", err)

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        device = trainer_device(trainer)
        # Read memory first: nothing below should change the figures.
        problems: list[str] = []
        memory: dict[str, Any] = {}
        try:
            memory = read_memory(device).as_dict()
        except Exception as err:
            problems.append(f"memory reading: {err!r}")
        tb = exception.__traceback__
        when = self._when(trainer, device, tb, problems)
        if getattr(exception, _REPORTED_MARK, False):
            log.info("OOMReporter: this out-of-memory error was reported already; not writing another report.")
            return
        with contextlib.suppress(Exception):  # some exception types refuse new attributes: then report again
            setattr(exception, _REPORTED_MARK, True)
        step_key = "/".join(str(when.get(k)) for k in ("fn", "stage", "epoch", "global_step", "batch_idx"))
        self._reported_steps = [*self._reported_steps, step_key][-_MAX_REMEMBERED:]

        rank = int(when.get("rank") or 0)
        # Never `trainer.log_dir` here: it is a collective, and only this rank is in `on_exception`.
        directory = self._resolved_dir or Path(self.dirpath or Path(trainer.default_root_dir) / "oom")
        dirpath = check_writable_dir("dirpath", directory)
        names = {
            "json": dirpath / f"oom_report_rank{rank}.json",
            "md": dirpath / f"oom_report_rank{rank}.md",
            "pickle": dirpath / f"oom_snapshot_rank{rank}.pickle",
        }
        _move_aside(names)

        report: dict[str, Any] = {"format": REPORT_FORMAT, "when": when}
        message = _safe_str(exception)
        report["error"] = {
            "type": _qualified_name(type(exception)),
            "message": message,
            "location": _innermost_location(tb),
        }
        batch: dict[str, Any] = {}
        try:
            found = find_in_traceback(tb, "batch")
            if found is not None:
                batch = describe_batch(found.value)
                batch["found_in"] = f"{found.function} ({found.location})"
            else:
                batch = {"found_in": None, "tensors": [], "num_tensors": 0, "micro_batch_size": None}
        except Exception as err:
            problems.append(f"failing batch: {err!r}")
        report["batch"] = batch
        try:
            memory["summary"] = _memory_summary(device)
        except Exception as err:
            problems.append(f"memory summary: {err!r}")
        try:
            memory.update({f"message_{k}": v for k, v in parse_oom_message(message).items()})
        except Exception as err:
            problems.append(f"error message numbers: {err!r}")
        report["memory"] = memory
        report["holders"] = self._holders(trainer, pl_module, device, memory.get("allocated_bytes"), problems)
        report["config"] = self._config(trainer, batch.get("micro_batch_size"), when.get("stage"), problems)
        try:
            state = _checkpointing_state(pl_module)
            at_start = self._checkpointing_at_start if when.get("stage") == "train" else None
            if not state["on"] and at_start and at_start["on"]:
                state = dict(at_start, seen="at train start")  # given back by its callback before this report
            report["config"]["activation_checkpointing"] = state
        except Exception as err:
            problems.append(f"activation checkpointing: {err!r}")
        try:
            report["hparams"] = _hparams(pl_module)
        except Exception as err:
            problems.append(f"hyperparameters: {err!r}")
        try:
            report["environment"] = collect_environment()
        except Exception as err:
            problems.append(f"environment: {err!r}")
        try:
            report["suggestions"] = self._suggestions(report, device)
        except Exception as err:
            problems.append(f"suggestions: {err!r}")
        report["snapshot"] = self._snapshot(names["pickle"], device, problems)
        report["report_errors"] = problems

        # One pass over everything gathered: credentials inside any value (env, hparams, config, messages) go.
        report = redact_secrets(report)
        failed: list[str] = []
        try:
            write_text_atomic(names["json"], json.dumps(report, indent=2, default=_json_default) + "\n")
        except Exception as err:
            failed.append(f"{names['json']}: {err!r}")
        try:
            markdown = render_markdown(report)
        except Exception as err:
            markdown = f"# Out-of-memory report\n\nThe Markdown form could not be rendered ({err!r}); see the JSON.\n"
        try:
            write_text_atomic(names["md"], markdown)
        except Exception as err:
            failed.append(f"{names['md']}: {err!r}")
        if failed:
            message = (
                f"OOMReporter: out-of-memory on rank {rank}, but the report could not be written"
                f" ({'; '.join(failed)}). The original error is re-raised unchanged."
            )
            log.error(message)
            self._warn.warn("write", message)
            return
        self._num_reports += 1
        log.warning("OOMReporter: out-of-memory on rank %d; report written to %s", rank, names["md"])

    def _when(
        self, trainer: pl.Trainer, device: torch.device, tb: TracebackType | None, problems: list[str]
    ) -> dict[str, Any]:
        when: dict[str, Any] = {"time": time.time(), "rank": 0, "world_size": 1, "run_id": run_id(trainer)}
        try:
            state = trainer.state
            when.update(
                rank=trainer.global_rank,
                local_rank=trainer.local_rank,
                node_rank=trainer.node_rank,
                world_size=trainer.world_size,
                fn=None if state.fn is None else str(state.fn.value),
                stage=None if state.stage is None else str(state.stage.value),
                epoch=trainer.current_epoch,
                global_step=trainer.global_step,
                batch_idx=None,
                device=str(device),
            )
            found = find_in_traceback(tb, "batch_idx")
            if found is not None and isinstance(found.value, int):
                when["batch_idx"] = found.value
        except Exception as err:
            problems.append(f"training position: {err!r}")
        return when

    def _holders(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        device: torch.device,
        allocated: int | None,
        problems: list[str],
    ) -> dict[str, Any]:
        holders: dict[str, Any] = {"device": str(device)}
        try:
            optimizers = list(getattr(trainer, "optimizers", []) or [])
            footprint = fp.model_footprint(pl_module, optimizers)
            holders["bytes_by_category"] = footprint.bytes_by_category(str(device))
            holders["rows"] = footprint.as_dict().get("rows", [])
            holders["unexplained_bytes"] = fp.unexplained_bytes(allocated, footprint, str(device))
            if self.top_k_tensors:
                names = fp.tensor_names(pl_module, optimizers)
                live = fp.live_tensors(device, names=names)[: self.top_k_tensors]
                holders["top_tensors"] = [_live_tensor_dict(t) for t in live]
        except Exception as err:
            problems.append(f"who holds memory: {err!r}")
        return holders

    def _config(
        self, trainer: pl.Trainer, micro_batch_size: int | None, stage: str | None, problems: list[str]
    ) -> dict[str, Any]:
        config: dict[str, Any] = {}
        try:
            accumulate = int(trainer.accumulate_grad_batches)
            world_size = int(trainer.world_size)
            effective = None
            if micro_batch_size:
                effective = micro_batch_size * world_size * (accumulate if stage == "train" else 1)
            config.update(
                precision=str(trainer.precision),
                accumulate_grad_batches=accumulate,
                micro_batch_size=micro_batch_size,
                effective_batch_size=effective,
                strategy=type(trainer.strategy).__name__,
                accelerator=type(trainer.accelerator).__name__,
                num_devices=trainer.num_devices,
                num_nodes=trainer.num_nodes,
                device_ids=str(list(trainer.device_ids)),
            )
        except Exception as err:
            problems.append(f"configuration: {err!r}")
        try:
            config["allocator"] = allocator_settings()
            config["versions"] = collect_versions()
        except Exception as err:
            problems.append(f"versions: {err!r}")
        return config

    def _suggestions(self, report: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
        memory = report.get("memory", {})
        holders = report.get("holders", {})
        config = report.get("config", {})
        allocator = config.get("allocator") or {}
        conf = allocator.get("PYTORCH_ALLOC_CONF") or allocator.get("PYTORCH_CUDA_ALLOC_CONF")
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
            world_size=int(report["when"].get("world_size") or 1),
            precision=config.get("precision"),
            allocator_conf=conf,
            device_type=device.type,
            activation_checkpointing=(config.get("activation_checkpointing") or {}).get("on"),
        )

    def _snapshot(self, path: Path, device: torch.device, problems: list[str]) -> dict[str, Any]:
        if not self.record_history:
            return {"path": None, "reason": "allocator history was not recorded (pass `record_history=True`)."}
        if not self._recording:
            return {"path": None, "reason": f"allocator history is not available on {device.type!r}."}
        try:
            if _torch_private.dump_memory_snapshot(path):
                return {"path": str(path), "how_to_open": _HOW_TO_OPEN.format(name=path.name, stem=path.stem)}
        except Exception as err:
            problems.append(f"allocator snapshot: {err!r}")
            return {"path": None, "reason": f"writing it failed: {err!r}"}
        return {"path": None, "reason": "this torch build cannot write allocator snapshots."}


# ---------------------------------------------------------------------------------------------------- helpers


def _safe_str(obj: Any) -> str:
    try:
        return str(obj)
    except Exception:
        return f"<{type(obj).__name__} whose str() failed>"


def _qualified_name(cls: type) -> str:
    module = getattr(cls, "__module__", "") or ""
    return cls.__qualname__ if module in ("builtins", "") else f"{module}.{cls.__qualname__}"


def _innermost_location(tb: TracebackType | None) -> str | None:
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return None
    code = last.tb_frame.f_code
    return f"{code.co_name} ({code.co_filename}:{last.tb_lineno})"


def _memory_summary(device: torch.device) -> str | None:
    if not supports_device_memory(device):
        return None
    module = getattr(torch, device.type, None)
    summary = getattr(module, "memory_summary", None)
    if summary is None:
        return None
    return str(summary(device, abbreviated=True))


def _live_tensor_dict(tensor: Any) -> dict[str, Any]:
    return {
        "name": tensor.name,
        "shape": list(tensor.shape),
        "dtype": tensor.dtype,
        "device": tensor.device,
        "bytes": tensor.bytes,
        "requires_grad": tensor.requires_grad,
        "has_grad_fn": tensor.has_grad_fn,
    }


def _checkpointing_state(pl_module: pl.LightningModule) -> dict[str, Any]:
    """Whether activation checkpointing is on, and where: modules wrapped by ``GradientCheckpointing`` and modules
    whose Hugging Face switch is on (``gradient_checkpointing = True``)."""
    wrapped, switched = [], []
    for name, module in pl_module.named_modules():
        if is_checkpointed(module):
            wrapped.append(name)
        elif module.__dict__.get("gradient_checkpointing") is True:
            switched.append(name)
    return {
        "on": bool(wrapped or switched),
        "wrapped": wrapped[:_MAX_LISTED],
        "model_switch": switched[:_MAX_LISTED],
        "num_wrapped": len(wrapped),
        "num_model_switch": len(switched),
    }


def _hparams(pl_module: pl.LightningModule) -> dict[str, Any]:
    """The module's saved hyperparameters as JSON values (non-JSON leaves become their ``str``), ``{}`` if none."""
    hparams = getattr(pl_module, "hparams", None)
    if not hparams:
        return {}
    return json.loads(json.dumps(dict(hparams), default=_json_default))


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        try:
            return obj.item()
        except Exception:
            pass
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def _move_aside(names: dict[str, Path]) -> None:
    """Rename an earlier report's files with its UTC time as suffix, so a new report never destroys it."""
    existing = [p for p in names.values() if p.exists()]
    if not existing:
        return
    anchor = names["json"] if names["json"].exists() else existing[0]
    stamp_time = anchor.stat().st_mtime
    with contextlib.suppress(Exception):  # the earlier report's own time, if it can be read
        stamp_time = float(json.loads(anchor.read_text(encoding="utf-8"))["when"]["time"])
    stamp = datetime.datetime.fromtimestamp(stamp_time, tz=datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for attempt in range(1000):
        suffix = stamp if attempt == 0 else f"{stamp}-{attempt}"
        targets = {p: p.with_name(f"{p.stem}-{suffix}{p.suffix}") for p in existing}
        if not any(t.exists() for t in targets.values()):
            break
    for source, target in targets.items():
        os.replace(source, target)
