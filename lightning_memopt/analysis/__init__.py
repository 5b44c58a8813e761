"""Reading memory JSONL logs back: summaries, plots, and the one reader of the log format.

:func:`analyze_memory_logs` is what ``lightning-memopt analyze`` runs (over the logs of one machine or of several
nodes; :func:`compare_ranks` compares the ranks). :func:`iter_memory_records` streams a log's
checked records for any other reader; :func:`load_memory_log` reads a whole log and refuses bad lines. Nothing here
imports torch or Lightning (matplotlib only when a plot is drawn).
"""

from lightning_memopt.analysis.findings import MemoryFinding
from lightning_memopt.analysis.memory_log import analyze_memory_logs
from lightning_memopt.analysis.plot import plot_memory_timeline
from lightning_memopt.analysis.ranks import RankComparison, RankPeak, compare_ranks
from lightning_memopt.analysis.records import MemoryLogError, iter_memory_records, load_memory_log
from lightning_memopt.analysis.summary import PhaseSummary, summarize_memory_log
from lightning_memopt.analysis.text import format_summary

__all__ = [
    "MemoryFinding",
    "MemoryLogError",
    "PhaseSummary",
    "RankComparison",
    "RankPeak",
    "analyze_memory_logs",
    "compare_ranks",
    "format_summary",
    "iter_memory_records",
    "load_memory_log",
    "plot_memory_timeline",
    "summarize_memory_log",
]
