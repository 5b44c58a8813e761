"""Out-of-memory reports: pure functions from numbers to a report dict and from the dict to Markdown.

Nothing here touches a Trainer or a device. :class:`~lightning_memopt.callbacks.OOMReporter` gathers the
facts at the moment of failure and hands them to these functions:

* :func:`describe_batch`: shapes, dtypes and devices of the tensors in a batch (any nesting);
* :func:`parse_oom_message`: the numbers in an allocator's error message (requested bytes, free bytes, ...);
* :func:`collect_environment`: environment variables from an allow-list of prefixes, secrets redacted;
* :func:`suggest_fixes`: ranked, concrete suggestions derived from the numbers;
* :func:`render_markdown`: the readable report.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from lightning_memopt.utilities.checks import is_finite_number
from lightning_memopt.utilities.files import regular_file_problem
from lightning_memopt.utilities.formatting import format_bytes
from lightning_memopt.utilities.redaction import (  # noqa: F401  (SECRET_FRAGMENTS: kept importable from here)
    REDACTED,
    SECRET_FRAGMENTS,
    is_secret_name,
    redact_secrets,
    redact_text,
)

__all__ = [
    "ALLOCATOR_ENV_VARS",
    "ENV_PREFIXES",
    "REDACTED",
    "REPORT_FORMAT",
    "collect_environment",
    "collect_versions",
    "describe_batch",
    "is_secret_name",
    "load_report",
    "parse_oom_message",
    "render_markdown",
    "suggest_fixes",
]

#: Identifies the JSON report and its schema version.
REPORT_FORMAT = "lightning-memopt/oom-report/1"

#: Environment variables are reported only when their name starts with one of these prefixes (or is listed in
#: ``_ENV_NAMES``). Everything else in the environment is left out.
ENV_PREFIXES: tuple[str, ...] = (
    "CUDA_",
    "CUBLAS_",
    "CUDNN_",
    "NCCL_",
    "NVIDIA_",
    "PYTORCH_",
    "TORCH_",
    "OMP_",
    "MKL_",
    "KMP_",
    "HIP_",
    "ROCR_",
    "HSA_",
    "PL_",
    "LIGHTNING_",
)
_ENV_NAMES = frozenset({"WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"})
# SECRET_FRAGMENTS, REDACTED and is_secret_name live in lightning_memopt.utilities.redaction (imported above),
# so that the environment, the Markdown and the callback's report all redact by one rule.
#: The caching-allocator settings, in the order torch reads them.
ALLOCATOR_ENV_VARS: tuple[str, ...] = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")

_MAX_BATCH_TENSORS = 32
_MAX_DEPTH = 6


# ----------------------------------------------------------------------------------------------------------------
# Environment and versions
# ----------------------------------------------------------------------------------------------------------------


def collect_environment(
    environ: Mapping[str, str] | None = None, prefixes: Sequence[str] = ENV_PREFIXES
) -> dict[str, str]:
    """Environment variables worth reporting, with secrets redacted.

    Only names starting with one of ``prefixes`` (and the launcher's rank/world-size variables) are kept;
    the value of any kept name containing KEY, TOKEN, SECRET, PASSWORD, CREDENTIAL or AUTH is replaced by
    ``"<redacted>"``, and credentials inside the other values (``https://user:password@host``,
    ``?token=...``, ``Bearer ...``) are replaced by :func:`~lightning_memopt.utilities.redaction.redact_text`.

    Args:
        environ: The environment to read. Default: ``os.environ``.
        prefixes: Allowed name prefixes.

    Example:
        >>> collect_environment({"NCCL_DEBUG": "INFO", "HOME": "/root", "TORCH_HUB_TOKEN": "abc",
        ...                      "PL_LOGGER_URI": "https://me:pw@host/runs"})
        {'NCCL_DEBUG': 'INFO', 'PL_LOGGER_URI': 'https://me:<redacted>@host/runs', 'TORCH_HUB_TOKEN': '<redacted>'}
    """
    environ = os.environ if environ is None else environ
    kept: dict[str, str] = {}
    for name in sorted(environ):
        if not (name.startswith(tuple(prefixes)) or name in _ENV_NAMES):
            continue
        kept[name] = REDACTED if is_secret_name(name) else redact_text(str(environ[name]))
    return kept


def allocator_settings(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The caching-allocator settings (``PYTORCH_ALLOC_CONF`` and its per-backend forms), ``None`` when unset.

    Example:
        >>> allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})["PYTORCH_CUDA_ALLOC_CONF"]
        'expandable_segments:True'
    """
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in ALLOCATOR_ENV_VARS}


