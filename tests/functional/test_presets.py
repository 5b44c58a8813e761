import copy
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_memopt.functional.precision import choose_precision, has_native_bf16
from lightning_memopt.functional.presets import PRESET_NAMES, PRESETS, TIERS, plan_accumulation, tier_for_memory
from tests.helpers.presets_table import check_batch_arithmetic, check_preset_table


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


def _reference_plan(per_rank, micro, target):
    """The plain search the divisor arithmetic must agree with: every d in 1..per_rank."""
    divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    if micro is None:
        accumulation = next(d for d in divisors if d >= min(target, per_rank))
        return per_rank // accumulation, accumulation
    return [d for d in divisors if d <= micro][-3:]


def test_divisor_arithmetic_matches_the_plain_search():
    for per_rank in range(1, 400):
        for target in (1, 2, 3, 4, 5, 8, 16, 500):
            plan = plan_accumulation(per_rank, None, target_accumulation=target)
            assert (plan.micro_batch_size, plan.accumulate_grad_batches) == _reference_plan(per_rank, None, target)
    for per_rank, micro in ((100, 16), (97, 8), (360, 7), (1000, 33)):
        with pytest.raises(ValueError) as info:
            plan_accumulation(per_rank, micro)
        assert f"`micro_batch_size` in {_reference_plan(per_rank, micro, 1)}" in str(info.value)


@pytest.mark.parametrize(
    "effective",
    [10**10, 2**62, 2**61 - 1, 2**63 - 1, 2147483647 * 4294967291, 3037000493**2, 897612484786617600],
    ids=["1e10", "2^62", "prime-2^61-1", "int64-max", "semiprime", "prime-square", "many-divisors"],
)
def test_huge_effective_batches_answer_fast(effective):
    start = time.perf_counter()
    plan = plan_accumulation(effective, target_accumulation=4)
    assert plan.micro_batch_size * plan.accumulate_grad_batches == effective
    assert plan.accumulate_grad_batches >= 4
    with pytest.raises(ValueError, match="is not divisible by `micro_batch_size`"):
        plan_accumulation(effective, 10**9 + 7)  # a prime that divides none of them: lists the micro-batches that do
    assert time.perf_counter() - start < 1.0


def test_huge_effective_batches_pick_the_expected_split():
    assert plan_accumulation(2**61 - 1, target_accumulation=2).micro_batch_size == 1  # a prime: micro-batch 1
    assert plan_accumulation(10**10, target_accumulation=4).accumulate_grad_batches == 4
    assert plan_accumulation(2147483647 * 4294967291, target_accumulation=2).accumulate_grad_batches == 2147483647


@pytest.mark.parametrize("bad", [2**63, 10**30])
def test_effective_batch_beyond_int64_is_refused(bad):
    with pytest.raises(ValueError, match=rf"`effective_batch_size` must be at most 2\*\*63 - 1 .*got {bad}"):
        plan_accumulation(bad)


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


@pytest.mark.parametrize("bad", [0, -8, float("nan"), float("inf"), True, "24", None])
def test_tier_rejects_what_is_not_a_finite_positive_number(bad):
    with pytest.raises(ValueError, match=f"`total_memory_gib` must be a finite, positive number, got {bad!r}"):
        tier_for_memory(bad)


def test_the_preset_table_has_the_properties_it_must_have():
    check_preset_table(PRESETS, TIERS)
    assert tuple(PRESETS) == PRESET_NAMES


def _broken(edit):
    presets, tiers = copy.deepcopy(PRESETS), list(TIERS)
    edit(presets, tiers)
    return presets, tiers


BROKEN = {
    "fastest-checkpoints": lambda p, t: p["max-speed"].update(gradient_checkpointing=True),
    "middle-accumulates-most": lambda p, t: p["balanced"].update(target_accumulation=8),
    "middle-collects-garbage-alone": lambda p, t: p.update(
        {
            "max-savings": {**p["max-savings"], "gc_every_n_train_steps": 0},
            "balanced": {**p["balanced"], "gc_every_n_train_steps": 50},
        }
    ),
    "savings-without-monitor": lambda p, t: p["max-savings"].update(monitor=False),
    "allocator-typo": lambda p, t: p["balanced"].update(allocator_conf="expandable_segments"),
    "knob-missing": lambda p, t: p["balanced"].pop("monitor"),
    "knob-as-string": lambda p, t: p["max-savings"].update(gradient_checkpointing="yes"),
    "no-accumulation-target": lambda p, t: p["max-speed"].update(target_accumulation=0),
    "short-precision-name": lambda p, t: p["balanced"].update(precision="bf16"),
    "tiers-out-of-order": lambda p, t: t.__setitem__(slice(0, 2), [t[1], t[0]]),
    "tier-bound-shrinks": lambda p, t: t.__setitem__(1, (10.0, "16GB", "balanced")),
    "last-tier-closed": lambda p, t: t.__setitem__(2, (80.0, "24GB+", "max-speed")),
    "tier-names-unknown-preset": lambda p, t: t.__setitem__(1, (20.0, "16GB", "fast")),
    "tier-label-outside-bounds": lambda p, t: t.__setitem__(1, (20.0, "32GB", "balanced")),
}


@pytest.mark.parametrize("edit", list(BROKEN.values()), ids=list(BROKEN))
def test_a_broken_table_entry_fails_the_checks(edit):
    presets, tiers = _broken(edit)
    with pytest.raises(AssertionError):
        check_preset_table(presets, tiers)
    # the checks themselves found it: the real table still passes
    check_preset_table(PRESETS, TIERS)


def test_batch_arithmetic_check_catches_a_split_that_loses_samples():
    # A split is wrong if micro x accumulation x world is not the effective batch: the check must see that.
    with pytest.raises(AssertionError):
        check_batch_arithmetic({"bad": {"target_accumulation": 4}}, largest=8, plan=_lossy_plan)


def _lossy_plan(effective, micro, devices, nodes, target):
    plan = plan_accumulation(effective, micro, devices, nodes, target)
    return type(plan)(
        plan.effective_batch_size, plan.micro_batch_size + 1, plan.accumulate_grad_batches, plan.world_size
    )


def test_a_recipe_list_stays_on_one_line_exactly_while_it_fits_the_width_with_its_indent():
    from lightning_memopt.functional.presets import _names_literal
    from lightning_memopt.utilities.formatting import WIDTH

    indent = "    "
    fits = "x" * (WIDTH - len(indent) - 4)  # ['xx...x'] is WIDTH - len(indent) characters
    assert _names_literal([fits], indent) == f"['{fits}']"
    assert _names_literal([fits + "x"], indent) == f"[\n{indent}    '{fits}x',\n{indent}]"
