"""The ``lightning-memopt`` command line.

Subcommands:

* ``analyze LOG|DIR [...] [--plot FILE.png]``: summary table and timeline plot from memory JSONL logs, of one
  machine or merged over several nodes (one directory per node).
* ``report REPORT [REPORT ...]``: an out-of-memory report (``oom_report_rank{r}.json``) as Markdown; a directory
  stands for the newest report of each rank in it.
* ``estimate --model CLASS_PATH | --config FILE.yaml [--data CLASS_PATH | --batch-shape SPEC ...] [--gpu NAME |
  --device-memory SIZE] [--effective-batch-size N]``: a training step's peak memory predicted on fake tensors
  (:func:`~lightning_memopt.planner.estimate_memory`, its breakdown table) and, with a budget, the plan
  (:func:`~lightning_memopt.planner.plan_memory`: micro-batch, accumulation, precision, checkpointing), with a
  progress line per estimate on stderr. The model and datamodule are given the LightningCLI way (class paths, init
  args, a YAML config, ``--model.NAME VALUE`` overrides); exit code 1 when nothing fits the budget. With
  ``--lengths FILE [--length-buckets N]``: the largest batch per length bucket
  (:func:`~lightning_memopt.planner.plan_token_budget`), ``L`` in ``--batch-shape`` standing for the lengths.

Each subcommand is one ``_add_<name>(subparsers)`` function that registers its parser and sets
``func``; ``main`` returns the process exit code (0 success, 2 bad input; ``estimate``: 1 when nothing fits). Bad
input never ends in a traceback: an error is one line on stderr naming the file or the argument, and a warning
(records ``analyze`` skipped) is one line on stderr before the output. ``analyze`` starts without importing torch or
Lightning, ``report`` without Lightning (it reads reports with ``lightning_memopt.functional.oom``, which imports
torch); ``estimate`` imports both when it runs (in ``lightning_memopt.cli_estimate``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import sys
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_memopt.__about__ import __version__
from lightning_memopt.utilities.formatting import printable

__all__ = ["main"]


class CLIError(Exception):
    """A one-line error for the user; ``main`` prints it and exits with code 2."""


_ANALYZE_DESCRIPTION = """\
Summarise memory JSONL logs (MemoryMonitor, MemoryAudit): one row per rank and phase (and run, when the logs
hold several run_ids) with peaks, means, growth and warnings; optionally a timeline plot.

