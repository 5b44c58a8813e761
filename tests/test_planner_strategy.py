"""``plan_memory`` over several GPUs: DDP where the whole model fits each rank, else FSDP2, CPU offload last; the GPUs
sharding needs when nothing fits. Meta models on fake tensors: in-process and fast."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_memopt import estimate_memory, plan_memory
from lightning_memopt.utilities.formatting import format_bytes
from tests.scripts.fsdp2_peak import WIDTH, ResidualMLP

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _big() -> ResidualMLP:
    """1.07 B parameters: AdamW's states alone exceed a 24 GB card under DDP; sharded 4 ways they fit."""
    with torch.device("meta"):
        return ResidualMLP(width=4096, blocks=8)


def _batch(b: int) -> torch.Tensor:
    return torch.randn(b, WIDTH)


def _tokens(b: int) -> torch.Tensor:
    return torch.empty(b, 512, 4096, device="meta")


@pytest.mark.slow
def test_a_model_too_big_for_one_24gb_card_is_sharded_with_fsdp2_over_4_gpus():
    model = _big()
    plan = plan_memory(model, _tokens, effective_batch_size=32, budget="24GB", devices=4, progress=lambda _: None)
    assert plan.feasible and plan.strategy == "fsdp2" and plan.sharded and plan.world_size == 4
    assert [t.strategy for t in plan.trials if not t.fits] == ["ddp", "ddp"]  # DDP tried first, fits nothing
    # the effective batch is kept: micro x accumulate x data-parallel ranks
    assert plan.micro_batch_size * plan.accumulate_grad_batches * 4 == 32
    # the per-rank estimate is estimate_memory's, sharded 4 ways as the plan says
    assert (plan.micro_batch_size, plan.accumulate_grad_batches) == (8, 1)
    alone = estimate_memory(
        model,
        _tokens(plan.micro_batch_size),
        precision=plan.precision,
        world_size=4,
        reshard_after_forward=True,
        accumulate_grad_batches=plan.accumulate_grad_batches,
    )
    assert plan.estimate is not None and plan.estimate.world_size == 4
    assert plan.estimate.peak_bytes == alone.peak_bytes < plan.usable_bytes
    assert plan.reshard_after_forward is True and plan.cpu_offload is False
    assert plan.shard_blocks == tuple(f"blocks.{i}" for i in range(8)) and plan.shard_roots == ("",)
    text = str(plan)
    assert "Plan: FSDP2 over 4 ranks (reshard_after_forward=True)" in text and "x 4 ranks = 32" in text
    assert "Why: DDP does not fit even the smallest micro-batch" in text and "per rank" in text


def test_a_model_that_fits_each_rank_gets_ddp():
    plan = plan_memory(
        ResidualMLP(), _batch, effective_batch_size=32, budget="1GB", devices=2, device="cpu", optimizer=ADAMW
    )
    assert plan.feasible and plan.strategy == "ddp" and not plan.sharded
    assert plan.micro_batch_size == 16 and plan.accumulate_grad_batches == 1
    assert plan.shard_blocks is None and plan.reshard_after_forward is None
    assert {t.strategy for t in plan.trials} == {"ddp"}  # FSDP2 is not even estimated
    assert "Why: DDP: the whole model fits on each of the 2 ranks" in str(plan)
    single = plan_memory(ResidualMLP(), _batch, effective_batch_size=16, budget="1GB", device="cpu")
    assert single.strategy == "single device" and single.strategy_reason == "" and "Why" not in str(single)


def _needs(**kwargs) -> int:
    est = estimate_memory(ResidualMLP(), _batch(1), device="cpu", optimizer=ADAMW, **kwargs)
    return est.peak_bytes


def test_cpu_offload_is_the_last_resort_and_said_so():
    sharded = _needs(world_size=2, reshard_after_forward=True)
    offloaded = _needs(world_size=2, reshard_after_forward=True, cpu_offload=True)
    assert offloaded < sharded
    budget = (offloaded + sharded) // 2
    plan = plan_memory(
        ResidualMLP(), _batch, effective_batch_size=2, budget=budget, devices=2, device="cpu", margin=0,
        optimizer=ADAMW,
    )  # fmt: skip
    assert plan.feasible and plan.strategy == "fsdp2 + cpu offload" and plan.cpu_offload
    # DDP's model states alone are over the budget: ruled out without an estimate
    assert [t.strategy for t in plan.trials] == ["fsdp2", "fsdp2 + cpu offload"]
    assert "DDP cannot fit: its parameters, gradients and gradient buckets alone need" in plan.strategy_reason
    assert "CPU offload is the last resort" in plan.strategy_reason and "FSDP2 without CPU offload" in str(plan)


def test_a_forced_strategy_is_kept_and_named():
    plan = plan_memory(
        ResidualMLP(), _batch, effective_batch_size=32, budget="1GB", devices=2, device="cpu", strategy="fsdp2",
        optimizer=ADAMW,
    )  # fmt: skip
    assert plan.strategy == "fsdp2" and plan.strategy_reason.startswith("`strategy='fsdp2'` as asked.")
    assert plan.estimate is not None and plan.estimate.world_size == 2


