"""AutoMicroBatch on one device: a simulated memory budget, Lightning's own accumulation as the reference."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_memopt import OOMReporter
from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from lightning_memopt.functional.micro_batch.slicing import batch_size_of, slice_batch
from tests.helpers.amb import N_SAMPLES, Data, Net, fit, weights
from tests.helpers.lightning import lightning_module
from tests.helpers.trainer import make_trainer


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_starts_above_the_budget_and_ends_bitwise_equal_to_lightning_accumulation(tmp_path, optimizer, where):
    budget = {"forward_budget": 4} if where == "forward" else {"backward_budget": 4}
    ours = Net(optimizer=optimizer, batch_size=16, **budget)
    callback = AutoMicroBatch()
    trainer = fit(tmp_path / "ours", ours, [callback])
    reference = Net(optimizer=optimizer, batch_size=4)  # the feasible micro-batch, Lightning's own accumulation
    ref_trainer = fit(tmp_path / "ref", reference, accumulate=4)
    assert callback.micro_batch_size == 4 and callback.retries == 2  # 16 -> 8 -> 4
    assert trainer.global_step == ref_trainer.global_step == 4
    got, expected = weights(ours), weights(reference)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    scheduler, ref_scheduler = trainer.lr_scheduler_configs[0].scheduler, ref_trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == ref_scheduler.last_epoch == 4
    assert trainer.optimizers[0].param_groups[0]["lr"] == ref_trainer.optimizers[0].param_groups[0]["lr"]
    # every sample of each step's batch counted exactly once, nothing else
    for step, grad in enumerate(ours.counts):
        expected_count = torch.zeros(N_SAMPLES)
        expected_count[step * 16 : (step + 1) * 16] = 1.0
        assert torch.allclose(grad * 16, expected_count, atol=1e-6), step
    if where == "forward":  # a backward failure logged before it failed: documented, it stays in the epoch mean
        expected_loss = ref_trainer.callback_metrics["train_loss"].item()
        assert trainer.callback_metrics["train_loss"].item() == pytest.approx(expected_loss, rel=1e-5)


def test_an_oom_in_backward_mid_window_restores_the_window_s_gradients(tmp_path):
    """accumulate 2: the window's first batch fits whole, its second runs out of memory in backward."""
    ours = Net(backward_budget=8, batch_size=16, budget_from_batch=1)
    callback = AutoMicroBatch()
    trainer = fit(tmp_path / "ours", ours, [callback], accumulate=2, max_steps=2)
    assert callback.micro_batch_size == 8 and callback.retries == 1
    assert ours.seen_sizes[:4] == [16, 16, 8, 8]  # batch 0 whole; batch 1 failed whole, then two halves
    for step, grad in enumerate(ours.counts):
        expected_count = torch.zeros(N_SAMPLES)
        expected_count[step * 32 : (step + 1) * 32] = 1.0
        assert torch.allclose(grad * 32, expected_count, atol=1e-6), step
    reference = Net(batch_size=16)
    fit(tmp_path / "ref", reference, accumulate=2, max_steps=2)
    for name, value in weights(reference).items():
        assert torch.allclose(weights(ours)[name], value, atol=1e-6), name
    assert trainer.global_step == 2


def test_the_micro_batch_is_saved_and_a_resumed_run_does_not_run_out_of_memory_again(tmp_path):
    model = Net(forward_budget=4, batch_size=16)
    callback = AutoMicroBatch()
    trainer = fit(tmp_path, model, [callback], max_steps=2)
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["callbacks"][callback.state_key]["micro_batch_size"] == 4
    resumed_model, resumed = Net(forward_budget=4, batch_size=16), AutoMicroBatch()
    trainer = make_trainer(tmp_path, callbacks=[resumed], max_steps=4, limit_train_batches=None, limit_val_batches=0)
    trainer.fit(resumed_model, ckpt_path=path)
    assert resumed.micro_batch_size == 4
    assert max(resumed_model.seen_sizes) == 4  # never tried 16 or 8 again
    assert trainer.global_step == 4


