"""``estimate_memory(stage=...)``: an evaluation step as Lightning's ``trainer.validate/test/predict`` runs it, against
the real CPU runs counted by the same live-storage counter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memopt.planner import MemoryEstimateError, estimate_memory
from tests.helpers.lightning import pl
from tests.helpers.measured_step import trainer_evaluation_peak
from tests.helpers.zoo import ZOO, _Samples, zoo_params


@pytest.mark.parametrize("entry", zoo_params())
def test_a_validation_step_estimates_as_a_real_trainer_validate(entry, tmp_path):
    est = estimate_memory(entry.build(batch_size=8), entry.batch(8, seed=1), device="cpu", stage="validate")
    real = trainer_evaluation_peak(entry.build(batch_size=8), tmp_path, "validate")
    assert est.peak_bytes == pytest.approx(real, rel=0.02)
    assert (est.gradient_bytes, est.optimizer_state_bytes, est.peak_phase) == (0, 0, "forward")
    assert str(est).startswith("Estimated peak memory of a validation step on cpu")


class Classifier(type(ZOO["resnet"].build())):  # the zoo's ResNet, with the steps trainer.test/predict run
    def predict_step(self, batch, batch_idx):
        return self(batch[0]).softmax(-1)

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)


@pytest.mark.parametrize("stage", ["test", "predict"])
def test_test_and_predict_steps_estimate_as_the_real_trainer_runs(stage, tmp_path):
    batch = ZOO["resnet"].batch(8, seed=1)
    est = estimate_memory(Classifier(batch_size=8), batch, device="cpu", stage=stage)
    real = trainer_evaluation_peak(Classifier(batch_size=8), tmp_path, stage)
    assert est.peak_bytes == pytest.approx(real, rel=0.02)


def test_an_evaluation_step_holds_no_gradients_optimizer_or_backward_workspace():
    model, x = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), torch.randn(32, 64)
    fit = estimate_memory(model, x, device="cuda", gpu="H100-80GB")
    evaluation = estimate_memory(model, x, device="cuda", gpu="H100-80GB", stage="validate")
    assert evaluation.at_peak["workspace"] * 2 == fit.at_peak["workspace"] == 2 * 32 * 1024**2
    assert evaluation.peak_bytes < fit.peak_bytes - fit.optimizer_state_bytes
    assert any("trainer.validate" in a for a in evaluation.assumptions)
    assert "activations and outputs (forward)" in evaluation.table()


def test_trainer_predict_keeps_every_batch_s_predictions_on_the_cpu_and_moves_them_off_the_gpu():
    model, x = nn.Sequential(nn.Linear(64, 4096)), torch.randn(32, 64)
    per_batch = 32 * 4096 * 4

    def peak(device, steps):
        return estimate_memory(model, x, device=device, stage="predict", steps=steps).peak_bytes

    assert peak("cpu", 4) - peak("cpu", 2) == 2 * per_batch
    assert peak("cuda", 4) == peak("cuda", 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": "train"}, r"`stage` must be one of 'fit', 'validate', 'test', 'predict', got 'train'"),
        ({"stage": "validate", "optimizer": torch.optim.SGD}, r"`optimizer` applies to training only"),
        ({"stage": "predict", "gradient_checkpointing": True}, r"`gradient_checkpointing` applies to training only"),
        ({"stage": "test", "accumulate_grad_batches": 2}, r"`accumulate_grad_batches` applies to training only"),
        ({"stage": "validate", "world_size": 2}, r"`world_size` is not modelled for evaluation yet"),
    ],
)
def test_bad_stage_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory(nn.Linear(4, 4), torch.randn(2, 4), device="cpu", **kwargs)


class OnlyForward(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return self.layer(x)


def test_a_module_without_the_stage_s_step_is_refused_by_name_and_predict_calls_forward():
    with pytest.raises(MemoryEstimateError, match=r"OnlyForward has no `test_step`: Lightning would not run the stage"):
        estimate_memory(OnlyForward(), torch.randn(2, 4), device="cpu", stage="test")
    est = estimate_memory(OnlyForward(), torch.randn(2, 4), device="cpu", stage="predict")  # Lightning's default
    assert est.peak_bytes == 4 * (4 * 4 + 4) + 3 * (4 * 2 * 4)  # the layer, x and the two steps' predictions


# ------------------------------------------------------------------------------------------------ plans


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512))


def _real_evaluation_peak(model, size):
    """A real CPU forward in eval and inference mode, as Lightning's validation loop runs it."""
    from lightning_memopt.functional.planning import LiveBytes

    model = model.eval()
    x = torch.randn(size, 128, 512)
    counter = LiveBytes()
    for t in [*model.parameters(), x]:
        counter.track(t)
    with counter, torch.inference_mode():
        model(x).sum()
    return counter.peak