def _version_of(distribution: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(distribution)
    except Exception:
        return None


def collect_versions() -> dict[str, str | None]:
    """Versions of Python, torch (and its CUDA/ROCm), Lightning, torchmetrics and lightning-memopt.

    Example:
        >>> sorted(collect_versions())[:3]
        ['cuda', 'hip', 'lightning']
    """
    from lightning_memopt.__about__ import __version__

    lightning_version = None
    try:
        import lightning

        lightning_version = lightning.__version__
    except Exception:
        lightning_version = _version_of("pytorch-lightning")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "cuda": getattr(torch.version, "cuda", None),
        "hip": getattr(torch.version, "hip", None),
        "lightning": lightning_version,
        "torchmetrics": _version_of("torchmetrics"),
        "lightning_memopt": __version__,
    }


# ----------------------------------------------------------------------------------------------------------------
# Batch
# ----------------------------------------------------------------------------------------------------------------


def _tensor_bytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.numel() * tensor.element_size())
    except Exception:
        return 0


def _walk(obj: Any, path: str, depth: int, out: list[tuple[str, torch.Tensor]], seen: set[int]) -> int:
    """Collect (path, tensor) pairs; returns how many tensors exist (counted past the limit too)."""
    if isinstance(obj, torch.Tensor):
        if len(out) < _MAX_BATCH_TENSORS:
            out.append((path, obj))
        return 1
    if depth >= _MAX_DEPTH or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return 0
    seen.add(id(obj))
    count = 0
    if isinstance(obj, Mapping):
        for key, value in list(obj.items())[:1000]:
            count += _walk(value, f"{path}[{key!r}]", depth + 1, out, seen)
    elif isinstance(obj, (list, tuple)):
        fields = getattr(obj, "_fields", None)  # namedtuple
        for i, value in enumerate(list(obj)[:1000]):
            name = f"{path}.{fields[i]}" if fields and i < len(fields) else f"{path}[{i}]"
            count += _walk(value, name, depth + 1, out, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            count += _walk(getattr(obj, field.name, None), f"{path}.{field.name}", depth + 1, out, seen)
    return count


def describe_batch(batch: Any, name: str = "batch") -> dict[str, Any]:
    """Shapes, dtypes, devices and sizes of the tensors in ``batch`` (tensors, mappings, sequences, dataclasses).

    At most 32 tensors are listed; ``num_tensors`` counts all of them. ``micro_batch_size`` is the first
    dimension of the first tensor with one (``None`` when no tensor has a dimension).

    Example:
        >>> d = describe_batch({"x": torch.zeros(8, 3), "y": torch.zeros(8, dtype=torch.long)})
        >>> d["tensors"][0]
        {'path': "batch['x']", 'shape': [8, 3], 'dtype': 'torch.float32', 'device': 'cpu', 'bytes': 96}
        >>> d["num_tensors"], d["bytes"], d["micro_batch_size"]
        (2, 160, 8)
    """
    found: list[tuple[str, torch.Tensor]] = []
    total = _walk(batch, name, 0, found, set())
    tensors = []
    for path, tensor in found:
        try:
            tensors.append(
                {
                    "path": path,
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype),
                    "device": str(tensor.device),
                    "bytes": _tensor_bytes(tensor),
                }
            )
        except Exception:  # a tensor subclass that cannot describe itself
            continue
    micro = next((t["shape"][0] for t in tensors if t["shape"]), None)
    return {
        "type": type(batch).__name__,
        "tensors": tensors,
        "num_tensors": total,
        "truncated": total > len(tensors),
        "bytes": sum(t["bytes"] for t in tensors),
        "micro_batch_size": micro,
    }


# ----------------------------------------------------------------------------------------------------------------
# Error messages
# ----------------------------------------------------------------------------------------------------------------