logs: memory_rank*.jsonl files, directories (the memory_rank*.jsonl in them) or quoted glob patterns; a file
named twice is read once. A job on several machines: pass each node's directory, for one table over all global
ranks with a node column (the records' node_rank) and a line naming each node's host and ranks. A global rank of
one run found in two logs, or from two hosts, over the same time is an error (two jobs that share a run id after
resuming from one checkpoint, or a copied log): analyse them separately. A run resumed later, in another
directory or on another machine, is merged into its ranks' rows. For example:
  lightning-memopt analyze node0/memopt node1/memopt

across ranks: per run and phase with two ranks or more, the rank that peaks and the lowest one with their node
and host, their ratio ("imbalanced" from 1.10x on) and, over several nodes, the rank that peaks on each node.
Compared: peak allocated bytes, or peak host RSS where a rank has no device figures.

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


#: The widest line ``--help`` prints, whatever the terminal.
HELP_WIDTH = 100


class _Paragraphs(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's paragraphs and indented examples, refilled to the terminal (100 columns at most)."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        kwargs["width"] = min(kwargs.get("width") or shutil.get_terminal_size().columns - 2, HELP_WIDTH)
        super().__init__(prog, **kwargs)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = text.strip("\n").split("\n\n")
        filled = []
        for p in paragraphs:
            if p.startswith(" "):
                filled.append(p)  # an indented example stays as it is
            else:
                filled.append(_fill(p, width, indent))
        return "\n\n".join(filled) + "\n"


def _fill(paragraph: str, width: int, indent: str) -> str:
    """A paragraph refilled; an example line (indented) inside it stays as it is."""
    lines = paragraph.splitlines()
    head = [line for line in lines if not line.startswith(" ")]
    tail = lines[len(head) :] if lines[: len(head)] == head else []
    if not tail:
        head = lines
    filled = textwrap.fill(" ".join(head), width, initial_indent=indent, subsequent_indent=indent)
    return "\n".join([filled, *tail])


def _add_analyze(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="summarise memory JSONL logs and plot a timeline",
        description=_ANALYZE_DESCRIPTION,
        formatter_class=_Paragraphs,
    )
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="memory_rank*.jsonl files written by MemoryMonitor, directories of them (one per node) or glob patterns",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="write a timeline plot to this file (the extension picks the format: .png, .svg, .pdf)",
    )
    parser.set_defaults(func=_run_analyze)


def _run_analyze(args: argparse.Namespace) -> int:
    # Looked up on the module at run time (tests replace analyze_memory_logs there); torch-free.
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
                message = printable(" ".join(str(warning.message).splitlines()))
                print(f"lightning-memopt analyze: warning: {message}", file=sys.stderr)
    print(printable(text, keep_newlines=True))  # the values in it were escaped one by one (analysis/text.py)
    return 0


_REPORT_DESCRIPTION = """\
Print an out-of-memory report written by OOMReporter (oom_report_rank*.json) as Markdown: when and where the
error happened, the failing batch, memory at the failure, who held it, the configuration and ranked suggestions,
as in the .md file written next to the JSON.

reports: oom_report_rank*.json files, printed in the order given, or directories: each stands for the newest
report of each rank in it (by rank), so the directory OOMReporter writes to prints every rank's latest failure.
For example:
  lightning-memopt report lightning_logs/version_0/memopt

any size in bounded memory: the JSON is streamed and at most 1000 entries of a list or object, 10 000 characters
of a string, 32 levels of nesting and 2 million characters in all are kept, each cut marked; the printed Markdown
is cut at 4 million characters. Terminal control and bidi characters from the report are escaped.

exit codes: 0 printed; 2 bad input (one line on stderr naming the file: missing, not JSON, not a report, or a
directory without reports).
"""


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="print an out-of-memory report (JSON from OOMReporter) as Markdown",
        description=_REPORT_DESCRIPTION,
        formatter_class=_Paragraphs,
    )
    parser.add_argument(
        "reports",
        nargs="+",
        metavar="REPORT",
        help="oom_report_rank*.json files (OOMReporter), or a directory of them: the newest report of each rank",
    )
    parser.set_defaults(func=_run_report)


#: What ``report`` prints of one report at most (the JSON is read with ``JSONLimits``' caps first).
_MAX_REPORT_CHARS = 4_000_000


def _run_report(args: argparse.Namespace) -> int:
    from lightning_memopt.functional.oom import load_report, newest_reports, render_markdown
    from lightning_memopt.utilities.json_capped import JSONLimits

    paths: list[str] = []
    for given in args.reports:
        if not os.path.isdir(given):
            paths.append(given)
            continue
        try:
            found = newest_reports(Path(given))
        except OSError as err:
            raise CLIError(f"{given}: cannot be read ({err.strerror or err})") from None
        if not found:
            raise CLIError(f"{given}: no oom_report_rank*.json in this directory (written by OOMReporter)")
        paths.extend(str(p) for p in found)
    texts = []
    for path in paths:
        try:
            report = load_report(path, JSONLimits())  # streamed, long values cut: any size prints in seconds
        except ValueError as err:  # missing, a directory or pipe, not JSON, not a report: says which file
            raise CLIError(str(err)) from None
        try:
            text = render_markdown(report)
        except Exception as err:  # a report shaped in a way rendering did not foresee: one line, no traceback
            raise CLIError(
                f"{path}: could not be rendered as Markdown ({type(err).__name__}: {err}); the JSON itself is intact,"
                " open it directly"
            ) from None
        if len(text) > _MAX_REPORT_CHARS:
            text = text[:_MAX_REPORT_CHARS] + f"\n... (output cut at {_MAX_REPORT_CHARS} characters; open {path})\n"
        texts.append(printable(text, keep_newlines=True))  # values were escaped one by one (render_markdown)
    print("\n".join(texts), end="")
    return 0


