"""No log line lost on resume: a torn last line, other runs in the same directory, one run id per run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_memopt import MemoryAudit, MemoryMonitor, OOMReporter
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

TORN = '{"time": 1700000000.5, "rank": 0, "phase": "train", "event": "st'


def _callbacks(directory: Path) -> list:
    return [
        MemoryMonitor(dirpath=directory, log_every_n_steps=1),
        MemoryAudit(dirpath=directory, leak_every_n_train_steps=1, leak_window=3, collect_garbage=False),
    ]


def _fit(
    tmp_path: Path, directory: Path, max_steps: int, ckpt_path: str | None = None, every: int = 0, name: str = "run"
) -> None:
    callbacks = _callbacks(directory)
    if every:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=every, save_top_k=-1))
    trainer = make_trainer(
        tmp_path / name,
        callbacks=callbacks,
        max_steps=max_steps,
        limit_train_batches=20,
        limit_val_batches=0,
        enable_checkpointing=bool(every),
        logger=False,
    )
    trainer.fit(TinyModel(), ckpt_path=ckpt_path)


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")


def _train_steps(records: list[dict], run: str) -> list[int]:
    return [
        r["global_step"] for r in records if r.get("run_id") == run and r["phase"] == "train" and r["event"] == "step"
    ]


def test_resumed_run_after_a_torn_last_line_starts_on_a_fresh_line(tmp_path):
    directory = tmp_path / "memory"
    _fit(tmp_path, directory, max_steps=4, every=2)
    path = directory / "memory_rank0.jsonl"
    before = _lines(path)
    assert before[-1] == ""  # the file ends with a complete line
    # The run is killed while it writes a record: half a line, no newline.
    with open(path, "a", encoding="utf-8") as f:
        f.write(TORN)
    _fit(tmp_path, directory, max_steps=6, ckpt_path=str(tmp_path / "run" / "epoch=0-step=2.ckpt"))

    lines = _lines(path)
    assert lines[: len(before) - 1] == before[:-1]  # nothing written before is rewritten
    assert lines[len(before) - 1] == TORN  # the torn line stays as it was, alone on its line
    resumed = [json.loads(line) for line in lines[len(before) :] if line]  # every record of the resumed run parses
    assert resumed, "the resumed run wrote nothing"
    run = resumed[0]["run_id"]
    assert {r["run_id"] for r in resumed} == {run}
    earlier = [json.loads(line) for line in before if line]
    assert _train_steps(earlier + resumed, run) == [1, 2, 3, 4, 5, 6]
    # MemoryAudit's records of the resumed run are in the same file, after the torn line, and parse too
    assert any(r["event"] == "audit" for r in resumed)


@pytest.mark.slow
def test_another_run_in_the_same_directory_never_hides_the_resumed_runs_steps(tmp_path):
    directory = tmp_path / "shared"
    path = directory / "memory_rank0.jsonl"
    _fit(tmp_path, directory, max_steps=5, every=5, name="a")  # run A: steps 1-5, checkpoint at 5
    run_a = json.loads(_lines(path)[0])["run_id"]
    _fit(tmp_path, directory, max_steps=8, name="b")  # run B: steps 1-8 in the same file
    _fit(tmp_path, directory, max_steps=8, ckpt_path=str(tmp_path / "a" / "epoch=0-step=5.ckpt"), name="a")

    records = [json.loads(line) for line in _lines(path) if line]
    run_b = next(r["run_id"] for r in records if r["run_id"] != run_a)
    assert _train_steps(records, run_a) == [1, 2, 3, 4, 5, 6, 7, 8]  # 6-8 of the resumed run A are there
    assert _train_steps(records, run_b) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert {r["run_id"] for r in records} == {run_a, run_b}


def test_every_callback_of_a_run_writes_one_run_id(tmp_path):
    class Fails(TinyModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. (raised by the test)")
            return super().training_step(batch, batch_idx)

    directory = tmp_path / "memory"
    callbacks = [*_callbacks(directory), OOMReporter(dirpath=tmp_path / "oom", max_listed=0)]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=5, limit_val_batches=0, logger=False)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(Fails())
    records = [json.loads(line) for line in _lines(directory / "memory_rank0.jsonl") if line]
    writers = {r["event"] for r in records}
    assert "step" in writers and "audit" in writers, writers  # both callbacks wrote
    run_ids = {r["run_id"] for r in records}
    assert len(run_ids) == 1 and len(next(iter(run_ids))) == 12
    report = json.loads((tmp_path / "oom" / "oom_report_rank0.json").read_text())
    assert report["when"]["run_id"] in run_ids

    # A second run in the same directory gets an id of its own.
    make_trainer(tmp_path, callbacks=_callbacks(directory), max_steps=1, limit_val_batches=0, logger=False).fit(
        TinyModel()
    )
    records = [json.loads(line) for line in _lines(directory / "memory_rank0.jsonl") if line]
    assert len({r["run_id"] for r in records}) == 2