_UNITS = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*(bytes|byte|b|kib|mib|gib|tib|kb|mb|gb|tb)\b"
_MESSAGE_FIELDS = {
    "requested_bytes": rf"tried to allocate {_SIZE}",
    "device_total_bytes": rf"total capacity of {_SIZE}",
    "device_free_bytes": rf"of which {_SIZE} is free",
    "process_in_use_bytes": rf"this process has {_SIZE} memory in use",
    "pytorch_allocated_bytes": rf"{_SIZE} is allocated by pytorch",
    "reserved_unallocated_bytes": rf"{_SIZE} is reserved by pytorch but unallocated",
}


def _to_bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.lower()])


def parse_oom_message(message: str) -> dict[str, int | None]:
    """The numbers an allocator puts in its out-of-memory message, in bytes (``None`` when absent).

    Example:
        >>> msg = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which"
        ...        " 1.50 GiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 6.00 GiB is"
        ...        " reserved by PyTorch but unallocated.")
        >>> fields = parse_oom_message(msg)
        >>> fields["requested_bytes"] == 2 * 1024**3, fields["reserved_unallocated_bytes"] == 6 * 1024**3
        (True, True)
    """
    result: dict[str, int | None] = {}
    for field, pattern in _MESSAGE_FIELDS.items():
        match = re.search(pattern, message or "", flags=re.IGNORECASE)
        result[field] = _to_bytes(match.group(1), match.group(2)) if match else None
    return result


# ----------------------------------------------------------------------------------------------------------------
# Suggestions
# ----------------------------------------------------------------------------------------------------------------


def _fraction(part: int | None, whole: int | None) -> float | None:
    if not (is_finite_number(part) and is_finite_number(whole)) or not whole:
        return None
    return part / whole


