"""MemoryAudit reports what the DataLoaders hold in host memory and flags the settings that waste it."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_memopt
from lightning_memopt import MemoryAudit, MemoryPreset
from lightning_memopt.analysis.memory_log import format_summary, load_memory_log, summarize_memory_log
from lightning_memopt.functional.audit.loaders import batch_bytes, loader_memory
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

GIB = 2**30


def _loader(**kwargs):
    return DataLoader(TensorDataset(torch.zeros(64, 1024)), batch_size=16, **kwargs)


def _measured(loader):
    """The bytes of a batch the loader yields, as MemoryAudit measures them (on the first batch it sees)."""
    return batch_bytes(next(iter(DataLoader(loader.dataset, batch_size=loader.batch_size))))


def test_batches_prepared_ahead_and_their_pinned_copies_are_counted():
    loader = _loader(num_workers=3, prefetch_factor=4, pin_memory=True)
    info = loader_memory(loader, "train", "cuda", cpu_count=8, host_total_bytes=64 * GIB, batch_bytes=_measured(loader))
    one = 16 * 1024 * 4
    assert (info.batch_bytes, info.in_flight) == (one, 12)
    assert info.pinned_bytes == 12 * one and info.host_bytes == 24 * one
    assert info.findings == []
    plain = loader_memory(
        _loader(), "train", "cpu", cpu_count=8, host_total_bytes=64 * GIB, batch_bytes=_measured(_loader())
    )
    assert (plain.in_flight, plain.host_bytes, plain.pinned_bytes, plain.prefetch_factor) == (0, 0, 0, None)
    assert "12 batch(es) of 64.00 KiB prepared ahead = 1.50 MiB, 768.00 KiB of it pinned" in info.summary()


class PythonObjects(Dataset):
    def __init__(self):
        self.tokens = [[i, i + 1] for i in range(150_000)]  # a tokenised dataset kept as Python lists

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return torch.tensor(self.tokens[i])


@pytest.mark.parametrize(
    ("make", "device", "expected"),
    [
        (lambda: _loader(num_workers=12), "cuda", "num_workers=12 exceeds the 8 CPU cores"),
        (
            lambda: _loader(num_workers=4, prefetch_factor=80),
            "cuda",
            "320 batches prepared ahead (num_workers=4 x prefetch_factor=80) of 64.00 KiB hold 20.00 MiB, over 25%",
        ),
        (lambda: _loader(pin_memory=True), "cpu", "pin_memory=True while training on cpu"),
        (
            lambda: _loader(num_workers=2, persistent_workers=True),
            "cuda",
            "persistent_workers=True keeps 2 validation worker(s)",
        ),
        (
            lambda: DataLoader(PythonObjects(), batch_size=4, num_workers=2),
            "cuda",
            "`dataset.tokens` is a Python container of 150,000 objects: each of the 2 workers",
        ),
    ],
    ids=["workers", "prefetch", "pin", "persistent", "python-objects"],
)
def test_each_wasteful_setting_is_named_with_its_fix(make, device, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # pinning for a CPU run of a GPU machine
    loader = make()
    info = loader_memory(
        loader, "val", device, cpu_count=8, host_total_bytes=64 * 2**20, evaluation=True, batch_bytes=_measured(loader)
    )
    assert len(info.findings) == 1 and expected in info.findings[0], info.findings


def test_batch_bytes_of_nested_batches():
    import numpy as np

    batch = {"peaks": torch.zeros(4, 8), "meta": [np.zeros(3, dtype=np.float64), ("id", torch.zeros(2))]}
    assert batch_bytes(batch) == 4 * 8 * 4 + 3 * 8 + 2 * 4


class LoaderModel(TinyModel):
    def __init__(self, val_workers=0, persistent=False):
        super().__init__()
        self.val_workers, self.persistent = val_workers, persistent

    def val_dataloader(self):
        return DataLoader(
            TensorDataset(torch.randn(8, 32)),
            batch_size=4,
            num_workers=self.val_workers,
            persistent_workers=self.persistent,
        )

    def validation_step(self, batch, batch_idx):
        return None


def _fit(tmp_path, model, **kwargs):
    audit = MemoryAudit(dirpath=tmp_path / "memory", **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[audit], max_steps=2, limit_val_batches=1, val_check_interval=1).fit(model)
    found = [w for w in caught if str(w.message).startswith(("MemoryAudit: val", "MemoryAudit: train"))]
    package = os.path.dirname(lightning_memopt.__file__)
    assert [w.filename for w in found if not w.filename.startswith(package + os.sep)] == []  # filterable by module
    ours = [str(w.message) for w in found]
    records = [json.loads(line) for line in (tmp_path / "memory" / "memory_rank0.jsonl").read_text().splitlines()]
    return audit, ours, records


def test_a_fit_reports_the_loaders_and_warns_about_persistent_validation_workers(tmp_path):
    audit, warned, records = _fit(tmp_path, LoaderModel(val_workers=1, persistent=True))
    assert [i.name for i in audit.loaders] == ["train", "val"]
    assert audit.loaders[0].batch_bytes == 4 * 32 * 4
    assert len(warned) == 1 and "val: persistent_workers=True keeps 1 validation worker(s)" in warned[0]
    reports = [r["loader"] for r in records if r["event"] == "dataloaders"]  # one per loader, at its first batch
    assert [loader["name"] for loader in reports] == ["train", "val"]
    assert reports[1]["in_flight"] == 2 and sum(r["host_bytes"] for r in reports) == 2 * 4 * 32 * 4
    [finding] = [r for r in records if r["event"] == "warning" and r["check"] == "dataloaders"]
    assert finding["loader"] == "val"
    text = format_summary(summarize_memory_log(load_memory_log(tmp_path / "memory" / "memory_rank0.jsonl")))
    assert "dataloaders" in text and "persistent_workers=True" in text  # analyze shows the finding


@pytest.mark.slow  # two fits: over 2 s on a loaded core
def test_a_clean_fit_says_nothing_and_the_audit_can_be_turned_off(tmp_path):
    audit, warned, records = _fit(tmp_path / "clean", LoaderModel())
    assert warned == [] and len(audit.loaders) == 2
    audit, warned, records = _fit(
        tmp_path / "off", LoaderModel(val_workers=1, persistent=True), audit_dataloaders=False
    )
    assert audit.loaders == [] and warned == [] and not [r for r in records if r["event"] == "dataloaders"]


@pytest.mark.parametrize("name", ["max-savings", "balanced", "max-speed"])
def test_the_preset_printout_recommends_loader_settings_for_its_tier(name):
    preset = MemoryPreset(name, effective_batch_size=64, micro_batch_size=8)
    kwargs = preset.dataloader_kwargs(cpu_count=16, cuda=True)
    ahead = kwargs["num_workers"] * kwargs.get("prefetch_factor", 0)
    assert kwargs["batch_size"] == 8 and kwargs["pin_memory"] is True
    assert ahead == {"max-savings": 2, "balanced": 8, "max-speed": 16}[name]  # fewer batches ahead, less memory
    assert kwargs["persistent_workers"] is (name == "max-speed")
    assert MemoryPreset(name).dataloader_kwargs(cpu_count=2, cuda=False) == {
        "batch_size": 32,
        "num_workers": 1,
        "prefetch_factor": {"max-savings": 1}.get(name, 2),
        "pin_memory": False,
        "persistent_workers": name == "max-speed",
    }
    row = next(r for r in preset.describe().splitlines() if r.startswith("dataloader"))
    assert "num_workers=" in row and "prefetch_factor" in row
    DataLoader(TensorDataset(torch.zeros(16, 2)), **kwargs)  # the settings are valid DataLoader arguments


_MAIN_PID = os.getpid()
_READ_IN_MAIN: list[int] = []


class CountsMainProcessReads(Dataset):
    """Lazily opened datasets (h5py, LMDB) must not be touched in the main process before workers fork."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if os.getpid() == _MAIN_PID:
            _READ_IN_MAIN.append(i)
        return torch.zeros(32)