def test_below_the_smallest_micro_batch_the_original_error_ends_the_run_with_a_report(tmp_path):
    model = Net(forward_budget=0, batch_size=8)
    callback = AutoMicroBatch(min_micro_batch_size=2)
    reporter = OOMReporter(dirpath=tmp_path / "oom")
    with pytest.raises(torch.OutOfMemoryError, match=r"simulated: forward of 2 samples.*min_micro_batch_size=2"):
        fit(tmp_path, model, [callback, reporter])
    assert model.seen_sizes == [8, 4, 2]
    assert list((tmp_path / "oom").glob("*.md"))  # OOMReporter wrote its report


@pytest.mark.parametrize(
    "error", [ValueError("not memory"), RuntimeError("CUDA error: out of memory")], ids=["value", "cuda-kernel"]
)
def test_other_errors_are_never_retried(tmp_path, error):
    class Failing(Net):
        def training_step(self, batch, batch_idx):
            self.seen_sizes.append(batch[0].shape[0])
            raise error

    model = Failing(batch_size=8)
    with pytest.raises(type(error), match=str(error)):
        fit(tmp_path, model, [AutoMicroBatch()])
    assert model.seen_sizes == [8]


Pair = namedtuple("Pair", ["x", "y", "idx"])


@dataclasses.dataclass
class Record:
    x: torch.Tensor
    y: torch.Tensor
    idx: torch.Tensor
    name: list


class Custom:
    def __init__(self, x, y, idx):
        self.x, self.y, self.idx = x, y, idx


def _collate(kind):
    def collate(items):
        x = torch.stack([i[0] for i in items])
        y = torch.stack([i[1] for i in items])
        idx = torch.tensor([i[2] for i in items])
        if kind == "dict":
            return {"x": x, "y": y, "idx": idx, "names": [f"s{int(i)}" for i in idx], "scale": 1.0}
        if kind == "namedtuple":
            return Pair(x, y, idx)
        if kind == "dataclass":
            return Record(x, y, idx, [f"s{int(i)}" for i in idx])
        return Custom(x, y, idx)

    return collate


class Typed(Net):
    def __init__(self, kind, **kw):
        super().__init__(**kw)
        self.kind = kind

    def unpack(self, batch):
        if self.kind == "dict":
            assert len(batch["names"]) == batch["x"].shape[0] and batch["scale"] == 1.0
            return batch["x"], batch["y"], batch["idx"]
        if self.kind == "dataclass":
            assert len(batch.name) == batch.x.shape[0]
        return batch.x, batch.y, batch.idx

    def train_dataloader(self):
        return DataLoader(Data(), batch_size=self.batch_size, shuffle=False, collate_fn=_collate(self.kind))


@pytest.mark.parametrize("kind", ["dict", "namedtuple", "dataclass"])
def test_batch_types_split_by_the_default_slicer(tmp_path, kind):
    model = Typed(kind, forward_budget=4, batch_size=8)
    callback = AutoMicroBatch()
    fit(tmp_path, model, [callback], max_steps=2)
    assert callback.micro_batch_size == 4 and model.seen_sizes == [8, 4, 4, 4, 4]


def test_a_custom_batch_type_needs_the_override_and_works_with_it(tmp_path):
    with pytest.raises(TypeError, match=r"Custom.*split_batch_fn=fn"):
        fit(tmp_path, Typed("custom", forward_budget=4, batch_size=8), [AutoMicroBatch()])

    def split(batch, start, stop):
        return Custom(batch.x[start:stop], batch.y[start:stop], batch.idx[start:stop])

    model = Typed("custom", forward_budget=4, batch_size=8)
    callback = AutoMicroBatch(split_batch_fn=split, batch_size_fn=lambda b: b.x.shape[0])
    fit(tmp_path / "override", model, [callback], max_steps=2)
    assert model.seen_sizes == [8, 4, 4, 4, 4]


def test_a_fixed_start_never_tries_the_whole_batch(tmp_path):
    model = Net(batch_size=16)
    fit(tmp_path, model, [AutoMicroBatch(micro_batch_size=4)], max_steps=1)
    assert model.seen_sizes == [4, 4, 4, 4]


def test_the_user_s_loop_is_given_back(tmp_path):
    model = Net(batch_size=8)
    trainer = make_trainer(tmp_path, callbacks=[AutoMicroBatch()], max_steps=1, limit_val_batches=0)
    original = trainer.fit_loop.epoch_loop.automatic_optimization
    trainer.fit(model)
    assert trainer.fit_loop.epoch_loop.automatic_optimization is original


