"""Every callback, the precision plugin and the presets on every zoo model, against a run without the package.

The reference is the same zoo module, built from the same seed, fit by a plain Trainer. Callbacks that only watch
(monitoring, cache cleaning, garbage collection, OOM reports, allocator settings, the audit) must leave training
bitwise unchanged and report what can be computed directly from the model; the ones that change how a step runs
(activation checkpointing, precision, presets) must give the weights of the Lightning setting they stand for.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from lightning_memopt import (
    AllocatorSettings,
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryAudit,
    MemoryMonitor,
    MemoryPrecision,
    MemoryPreset,
    OOMReporter,
    to_device_and_dtype,
)
from lightning_memopt.analysis import summarize_memory_log
from tests.helpers.lightning import pl
from tests.helpers.trainer import make_trainer
from tests.helpers.zoo import ZooModel, zoo_params

STEPS = 3


@pytest.fixture(autouse=True)
def _allocator_env_given_back():
    saved = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    yield
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if saved is not None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = saved


def _fit(entry: ZooModel, tmp_path, batch_size: int = 4, **trainer_kwargs: Any):
    module = entry.build(batch_size=batch_size)
    kwargs = {"max_steps": STEPS, "limit_train_batches": 8, "limit_val_batches": 0, **trainer_kwargs}
    trainer = make_trainer(tmp_path, **kwargs)
    trainer.fit(module)
    return module, trainer


def _assert_same_weights(actual: torch.nn.Module, expected: torch.nn.Module, exact: bool = True) -> None:
    expected_state = expected.state_dict()
    for name, value in actual.state_dict().items():
        if exact:
            assert torch.equal(value, expected_state[name]), name
        else:
            torch.testing.assert_close(value, expected_state[name], msg=name)


def _metrics(trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("entry", zoo_params())
def test_watching_callbacks_leave_training_bitwise_unchanged(entry: ZooModel, tmp_path):
    reference, ref_trainer = _fit(entry, tmp_path / "plain")
    callbacks = [
        MemoryMonitor(dirpath=tmp_path / "memory"),
        CacheCleaner(every_n_train_steps=1),
        GarbageCollector(every_n_train_steps=1),
        OOMReporter(dirpath=tmp_path / "oom"),
        AllocatorSettings(allocator_conf="expandable_segments:True"),
    ]
    module, trainer = _fit(entry, tmp_path / "watched", callbacks=callbacks)
    _assert_same_weights(module, reference)
    assert _metrics(trainer) == _metrics(ref_trainer)
    records = [json.loads(line) for line in callbacks[0].path.read_text().splitlines()]
    train = [r for r in records if r.get("phase") == "train"]
    batches = ref_trainer.fit_loop.epoch_loop.batch_progress.total.completed  # manual: 2 optimizer steps a batch
    assert len([r for r in train if r["event"] == "step"]) == batches  # a reading per batch (log_every_n_steps=1)
    (summary,) = [s for s in summarize_memory_log(records) if s.phase == "train"]
    assert summary.num_readings == batches
    assert summary.peak_host_rss_bytes == max(r["host_rss_bytes"] for r in train)
    assert not (tmp_path / "oom").exists()  # no out-of-memory: no report
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # given back at teardown


@pytest.mark.slow
@pytest.mark.parametrize("entry", zoo_params())
def test_audit_footprint_is_the_model_and_training_is_unchanged(entry: ZooModel, tmp_path):
    reference, _ = _fit(entry, tmp_path / "plain")
    audit = MemoryAudit(dirpath=tmp_path / "audit", leak_every_n_train_steps=1, leak_window=3)
    module, _ = _fit(entry, tmp_path / "audited", callbacks=[audit])
    _assert_same_weights(module, reference)
    by_category = audit.last_audit["footprint"]["bytes_by_category"]
    assert by_category["parameters"] == _bytes(module.parameters())
    assert by_category.get("buffers", 0) == _bytes(module.buffers())


class _OutOfMemoryAtBatch:
    """Every forward of a module's layers raises ``torch.OutOfMemoryError`` from training batch ``batch_idx`` on."""

    def __init__(self, module: torch.nn.Module, batch_idx: int) -> None:
        self.armed = False
        original = module.training_step

        def training_step(batch, idx, *args):
            self.armed = idx >= batch_idx
            return original(batch, idx, *args)

        module.training_step = training_step
        for layer in module.modules():
            if list(layer.parameters(recurse=False)):
                layer.register_forward_pre_hook(self.hook)

    def hook(self, layer, args):
        if self.armed:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


