"""Files never stop training: a full disk, a log directory replaced mid-run, bad directories refused in setup.

The full-disk cases run twice: on a real, tiny tmpfs that fills up mid-run (where this process may mount one,
e.g. as root in CI) and with ``ENOSPC`` injected into the writer's system calls (everywhere).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import uuid
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_memopt import MemoryAudit, MemoryMonitor, OOMReporter
from lightning_memopt.utilities import jsonl
from tests.helpers.lightning import pl
from tests.helpers.models import TinyModel
from tests.helpers.pipes import PipeWatchdog
from tests.helpers.trainer import make_trainer

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (raised by the test)"


class StepModel(TinyModel):
    """Calls ``at_step[n]()`` at the start of training batch ``n`` (1-based step about to run = n + 1)."""

    def __init__(self, at_step=None):
        super().__init__()
        self.at_step = at_step or {}
        self.raised = None

    def training_step(self, batch, batch_idx):
        action = self.at_step.get(batch_idx)
        if action is not None:
            action(self)
        return super().training_step(batch, batch_idx)


def _raise_oom(model):
    model.raised = torch.OutOfMemoryError(OOM)
    raise model.raised


def _callbacks(directory):
    return [
        MemoryMonitor(dirpath=directory / "memory", log_every_n_steps=1),
        MemoryAudit(dirpath=directory / "memory", leak_every_n_train_steps=1, leak_window=3, collect_garbage=False),
        OOMReporter(dirpath=directory / "oom", max_listed=0),
    ]


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ a full disk


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs; skipped where this process may not mount one."""
    mount_point = tmp_path / "tinyfs"
    mount_point.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
            check=True,
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=120)


def _fill(directory):
    """Use up every byte of the file system that holds ``directory``."""

    def fill(model):
        with open(directory / f"filler-{uuid.uuid4().hex}", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as err:
                assert err.errno == errno.ENOSPC
        with open(directory / "filler-last", "wb", buffering=0) as f:  # the last partial page
            try:
                while True:
                    f.write(b"\0")
            except OSError:
                pass

    return fill


class _FullDiskOs:
    """The ``os`` module as the JSONL writer sees it, with ``write`` failing with ENOSPC once ``full`` is set."""

    def __init__(self):
        self.full = False

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)


@pytest.fixture(params=["tmpfs", "injected"])
def full_disk(request, tmp_path, monkeypatch):
    """``(directory, fill)``: callbacks write under ``directory``; ``fill`` (a training-step action) fills the disk."""
    if request.param == "tmpfs":
        directory = request.getfixturevalue("tiny_fs")
        return directory, _fill(directory)
    fake = _FullDiskOs()
    monkeypatch.setattr(jsonl, "os", fake)
    return tmp_path, lambda model: setattr(fake, "full", True)


