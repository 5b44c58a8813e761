"""``calls`` and ``seconds`` of a callback that times its work with ``TimedCalls`` (``functional.collection``)."""

from __future__ import annotations

from lightning_memopt.functional.collection import TimedCalls

__all__ = ["TimedCallsCounters"]


class TimedCallsCounters:
    """Mixin: ``calls`` and ``seconds`` read from and written to ``self._timed`` (a checkpoint restores them)."""

    _timed: TimedCalls

    @property
    def calls(self) -> int:
        """Calls made (restored from a checkpoint on resume)."""
        return self._timed.calls

    @calls.setter
    def calls(self, value: int) -> None:
        self._timed.calls = value

    @property
    def seconds(self) -> float:
        """Seconds spent in those calls."""
        return self._timed.seconds

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._timed.seconds = value