@pytest.mark.slow
def test_nothing_fits_one_gpu_plans_the_gpus_fsdp2_needs():
    model = _big()
    plan = plan_memory(model, _tokens, effective_batch_size=32, budget="24GB", progress=lambda _: None)
    # the lower bound is 2 and FSDP2's estimate over 2 GPUs fits micro-batch 1
    assert not plan.feasible and plan.gpus_needed == 2 and plan.gpus_needed_planned
    assert f"Needs sharding: FSDP2 over {plan.gpus_needed} GPUs fits micro-batch 1 (planned:" in plan.advice
    again = plan_memory(
        model, _tokens, effective_batch_size=32, budget="24GB", devices=plan.gpus_needed, progress=lambda _: None
    )
    assert again.feasible and again.sharded


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": 0}, "`devices` must be a positive int, got 0"),
        ({"num_nodes": -1}, "`num_nodes` must be a positive int"),
        ({"strategy": "fsdp"}, "`strategy` must be one of 'auto', 'ddp', 'fsdp2', got 'fsdp'"),
        ({"strategy": "fsdp2"}, "`strategy`='fsdp2' needs several ranks"),
        ({"shard_modules": ["blocks.*"]}, "`shard_modules`=\\['blocks.\\*'\\] names the blocks FSDP2 shards"),
    ],
)
def test_bad_world_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_memory(ResidualMLP(), _batch, effective_batch_size=4, budget="1GB", device="cpu", **kwargs)


def test_nothing_fits_even_offloaded_the_advice_speaks_of_the_states_on_the_gpu():
    offloaded = _needs(world_size=2, reshard_after_forward=True, cpu_offload=True)
    plan = plan_memory(
        ResidualMLP(), _batch, effective_batch_size=2, budget=offloaded // 2, devices=2, device="cpu", margin=0,
        optimizer=ADAMW,
    )  # fmt: skip
    assert not plan.feasible and plan.strategy == "fsdp2 + cpu offload" and plan.estimate.sharding.cpu_offload
    assert [t.strategy for t in plan.trials] == ["fsdp2", "fsdp2 + cpu offload"]  # DDP ruled out by its states
    sharded = _needs(world_size=2, reshard_after_forward=True)
    assert f"even micro-batch 1 with 32-true, fsdp2 needs {format_bytes(sharded)} per rank;" in plan.advice
    assert plan.strategy_reason == "" and "Why" not in str(plan)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_ddp_s_model_state_floor_is_below_every_ddp_estimate(precision):
    """The floor that rules DDP out before any estimate is a lower bound of what DDP's estimates need."""
    from lightning_memopt.planner.search import needed_bytes, replicated_floor

    model = ResidualMLP()
    model.blocks[0].requires_grad_(False)  # frozen parameters: no gradients, no buckets
    floor = replicated_floor(model, precision, world=2)
    est = estimate_memory(model, _batch(1), device="cpu", optimizer=ADAMW, precision=precision)
    assert floor <= needed_bytes(est, 2)
    states = est.parameter_bytes + est.buffer_bytes + 2 * est.gradient_bytes
    assert floor == states  # parameters at the precision, gradients and their buckets: nothing else


def test_ddp_is_estimated_where_its_floor_fits_and_skipped_where_it_does_not():
    from lightning_memopt.planner.search import replicated_floor

    floor = replicated_floor(ResidualMLP(), "32-true", world=2)
    for budget, estimated in ((floor + 1, True), (floor - 1, False)):
        plan = plan_memory(
            ResidualMLP(), _batch, effective_batch_size=2, budget=budget, devices=2, device="cpu", margin=0,
            optimizer=ADAMW,
        )  # fmt: skip
        assert ("ddp" in {t.strategy for t in plan.trials}) is estimated


def test_an_fsdp2_plan_offers_fsdp2_s_own_mixed_precision_and_the_preset_builds_it():
    from lightning_memopt import MemoryPreset

    plan = plan_memory(
        ResidualMLP(), _batch, effective_batch_size=32, budget=8_000_000, devices=2, device="cpu",
        precision="bf16-mixed", margin=0, optimizer=ADAMW, strategy="fsdp2",
    )  # fmt: skip
    policy = estimate_memory(
        ResidualMLP(), _batch(plan.micro_batch_size), device="cpu", optimizer=ADAMW, precision="bf16-mixed",
        world_size=2, reshard_after_forward=True, mixed_precision_policy=True,
        accumulate_grad_batches=plan.accumulate_grad_batches,
    )  # fmt: skip
    assert plan.policy_estimate.peak_bytes == policy.peak_bytes < plan.estimate.peak_bytes
    offer = "FSDP2's own mixed precision (MixedPrecisionPolicy, Trainer at 32-true) needs"
    assert f"{offer} {format_bytes(policy.peak_bytes)}" in str(plan)
    preset = MemoryPreset.from_plan(plan, mixed_precision_policy=True)
    recipe = preset.configure_model_recipe
    assert (
        'options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)' in recipe
    )
    assert '# Trainer(precision="32-true", strategy=ModelParallelStrategy(' in recipe
    assert preset.trainer_kwargs()["precision"] == "32-true"  # no autocast on top of the policy
    ddp = plan_memory(ResidualMLP(), _batch, effective_batch_size=32, budget="1GB", devices=2, device="cpu",
                      precision="bf16-mixed", optimizer=ADAMW)  # fmt: skip
    assert ddp.strategy == "ddp" and ddp.policy_estimate is None and "MixedPrecisionPolicy" not in str(ddp)
    with pytest.raises(ValueError, match=r"`mixed_precision_policy=True` is FSDP2's own mixed precision"):
        MemoryPreset.from_plan(ddp, mixed_precision_policy=True)


@pytest.mark.parametrize(
    ("plain", "checkpointed", "expected"), [(4, 8, (8, True)), (4, 6, (4, False)), (None, 2, (2, True))]
)
def test_checkpointing_is_chosen_from_exactly_twice_the_micro_batch_without_it(plain, checkpointed, expected):
    from lightning_memopt.planner.search import _choose

    class Runs:  # what the search found with checkpointing off and on
        def largest_fitting(self, option, candidates, verify=True):
            return checkpointed if option else plain

        def confirm(self, option, size, candidates):
            return size

    assert _choose(Runs(), [1, 2, 4, 6, 8], "auto") == expected
