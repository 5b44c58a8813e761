"""AutoMicroBatch in validation, test and predict: an out-of-memory error no longer ends the run.

The reference throughout is the same model evaluated without the callback at the micro-batch the callback ends with
(the loader's batch at that size): logged epoch values, metric results, step outputs and predictions must be bitwise
equal, with one ``on_*_batch_end`` call and one prediction per loader batch.
"""

from __future__ import annotations

import pytest
import torch

from lightning_memopt import OOMReporter
from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.amb import N_SAMPLES
from tests.helpers.amb_eval import EvalNet
from tests.helpers.lightning import lightning_module
from tests.helpers.trainer import make_trainer

BasePredictionWriter = lightning_module("callbacks").BasePredictionWriter
ModelCheckpoint = lightning_module("callbacks").ModelCheckpoint

EVAL = {"limit_val_batches": None, "limit_test_batches": None, "limit_predict_batches": None}


def _trainer(tmp_path, callbacks=(), **kwargs):
    return make_trainer(tmp_path, callbacks=list(callbacks), **{**EVAL, **kwargs})


def _flat(ends):
    """The per-loader-batch outputs of the end hooks, concatenated over the run."""
    return {key: torch.cat([out[key] for _, out in ends]) for key in ("preds", "idx")}


def _run(stage, tmp_path, model, callbacks=()):
    trainer = _trainer(tmp_path, callbacks)
    out = getattr(trainer, stage)(model)
    return trainer, out


