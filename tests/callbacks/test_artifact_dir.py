"""One way to store and default ``dirpath`` for every writer: ``MemoryMonitor``, ``MemoryAudit``, ``OOMReporter``."""

import pathlib

import pytest
import torch

from lightning_memopt.callbacks import MemoryAudit, MemoryMonitor, OOMReporter
from lightning_memopt.callbacks._memory_log import ArtifactCallback
from lightning_memopt.utilities import trainer as trainer_utils
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

WRITERS = [MemoryMonitor, MemoryAudit, OOMReporter]


@pytest.mark.parametrize("writer", WRITERS)
def test_dirpath_is_stored_as_str_or_none(writer, tmp_path):
    assert isinstance(writer(), ArtifactCallback)
    assert writer().dirpath is None
    given = writer(dirpath=tmp_path / "logs")
    assert given.dirpath == str(tmp_path / "logs") and type(given.dirpath) is str
    assert writer(dirpath=str(tmp_path)).dirpath == str(tmp_path)


class _OOMAtStep2(TinyModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().training_step(batch, batch_idx)


def test_one_default_directory_under_the_log_dir_for_all_writers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    monitor, audit, reporter = MemoryMonitor(log_every_n_steps=1), MemoryAudit(), OOMReporter(max_listed=0)
    trainer = make_trainer(tmp_path, callbacks=[monitor, audit, reporter], logger=CSVLogger(tmp_path / "logs"))
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(_OOMAtStep2())
    expected = tmp_path / "logs" / "lightning_logs" / "version_0" / "memopt"
    assert monitor.path == audit.path == expected / "memory_rank0.jsonl"
    reports = sorted(p.name for p in expected.glob("oom_report_rank0.*"))
    assert reports == ["oom_report_rank0.json", "oom_report_rank0.md"]
    assert (monitor.dirpath, audit.dirpath, reporter.dirpath) == (None, None, None)  # the user's value stays


def test_default_artifact_dir_without_a_logger_and_without_communicating(tmp_path):
    trainer = make_trainer(tmp_path, logger=False)
    assert trainer_utils.default_artifact_dir(trainer) == str(tmp_path / "memopt")

    class Collective:  # `log_dir` broadcasts under DDP: `communicate=False` never reads it
        default_root_dir = str(tmp_path)

        @property
        def log_dir(self):
            raise AssertionError("read log_dir")

    assert trainer_utils.default_artifact_dir(Collective(), communicate=False) == str(tmp_path / "memopt")
    assert pathlib.Path(trainer_utils.default_artifact_dir(Collective())) == tmp_path / "memopt"  # a failing read


def test_dead_trainer_helpers_are_gone():
    assert not hasattr(trainer_utils, "env_flag") and not hasattr(trainer_utils, "phase_of_stage")
