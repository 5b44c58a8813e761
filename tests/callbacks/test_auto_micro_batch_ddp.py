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
    evaluation = {"validate_micro_batch_size": None, "test_micro_batch_size": None, "predict_micro_batch_size": None}
    # halved twice on rank 1, both ranks; no evaluation ran
    assert saved[micro.state_key] == {"micro_batch_size": 2, "retries": 2, **evaluation}
    assert saved[monitor.state_key] == {"last_logged_train_step": 3}
    for key in ["retries", *evaluation]:  # as a version that saved only the size would
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
