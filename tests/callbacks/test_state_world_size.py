"""State saved by a 2-process DDP run resumes in a 1-process run (the world size changed between the two)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_memopt import MemoryMonitor
from lightning_memopt.analysis.memory_log import load_memory_log
from lightning_memopt.callbacks import AutoMicroBatch
from tests.helpers.amb import Net
from tests.helpers.subprocess_run import SCRIPTS, run_file
from tests.helpers.trainer import make_trainer


@pytest.mark.slow
def test_a_two_process_checkpoint_in_an_older_format_resumes_in_one_process(tmp_path):
    proc = run_file(SCRIPTS / "state_world_size.py", tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = tmp_path / "ddp.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    micro, monitor = AutoMicroBatch(), MemoryMonitor(log_every_n_steps=1)
    saved = checkpoint["callbacks"]
    assert saved[micro.state_key] == {"micro_batch_size": 2, "retries": 2}  # halved twice on rank 1, both ranks
    assert saved[monitor.state_key] == {"last_logged_train_step": 3}
    del saved[micro.state_key]["retries"]  # as a version that saved only the size would
    torch.save(checkpoint, path)

    model = Net(batch_size=8, forward_budget=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, callbacks=[micro, monitor], max_steps=5, limit_train_batches=None)
        trainer.fit(model, ckpt_path=str(path))
    said = [str(w.message) for w in caught if str(w.message).startswith("AutoMicroBatch: ")]
    assert len(said) == 1 and "'retries'" in said[0]
    assert trainer.global_step == 5
    assert micro.micro_batch_size == 2 and max(model.seen_sizes) == 2  # the size found by two processes held
    steps = [r["global_step"] for r in load_memory_log(monitor.path) if r["phase"] == "train" and r["event"] == "step"]
    assert steps == sorted(set(steps)) and steps[-2:] == [4, 5]  # each step written once, the resumed ones added