class WorkerModel(TinyModel):
    def train_dataloader(self):
        return DataLoader(CountsMainProcessReads(), batch_size=4, num_workers=1)

    def validation_step(self, batch, batch_idx):
        return None


def test_the_audit_measures_batches_without_reading_the_dataset(tmp_path):
    _READ_IN_MAIN.clear()
    _, _, records = _fit(tmp_path, WorkerModel())
    assert _READ_IN_MAIN == []  # every sample was read by the worker
    [train] = [r["loader"] for r in records if r["event"] == "dataloaders" and r["loader"]["name"] == "train"]
    assert train["batch_bytes"] == 4 * 32 * 4 and train["in_flight"] == 2  # 1 worker x prefetch_factor 2


class PaddedModel(TinyModel):
    """Batches of token ids padded to 128 with an attention mask: the samples are 3 to 24 tokens long."""

    def training_step(self, batch, batch_idx):
        return self.layer(batch["input_ids"].float()[:, :32]).pow(2).mean()

    def train_dataloader(self):
        samples = []
        for i in range(16):
            mask = torch.zeros(128, dtype=torch.long)
            mask[: 3 + i * 21 // 15] = 1
            samples.append({"input_ids": torch.ones(128, dtype=torch.long), "attention_mask": mask})
        return DataLoader(samples, batch_size=8)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(4, 32)), batch_size=4)

    def validation_step(self, batch, batch_idx):
        return None


