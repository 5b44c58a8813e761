"""A Lightning logger that keeps every ``log_metrics`` call, for the tests of the memory callbacks."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import Logger


class RecordingLogger(Logger):
    """Keeps ``(step, metrics)`` of every ``log_metrics`` call in :attr:`calls`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "rec"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))