_ESTIMATE_DESCRIPTION = """\
Predict a training step's peak memory without a GPU (fake tensors: shapes, no data) and, with a memory budget,
plan the micro-batch, gradient accumulation, precision and activation checkpointing that fit it.

model: --model CLASS_PATH (a LightningModule or nn.Module) with its init args from --config (a LightningCLI YAML
config: model: class_path + init_args, or the init args alone for a LightningCLI with a fixed model class) and
from overrides --model.NAME VALUE (also --model.init_args.NAME VALUE; values are read as YAML: 0.1, true, null,
[1, 2]). --model '{class_path: ..., init_args: {...}}' replaces the section. Nested class_path/init_args are built
too. The working directory is importable (examples.dreams.module.SpectraFineTuner from the repository root).
The config's optimizer: section (or --optimizer CLASS_PATH, --optimizer.NAME VALUE) replaces the module's
configure_optimizers; trainer: gives defaults for --precision, --devices, --num-nodes and accumulate_grad_batches;
memory: (MemoryPresetCLI's preset; --memory.NAME VALUE) gives the micro-batch, precision, checkpointing and
effective batch (flags win; when planning, what it leaves null the plan chooses) and a plan that fits ends with the
memory: section to paste back. Other sections (seed_everything, a LightningCLI subclass's own, ...) are ignored.
link_arguments are not applied.

batch: from the datamodule (--data CLASS_PATH, --data.NAME VALUE, or the config's data: section): prepare_data(),
setup("fit"), then the first B samples of train_dataloader()'s dataset in order (a smaller set is cycled),
collated by its collate_fn. Variable-length samples: the first batch decides the length; choose init args that
give the longest (e.g. padding to the maximum). Without a datamodule, a LightningModule's own train_dataloader()
is used. Or describe it: --batch-shape SPEC per tensor, SPEC = [name=]DIMS[:dtype], DIMS comma-separated ints
and B (the micro-batch), dtype default float32: one tensor is the batch, several a tuple, named ones a dict
(--batch-shape ids=B,512:int64 --batch-shape labels=B:int64). Shapes hold no data and no memory, at any size;
the model is built on the meta device too (an __init__ that needs data is built on the CPU, with a note). A
datamodule's samples are real: a batch of them larger than this machine's memory is refused before reading.

without a budget: the estimate at --batch-size (default: the datamodule's batch size) and its breakdown table;
--precision auto means 32-true (Lightning's default). With --gpu NAME or --device-memory SIZE: the plan for
--effective-batch-size samples per optimizer step over all devices (default: batch size x accumulate_grad_batches
x devices x nodes), every micro-batch tried estimated on its own; printed: the estimate at the chosen micro-batch,
the trials and the verdict; --precision auto picks bf16-mixed where the GPU computes bf16 (and for a
--device-memory size), else 16-mixed (32-true for --device cpu). Usable memory: the budget less the CUDA context
(512 MiB) and --margin. A progress line per estimate goes to stderr.

lengths: with --lengths FILE (the dataset's lengths, one sample per line: 512, or 512,96 for a source and a target)
and a budget, the table of the largest batch per length bucket instead (plan_token_budget): L (or L0, L1, ... per
axis) in --batch-shape is where the lengths go (--batch-shape ids=B,L0:int64 --batch-shape labels=B,L1:int64);
--length-buckets N places about N buckets at the lengths' quantiles (default 16), or names them (128x32,512x96).
Printed: the table and the TokenBudgetBatchSampler line that batches by it; exit code 1 when no bucket fits.

exit codes: 0 an estimate, or a plan that fits; 1 nothing fits the budget (the advice says what would: 8-bit
optimizer states or sharding); 2 bad input (one line on stderr naming the argument).

example (from the repository root, or an unpacked sdist):
  lightning-memopt estimate --config examples/dreams/config.yaml \\
      --model examples.dreams.module.SpectraFineTuner \\
      --data examples.dreams.module.SpectraDataModule \\
      --model.model_preset small --gpu A100-40GB --effective-batch-size 64
"""


