"""Reading memory JSONL logs back: summaries and plots."""

from lightning_memopt.analysis.memory_log import (
    MemoryFinding,
    MemoryLogError,
    PhaseSummary,
    analyze_memory_logs,
    format_summary,
    load_memory_log,
    plot_memory_timeline,
    summarize_memory_log,
)

__all__ = [
    "MemoryFinding",
    "MemoryLogError",
    "PhaseSummary",
    "analyze_memory_logs",
    "format_summary",
    "load_memory_log",
    "plot_memory_timeline",
    "summarize_memory_log",
]