def test_full_disk_warns_once_per_file_writer_and_training_goes_on(full_disk, request):
    directory, fill = full_disk
    model = StepModel({0: fill})  # after the fit-start records, before step 1
    trainer = make_trainer(directory, callbacks=_callbacks(directory)[:2], max_steps=6, limit_train_batches=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert trainer.global_step == 6
    stopped = [str(w.message) for w in caught if "are not stored" in str(w.message)]
    monitor = [m for m in stopped if m.startswith("MemoryMonitor: records from train step ")]
    audit = [m for m in stopped if m.startswith("MemoryAudit: records from train step ")]
    assert len(monitor) == 1 and len(audit) <= 1 and len(stopped) == len(monitor) + len(audit), stopped
    assert all("No space left on device" in m for m in stopped), stopped
    first_lost = int(monitor[0].split("train step ")[1].split()[0])
    # what was written before the disk filled up is kept, and nothing after it
    steps = [r["global_step"] for r in _records(directory / "memory" / "memory_rank0.jsonl") if r["event"] == "step"]
    assert steps == list(range(1, first_lost)), (steps, first_lost)
    if request.node.callspec.params["full_disk"] == "injected":  # exact: every write fails from step 1 on
        assert first_lost == 1 and len(audit) == 1 and "records from train step 1 on" in audit[0], stopped
    # a tmpfs still takes a few lines into the page the file already has: the loss may start later


def test_full_disk_never_masks_an_out_of_memory_error(full_disk):
    directory, fill = full_disk
    # the disk fills before step 2; out of memory in step 16, once a tmpfs has used up the page its files already had
    model = StepModel({1: fill, 15: _raise_oom})
    trainer = make_trainer(directory, callbacks=_callbacks(directory), max_steps=20, limit_train_batches=20)
    with pytest.warns(UserWarning, match="are not stored"), pytest.raises(BaseException) as info:
        trainer.fit(model)
    assert info.value is model.raised
    assert type(info.value) is torch.OutOfMemoryError and str(info.value) == OOM


# ------------------------------------------------------------------------------------------------ a directory replaced


def test_log_directory_replaced_by_a_file_mid_run_warns_from_which_step(tmp_path):
    memory = tmp_path / "memory"

    def replace(model):
        shutil.rmtree(memory)
        memory.write_text("not a directory any more")

    trainer = make_trainer(
        tmp_path, callbacks=[MemoryMonitor(dirpath=memory, log_every_n_steps=1)], max_steps=5, limit_train_batches=5
    )
    with pytest.warns(UserWarning, match="records from train step 3 on are not stored") as caught:
        trainer.fit(StepModel({2: replace}))
    assert trainer.global_step == 5
    message = next(str(w.message) for w in caught if "are not stored" in str(w.message))
    assert "no longer exists" in message and str(memory / "memory_rank0.jsonl") in message
    assert memory.read_text() == "not a directory any more"


def test_log_file_deleted_mid_run_is_not_written_silently(tmp_path):
    memory = tmp_path / "memory"
    trainer = make_trainer(
        tmp_path, callbacks=[MemoryMonitor(dirpath=memory, log_every_n_steps=1)], max_steps=5, limit_train_batches=5
    )
    with pytest.warns(UserWarning, match="records from train step 3 on are not stored"):
        trainer.fit(StepModel({2: lambda model: (memory / "memory_rank0.jsonl").unlink()}))
    assert trainer.global_step == 5


# ------------------------------------------------------------------------------------------------ setup checks


@pytest.mark.parametrize("relative", ["file", "file/oom", "file/a/b"])
def test_oom_reporter_refuses_a_dirpath_at_or_under_a_file_in_setup(tmp_path, relative):
    (tmp_path / "file").write_text("x")
    dirpath = tmp_path / relative
    model = StepModel({0: lambda m: pytest.fail("training started")})
    trainer = make_trainer(tmp_path, callbacks=[OOMReporter(dirpath=dirpath)])
    with pytest.raises(OSError, match="`dirpath` must be a writable directory") as info:
        trainer.fit(model)
    message = str(info.value)
    assert repr(str(dirpath)) in message and f"{str(tmp_path / 'file')!r} is a file" in message
    assert "Pass a `dirpath`" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_oom_reporter_refuses_an_unwritable_dirpath_in_setup(tmp_path):  # pragma: no cover - CI runs as root
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    trainer = make_trainer(tmp_path, callbacks=[OOMReporter(dirpath=locked / "oom")])
    with pytest.raises(OSError, match="is not writable"):
        trainer.fit(TinyModel())


def test_oom_reporter_creates_its_directory_only_when_it_reports(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[OOMReporter()])
    trainer.fit(TinyModel())
    assert not (tmp_path / "memopt").exists()
    model = StepModel({1: _raise_oom})
    trainer = make_trainer(tmp_path, callbacks=[OOMReporter()])
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(model)
    names = sorted(p.name for p in (tmp_path / "memopt").iterdir())
    assert [n for n in names if "-" not in n] == ["oom_report_rank0.json", "oom_report_rank0.md"]
    assert len(names) == 4  # the same two files under the report's own name


def test_oom_reporter_on_exception_never_asks_the_trainer_for_log_dir(tmp_path, monkeypatch):
    """``trainer.log_dir`` broadcasts under DDP: reached from ``on_exception`` on one rank, it hangs the job."""
    import lightning.pytorch as pl

    model = StepModel({1: _raise_oom})
    reporter = OOMReporter()
    trainer = make_trainer(tmp_path, callbacks=[reporter])
    asked = []
    original = pl.Trainer.log_dir

    def spy(self):
        asked.append(self.state.status.value)
        return original.fget(self)

    monkeypatch.setattr(pl.Trainer, "log_dir", property(spy))
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(model)
    assert asked and "interrupted" not in asked, asked  # asked in setup (running), never after the failure
    assert (tmp_path / "memopt" / "oom_report_rank0.json").exists()


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir], ids=["named-pipe", "directory"])
@pytest.mark.parametrize("callback", [MemoryMonitor, MemoryAudit])
def test_jsonl_path_that_is_not_a_regular_file_is_refused_in_setup(tmp_path, make, callback):
    memory = tmp_path / "memory"
    memory.mkdir()
    make(memory / "memory_rank0.jsonl")
    trainer = make_trainer(tmp_path, callbacks=[callback(dirpath=memory)])
    watchdog = PipeWatchdog(memory / "memory_rank0.jsonl") if make is os.mkfifo else None
    try:
        with pytest.raises(OSError, match="not a regular file") as info:
            trainer.fit(TinyModel())
    finally:
        if watchdog is not None:
            watchdog.stop()
    assert watchdog is None or not watchdog.fired, "setup blocked opening the named pipe"
    assert "`dirpath`" in str(info.value) and "memory_rank0.jsonl" in str(info.value)


