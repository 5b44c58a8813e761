"""AutoMicroBatch on the zoo: a batch of 16 that fits only as micro-batches of 4 (out of memory in forward or in
backward, at 16 and at 8) trains exactly as Lightning's own ``accumulate_grad_batches=4`` at a batch of 4.

Bitwise: weights, BatchNorm buffers, the epoch values of ``self.log`` (a torchmetrics accuracy among them) and the
LR schedule. Dropout makes this a test of the random states: the retry at 4 must draw the masks Lightning draws.
"""

from __future__ import annotations

import pytest
import torch

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.amb import BackwardBudget
from tests.helpers.trainer import make_trainer
from tests.helpers.zoo import N_SAMPLES, ZOO, ZooModel, zoo_params

#: The last layer of each entry: after its dropout and BatchNorm, so that a failed attempt has drawn and updated them.
LAST_LAYER = {"t5": "model.lm_head", "bert": "model.classifier", "resnet": "head", "lstm": "out", "metrics": "head"}
BUDGET = 4


def with_budget(module, entry: ZooModel, where: str):
    """``module`` whose last layer runs out of memory (in ``where``) on more than ``BUDGET`` samples in training."""

    def hook(layer, args, output):
        if not layer.training:
            return output
        if where == "forward" and output.shape[0] > BUDGET:
            raise torch.OutOfMemoryError(f"simulated: forward of {output.shape[0]} samples, budget {BUDGET}")
        return BackwardBudget.apply(output, BUDGET)

    module.get_submodule(LAST_LAYER[entry.name]).register_forward_hook(hook)
    return module


def fit(tmp_path, module, callbacks=(), accumulate=1):
    trainer = make_trainer(
        tmp_path,
        callbacks=list(callbacks),
        accumulate_grad_batches=accumulate,
        max_epochs=1,
        max_steps=-1,
        limit_train_batches=None,
        limit_val_batches=0,
    )
    trainer.fit(module)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("entry", zoo_params(feature="AutoMicroBatch"))
def test_a_recovered_run_equals_lightning_accumulation_at_the_size_that_fits(entry: ZooModel, where, tmp_path):
    torch.manual_seed(123)
    ours = with_budget(entry.build(batch_size=16), entry, where)
    callback = AutoMicroBatch()
    trainer = fit(tmp_path / "ours", ours, [callback])
    torch.manual_seed(123)
    reference = with_budget(entry.build(batch_size=BUDGET), entry, where)
    ref_trainer = fit(tmp_path / "ref", reference, accumulate=16 // BUDGET)

    assert (callback.micro_batch_size, callback.retries) == (BUDGET, 2)  # 16 -> 8 -> 4 on the first batch
    assert trainer.global_step == ref_trainer.global_step == N_SAMPLES // 16
    got, expected = ours.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    different = [name for name, value in expected.items() if not torch.equal(got[name], value)]
    assert not different, different  # weights and buffers (BatchNorm running statistics and counters), bitwise
    assert trainer.callback_metrics.keys() == ref_trainer.callback_metrics.keys()
    for key, value in ref_trainer.callback_metrics.items():  # epoch values of self.log, the accuracy metric too
        assert torch.equal(trainer.callback_metrics[key], value), key
    assert trainer.optimizers[0].param_groups[0]["lr"] == ref_trainer.optimizers[0].param_groups[0]["lr"]


def _runs(entry: ZooModel, tmp_path, **switches):
    torch.manual_seed(123)
    ours = with_budget(entry.build(batch_size=16), entry, "backward")
    trainer = fit(tmp_path / "ours", ours, [AutoMicroBatch(**switches)])
    torch.manual_seed(123)
    reference = with_budget(entry.build(batch_size=BUDGET), entry, "backward")
    ref_trainer = fit(tmp_path / "ref", reference, accumulate=16 // BUDGET)
    return ours, reference, trainer.callback_metrics, ref_trainer.callback_metrics


def _differ(got, expected):
    return sorted(k for k, v in expected.items() if not torch.equal(got[k], v))


@pytest.mark.slow
@pytest.mark.zoo
def test_each_switch_turns_off_its_own_part_only(tmp_path):
    from tests.helpers.zoo import ZOO

    # the random states: dropout draws other masks, the weights differ; the metric states are still put back
    ours, reference, _, _ = _runs(ZOO["metrics"], tmp_path / "rng", restore_rng=False)
    assert _differ(ours.state_dict(), reference.state_dict())
    # the metrics and self.log results: the accuracy counts the failed attempts; the weights are still exact
    ours, reference, logged, ref_logged = _runs(ZOO["metrics"], tmp_path / "metrics", restore_metrics=False)
    assert not _differ(ours.state_dict(), reference.state_dict())
    assert _differ(logged, ref_logged) == ["train_acc", "train_loss", "train_loss_epoch"]  # not train_loss_step
    # the buffers: BatchNorm counted the failed attempts' forwards (10 instead of 8)
    ours, reference, _, _ = _runs(ZOO["resnet"], tmp_path / "buffers", restore_buffers=False)
    assert int(ours.stem[1].num_batches_tracked) == 10 and int(reference.stem[1].num_batches_tracked) == 8


@pytest.mark.zoo
def test_on_manual_optimization_the_callback_says_it_does_not_apply_before_any_step(tmp_path):
    """The zoo entry AutoMicroBatch does not apply to: refused in setup for the zoo's reason; nothing trained."""
    entry = ZOO["manual"]
    assert "AutoMicroBatch" in entry.not_applicable
    module = entry.build(batch_size=4)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match="AutoMicroBatch needs automatic optimization.*manual_backward"):
        fit(tmp_path, module, callbacks=[AutoMicroBatch()])
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


#: The layer whose output runs out of memory in evaluation: the training one, the discriminator for the manual entry.
EVAL_LAYER = {**LAST_LAYER, "manual": "discriminator"}


def with_eval_budget(module, entry: ZooModel):
    """``module`` whose layer :data:`EVAL_LAYER` runs out of memory on more than ``BUDGET`` samples in evaluation."""

    def hook(layer, args, output):
        if not layer.training and output.shape[0] > BUDGET:
            raise torch.OutOfMemoryError(f"simulated: evaluation of {output.shape[0]} samples, budget {BUDGET}")
        return output

    module.get_submodule(EVAL_LAYER[entry.name]).register_forward_hook(hook)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("entry", zoo_params())
def test_an_evaluation_that_recovered_equals_validating_at_the_size_that_fits(entry: ZooModel, tmp_path):
    """Every entry, the manual-optimization one included (only evaluation is split): the logged values bitwise."""
    callback = AutoMicroBatch(train=entry.automatic_optimization)
    ours = with_eval_budget(entry.build(batch_size=16), entry)
    (got,) = make_trainer(tmp_path / "ours", callbacks=[callback], limit_val_batches=None).validate(ours)
    reference = entry.build(batch_size=BUDGET)
    (expected,) = make_trainer(tmp_path / "ref", limit_val_batches=None).validate(reference)
    assert got == expected
    assert callback.eval_micro_batch_sizes["validate"] == BUDGET
