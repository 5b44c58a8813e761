"""``warning`` and ``micro_batch`` records as findings with their text: what the summary lists and the plot marks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MemoryFinding", "finding_check", "finding_text", "int_field", "micro_batch_text"]

#: Warnings kept with their text per (run, rank, phase) and check, and per plot panel and check; the rest are counted.
LISTED_FINDINGS = 5
MAX_FINDING_CHARS = 2000
#: Micro-batch changes kept with their text per (run, rank, phase) and per plot panel.
LISTED_CHANGES = 20


@dataclass(frozen=True)
class MemoryFinding:
    """One ``warning`` record of a log, with its text.

    ``check`` is what found it: ``"duplicates"`` or ``"leak"`` (MemoryAudit's ``check`` field), ``"threshold"``
    (MemoryMonitor's ``warn_threshold``) or ``"warning"`` (a warning record that says neither). ``seconds`` counts
    from the first record of the same run. Messages longer than 2,000 characters are cut there.

    :class:`~lightning_memopt.analysis.PhaseSummary` also lists AutoMicroBatch's ``micro_batch`` records as
    findings with check ``"micro_batch"`` (see :func:`micro_batch_text`).
    """

    check: str
    message: str
    global_step: int | None
    epoch: int | None
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def finding_check(r: Mapping[str, Any]) -> str:
    """The check behind a ``warning`` record: its ``check`` field, else ``"threshold"`` when it names the ``field``
    that crossed MemoryMonitor's threshold, else ``"warning"``.

    Examples:
        >>> finding_check({"check": "leak"}), finding_check({"field": "allocated_bytes"}), finding_check({})
        ('leak', 'threshold', 'warning')
    """
    check = r.get("check")
    if isinstance(check, str) and check:
        return check
    return "threshold" if isinstance(r.get("field"), str) and r.get("field") else "warning"


def finding_text(r: Mapping[str, Any]) -> str:
    """A record's ``message`` on one line, cut at 2,000 characters; ``(no message)`` when it has none."""
    message = r.get("message")
    if not isinstance(message, str) or not message.strip():
        return "(no message)"
    message = " ".join(message.split())
    return message if len(message) <= MAX_FINDING_CHARS else message[: MAX_FINDING_CHARS - 3] + "..."


def int_field(r: Mapping[str, Any], key: str) -> int | None:
    """``r[key]`` when it is an int > 0 (a size), else ``None``."""
    value = r.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def micro_batch_text(r: Mapping[str, Any]) -> str:
    """``micro-batch 16 -> 8 (out of memory; batch of 16)`` from a ``micro_batch`` record; "?" for a missing size.

    Examples:
        >>> micro_batch_text({"previous_micro_batch_size": 16, "micro_batch_size": 8, "reason": "out of memory"})
        'micro-batch 16 -> 8 (out of memory)'
    """
    old, new, n = (int_field(r, k) for k in ("previous_micro_batch_size", "micro_batch_size", "batch_size"))
    reason = r.get("reason")
    why: list[str] = []
    if isinstance(reason, str) and reason.strip():
        why.append(" ".join(reason.split())[:200])
    if n is not None:
        why.append(f"batch of {n}")
    text = f"micro-batch {old if old is not None else '?'} -> {new if new is not None else '?'}"
    if why:
        text += f" ({'; '.join(why)})"
    return text