def test_a_first_batch_mostly_padding_gets_a_finding_with_its_lengths(tmp_path):
    _, warned, records = _fit(tmp_path, PaddedModel())
    [finding] = [w for w in warned if "padding" in w]
    assert (
        "train: " in finding
        and "of the first batch is padding (`batch['attention_mask']`: 8 samples padded to 128" in finding
    )
    assert "Pad each batch to its longest sample" in finding and "TokenBudgetBatchSampler" in finding
    [train] = [r["loader"] for r in records if r["event"] == "dataloaders" and r["loader"]["name"] == "train"]
    [padding] = train["padding"]
    assert padding["padded_to"] == 128 and padding["longest"] == 3 + 7 * 21 // 15 and padding["padding_share"] > 0.9
    assert "input_ids" not in json.dumps(padding)  # lengths only: no token ids


class MaxLengthModel(PaddedModel):
    """Every batch padded to 128 (a fixed max_length) where 99 % of the samples are 3 to 24 tokens long."""

    def train_dataloader(self):
        samples = []
        for i in range(160):
            mask = torch.zeros(128, dtype=torch.long)
            mask[: 3 + i % 22] = 1
            samples.append({"input_ids": torch.ones(128, dtype=torch.long), "attention_mask": mask})
        return DataLoader(samples, batch_size=8)


def test_batches_all_padded_far_beyond_the_p99_length_are_told_to_cap_max_length(tmp_path):
    audit = MemoryAudit(dirpath=tmp_path / "memory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, callbacks=[audit], max_steps=18, limit_val_batches=0, limit_train_batches=None)
        trainer.fit(MaxLengthModel())
    [finding] = [str(w.message) for w in caught if "Cap `max_length`" in str(w.message)]
    assert "each of the first 16 batches is padded to 128 or more (`batch['attention_mask']`)" in finding
    assert "99 % of their 128 samples are at most 24 long" in finding and "Cap `max_length` at 24" in finding
    assert audit._session.length_sample.done  # sampled once, then left alone


@pytest.mark.parametrize("extra", [0, -1])
def test_a_python_container_is_named_from_the_threshold_on(extra):
    from lightning_memopt.functional.audit.loaders import PYTHON_OBJECTS_THRESHOLD

    dataset = TensorDataset(torch.zeros(8, 2))
    dataset.ids = list(range(PYTHON_OBJECTS_THRESHOLD + extra))  # type: ignore[attr-defined]
    loader = DataLoader(dataset, batch_size=4, num_workers=2)
    info = loader_memory(loader, "train", "cuda", cpu_count=8, host_total_bytes=64 * 2**30, batch_bytes=64)
    named = [f for f in info.findings if "`dataset.ids` is a Python container" in f]
    assert len(named) == (1 if extra == 0 else 0)