def test_a_plan_gives_the_largest_evaluation_batch_that_fits_and_the_preset_carries_it():
    from lightning_memopt import MemoryPreset, plan_memory

    model = _mlp()
    plan = plan_memory(
        model, lambda b: torch.randn(b, 128, 512), effective_batch_size=64, budget="20MB", device="cpu",
        evaluation="validate",
    )  # fmt: skip
    assert plan.micro_batch_size == 8 and plan.eval_stage == "validate"
    size = plan.eval_batch_size
    assert size > plan.micro_batch_size  # no gradients or optimizer states: a larger batch fits
    assert _real_evaluation_peak(model, size) <= plan.usable_bytes < _real_evaluation_peak(model, 2 * size)
    assert plan.eval_estimate.stage == "validate" and plan.eval_estimate.peak_bytes <= plan.usable_bytes
    assert [t.strategy for t in plan.eval_trials] == ["validate"] * len(plan.eval_trials)
    assert f"Evaluation (trainer.validate): batch {size} per device" in str(plan)
    preset = MemoryPreset.from_plan(plan, monitor=False)
    assert (preset.eval_batch_size, preset.evaluation_batch_size, preset.batch_size) == (size, size, 8)
    assert "eval_batch_size" in preset.describe()
    with pytest.raises(ValueError, match=r"`eval_batch_size` is decided by the plan"):
        MemoryPreset.from_plan(plan, eval_batch_size=4)
    without = plan_memory(model, lambda b: torch.randn(b, 128, 512), effective_batch_size=64, budget="20MB",
                          device="cpu")  # fmt: skip
    assert without.eval_stage is None and MemoryPreset.from_plan(without).evaluation_batch_size == 8


def test_an_evaluation_batch_is_not_planned_without_a_training_setting_or_under_fsdp2():
    from lightning_memopt import plan_memory
    from lightning_memopt.planner.search import PlanSearch, PlanSettings, Stage

    plan = plan_memory(_mlp(), lambda b: torch.randn(b, 128, 512), effective_batch_size=64, budget="2MB",
                       device="cpu", evaluation="predict")  # fmt: skip
    assert not plan.feasible and plan.eval_batch_size is None
    assert "Evaluation (trainer.predict): not planned: no training setting fits." in str(plan)
    settings = PlanSettings(_mlp(), lambda b: torch.randn(b, 512), usable=10**9, precision="32-true", device="cpu")
    search = PlanSearch(settings, effective=16, world=2, sizes=[1, 2, 4, 8], gradient_checkpointing=False)
    search.done.append(Stage(settings.trials(8, 2, sharded=True, cpu_offload=False), chosen=4, checkpointed=False))
    planned = search.evaluation("test", 4)
    assert (planned.size, planned.note) == (None, "not planned: evaluation under FSDP2 is not modelled yet.")


@pytest.mark.parametrize("bad", ["fit", "val", 1])
def test_a_bad_evaluation_stage_is_named(bad):
    from lightning_memopt import MemoryPreset, plan_memory

    with pytest.raises(ValueError, match=r"`evaluation` must be one of 'validate', 'test', 'predict'"):
        plan_memory(_mlp(), lambda b: torch.randn(b, 512), effective_batch_size=8, budget="1GB", device="cpu",
                    evaluation=bad)  # fmt: skip
    with pytest.raises(ValueError, match=r"`eval_batch_size`"):
        MemoryPreset(eval_batch_size=0)


class PaddedEncoder(pl.LightningModule):
    """torch's TransformerEncoder over padded token batches: in evaluation its fast path packs them into nested
    tensors."""

    def __init__(self, batch_size=8):
        super().__init__()
        self.batch_size = batch_size
        self.embed = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)  # enable_nested_tensor=True, torch's default
        self.head = nn.Linear(32, 5)

    def forward(self, ids, padding):
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=padding).mean(1))

    def validation_step(self, batch, batch_idx):
        ids, padding, labels = batch
        return nn.functional.cross_entropy(self(ids, padding), labels)

    def val_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(1, 100, (4 * self.batch_size, 24), generator=generator)
        lengths = torch.randint(6, 25, (4 * self.batch_size,), generator=generator)
        padding = torch.arange(24) >= lengths[:, None]  # True where padded: a third of the positions
        labels = torch.randint(0, 5, (4 * self.batch_size,), generator=generator)
        return torch.utils.data.DataLoader(_Samples((ids, padding, labels)), self.batch_size)


def test_torch_s_transformer_encoder_is_estimated_in_evaluation_without_its_nested_tensors(tmp_path):
    """The padded path is estimated (fake tensors cannot hold nested ones) and said: a little above the real
    ``trainer.validate``, whose nested tensors skip the padded positions."""
    module = PaddedEncoder()
    batch = next(iter(module.val_dataloader()))
    est = estimate_memory(module, batch, device="cpu", stage="validate")
    real = trainer_evaluation_peak(PaddedEncoder(), tmp_path, "validate")
    assert real < est.peak_bytes <= 1.1 * real
    assert any(a.startswith("nn.TransformerEncoder without its nested-tensor fast path") for a in est.assumptions)
    assert module.encoder.use_nested_tensor  # the user's module is not changed