@pytest.mark.parametrize("stage", ["validate", "test"])
@pytest.mark.parametrize(("batch", "budget", "fits"), [(16, 4, 4), (12, 5, 3)])
def test_an_evaluation_that_runs_out_of_memory_equals_evaluating_at_the_batch_that_fits(
    tmp_path, stage, batch, budget, fits
):
    callback = AutoMicroBatch()
    model = EvalNet(eval_budget=budget, eval_batch_size=batch)
    _, results = _run(stage, tmp_path / "split", model, [callback])
    reference = EvalNet(eval_batch_size=fits)
    _, ref_results = _run(stage, tmp_path / "ref", reference)

    prefix = "val" if stage == "validate" else "test"
    assert results == ref_results  # the epoch values, each micro-batch weighted by its own samples
    assert results[0][f"{prefix}_loss"] == ref_results[0][f"{prefix}_loss"]
    assert callback.eval_micro_batch_sizes[stage] == fits and callback.retries == 0
    loader_batches = -(-N_SAMPLES // batch)
    assert [i for i, _ in model.ends[stage]] == list(range(loader_batches))  # one end hook per loader batch
    loader_sizes = [min(batch, N_SAMPLES - i * batch) for i in range(loader_batches)]
    assert [len(out["preds"]) for _, out in model.ends[stage]] == loader_sizes  # outputs put back together
    got, expected = _flat(model.ends[stage]), _flat(reference.ends[stage])
    assert torch.equal(got["preds"], expected["preds"]) and torch.equal(got["idx"], torch.arange(N_SAMPLES))
    correct = sum(out["correct"] for _, out in model.ends[stage])
    assert correct == sum(out["correct"] for _, out in reference.ends[stage])  # counts add up
    assert max(model.step_sizes[len(model.step_sizes) - N_SAMPLES // fits :]) == fits


def test_a_failed_micro_batch_that_logged_and_updated_a_metric_is_put_back(tmp_path):
    # restore_metrics=False leaves the failed micro-batches' logged values and metric updates in: the results differ
    model = EvalNet(eval_budget=4)
    _, kept = _run("validate", tmp_path / "a", model, [AutoMicroBatch(restore_metrics=False)])
    _, restored = _run("validate", tmp_path / "b", EvalNet(eval_budget=4), [AutoMicroBatch()])
    _, reference = _run("validate", tmp_path / "c", EvalNet(eval_batch_size=4))
    assert restored == reference
    assert kept[0]["val_mse"] != reference[0]["val_mse"] and kept[0]["val_loss"] != reference[0]["val_loss"]


def test_predict_returns_one_prediction_per_loader_batch_and_writers_see_loader_batches(tmp_path):
    class Writer(BasePredictionWriter):
        def __init__(self):
            super().__init__(write_interval="batch")
            self.seen = []

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            self.seen.append((batch_idx, len(prediction["preds"]), batch[0].shape[0]))

    writer, callback = Writer(), AutoMicroBatch()
    torch.manual_seed(1)
    _, predictions = _run("predict", tmp_path / "split", EvalNet(eval_budget=4), [callback, writer])
    torch.manual_seed(1)
    _, reference = _run("predict", tmp_path / "ref", EvalNet(eval_batch_size=4))
    assert len(predictions) == N_SAMPLES // 16 and writer.seen == [(i, 16, 16) for i in range(4)]
    # the random numbers a failed micro-batch drew are drawn again: bitwise those of the loader at 4
    assert torch.equal(torch.cat([p["preds"] for p in predictions]), torch.cat([p["preds"] for p in reference]))
    assert torch.equal(torch.cat([p["idx"] for p in predictions]), torch.arange(N_SAMPLES))
    assert callback.eval_micro_batch_sizes == {"validate": None, "test": None, "predict": 4}


def test_validation_inside_fit_survives_and_the_epoch_checkpoint_is_written(tmp_path):
    callback, reporter = AutoMicroBatch(), OOMReporter(dirpath=str(tmp_path / "oom"))
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_loss")
    model = EvalNet(eval_budget=4)
    trainer = _trainer(
        tmp_path, [callback, reporter, checkpoint], max_epochs=1, max_steps=-1, enable_checkpointing=True
    )
    trainer.fit(model)
    reference = EvalNet(eval_batch_size=4)
    ref_trainer = _trainer(tmp_path / "ref", max_epochs=1, max_steps=-1)
    ref_trainer.fit(reference)
    assert trainer.callback_metrics["val_loss"] == ref_trainer.callback_metrics["val_loss"]
    assert checkpoint.best_model_path and not (tmp_path / "oom").exists()
    saved = torch.load(checkpoint.best_model_path, weights_only=False)["callbacks"][callback.state_key]
    assert saved["validate_micro_batch_size"] == 4 and saved["micro_batch_size"] == 16  # training untouched
    resumed = AutoMicroBatch()
    resumed.load_state_dict(saved)
    assert resumed.eval_micro_batch_sizes["validate"] == 4


def test_the_evaluation_micro_batch_is_kept_for_later_runs_of_the_stage_and_the_step_given_back(tmp_path):
    callback = AutoMicroBatch()
    model = EvalNet(eval_budget=4)
    trainer = _trainer(tmp_path, [callback])
    trainer.validate(model)
    model.step_sizes.clear()
    trainer.validate(model)
    assert set(model.step_sizes) == {4}  # no second out-of-memory error
    assert "validation_step" not in vars(trainer.strategy)


def test_evaluate_false_leaves_evaluation_alone_and_the_error_ends_the_run(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        _run("validate", tmp_path, EvalNet(eval_budget=4), [AutoMicroBatch(evaluate=False)])


def test_an_evaluation_micro_batch_of_the_smallest_size_that_still_fails_ends_with_what_was_tried(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match=r"AutoMicroBatch, test: a micro-batch of 2 sample\(s\)") as err:
        _run("test", tmp_path, EvalNet(eval_budget=1), [AutoMicroBatch(min_micro_batch_size=2)])
    assert "simulated" in str(err.value)


def test_train_false_splits_only_evaluation_and_takes_manual_optimization(tmp_path):
    class Manual(EvalNet):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            self.optimizers().step()
            self.optimizers().zero_grad()

    callback = AutoMicroBatch(train=False)
    trainer = _trainer(tmp_path, [callback], max_steps=2, limit_train_batches=2)
    trainer.fit(Manual(eval_budget=4))
    assert callback.micro_batch_size is None and callback.eval_micro_batch_sizes["validate"] == 4
    with pytest.raises(ValueError, match=r"AutoMicroBatch\(train=False\)"):
        _trainer(tmp_path, [AutoMicroBatch()], max_steps=1).fit(Manual())


def test_training_step_outputs_reach_on_train_batch_end_put_back_together(tmp_path):
    class Outputs(EvalNet):
        def __init__(self):
            super().__init__()
            self.train_ends = []

        def training_step(self, batch, batch_idx):
            x, _, idx = batch
            if x.shape[0] > 4:
                raise torch.OutOfMemoryError("simulated: training forward")
            loss = super().training_step(batch, batch_idx)
            return {"loss": loss, "idx": idx, "count": x.shape[0]}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.train_ends.append(outputs)

    model = Outputs()
    _trainer(tmp_path, [AutoMicroBatch()], max_steps=2, limit_val_batches=0).fit(model)
    assert [out["idx"].tolist() for out in model.train_ends] == [list(range(16)), list(range(16, 32))]
    assert [out["count"] for out in model.train_ends] == [16, 16]


def test_a_batch_goes_on_from_the_micro_batch_that_failed(tmp_path):
    class Heavy(EvalNet):
        # samples from 40 on are heavier: more than 4 of them run out of memory
        def _over_budget(self, n):
            pass

        def validation_step(self, batch, batch_idx):
            out = super().validation_step(batch, batch_idx)
            if batch[2].max() >= 40 and batch[2].shape[0] > 4:
                raise torch.OutOfMemoryError("simulated: heavy samples")
            return out

    model = Heavy()
    _, results = _run("validate", tmp_path / "split", model, [AutoMicroBatch()])
    # batch 2 (samples 32-47): 16 fails, 8 goes through, 8 (40-47) fails, then 4 + 4 from sample 40; batch 3 at 4
    assert model.step_sizes == [16, 16, 16, 8, 8, 4, 4, 4, 4, 4, 4]
    _, whole = _run("validate", tmp_path / "whole", EvalNet(eval_batch_size=N_SAMPLES))
    assert results[0]["val_mse"] == pytest.approx(whole[0]["val_mse"], rel=1e-6)
    assert results[0]["val_loss"] == pytest.approx(whole[0]["val_loss"], rel=1e-6)


def test_a_step_set_on_the_strategy_object_by_someone_else_comes_back(tmp_path):
    trainer = _trainer(tmp_path, [AutoMicroBatch()])
    own = trainer.strategy.validation_step  # the bound method, set on the object as another wrapper would
    trainer.strategy.validation_step = own
    trainer.validate(EvalNet(eval_budget=4))
    assert vars(trainer.strategy)["validation_step"] is own