def _add_estimate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="predict a training step's peak memory and plan micro-batch, precision and checkpointing",
        description=_ESTIMATE_DESCRIPTION,
        formatter_class=_Paragraphs,
        usage="%(prog)s [--config FILE.yaml] [--model CLASS_PATH] [--model.NAME VALUE ...]\n"
        "         [--data CLASS_PATH | --batch-shape SPEC ...] [--gpu NAME | --device-memory SIZE]\n"
        "         [--effective-batch-size N] [options]",
    )
    what = parser.add_argument_group("model and batch")
    what.add_argument(
        "--config",
        metavar="FILE.yaml",
        action="append",
        default=None,
        help="a LightningCLI config (model:, data:, optimizer:, trainer:); repeat to merge several",
    )
    what.add_argument(
        "--model",
        metavar="CLASS_PATH",
        default=None,
        help="the LightningModule (or nn.Module) class, e.g. examples.dreams.module.SpectraFineTuner;"
        " init args from --config and --model.NAME VALUE",
    )
    what.add_argument(
        "--data",
        metavar="CLASS_PATH",
        default=None,
        help="the LightningDataModule class whose training set gives the batch; init args from --config"
        " and --data.NAME VALUE",
    )
    what.add_argument(
        "--optimizer",
        metavar="CLASS_PATH",
        default=None,
        help="an optimizer class (torch.optim.AdamW, or AdamW) instead of configure_optimizers;"
        " init args --optimizer.NAME VALUE",
    )
    what.add_argument(
        "--batch-shape",
        metavar="SPEC",
        action="append",
        default=None,
        help="one batch tensor, [name=]DIMS[:dtype] with B for the micro-batch, e.g. B,128,64:float32;"
        " repeat per tensor (instead of --data)",
    )
    what.add_argument(
        "--lengths",
        metavar="FILE",
        default=None,
        help="the dataset's lengths, one sample per line (512, or 512,96 for two axes): plan the largest batch per"
        " length bucket instead (L, L0, L1 in --batch-shape are the lengths; needs --gpu or --device-memory)",
    )
    what.add_argument(
        "--length-buckets",
        metavar="N|LENGTHS",
        default=None,
        help="with --lengths: about N buckets at the lengths' quantiles (default 16), or the buckets: 128,512"
        " (one axis) or 128x32,512x96 (two)",
    )
    what.add_argument(
        "--batch-size",
        metavar="N",
        type=int,
        default=None,
        help="the micro-batch to estimate without a budget (default: the datamodule's)",
    )
    budget = parser.add_argument_group("memory budget (one of --gpu, --device-memory)")
    budget.add_argument(
        "--gpu",
        metavar="NAME",
        default=None,
        help="a GPU by name: T4, V100-16GB, A10G, L4, RTX4090, A100-40GB, A100-80GB, L40S, H100-80GB, H200, ...",
    )
    budget.add_argument(
        "--device-memory",
        metavar="SIZE",
        default=None,
        help="the device's memory: 40GB (10^9 bytes), 24GiB (2^30) or bytes",
    )
    budget.add_argument(
        "--effective-batch-size",
        metavar="N",
        type=int,
        default=None,
        help="samples per optimizer step over all devices, kept exactly by the plan",
    )
    budget.add_argument(
        "--devices",
        metavar="N",
        type=int,
        default=None,
        help="data-parallel devices per node (default: trainer.devices of the config, else 1)",
    )
    budget.add_argument(
        "--num-nodes",
        metavar="N",
        type=int,
        default=None,
        help="nodes (default: trainer.num_nodes of the config, else 1)",
    )
    budget.add_argument(
        "--margin",
        metavar="FRACTION",
        type=float,
        default=0.1,
        help="fraction of the usable memory left free for what is not modelled (default 0.1)",
    )
    how = parser.add_argument_group("settings")
    how.add_argument(
        "--precision",
        metavar="PRECISION",
        default=None,
        help="auto, 32-true, 16-mixed, bf16-mixed, 16-true or bf16-true (or 32, 16, bf16); default:"
        " trainer.precision of the config, else auto",
    )
    how.add_argument(
        "--checkpointing",
        metavar="auto|on|off|BLOCKS",
        default=None,
        help="activation checkpointing: auto (the plan tries without and with; no budget: the model as"
        " it is), on (the model's own switch, activation_checkpointing_enable() or the older"
        " gradient_checkpointing_enable(), where it has one, else"
        " PyTorch transformer layers), off, or block class names / name patterns, comma-separated;"
        " default: the memory: section's preset, else auto",
    )
    how.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="the target modelled (default cuda; the estimate itself runs on the CPU)",
    )
    how.add_argument(
        "--stage",
        choices=("fit", "validate", "test", "predict"),
        default="fit",
        help="the step: fit (training, the default) or an evaluation stage of the Trainer. An estimate of"
        " validate/test/predict estimates that step (no gradients, optimizer, accumulation or checkpointing);"
        " a plan (--gpu / --device-memory) plans the training micro-batch and that stage's batch per device",
    )
    parser.set_defaults(func=_run_estimate, takes_overrides=True)


