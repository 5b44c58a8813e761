"""The zoo itself: every entry builds the same weights from the same seed, makes the batches its step takes and
trains with a plain Lightning Trainer (the reference the feature tests compare against)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.trainer import make_trainer
from tests.helpers.zoo import N_SAMPLES, ZOO, ZooModel, zoo_params


@pytest.mark.parametrize("entry", zoo_params())
def test_same_seed_same_weights_and_it_trains(entry: ZooModel, tmp_path):
    first, second = entry.build(), entry.build()
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    before = {k: v.clone() for k, v in first.state_dict().items()}
    trainer = make_trainer(tmp_path, max_steps=2, limit_val_batches=0)
    trainer.fit(first)
    changed = [k for k, v in first.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert changed, "no weight changed in two steps"
    assert trainer.global_step == 2  # manual: two optimizer steps in its one batch


@pytest.mark.parametrize("entry", zoo_params())
def test_batches_have_the_samples_asked_for(entry: ZooModel):
    module = entry.build(batch_size=4)
    loader = module.train_dataloader()
    assert len(loader.dataset) == N_SAMPLES
    first = next(iter(loader))
    leaves = first.values() if isinstance(first, dict) else first if isinstance(first, (tuple, list)) else [first]
    assert {len(t) for t in leaves} == {4}


@pytest.mark.zoo
def test_not_applicable_features_say_why():
    manual = ZOO["manual"]
    assert not manual.automatic_optimization
    assert "manual_backward" in manual.not_applicable["AutoMicroBatch"]
    assert [p.id for p in zoo_params(feature="AutoMicroBatch")] == [n for n in ZOO if n != "manual"]
