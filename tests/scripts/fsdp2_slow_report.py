"""Rank 1 runs out of memory inside FSDP's reduce-scatter under Lightning's own launcher, and rank 0's report is slow.

Usage: ``python fsdp2_slow_report.py SECONDS`` in an empty directory (run by
``tests/callbacks/test_faults_reports_fsdp2.py``). Two CPU processes (gloo) started by Lightning from this one script
(``devices=2``: rank 0 is this process and watches rank 1, killing every process within 5 s of rank 1 ending with an
error), ``ModelParallelStrategy`` with ``fully_shard`` per block, ``AutoMicroBatch`` and ``OOMReporter`` (``reports/``).
Rank 1's reduce-scatter raises ``torch.OutOfMemoryError`` (not recoverable: rank 0 waits inside that collective);
rank 0's report takes ``SECONDS`` longer to write. Each rank that gets there writes ``caught_rank{r}.json``: the
error it ended with, and on rank 1 whether it is the very object the collective raised. Lightning re-launches this
file for rank 1, so it must be a file of its own.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def _slow_reports(seconds: float) -> None:
    """Rank 0's report writing takes ``seconds`` more (before its files are written)."""
    from lightning_memopt.functional import oom

    save = oom.save_report

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return save(*args, **kwargs)

    oom.save_report = slow


def _failing_reduce_scatter() -> list[BaseException]:
    """Rank 1's reduce-scatter runs out of memory inside the collective; the errors raised, in a list."""
    raised: list[BaseException] = []

    def fails(*args, **kwargs):
        raised.append(torch.OutOfMemoryError("simulated: inside the reduce-scatter"))
        raise raised[-1]

    torch.distributed.reduce_scatter_single = fails
    return raised


def main(seconds: float) -> None:
    from lightning_memopt import AutoMicroBatch, OOMReporter
    from lightning_memopt.functional.micro_batch.retry import is_unrecoverable
    from tests.scripts.amb_fsdp2 import Sharded, fsdp2_trainer

    trainer = fsdp2_trainer([AutoMicroBatch(), OOMReporter(dirpath="reports")])
    rank, raised = trainer.global_rank, []
    if rank == 0:
        _slow_reports(seconds)
    else:
        raised = _failing_reduce_scatter()
    try:
        trainer.fit(Sharded())
    except BaseException as err:
        caught = {
            "type": type(err).__name__,
            "message": str(err),
            "original": bool(raised) and err is raised[0],
            "unrecoverable": is_unrecoverable(err),
        }
        with open(f"caught_rank{rank}.json", "w") as f:
            json.dump(caught, f)
        raise


if __name__ == "__main__":
    main(float(sys.argv[1]))
