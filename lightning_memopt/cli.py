"""The ``lightning-memopt`` command line.

Subcommands:

* ``analyze LOG [LOG ...] [--plot FILE.png]``: summary table and timeline plot from memory JSONL logs.
* ``report REPORT [REPORT ...]``: an out-of-memory report (``oom_report_rank{r}.json``) as Markdown.

Each subcommand is one ``_add_<name>(subparsers)`` function that registers its parser and sets
``func``; ``main`` returns the process exit code (0 success, 2 bad input). Bad input never ends in a
traceback: an error is one line on stderr naming the file, and a warning (records ``analyze`` skipped) is one
line on stderr before the output.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from lightning_memopt.__about__ import __version__

__all__ = ["main"]


class CLIError(Exception):
    """A one-line error for the user; ``main`` prints it and exits with code 2."""


_ANALYZE_DESCRIPTION = """\
Summarise memory JSONL logs (MemoryMonitor, MemoryAudit): one row per rank and phase (and run, when the logs
hold several run_ids) with peaks, means, growth and warnings; optionally a timeline plot.

growth: a straight line fitted to the phase's step readings (allocated bytes; host RSS, marked "(RSS)", where
the device gives none) against global_step, leaving out the first third of the steps (warm-up). Shown as the
line's change over the steps it was fitted on ("+96.00 MiB over steps 140-400") only when the slope is at
least 4 standard errors from zero (the error from the readings' scatter about the line, or from the scatter
of block means when memory moves between plateaus) and the change is at least twice the readings' scatter;
otherwise "flat over steps A-B". "too short to tell" when fewer than 10 readings spanning 100 steps, at 4 or
more different steps, remain after the warm-up (a few readings do not show a trend).

warnings: counted per check (MemoryAudit's duplicates and leak, MemoryMonitor's threshold); each is listed
with its text under the table ("warnings in the logs", the first five of each check per row) and marked on
the plot with a labelled line (threshold warnings: a red x at the figure that crossed the threshold).

micro-batch: AutoMicroBatch's changes (written to the log when MemoryMonitor is present) appear as a column
("16 -> 4 (2 changes)"), are listed under the table with their step and reason, and are marked on the plot
with a dotted line.
"""


def _add_analyze(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("analyze", help="summarise memory JSONL logs and plot a timeline",
                                   description=_ANALYZE_DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", metavar="LOG", help="memory_rank*.jsonl files written by MemoryMonitor")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="write a timeline plot to this file (the extension picks the format: .png, .svg, .pdf)")
    parser.set_defaults(func=_run_analyze)


def _run_analyze(args: argparse.Namespace) -> int:
    from lightning_memopt.analysis import memory_log

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            _, text = memory_log.analyze_memory_logs(args.logs, plot=args.plot)
        except ValueError as err:  # MemoryLogError (a log) or a plot path that cannot be written
            raise CLIError(str(err)) from None
        except ImportError as err:
            raise CLIError(f"plotting needs matplotlib ({err}): pip install 'lightning-memopt[plot]'") from None
        except Exception as err:  # the last line of defence: one line naming the input, never a traceback
            raise CLIError(
                f"could not analyse {', '.join(args.logs)} ({type(err).__name__}: {err}); please report this"
            ) from None
        finally:
            # Skipped records and the like: one line each, before the table or the error.
            for warning in caught:
                message = " ".join(str(warning.message).splitlines())
                print(f"lightning-memopt analyze: warning: {message}", file=sys.stderr)
    print(text)
    return 0


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("report", help="print an out-of-memory report (JSON from OOMReporter) as Markdown")
    parser.add_argument("reports", nargs="+", metavar="REPORT", help="oom_report_rank*.json files (OOMReporter)")
    parser.set_defaults(func=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from lightning_memopt.functional.oom import load_report, render_markdown

    texts = []
    for path in args.reports:
        try:
            report = load_report(path)
        except ValueError as err:  # missing, a directory or pipe, not JSON, not a report: says which file
            raise CLIError(str(err)) from None
        try:
            texts.append(render_markdown(report))
        except Exception as err:  # a report shaped in a way rendering did not foresee: one line, no traceback
            raise CLIError(
                f"{path}: could not be rendered as Markdown ({type(err).__name__}: {err}); the JSON itself is intact,"
                " open it directly"
            ) from None
    print("\n".join(texts), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-memopt", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_analyze(subparsers)
    _add_report(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as err:
        message = " ".join(str(err).splitlines())  # one line, whatever the message holds
        print(f"lightning-memopt {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
