"""estimate_memory and plan_memory on every zoo model: the CPU estimate equals a real step on real tensors, a real
Trainer.fit (counted by the same live-storage counter) is within Lightning's own scalars of it, plans hold with
the accumulation they recommend, and every model has a CUDA estimate."""

from __future__ import annotations

import pytest
import torch

from lightning_memopt import estimate_memory, plan_memory
from tests.helpers.measured_step import trainer_peak
from tests.helpers.zoo import ZooModel, zoo_params

#: Zoo entries whose estimates take over 2 s on a loaded CPU, and those whose plans do (several estimates each).
SLOW, SLOW_PLANS = ("t5", "bert"), ("t5", "bert", "resnet", "lstm")


def params(slow=SLOW):
    out = []
    for param in zoo_params():
        entry = param.values[0]
        marks = list(param.marks)
        if entry.name in slow:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(entry, id=entry.name, marks=marks))
    return out


def accumulation(entry: ZooModel) -> int:
    return 2 if entry.automatic_optimization else 1  # Lightning refuses accumulation with manual optimization


@pytest.mark.parametrize("entry", params())
def test_the_cpu_estimate_equals_a_real_step_and_a_real_trainer_fit(entry, tmp_path):
    module, batch, accumulate = entry.build(batch_size=4), entry.batch(4), accumulation(entry)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    est = estimate_memory(module, batch, device="cpu", accumulate_grad_batches=accumulate)
    real = estimate_memory(module, batch, device="cpu", fake=False, accumulate_grad_batches=accumulate)
    assert est.peak_bytes == real.peak_bytes and est.at_peak == real.at_peak
    assert (est.peak_phase, est.peak_step, est.peak_micro_batch) == (
        real.peak_phase,
        real.peak_step,
        real.peak_micro_batch,
    )
    for key, value in module.state_dict().items():  # neither run trained the user's module
        assert torch.equal(value, before[key]), key
    fit = trainer_peak(module, tmp_path, accumulate_grad_batches=accumulate)
    assert 0 <= fit - est.peak_bytes <= 64  # Lightning's own scalars: the loss it keeps, logged values


@pytest.mark.parametrize("entry", params(slow=SLOW_PLANS))
def test_a_plan_holds_with_the_accumulation_it_recommends(entry):
    """The whole batch just does not fit: the plan splits it (or, for manual optimization, says nothing fits), and
    the chosen micro-batch's real step, with its accumulation, fits."""
    module, effective = entry.build(), 4
    whole = estimate_memory(module, entry.batch(effective), device="cpu").peak_bytes
    plan = plan_memory(
        module,
        entry.batch,
        effective_batch_size=effective,
        budget=whole - 1,
        margin=0.0,
        device="cpu",
        gradient_checkpointing=False,
    )
    assert plan.feasible == any(t.fits for t in plan.trials)
    if not entry.automatic_optimization:
        assert not plan.feasible and "manual optimization cannot accumulate" in plan.advice
        return
    assert plan.feasible and plan.micro_batch_size < effective
    accumulate = effective // plan.micro_batch_size
    assert plan.accumulate_grad_batches == plan.estimate.accumulate_grad_batches == accumulate
    assert plan.estimate.peak_bytes <= plan.usable_bytes
    real = estimate_memory(
        module, entry.batch(plan.micro_batch_size), device="cpu", fake=False, accumulate_grad_batches=accumulate
    )
    assert real.peak_bytes <= plan.usable_bytes


@pytest.mark.parametrize("entry", params())
def test_every_zoo_model_has_a_cuda_estimate_and_an_h100_plan(entry, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    module, batch = entry.build(), entry.batch(4)
    est = estimate_memory(module, batch, device="cuda", precision="bf16-mixed", gpu="H100-80GB")
    assert est.at_peak["workspace"] == 2 * 32 * 1024**2  # torch's default on compute capability 9.0
    assert (est.peak_bytes - est.at_peak["workspace"]) % 512 == 0
    plan = plan_memory(module, entry.batch, effective_batch_size=8, budget="H100-80GB")
    assert plan.feasible and (plan.micro_batch_size, plan.accumulate_grad_batches) == (8, 1)
    assert plan.precision == "bf16-mixed" and plan.estimate.at_peak["workspace"] == 2 * 32 * 1024**2