def _run_estimate(args: argparse.Namespace) -> int:
    # Imported when the subcommand runs: it imports torch and Lightning.
    from lightning_memopt.cli_estimate import EstimateInputError, run_estimate

    try:
        return run_estimate(args)
    except EstimateInputError as err:
        raise CLIError(str(err)) from None
    except Exception as err:  # the last line of defence: one line, never a traceback
        raise CLIError(f"the estimate stopped unexpectedly ({type(err).__name__}: {err}); please report this") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-memopt", description=__doc__.splitlines()[0].replace("``", ""), formatter_class=_Paragraphs
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_analyze(subparsers)
    _add_report(subparsers)
    _add_estimate(subparsers)
    return parser


#: Flags that take one value and are repeated for more (``action="append"``): ``--batch-shape A --batch-shape B``.
_REPEATED_FLAGS = ("--batch-shape", "--config")


def _check_one_value_per_flag(argv: Sequence[str]) -> None:
    """Raises ``CLIError`` when values follow a repeated flag's own value (``--batch-shape A B``).

    Such a value is left over by the parser, which would otherwise call it an unrecognized argument.
    """
    for i, token in enumerate(argv):
        flag, equals, joined = token.partition("=")
        if flag not in _REPEATED_FLAGS:
            continue
        first = i + 1 if equals else i + 2  # the token after the flag's own value
        extra = list(itertools.takewhile(lambda t: not t.startswith("-"), argv[first:]))
        if not extra:
            continue
        values = [joined if equals else argv[i + 1], *extra]
        repeated = " ".join(f"{flag} {shlex.quote(v)}" for v in values)
        raise CLIError(
            f"`{flag}` takes one value per flag, got {len(values)} after one {flag}:"
            f" {' '.join(shlex.quote(v) for v in values)}; repeat the flag for each: {repeated}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extras = parser.parse_known_args(argv)
    if extras and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extras)}")  # what parse_args says
    args.overrides = extras  # estimate's --model.NAME VALUE and the like
    try:
        if extras:
            _check_one_value_per_flag(argv)
        return int(args.func(args) or 0)
    except CLIError as err:
        message = printable(" ".join(str(err).splitlines()))  # one line, no control characters from the input
        print(f"lightning-memopt {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
