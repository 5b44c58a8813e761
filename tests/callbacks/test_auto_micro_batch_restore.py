"""AutoMicroBatch's retries and first batch through a Trainer: its restore switches, the first-batch check of the
slicer, the error chained to the out-of-memory error, and the OOM report of a run that gave up."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric

from lightning_memopt import OOMReporter
from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.amb import Data, Net, fit
from tests.helpers.lightning import pl


@pytest.mark.parametrize("name", ["restore_rng", "restore_metrics", "restore_buffers"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_restore_switch_that_is_not_a_bool_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=rf"`{name}` must be a bool \(True or False\), got {value!r}"):
        AutoMicroBatch(**{name: value})


class Noisy(Net):
    """Net with dropout, BatchNorm and a torchmetrics mean logged per epoch: what a failed attempt changes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm, self.drop = torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.3)
        self.mean_target = MeanMetric()

    def unpack(self, batch):
        x, y, idx = batch
        return self.drop(self.norm(x)), y, idx

    def training_step(self, batch, batch_idx):
        self.mean_target(batch[1])
        self.log("mean_target", self.mean_target, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_recovered_run_equals_lightning_accumulation_bitwise(tmp_path, where):
    budget = {f"{where}_budget": 4}
    torch.manual_seed(7)
    ours = Noisy(batch_size=16, **budget)
    trainer = fit(tmp_path / "ours", ours, [AutoMicroBatch()], max_steps=2)
    torch.manual_seed(7)
    reference = Noisy(batch_size=4, **budget)
    ref_trainer = fit(tmp_path / "ref", reference, accumulate=4, max_steps=2)
    assert ours.seen_sizes == [16, 8] + [4] * 8  # 16 and 8 ran out of memory, then two batches of 16 in fours
    for name, value in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name
    assert set(ref_trainer.callback_metrics) == {"mean_target", "train_loss"}
    for key, value in ref_trainer.callback_metrics.items():
        assert torch.equal(trainer.callback_metrics[key], value), key


# ------------------------------------------------------------------------------------------------ the first batch


class Opaque:
    """A batch element the default slicer cannot split."""


class WithOpaque(Net):
    """Net whose batches carry an element the default slicer refuses (its batch size is still readable)."""

    def train_dataloader(self):
        return DataLoader(Data(), batch_size=self.batch_size, collate_fn=lambda s: (*_collate(s), Opaque()))

    def unpack(self, batch):
        return batch[:3]


def _collate(samples):
    return torch.utils.data.default_collate(samples)


def test_a_batch_that_cannot_be_split_is_refused_before_its_first_step(tmp_path):
    model = WithOpaque()
    with pytest.raises(TypeError, match=r"cannot split `batch\[3\]` of type .*Opaque.*split_batch_fn=fn") as caught:
        fit(tmp_path, model, [AutoMicroBatch()])
    assert model.seen_sizes == [] and model.counts == []  # no training_step ran, no optimizer stepped
    assert caught.value.__cause__ is None  # no out-of-memory error happened


class TimeMajor(pl.LightningModule):
    """A model on time-major batches ``(T=10, B=4, F=3)``: the default slicer would cut along time."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.randn(16, 10, 3)
        return DataLoader(data, batch_size=4, collate_fn=lambda s: torch.stack(s, dim=1))


def test_a_time_major_batch_warns_which_dim_is_split(tmp_path):
    with pytest.warns(UserWarning, match=r"along the first dim of `batch` \(10 samples.*batch_size is 4"):
        fit(tmp_path, TimeMajor(), [AutoMicroBatch()], max_steps=2)


# ------------------------------------------------------------------------------------------------ after an OOM


def test_an_error_raised_in_a_retry_has_the_out_of_memory_error_as_its_cause(tmp_path):
    def split(batch, start, stop):
        if stop - start > 1 and start == 0 and stop < 16:
            raise KeyError("this slicer cannot cut 8 samples")
        return tuple(t[start:stop] for t in batch)

    model = Net(backward_budget=4)
    with pytest.raises(KeyError, match="cannot cut 8") as caught:
        fit(tmp_path, model, [AutoMicroBatch(split_batch_fn=split)])
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert "backward of 16 samples" in str(caught.value.__cause__)


def test_the_oom_report_of_a_run_that_gave_up_gives_the_whole_batch_and_the_micro_batch(tmp_path):
    reporter = OOMReporter(dirpath=tmp_path / "reports", max_listed=0)
    with pytest.raises(torch.OutOfMemoryError, match="still ran out of memory"):
        fit(tmp_path, Net(forward_budget=0), [AutoMicroBatch(min_micro_batch_size=2), reporter], accumulate=2)
    report = json.loads((tmp_path / "reports" / "oom_report_rank0.json").read_text())
    config = report["config"]
    assert config["micro_batch_size"] == 2  # the micro-batch that ran out of memory
    assert config["effective_batch_size"] == 16 * 2  # the batch of 16, accumulated over 2 batches
    assert report["batch"]["micro_batch_size"] == 2  # the failing frame's slice, as the batch section describes it


def test_large_buffer_copies_are_reported_once(tmp_path, monkeypatch):
    import warnings

    from lightning_memopt.callbacks import auto_micro_batch

    class Queued(Net):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.register_buffer("queue", torch.zeros(1024))

        def training_step(self, batch, batch_idx):
            self.queue.add_(1.0)  # a queue changed in place every batch
            return super().training_step(batch, batch_idx)

    monkeypatch.setattr(auto_micro_batch, "LARGE_BUFFER_COPIES", 4096)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, Queued(batch_size=16), [AutoMicroBatch()], max_steps=4)
    said = [str(w.message) for w in caught if "buffers that change in place" in str(w.message)]
    assert len(said) == 1 and "restore_buffers=False" in said[0]
