"""One line per fit for the callbacks that have nothing to do on this device, instead of one line each.

A callback that finds nothing to do in ``setup`` (``CacheCleaner`` on a CPU, ``AllocatorSettings`` without CUDA)
calls :func:`note_inactive`; the first of them to reach ``on_fit_start`` (after every callback's ``setup``) calls
:func:`report_inactive`, which prints one line naming them all and why, and forgets them.
"""

from __future__ import annotations

import textwrap
import weakref
from typing import Any

from lightning_memopt.utilities.namespaces import rank_zero_info

__all__ = ["inactive_line", "note_inactive", "report_inactive"]

#: Columns a printout may take.
WIDTH = 100

_pending: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def note_inactive(trainer: Any, owner: str, reason: str) -> None:
    """Remember that ``owner`` (a callback's name) does nothing in this fit of ``trainer``, and ``reason``."""
    _pending.setdefault(trainer, {})[owner] = reason


def inactive_line(inactive: dict[str, str]) -> str:
    """The line :func:`report_inactive` prints, wrapped to :data:`WIDTH` columns.

    Example:
        >>> print(inactive_line({"CacheCleaner": "no allocator cache on cpu", "AllocatorSettings": "no CUDA"}))
        lightning-memopt: inactive here: CacheCleaner (no allocator cache on cpu), AllocatorSettings (no
          CUDA).
    """
    text = ", ".join(f"{owner} ({reason})" for owner, reason in inactive.items())
    return textwrap.fill(f"lightning-memopt: inactive here: {text}.", width=WIDTH, subsequent_indent="  ")


def report_inactive(trainer: Any) -> None:
    """Print (rank zero) the one line about the callbacks noted for ``trainer``, once per fit."""
    inactive = _pending.pop(trainer, None)
    if inactive:
        rank_zero_info(inactive_line(inactive))
