"""The ``lightning-memopt`` command line.

Subcommands:

* ``analyze LOG [LOG ...] [--plot FILE.png]``: summary table and timeline plot from memory JSONL logs.
* ``report REPORT [REPORT ...]``: an out-of-memory report (``oom_report_rank{r}.json``) as Markdown.

Each subcommand is one ``_add_<name>(subparsers)`` function that registers its parser and sets
``func``; ``main`` returns the process exit code (0 success, 2 bad input).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_memopt.__about__ import __version__

__all__ = ["main"]


class CLIError(Exception):
    """A one-line error for the user; ``main`` prints it and exits with code 2."""


def _add_analyze(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("analyze", help="summarise memory JSONL logs and plot a timeline")
    parser.add_argument("logs", nargs="+", metavar="LOG", help="memory_rank*.jsonl files written by MemoryMonitor")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="write a timeline plot to this file")
    parser.set_defaults(func=_run_analyze)


def _run_analyze(args: argparse.Namespace) -> int:
    from lightning_memopt.analysis.memory_log import MemoryLogError, analyze_memory_logs

    try:
        _, text = analyze_memory_logs(args.logs, plot=args.plot)
    except MemoryLogError as err:
        raise CLIError(str(err)) from None
    except ImportError as err:
        raise CLIError(f"plotting needs matplotlib ({err}): pip install 'lightning-memopt[plot]'") from None
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
            texts.append(render_markdown(load_report(path)))
        except ValueError as err:
            raise CLIError(str(err)) from None
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
        print(f"lightning-memopt {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