def test_slicer_edges():
    batch = {"x": torch.arange(6).view(6, 1), "t": (torch.zeros(6), ["a"] * 6), "none": None, "scalar": torch.tensor(1)}
    part = slice_batch(batch, 1, 3)
    assert part["x"].tolist() == [[1], [2]] and part["t"][1] == ["a", "a"] and part["none"] is None
    assert part["scalar"].item() == 1
    assert batch_size_of(batch) == 6
    with pytest.raises(TypeError, match=r"batch\['w'\].*first dim is not the batch size 6"):
        slice_batch({"x": torch.zeros(6), "w": torch.zeros(5)}, 0, 3)
    with pytest.raises(TypeError, match=r"cannot tell the batch size.*split_batch_fn=fn"):
        batch_size_of({"names": ["a", "b"]})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"micro_batch_size": "big"}, "micro_batch_size"),
        ({"min_micro_batch_size": 0}, "min_micro_batch_size"),
        ({"micro_batch_size": 2, "min_micro_batch_size": 4}, "min_micro_batch_size"),
        ({"split_batch_fn": 3}, "split_batch_fn"),
        ({"batch_size_fn": 16}, "batch_size_fn"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoMicroBatch(**kwargs)


def test_a_micro_batch_equal_to_the_smallest_allowed_is_accepted():
    amb = AutoMicroBatch(micro_batch_size=4, min_micro_batch_size=4)
    assert (amb.micro_batch_size, amb.min_micro_batch_size) == (4, 4)


def test_manual_optimization_is_refused_in_setup(tmp_path):
    class Manual(Net):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="automatic optimization"):
        fit(tmp_path, Manual(), [AutoMicroBatch()])


def test_fp16_grad_scaler_steps_and_state_match_lightning_accumulation(tmp_path):
    """16-mixed on CPU (fp16 autocast with a GradScaler): same weights and the same scaler state as the reference."""
    from lightning_memopt import MemoryPrecision

    ours, reference = Net(forward_budget=4, batch_size=16), Net(batch_size=4)
    plugins = [MemoryPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**14))]
    ref_plugins = [MemoryPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**14))]
    trainer = fit(tmp_path / "ours", ours, [AutoMicroBatch()], plugins=plugins)
    ref_trainer = fit(tmp_path / "ref", reference, accumulate=4, plugins=ref_plugins)
    assert trainer.global_step == ref_trainer.global_step == 4
    scaler, ref_scaler = plugins[0].scaler, ref_plugins[0].scaler
    assert scaler.state_dict() == ref_scaler.state_dict()
    assert scaler.state_dict()["_growth_tracker"] == 4  # the scaler ran: four finite steps
    for name, value in weights(reference).items():
        assert torch.equal(weights(ours)[name], value), name


def test_strategies_with_collectives_inside_forward_are_refused():
    from types import SimpleNamespace

    FSDPStrategy = lightning_module("strategies").FSDPStrategy

    trainer = SimpleNamespace(strategy=FSDPStrategy(), world_size=1)
    module = SimpleNamespace(automatic_optimization=True)
    with pytest.raises(ValueError, match=r"FSDPStrategy.*collectives inside forward"):
        AutoMicroBatch().setup(trainer, module, "fit")


def run_benchmark(tmp_path, *args):
    """``benchmarks/auto_microbatch.py *args --out FILE`` in ``tmp_path``; its JSON result."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "auto_microbatch.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_benchmark_quick_mode_runs(tmp_path):
    result = run_benchmark(tmp_path, "--quick")
    assert result["recovery"]["micro_batch_size"] == 8 and result["ratio_wall"] > 0
    big = next(row for row in result["snapshot"] if "64 MiB" in row["module"])
    assert big["first_batch_bytes"] > 64 * 2**20 > 100 * big["later_batch_bytes"]  # the constant buffer: copied once
    queue = result["queue_copy"]  # a 200 MiB queue changed in place: one host copy reused, nothing allocated per batch
    assert queue["reused_copy_new_bytes_per_batch"] == 0 and queue["held_bytes"] == 200 * 2**20


@pytest.mark.slow
def test_benchmark_eval_quick_mode_runs(tmp_path):
    result = run_benchmark(tmp_path, "--eval", "--quick")
    assert result["ratio_cpu"] > 0 and len(result["runs"]) == 4  # the ratio is the benchmark's; CI only runs it
    assert result["recovery"]["equal_logged_values"] is True
