"""What each callback's checkpoint state holds, checked on load (:func:`lightning_memopt.utilities.state.load_state`).

One schema per callback, ``key -> StateField``. A harmless key (a statistic) that is missing or bad warns and starts
fresh; any other raises ``ValueError`` naming the callback, the key, the value and the fix. ``MemoryAudit``'s leak
samples are checked by its core, :class:`lightning_memopt.functional.audit.session.AuditSession`.

When a key is missing or bad:

* ``AutoMicroBatch.micro_batch_size``: an error (the size that fits decides how the resumed run splits its batches;
  ``None``, a size not found yet, is valid and keeps the configured start);
* ``AutoMicroBatch.retries``, ``CacheCleaner.calls``/``seconds``, ``GarbageCollector.calls``/``seconds``/
  ``collected``: fresh at 0 (statistics);
* ``AutoMicroBatch.micro_batch_elements``, ``validate_micro_batch_size`` / ``_elements`` (``test_``, ``predict_``):
  fresh at ``None`` (the whole batch, or the saved size; what fits is found again at the cost of one out-of-memory
  error);
* ``MemoryMonitor.last_logged_train_step``: fresh at -1 (a resumed run still skips the steps its log holds);
* ``OOMReporter.reported_steps``/``num_reports``: fresh, empty and 0 (at worst one failure is reported twice).
"""

from __future__ import annotations

from typing import Any

from lightning_memopt.utilities.state import StateField, as_float, as_int, as_list, as_optional, load_state

__all__ = ["MAX_REMEMBERED_REPORTS", "SCHEMAS", "restore_state"]

#: How many reported failure positions ``OOMReporter`` remembers (and keeps of a checkpoint's).
MAX_REMEMBERED_REPORTS = 100


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not a str")
    return value


_COUNT = StateField(as_int(0), "a non-negative int", default=0)
_SECONDS = StateField(as_float(0.0), "a finite, non-negative number", default=0.0)

SCHEMAS: dict[str, dict[str, StateField]] = {
    "AutoMicroBatch": {
        "micro_batch_size": StateField(as_optional(as_int(1)), "a positive int or None", harmless=False),
        "retries": _COUNT,
        "micro_batch_elements": StateField(as_optional(as_int(1)), "a positive int or None"),
        **{
            f"{stage}_{what}": StateField(as_optional(as_int(1)), "a positive int or None")
            for stage in ("validate", "test", "predict")
            for what in ("micro_batch_size", "micro_batch_elements")
        },
    },
    "CacheCleaner": {"calls": _COUNT, "seconds": _SECONDS},
    "GarbageCollector": {"calls": _COUNT, "seconds": _SECONDS, "collected": _COUNT},
    "MemoryMonitor": {"last_logged_train_step": StateField(as_int(-1), "an int >= -1", default=-1)},
    "OOMReporter": {
        "reported_steps": StateField(as_list(_text, MAX_REMEMBERED_REPORTS), "a list of str", default=[]),
        "num_reports": _COUNT,
    },
}


def restore_state(owner: str, state_dict: Any) -> dict[str, Any]:
    """``state_dict`` of the callback named ``owner`` checked against its schema: every key, checked or fresh.

    Raises:
        ValueError: a key that cannot start fresh is missing or bad (see the table above).

    Examples:
        >>> restore_state("CacheCleaner", {"calls": 2, "seconds": 0.5})
        {'calls': 2, 'seconds': 0.5}
    """
    return load_state(owner, state_dict, SCHEMAS[owner])
