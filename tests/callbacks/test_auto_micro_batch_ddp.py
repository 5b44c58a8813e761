"""AutoMicroBatch on two DDP processes (gloo), only rank 1 short of memory: both ranks halve together and end equal to
one process at the global batch; the state saved by the 2-process run resumes in a 1-process run.

Both tests read one run of ``tests/scripts/amb_ddp.py``.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from lightning_memopt import MemoryMonitor
from lightning_memopt.analysis.memory_log import load_memory_log
from lightning_memopt.callbacks import AutoMicroBatch
from tests.helpers.amb import Net, fit
from tests.helpers.amb_eval import EvalNet
from tests.helpers.subprocess_run import run_script_once
from tests.helpers.trainer import make_trainer


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return run_script_once(tmp_path_factory, "amb_ddp.py")


@pytest.mark.slow
def test_two_ddp_processes_where_only_rank_1_runs_out_of_memory(ddp_run, tmp_path):
    reference = Net(optimizer="adamw", batch_size=16)  # one process, the global batch
    fit(tmp_path / "ref", reference, max_steps=3)
    for where in ("forward", "backward"):
        ranks = [torch.load(ddp_run / f"{where}_rank{r}.pt", weights_only=False) for r in (0, 1)]
        for r in ranks:  # both ranks halved together (8 -> 4 -> 2) and made the same three steps
            assert (r["micro"], r["retries"], r["step"]) == (2, 2, 3)
        assert ranks[0]["sizes"][:3] == [8, 4, 2]  # rank 0 had memory to spare and still followed rank 1
        for rank, reason in ((0, "out of memory on another process"), (1, "out of memory")):
            log = load_memory_log(ddp_run / where / f"memory_rank{rank}.jsonl")
            changes = [
                (r["previous_micro_batch_size"], r["micro_batch_size"], r["reason"])
                for r in log
                if r["event"] == "micro_batch"
            ]
            assert changes == [(8, 4, reason), (4, 2, reason)], (where, rank)
        for name, value in ranks[0]["weights"].items():
            assert torch.equal(value, ranks[1]["weights"][name]), (where, name)
            assert torch.allclose(value, reference.state_dict()[name], atol=1e-6), (where, name)


@pytest.mark.slow
def test_a_two_process_checkpoint_in_an_older_format_resumes_in_one_process(ddp_run, tmp_path, monkeypatch):
    path = tmp_path / "ddp.ckpt"
    checkpoint = torch.load(ddp_run / "forward.ckpt", weights_only=False)
    # a copy of the run's log directory, written by 2 processes: the resumed process appends to it
    shutil.copytree(ddp_run / "forward", tmp_path / "forward")
    monkeypatch.chdir(tmp_path)
    micro, monitor = AutoMicroBatch(), MemoryMonitor(dirpath="forward", log_every_n_steps=1)
    saved = checkpoint["callbacks"]
    evaluation = {
        f"{stage}_micro_batch_{what}": None
        for stage in ("validate", "test", "predict")
        for what in ("size", "elements")
    }
    # halved twice on rank 1, both ranks (2 samples of 6 elements); no evaluation ran
    assert saved[micro.state_key] == {"micro_batch_size": 2, "retries": 2, "micro_batch_elements": 12, **evaluation}
    assert saved[monitor.state_key] == {"last_logged_train_step": 3}
    for key in ["retries", "micro_batch_elements", *evaluation]:  # as a version that saved only the size would
        del saved[micro.state_key][key]
    torch.save(checkpoint, path)

    model = Net(optimizer="adamw", batch_size=8, forward_budget=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, callbacks=[micro, monitor], max_steps=5, limit_train_batches=None)
        trainer.fit(model, ckpt_path=str(path))
    said = [str(w.message) for w in caught if str(w.message).startswith("AutoMicroBatch: ")]
    assert len(said) == 1 and "'retries'" in said[0]
    assert trainer.global_step == 5
    assert micro.micro_batch_size == 2 and max(model.seen_sizes) == 2  # the size found by two processes held
    steps = [r["global_step"] for r in load_memory_log(monitor.path) if r["phase"] == "train" and r["event"] == "step"]
    assert steps == [1, 2, 3, 4, 5]  # each step written once, the resumed ones added to the run's own log


@pytest.mark.slow
def test_a_synced_step_log_that_the_rank_out_of_memory_never_reaches_leaves_no_rank_waiting(ddp_run, tmp_path):
    # training: rank 0 logs with sync_dist=True while rank 1 ran out of memory in forward; both halve together
    ranks = [torch.load(ddp_run / f"sync_log_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["micro"] == ranks[1]["micro"] == 2
    reference = Net(optimizer="adamw", batch_size=16)
    fit(tmp_path / "ref", reference, max_steps=3)
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][name]), name
        assert torch.allclose(value, reference.state_dict()[name], atol=1e-6), name


@pytest.mark.slow
def test_a_validation_with_synced_step_logs_out_of_memory_on_one_rank_equals_one_process_at_the_batch_that_fits(
    ddp_run, tmp_path
):
    ranks = [torch.load(ddp_run / f"validate_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:  # rank 0 had memory to spare and followed rank 1: 16 -> 8 -> 4, then 4 for the second batch
        assert r["micro"]["validate"] == 4
        assert r["sizes"] == [16, 8, 4, 4, 4, 4, 4, 4, 4, 4]
    assert ranks[0]["results"] == ranks[1]["results"]
    reference = EvalNet(eval_batch_size=4)  # one process, every sample, the batch that fits
    (expected,) = make_trainer(tmp_path, limit_val_batches=None).validate(reference)
    (got,) = ranks[0]["results"]
    for key in ("val_loss", "val_mse"):
        assert got[key] == pytest.approx(expected[key], rel=1e-6), key
