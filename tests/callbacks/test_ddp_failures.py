"""Two-process DDP (gloo, CPU): an out-of-memory error on one rank ends the run, it never hangs it.

Every exported callback runs at its defaults. Rank 1 alone raises ``torch.OutOfMemoryError`` in forward or in
backward; the run must end well within 60 s, rank 1 must write its report to the default directory, and the
caller of ``trainer.fit`` on rank 1 must get the original error object.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers.subprocess_run import run_script

SCRIPT = """
import json
import os
import sys
from datetime import timedelta

import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from lightning_memopt import (
    CacheCleaner, GarbageCollector, GradientCheckpointing, MemoryAudit, MemoryMonitor, OOMReporter,
)
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

WHERE = sys.argv[1]
MESSAGE = "CUDA out of memory. Tried to allocate 1.00 GiB (rank 1 only, in " + WHERE + ")"


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError(MESSAGE)


class RankOneFails(TinyModel):
    def forward(self, x):
        out = super().forward(x)
        if self.training and self.global_rank == 1 and self.trainer.fit_loop.batch_idx == 2:
            if WHERE == "forward":
                raise torch.OutOfMemoryError(MESSAGE)
            out = _FailInBackward.apply(out)  # the first node of backward: fails before any gradient exists
        return out


callbacks = [MemoryMonitor(), CacheCleaner(), GarbageCollector(), OOMReporter(), MemoryAudit(),
             GradientCheckpointing()]
# The process group's own timeout is far beyond the test's limit: only a run that ends by itself passes.
trainer = make_trainer(".", accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=600)),
                       max_steps=6, limit_train_batches=6, callbacks=callbacks, logger=CSVLogger("logs"))
model = RankOneFails()
try:
    trainer.fit(model)
except BaseException as err:
    if trainer.global_rank == 1:
        with open(f"caught_rank{trainer.global_rank}.json", "w") as f:
            json.dump({"type": type(err).__name__, "message": str(err),
                       "is_oom": isinstance(err, torch.OutOfMemoryError)}, f)
    raise
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_oom_on_one_rank_ends_the_run_with_a_report(tmp_path, where):
    start = time.monotonic()
    result = run_script(SCRIPT, tmp_path, timeout=90, args=(where,))
    elapsed = time.monotonic() - start
    output = result.stdout[-2000:] + result.stderr[-4000:]
    assert elapsed < 60, f"the run took {elapsed:.0f} s\n{output}"
    assert result.returncode != 0, output
    caught = json.loads((tmp_path / "caught_rank1.json").read_text())
    assert caught == {
        "type": "OutOfMemoryError",
        "is_oom": True,
        "message": f"CUDA out of memory. Tried to allocate 1.00 GiB (rank 1 only, in {where})",
    }, output
    reports = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("oom_report_rank*"))
    assert reports == [
        "logs/lightning_logs/version_0/oom/oom_report_rank1.json",
        "logs/lightning_logs/version_0/oom/oom_report_rank1.md",
    ], output
    report = json.loads((tmp_path / reports[0]).read_text())
    assert report["when"]["rank"] == 1 and report["error"]["type"] == "torch.OutOfMemoryError"
    assert report["when"]["world_size"] == 2 and report["config"]["strategy"] == "DDPStrategy"
    assert report["config"]["effective_batch_size"] == 2 * report["config"]["micro_batch_size"]