def _pct(part: int | None, whole: int | None) -> str:
    fraction = _fraction(part, whole)
    return "n/a" if fraction is None else f"{100 * fraction:.0f} %"


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
    precision: str | None = None,
    allocator_conf: str | None = None,
    device_type: str = "cuda",
    activation_checkpointing: bool | None = None,
) -> list[dict[str, Any]]:
    """Ranked suggestions for getting the failed step to fit, derived from the numbers at the failure.

    Each suggestion is a dict with ``rank`` (1 = try first), ``action`` (what to change), ``why`` (the
    numbers that point to it) and ``saves_bytes`` (a rough estimate of the memory it frees, or ``None``).
    Suggestions with an estimate come first, largest first; the rest keep a fixed order of usefulness.

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
        precision: The trainer's precision string (``"32-true"``, ``"bf16-mixed"``, ...).
        allocator_conf: The allocator settings in effect (``PYTORCH_ALLOC_CONF`` or the CUDA form).
        device_type: ``"cuda"``, ``"mps"``, ``"cpu"``, ...
        activation_checkpointing: whether activation checkpointing was on (``None``: unknown). When it was,
            it is not suggested again.

    Example:
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
    total = allocated_bytes if allocated_bytes else (accounted + (unexplained_bytes or 0)) or None
    # Shares are "of allocated" only where the device reported allocated bytes (not on the CPU).
    basis = "allocated" if allocated_bytes else "the bytes counted"
    activations = unexplained_bytes
    act_frac = _fraction(activations, total)
    training = stage == "train"
    accumulate = accumulate_grad_batches or 1
    tips: list[tuple[int | None, int, str, str]] = []  # (saves, priority, action, why)

    def add(saves: int | None, priority: int, action: str, why: str) -> None:
        tips.append((None if saves is None else max(int(saves), 0), priority, action, why))

    capacity = device_total_bytes
    if requested_bytes and capacity and requested_bytes >= 0.5 * capacity:
        add(
            requested_bytes,
            0,
            "Check the shape of the tensor being allocated: one allocation is too large for the device",
            f"A single allocation of {format_bytes(requested_bytes)} was requested, {_pct(requested_bytes, capacity)}"
            f" of the device's {format_bytes(capacity)}. Typical causes: a [batch, seq, seq] attention matrix, a"
            " [batch, seq, vocab] logits tensor, or a shape bug (broadcasting two large vectors).",
        )

    activations_dominate = act_frac is None or act_frac >= 0.3
    if training and activations_dominate:
        why = (
            f"Activations and temporaries (allocated memory no parameter, gradient, optimizer state or buffer"
            f" accounts for) are {format_bytes(activations)} ({_pct(activations, total)} of {basis})."
            if activations is not None
            else "Allocated memory is unknown on this device; activations usually dominate a training step."
        )
        if not activation_checkpointing:
            add(
                None if activations is None else activations * 0.6,
                2,
                "Enable activation checkpointing: recompute layer activations in backward instead of storing them"
                " (the `GradientCheckpointing` callback, or `model.activation_checkpointing_enable()` for Hugging"
                " Face models; `gradient_checkpointing_enable()` before transformers 5)",
                why,
            )
        else:
            why += " Activation checkpointing is on already: what remains is the checkpointed inputs and one layer."
        if micro_batch_size and micro_batch_size >= 2:
            half = micro_batch_size // 2
            effective = micro_batch_size * accumulate * max(world_size, 1)
            halved = half * 2 * accumulate * max(world_size, 1)
            keeps = f"stays {effective}" if halved == effective else f"goes from {effective} to {halved}"
            add(
                None if activations is None else activations / 2,
                3,
                f"Halve the micro-batch and double `accumulate_grad_batches`: batch size {micro_batch_size} ->"
                f" {half}, `accumulate_grad_batches` {accumulate} -> {2 * accumulate}, so the effective batch"
                f" {keeps}",
                why + " Activation memory grows linearly with the micro-batch.",
            )
        elif micro_batch_size == 1:
            add(
                None,
                6,
                "Shorten the inputs (sequence length, image size, crop): the micro-batch is already 1",
                why,
            )
    if activations_dominate and precision and precision.startswith(("32", "64")) and device_type != "cpu":
        add(
            None if activations is None else activations / 2,
            4,
            "Train in mixed precision: `Trainer(precision='bf16-mixed')` (or '16-mixed' on GPUs without bf16)",
            f"Precision is {precision!r}: activations are stored in 32 bits; mixed precision stores most of them"
            " in 16.",
        )

    if not training and stage is not None:
        add(
            None if activations is None else activations / 2,
            3,
            f"Lower the {stage} batch size (the {stage} DataLoader's `batch_size`) and keep step outputs off the"
            " device (`.detach().cpu()` before storing them)",
            f"The error happened in {stage}, where no gradients are stored: the batch and the outputs kept"
            " across steps take the memory.",
        )
        if grads:
            add(
                grads,
                5,
                "Free gradients before evaluation: `optimizer.zero_grad(set_to_none=True)`",
                f"{format_bytes(grads)} of gradients are still held while {stage} runs.",
            )

    if total and opt and opt / total >= 0.25:
        sharded = opt * (1 - 1 / world_size) if world_size > 1 else opt / 2
        action = (
            "Shard the optimizer state across ranks: `strategy='fsdp'` or `strategy='deepspeed_stage_2'`,"
            " or use a lighter optimizer"
            if world_size > 1
            else "Use an optimizer with less state: SGD with momentum (1 state per parameter instead of Adam's 2),"
            " Adafactor, or an 8-bit Adam; with several GPUs, shard it (`strategy='fsdp'`)"
        )
        add(
            sharded,
            5,
            action,
            f"Optimizer states hold {format_bytes(opt)} ({_pct(opt, total)} of {basis}), versus"
            f" {format_bytes(params)} of parameters.",
        )
    if total and (params + grads) / total >= 0.5 and training:
        add(
            (params + grads) * (1 - 1 / world_size) if world_size > 1 else None,
            7,
            "Shard parameters and gradients (`strategy='fsdp'`), or train fewer parameters (freeze layers, adapters)"
            if world_size > 1
            else "Train fewer parameters (freeze layers, use adapters/LoRA) or keep weights in 16 bits"
            " (`precision='bf16-true'`)",
            f"Parameters and gradients hold {format_bytes(params + grads)} ({_pct(params + grads, total)} of {basis}).",
        )

    cached = None if reserved_bytes is None or allocated_bytes is None else reserved_bytes - allocated_bytes
    conf = allocator_conf or ""
    if (
        cached is not None
        and reserved_bytes
        and cached >= max(0.1 * reserved_bytes, requested_bytes or 0)
        and "expandable_segments:true" not in conf.replace(" ", "").lower()
        and device_type == "cuda"
    ):
        add(
            cached,
            1,
            "Reduce fragmentation: set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (or `PYTORCH_ALLOC_CONF`"
            " on torch >= 2.8) before the process starts",
            f"{format_bytes(cached)} ({_pct(cached, reserved_bytes)} of reserved) was reserved by PyTorch but not"
            f" allocated when {format_bytes(requested_bytes)} could not be found in one piece.",
        )
    if reserved_bytes is not None and device_total_bytes and device_free_bytes is not None:
        others = device_total_bytes - device_free_bytes - reserved_bytes
        if others >= 0.1 * device_total_bytes:
            add(
                others,
                8,
                "Free the device of other users: another process, or non-PyTorch allocations (CUDA context, NCCL,"
                " cuDNN workspaces), hold memory (`nvidia-smi` lists the processes)",
                f"{format_bytes(others)} ({_pct(others, device_total_bytes)} of the device) is used outside this"
                " process's caching allocator.",
            )

    ordered = sorted(tips, key=lambda t: (t[0] is None, -(t[0] or 0), t[1]))
    return [
        {"rank": i + 1, "action": action, "why": why, "saves_bytes": saves}
        for i, (saves, _, action, why) in enumerate(ordered)
    ]


# ----------------------------------------------------------------------------------------------------------------
# Reading reports back
# ----------------------------------------------------------------------------------------------------------------


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read an ``oom_report_rank{r}.json`` file written by ``OOMReporter``.

    Raises:
        ValueError: naming the file and what is wrong with it (missing, not JSON, not an OOM report).

    Example:
        >>> load_report("missing.json")
        Traceback (most recent call last):
        ...
        ValueError: missing.json: no such file. Pass the oom_report_rank{r}.json written by OOMReporter.
    """
    hint = "Pass the oom_report_rank{r}.json written by OOMReporter."
    name = os.fspath(path)
    problem = regular_file_problem(name)  # a named pipe or a device is refused without opening it
    if problem is not None:
        raise ValueError(f"{name}: {problem}. {hint}")
    try:
        with open(name, encoding="utf-8") as f:
            report = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{name}: no such file. {hint}") from None
    except IsADirectoryError:
        raise ValueError(f"{name}: is a directory. {hint}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{name}: cannot be read ({err}). {hint}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: not valid JSON ({err.msg} at line {err.lineno}). {hint}") from None
    except RecursionError:
        raise ValueError(f"{name}: not valid JSON (nested too deeply to read). {hint}") from None
    if not isinstance(report, dict) or not str(report.get("format", "")).startswith("lightning-memopt/oom-report/"):
        raise ValueError(f"{name}: not an out-of-memory report (no 'format' field of OOMReporter). {hint}")
    return report