def test_a_full_disk_at_setup_is_a_warning_not_an_error(tmp_path, monkeypatch):
    from lightning_memopt.utilities import jsonl as module

    def full(name, path):
        raise OSError(f"`{name}` ... cannot be created") from OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module, "check_writable_dir", full)
    monkeypatch.setattr(module, "os", SimpleNamespace(**{**vars(os), "open": _enospc_open}))
    trainer = make_trainer(tmp_path, callbacks=[MemoryMonitor(dirpath=tmp_path / "memory")])
    with pytest.warns(UserWarning, match="records from train step 0 on are not stored"):
        trainer.fit(TinyModel())
    assert trainer.global_step == 4


def _enospc_open(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("callback", [MemoryMonitor, MemoryAudit])
def test_jsonl_path_that_is_a_planted_symlink_is_refused_in_setup(tmp_path, callback):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "victim.txt"
    target.write_text("precious\n")
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "memory_rank0.jsonl").symlink_to(target)
    trainer = make_trainer(tmp_path, callbacks=[callback(dirpath=memory)])
    with pytest.raises(OSError, match="is a symbolic link") as info:
        trainer.fit(TinyModel())
    assert "`dirpath`" in str(info.value) and "memory_rank0.jsonl" in str(info.value)
    assert "Remove the link or pass another `dirpath`" in str(info.value)
    assert target.read_text() == "precious\n"


def test_a_symlink_planted_after_setup_stops_the_log_and_training_goes_on(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    memory = tmp_path / "memory"

    class Plant(pl.Callback):
        def on_fit_start(self, trainer, pl_module):  # after setup checked the path, before the first record
            (memory / "memory_rank0.jsonl").symlink_to(target)

    callbacks = [Plant(), *_callbacks(tmp_path)[:2]]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=3, limit_train_batches=3, limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModel())
    assert trainer.global_step == 3
    stopped = [str(w.message) for w in caught if "are not stored" in str(w.message)]
    assert {m.split(":")[0] for m in stopped} == {"MemoryMonitor", "MemoryAudit"} and len(stopped) == 2, stopped
    assert all("symbolic link" in m and str(memory / "memory_rank0.jsonl") in m for m in stopped), stopped
    assert target.read_text() == "precious\n"