@pytest.mark.parametrize("entry", zoo_params())
def test_oom_report_describes_the_failing_batch_and_model(entry: ZooModel, tmp_path):
    module = entry.build(batch_size=4)
    _OutOfMemoryAtBatch(module, batch_idx=1)
    reporter = OOMReporter(dirpath=tmp_path / "oom")
    trainer = make_trainer(tmp_path, max_steps=STEPS, limit_val_batches=0, callbacks=[reporter])
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        trainer.fit(module)
    report = json.loads((tmp_path / "oom" / "oom_report_rank0.json").read_text())
    assert report["batch"]["micro_batch_size"] == 4
    assert (report["when"]["stage"], report["when"]["batch_idx"]) == ("train", 1)
    assert report["holders"]["bytes_by_category"]["parameters"] == _bytes(module.parameters())
    assert report["error"]["type"] == "torch.OutOfMemoryError"


def _checkpointing(entry: ZooModel) -> GradientCheckpointing:
    if entry.checkpoint_modules is None:  # Hugging Face: the model's own switch
        return GradientCheckpointing()
    return GradientCheckpointing(checkpoint_modules=list(entry.checkpoint_modules))


@pytest.mark.parametrize("entry", zoo_params())
def test_gradient_checkpointing_gives_the_same_weights(entry: ZooModel, tmp_path):
    reference, _ = _fit(entry, tmp_path / "plain")
    callback = _checkpointing(entry)
    seen: list[bool] = []

    class During(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            switch = getattr(getattr(pl_module, "model", None), "is_gradient_checkpointing", False)
            seen.append(bool(callback.wrapped_names) or bool(switch))

    module, _ = _fit(entry, tmp_path / "checkpointed", callbacks=[callback, During()])
    assert seen and all(seen), "checkpointing was not on during the fit"
    # T5 uses its tied embedding in three places: recomputation changes the order its gradients are summed in
    _assert_same_weights(module, reference, exact=entry.name != "t5")


@pytest.mark.parametrize("entry", zoo_params())
@pytest.mark.parametrize(("mode", "lightning_precision"), [("auto", "32-true"), ("bf16-mixed", "bf16-mixed")])
def test_memory_precision_equals_lightning_precision(entry: ZooModel, mode: str, lightning_precision: str, tmp_path):
    reference, ref_trainer = _fit(entry, tmp_path / "plain", precision=lightning_precision)
    module, trainer = _fit(entry, tmp_path / "plugin", plugins=[MemoryPrecision(mode)])
    _assert_same_weights(module, reference)
    assert _metrics(trainer) == _metrics(ref_trainer)


@pytest.mark.parametrize("entry", zoo_params(feature="accumulate_grad_batches"))
def test_preset_equals_lightning_accumulation_at_its_micro_batch(entry: ZooModel, tmp_path):
    preset = MemoryPreset.from_name("balanced", effective_batch_size=8, micro_batch_size=2)
    assert preset.accumulate_grad_batches == 4
    reference, ref_trainer = _fit(entry, tmp_path / "plain", batch_size=2, accumulate_grad_batches=4)
    kwargs = preset.trainer_kwargs()
    kwargs.pop("devices", None)
    module, trainer = _fit(entry, tmp_path / "preset", batch_size=preset.batch_size, **kwargs)
    _assert_same_weights(module, reference)
    assert trainer.global_step == ref_trainer.global_step == STEPS


@pytest.mark.parametrize("entry", zoo_params())
def test_to_device_and_dtype_equals_module_to_and_counts_its_bytes(entry: ZooModel):
    reference, module = entry.build(), entry.build()
    before = _bytes(module.parameters()) + _bytes(module.buffers())
    reference.to(torch.bfloat16)
    result = to_device_and_dtype(module, "cpu", torch.bfloat16)
    _assert_same_weights(module, reference)
    assert result.converted
    assert (result.total_bytes_before, result.total_bytes_after) == (
        before,
        _bytes(module.parameters()) + _bytes(module.buffers()),
    )
    assert not to_device_and_dtype(module, "cpu", torch.bfloat16).converted
