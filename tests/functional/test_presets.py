import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_memopt.functional.presets import (
    PRESET_NAMES,
    PRESETS,
    choose_precision,
    has_native_bf16,
    plan_accumulation,
    tier_for_memory,
)


@pytest.mark.parametrize(
    ("effective", "micro", "devices", "nodes", "expected"),
    [
        (128, 16, 1, 1, 8),  # "batch 96 -> 16 with accumulation 8 (effective 128)"
        (32, 4, 1, 1, 8),  # 4 x 8
        (128, 8, 1, 1, 16),  # 8 x 16
        (128, 8, 4, 2, 2),
        (64, 32, 2, 1, 1),
    ],
)
def test_accumulation_arithmetic(effective, micro, devices, nodes, expected):
    plan = plan_accumulation(effective, micro, devices, nodes)
    assert plan.accumulate_grad_batches == expected
    assert plan.micro_batch_size * plan.accumulate_grad_batches * devices * nodes == effective


@settings(max_examples=200, deadline=None)
@given(
    per_rank=st.integers(1, 512),
    world=st.sampled_from([(1, 1), (2, 1), (4, 2), (8, 1)]),
    target=st.integers(1, 16),
)
def test_chosen_micro_batch_keeps_effective_batch(per_rank, world, target):
    devices, nodes = world
    effective = per_rank * devices * nodes
    plan = plan_accumulation(effective, None, devices, nodes, target_accumulation=target)
    assert plan.micro_batch_size * plan.accumulate_grad_batches * devices * nodes == effective
    assert plan.accumulate_grad_batches >= min(target, per_rank)


def test_target_accumulation_picks_smallest_divisor_at_or_above_target():
    assert plan_accumulation(96, target_accumulation=5).accumulate_grad_batches == 6
    assert plan_accumulation(7, target_accumulation=4).accumulate_grad_batches == 7  # prime: micro-batch 1
    assert plan_accumulation(2, target_accumulation=8).micro_batch_size == 1


def test_non_divisible_split_raises_with_nearest_valid_sizes():
    with pytest.raises(
        ValueError, match=r"`effective_batch_size`=100 is not divisible .* Use `effective_batch_size`=96 or 112"
    ):
        plan_accumulation(100, 16)


def test_effective_smaller_than_micro_times_world_raises():
    with pytest.raises(
        ValueError, match=r"at least `micro_batch_size` x `devices` x `num_nodes` = 16 x 4 x 1 = 64, got 32"
    ):
        plan_accumulation(32, 16, devices=4)
    with pytest.raises(ValueError, match="not divisible by the world size 4"):
        plan_accumulation(10, None, devices=4)


@pytest.mark.parametrize(("name", "value"), [("effective_batch_size", 0), ("micro_batch_size", -1), ("devices", 1.5)])
def test_bad_numbers_name_the_argument(name, value):
    kwargs = {"effective_batch_size": 8, "micro_batch_size": 2, "devices": 1}
    kwargs[name] = value
    with pytest.raises(ValueError, match=f"`{name}` must be a positive int, got {value}"):
        plan_accumulation(**kwargs)


@pytest.mark.parametrize(
    ("capability", "native"),
    [((6, 1), False), ((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 6), True), ((9, 0), True), (None, False)],
)
def test_native_bf16_needs_compute_capability_8(capability, native):
    assert has_native_bf16("cuda", capability) is native


def test_auto_precision_per_device():
    assert choose_precision("auto", "cuda", (9, 0), "NVIDIA H100").precision == "bf16-mixed"
    v100 = choose_precision("auto", "cuda", (7, 0), "Tesla V100")
    assert v100.precision == "16-mixed"
    assert "Tesla V100 (compute capability 7.0)" in v100.reason and "GradScaler" in v100.reason
    cpu = choose_precision("auto", "cpu")
    assert cpu.precision == "32-true" and "bf16-mixed" in cpu.reason


def test_bf16_on_gpu_without_it_names_gpu_and_suggests_fp16():
    with pytest.raises(ValueError, match=r"Tesla T4 \(compute capability 7.5\).*Use `precision='16-true'`"):
        choose_precision("bf16-true", "cuda", (7, 5), "Tesla T4")
    assert choose_precision("bf16-mixed", "cuda", (7, 0), "V100", allow_emulated_bf16=True).precision == "bf16-mixed"
    assert choose_precision("bf16-mixed", "cpu").precision == "bf16-mixed"


def test_unknown_precision_lists_valid_modes():
    with pytest.raises(ValueError, match="`precision` must be one of 'auto', '32-true'.*got 'fp8'"):
        choose_precision("fp8", "cuda", (9, 0))


@pytest.mark.parametrize(
    ("gib", "tier"),
    [
        (4, ("8GB", "max-savings")),
        (8, ("8GB", "max-savings")),
        (12, ("8GB", "max-savings")),
        (16, ("16GB", "balanced")),
        (20, ("16GB", "balanced")),
        (24, ("24GB+", "max-speed")),
        (80, ("24GB+", "max-speed")),
    ],
)
def test_tiers(gib, tier):
    assert tier_for_memory(gib) == tier


def test_tier_rejects_non_positive():
    with pytest.raises(ValueError, match="`total_memory_gib` must be a positive number, got 0"):
        tier_for_memory(0)


def test_preset_tables_are_ordered_by_savings():
    assert PRESET_NAMES == ("max-savings", "balanced", "max-speed")
    acc = [PRESETS[n]["target_accumulation"] for n in PRESET_NAMES]
    assert acc == sorted(acc, reverse=True)
    assert PRESETS["max-savings"]["gradient_checkpointing"] and not PRESETS["max-speed"]["gradient_checkpointing"]
