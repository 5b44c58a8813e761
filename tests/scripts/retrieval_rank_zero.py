"""The misuse ``if trainer.is_global_zero: metric.compute()`` with 2 gloo processes; each rank writes what happened.

Usage: ``python retrieval_rank_zero.py PORT``; writes ``rank{0,1}.json`` (``"no error"`` or ``"Type: message"``).
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_memopt import StreamingRetrievalMetric


def run(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    # not a hang guard: the time-out is what rank 0's lone compute() runs into (forked ranks meet in milliseconds)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=4))
    metric = StreamingRetrievalMetric()
    samples = [3 * rank, 3 * rank + 1, 3 * rank + 2]
    metric.update(torch.eye(3) + rank, torch.eye(3), text_ids=[0, 1, 2], sample_ids=samples)
    try:
        if rank == 0:  # the misuse: `if trainer.is_global_zero: metric.compute()`
            metric.compute()
            result = "no error"
        else:
            dist.barrier()  # where the other processes go next (Lightning's end of a stage)
            result = "no error"
    except Exception as err:
        result = f"{type(err).__name__}: {err}"
    with open(f"rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    mp.start_processes(run, args=(sys.argv[1],), nprocs=2, start_method="fork", join=True)
