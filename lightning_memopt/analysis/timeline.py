"""What the timeline plot keeps of one (run, rank) while a log streams by: compact series, phase spans, findings.

No matplotlib or numpy here: the figures go into ``array`` buffers that :mod:`~lightning_memopt.analysis.plot`
draws from.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_memopt.analysis.findings import (
    LISTED_CHANGES,
    LISTED_FINDINGS,
    finding_check,
    finding_text,
    micro_batch_text,
)
from lightning_memopt.analysis.records import MICRO_BATCH_EVENT, READING_EVENTS
from lightning_memopt.utilities.checks import is_finite_number

__all__ = ["DEVICE_SERIES", "HOST_SERIES", "TimelinePanel"]

#: Plotted series: (field, label, line style) with device figures, and the host's without.
DEVICE_SERIES = (
    ("allocated_bytes", "allocated", "-"),
    ("reserved_bytes", "reserved", "-"),
    ("peak_allocated_bytes", "peak allocated (since phase start)", ":"),
)
HOST_SERIES = (("host_rss_bytes", "host RSS (no device readings)", "-"),)


@dataclass
class TimelinePanel:
    """What the timeline plot needs of one (run, rank): the plotted series, phase spans, warnings."""

    device: str | None = None
    device_time: float = math.inf
    node_rank: int | None = None  # where the rank ran (the first record that says)
    host: str | None = None
    has_device: bool = False
    top_device: float = 0.0
    top_host: float = 0.0
    total: float = 0.0
    series: dict[str, tuple[array, array]] = field(default_factory=dict)  # field -> (times, values)
    phase_t: array = field(default_factory=lambda: array("d"))
    phase_start: array = field(default_factory=lambda: array("b"))  # 1 start, 0 end
    phase_name: list[str] = field(default_factory=list)
    # Threshold warnings with the figure they are about: a mark at that figure.
    warn_t: array = field(default_factory=lambda: array("d"))
    warn_v: array = field(default_factory=lambda: array("d"))
    # Every other warning (MemoryAudit's findings): a labelled line at its time. (time, check, text)
    findings: list[tuple[float, str, str]] = field(default_factory=list)
    checks: dict[str, int] = field(default_factory=dict)
    # AutoMicroBatch's changes: a labelled dotted line at their time. (time, "micro_batch", text)
    changes: list[tuple[float, str, str]] = field(default_factory=list)

    def add(self, r: Mapping[str, Any], event: str, t: float) -> None:
        """Take one checked record of ``event`` at time ``t``."""
        if r.get("device") and t < self.device_time:
            self.device, self.device_time = r["device"], t
        if self.host is None and self.node_rank is None:
            self.node_rank, self.host = r.get("node_rank"), r.get("host")
        if event == "warning":
            self._add_warning(r, t)
        elif event == MICRO_BATCH_EVENT:
            if len(self.changes) < LISTED_CHANGES:
                self.changes.append((t, MICRO_BATCH_EVENT, micro_batch_text(r)))
        elif event in READING_EVENTS:
            self._add_reading(r, event, t)

    def _add_warning(self, r: Mapping[str, Any], t: float) -> None:
        """A threshold warning as a mark at its figure; any other as a finding (the first few of each check)."""
        check = finding_check(r)
        value = None
        if check == "threshold":
            key = r.get("field")  # the figure that crossed the threshold
            if isinstance(key, str):
                value = r.get(key)
        if value is not None and is_finite_number(value) and value >= 0:
            self.warn_t.append(t)
            self.warn_v.append(float(value))
            return
        seen = self.checks.get(check, 0)
        self.checks[check] = seen + 1
        if seen < LISTED_FINDINGS:
            self.findings.append((t, check, finding_text(r)))

    def _add_reading(self, r: Mapping[str, Any], event: str, t: float) -> None:
        """The reading's plotted figures, the plot's top and total, and a phase boundary for start and end."""
        for key, _, _ in (*DEVICE_SERIES, *HOST_SERIES):
            value = r.get(key)
            if value is not None:
                times, values = self.series.setdefault(key, (array("d"), array("d")))
                times.append(t)
                values.append(value)
                if key == "host_rss_bytes":
                    self.top_host = max(self.top_host, float(value))
                else:
                    self.top_device = max(self.top_device, float(value))
        if r.get("allocated_bytes") is not None:
            self.has_device = True
        self.total = max(self.total, float(r.get("device_total_bytes") or 0))
        if event != "step":
            self.phase_t.append(t)
            self.phase_start.append(event == "phase_start")
            self.phase_name.append(r["phase"])
