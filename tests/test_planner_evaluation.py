"""``estimate_memory(stage=...)``: an evaluation step as Lightning's ``trainer.validate/test/predict`` runs it, against
the real CPU runs counted by the same live-storage counter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memopt.planner import estimate_memory
from tests.helpers.lightning import pl
from tests.helpers.measured_step import trainer_evaluation_peak
from tests.helpers.zoo import ZOO, zoo_params


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
    with pytest.raises(ValueError, match=r"OnlyForward has no `test_step`: Lightning would not run the stage"):
        estimate_memory(OnlyForward(), torch.randn(2, 4), device="cpu", stage="test")
    est = estimate_memory(OnlyForward(), torch.randn(2, 4), device="cpu", stage="predict")  # Lightning's default
    assert est.peak_bytes == 4 * (4 * 4 + 4) + 3 * (4 * 2 * 4)  # the layer, x and the two steps' predictions