# ----------------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------------


_RAW_CHARS = 200


def _cell(value: Any) -> str:
    text = "n/a" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _size(value: Any) -> str:
    """Bytes as text; a value that is not a number (a hand-edited report) is shown as it is."""
    return format_bytes(value) if value is None or is_finite_number(value) else _cell(value)


def _shape(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _raw(value: Any) -> str:
    """Compact JSON of ``value`` on one line, cut at 200 characters."""
    try:
        text = json.dumps(value, default=repr, ensure_ascii=False)
    except Exception:
        text = repr(value)
    text = text.replace("\n", " ")
    return text if len(text) <= _RAW_CHARS else text[: _RAW_CHARS - 3] + "..."


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    for types, name in (
        ((Mapping,), "an object"),
        ((list, tuple), "a list"),
        ((str,), "a string"),
        ((int, float), "a number"),
        ((type(None),), "null"),
    ):
        if isinstance(value, types):
            return name
    return f"a {type(value).__name__}"


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _fence(text: str) -> list[str]:
    return ["```", text.rstrip("\n"), "```", ""]


def _iso(timestamp: Any) -> str:
    try:
        return datetime.datetime.fromtimestamp(float(timestamp), tz=datetime.timezone.utc).isoformat(timespec="seconds")
    except Exception:
        return _cell(timestamp)


def _flatten(mapping: Mapping[Any, Any], prefix: str = "", depth: int = 0) -> Iterable[tuple[str, Any]]:
    """``(dotted.name, value)`` pairs of a nested mapping; lists and deep parts as compact JSON."""
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and depth < 4:
            yield from _flatten(value, name + ".", depth + 1)
        elif isinstance(value, (Mapping, list, tuple)):
            yield name, _raw(value)
        else:
            yield name, value


class _Shape:
    """Reads the parts of a report, noting those whose type is not what ``OOMReporter`` writes."""

    def __init__(self) -> None:
        self.unexpected: list[str] = []

    def get(self, parent: Mapping[str, Any], key: str, expected: type, where: str = "") -> Any:
        value = parent.get(key)
        if not value:
            return {} if expected is Mapping else []
        if isinstance(value, expected):
            return value
        self.note(f"{where}{key}", value, expected)
        return {} if expected is Mapping else []

    def items(self, values: Iterable[Any], where: str) -> list[Mapping[str, Any]]:
        """The objects of a list; the other entries are noted and left out."""
        kept = []
        for i, value in enumerate(values):
            if isinstance(value, Mapping):
                kept.append(value)
            else:
                self.note(f"{where}[{i}]", value, Mapping)
        return kept

    def note(self, where: str, value: Any, expected: type) -> None:
        wanted = {Mapping: "an object", list: "a list", str: "a string"}.get(expected, expected.__name__)
        self.unexpected.append(f"`{where}` (expected {wanted}, got {_kind(value)}): {_raw(value)}")


def render_markdown(report: Mapping[str, Any]) -> str:
    """The readable form of an OOM report dict (as written to ``oom_report_rank{r}.json``).

    Sections that are missing from ``report`` are left out, so a partial report still renders. A section or
    entry of an unexpected type (a hand-edited or truncated report) is listed, as raw JSON, under "Parts of
    this report with an unexpected shape" and the rest renders as usual. Credentials are redacted first
    (:func:`~lightning_memopt.utilities.redaction.redact_secrets`), whatever the report holds.

    Example:
        >>> text = render_markdown({"when": {"rank": 0, "world_size": 1, "stage": "train", "global_step": 7},
        ...     "error": {"type": "torch.OutOfMemoryError", "message": "CUDA out of memory."}})
        >>> text.splitlines()[0]
        '# Out-of-memory report: rank 0 of 1, train, global step 7'
    """
    if not isinstance(report, Mapping):
        return f"# Out-of-memory report\n\nNot a report: expected an object, got {_kind(report)}: {_raw(report)}\n"
    report = redact_secrets(report)
    shape = _Shape()
    when = shape.get(report, "when", Mapping)
    lines = [
        f"# Out-of-memory report: rank {when.get('rank', '?')} of {when.get('world_size', '?')},"
        f" {when.get('stage', '?')}, global step {when.get('global_step', '?')}",
        "",
    ]
    if when:
        lines += ["## When and where", ""]
        lines += _table(
            ["field", "value"],
            [
                ("time (UTC)", _iso(when.get("time"))),
                ("rank / world size", f"{when.get('rank')} / {when.get('world_size')}"),
                ("trainer function", when.get("fn")),
                ("stage", when.get("stage")),
                ("epoch", when.get("epoch")),
                ("global step", when.get("global_step")),
                ("batch index", when.get("batch_idx")),
                ("device", when.get("device")),
            ],
        )
    error = shape.get(report, "error", Mapping)
    if error:
        lines += ["## Error", "", f"`{error.get('type')}` raised at {_cell(error.get('location'))}", ""]
        lines += _fence(str(error.get("message", "")))

    suggestions = shape.items(shape.get(report, "suggestions", list), "suggestions")
    if suggestions:
        lines += ["## Suggestions (try in this order)", ""]
        for tip in suggestions:
            saves = tip.get("saves_bytes")
            estimate = f" (frees about {format_bytes(saves)})" if is_finite_number(saves) and saves else ""
            lines.append(f"{tip.get('rank')}. **{tip.get('action')}**{estimate}. {tip.get('why')}")
        lines.append("")

    batch = shape.get(report, "batch", Mapping)
    if batch:
        lines += ["## Failing batch", ""]
        if batch.get("found_in"):
            lines += [f"Read from the local `batch` of `{batch.get('found_in')}`.", ""]
        else:
            lines += ["No local named `batch` was found in the traceback.", ""]
        tensors = shape.items(shape.get(batch, "tensors", list, "batch."), "batch.tensors")
        if tensors:
            lines += _table(
                ["tensor", "shape", "dtype", "device", "size"],
                [
                    (t.get("path"), _shape(t.get("shape")), t.get("dtype"), t.get("device"), _size(t.get("bytes")))
                    for t in tensors
                ],
            )
        if batch.get("truncated"):
            lines += [f"({batch.get('num_tensors')} tensors in all; the first {len(tensors)} are listed.)", ""]

    memory = shape.get(report, "memory", Mapping)
    if memory:
        lines += ["## Memory at failure", ""]
        rows = [
            (key, _size(value) if str(key).endswith("_bytes") else value)
            for key, value in memory.items()
            if key not in ("summary", "time") and not isinstance(value, (Mapping, list, tuple))
        ]
        lines += _table(["field", "value"], rows)

    holders = shape.get(report, "holders", Mapping)
    if holders:
        lines += ["## Who holds memory", ""]
        by_cat = shape.get(holders, "bytes_by_category", Mapping, "holders.")
        allocated = memory.get("allocated_bytes")
        cat_rows = [(name, _size(value), _pct(value, allocated)) for name, value in by_cat.items()]
        cat_rows.append(
            (
                "unexplained (activations, temporaries, other tensors)",
                _size(holders.get("unexplained_bytes")),
                _pct(holders.get("unexplained_bytes"), allocated),
            )
        )
        lines += [f"On `{holders.get('device')}`:", ""]
        lines += _table(["category", "bytes", "of allocated"], cat_rows)
        rows = shape.items(shape.get(holders, "rows", list, "holders."), "holders.rows")
        if rows:
            lines += ["By dtype and device (all devices):", ""]
            lines += _table(
                ["category", "dtype", "device", "tensors", "bytes"],
                [
                    (r.get("category"), r.get("dtype"), r.get("device"), r.get("num_tensors"), _size(r.get("bytes")))
                    for r in rows
                ],
            )
        top = shape.items(shape.get(holders, "top_tensors", list, "holders."), "holders.top_tensors")
        if top:
            lines += [f"Largest live tensors on `{holders.get('device')}`:", ""]
            lines += _table(
                ["#", "name", "shape", "dtype", "size", "requires grad", "from autograd"],
                [
                    (
                        i + 1,
                        t.get("name") or "(unnamed)",
                        _shape(t.get("shape", ())),
                        t.get("dtype"),
                        _size(t.get("bytes")),
                        t.get("requires_grad"),
                        t.get("has_grad_fn"),
                    )
                    for i, t in enumerate(top)
                ],
            )

    config = shape.get(report, "config", Mapping)
    if config:
        lines += ["## Configuration", ""]
        lines += _table(
            ["setting", "value"],
            [(k, v) for k, v in config.items() if not isinstance(v, (Mapping, list, tuple))],
        )
        for title, key in (("Allocator settings", "allocator"), ("Versions", "versions")):
            section = shape.get(config, key, Mapping, "config.")
            if section:
                lines += [f"{title}:", ""]
                lines += _table(["name", "value"], section.items())

    hparams = shape.get(report, "hparams", Mapping)
    if hparams:
        lines += ["## Hyperparameters (`hparams`, secrets redacted)", ""]
        lines += _table(["name", "value"], _flatten(hparams))

    snapshot = shape.get(report, "snapshot", Mapping)
    if snapshot:
        lines += ["## Allocator snapshot", ""]
        if snapshot.get("path"):
            lines += [f"Written to `{snapshot['path']}`. {snapshot.get('how_to_open', '')}", ""]
        else:
            lines += [f"Not written: {snapshot.get('reason', 'unknown reason')}", ""]

    environment = shape.get(report, "environment", Mapping)
    if environment:
        lines += ["## Environment (allow-listed, secrets redacted)", ""]
        lines += _table(["name", "value"], environment.items())

    summary = memory.get("summary")
    if summary and isinstance(summary, str):
        lines += ["## Allocator summary (`memory_summary()`)", ""]
        lines += _fence(summary)
    elif summary:
        shape.note("memory.summary", summary, str)

    problems = shape.get(report, "report_errors", list)
    if problems:
        lines += ["## Parts of this report that could not be gathered", ""]
        lines += [f"- {p}" for p in problems] + [""]
    if shape.unexpected:
        lines += ["## Parts of this report with an unexpected shape", ""]
        lines += [f"- {entry}" for entry in shape.unexpected] + [""]
    return "\n".join(lines).rstrip("\n") + "\n"
