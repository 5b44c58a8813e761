"""The properties the preset table and the GPU-size tiers must have, checked on any table given as an argument.

Each check raises ``AssertionError`` naming the entry at fault, so a test can run them on the real table and on a
deliberately broken copy (which must fail).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_memopt.functional.allocator import parse_alloc_conf
from lightning_memopt.functional.precision import normalize_precision
from lightning_memopt.functional.presets import plan_accumulation

#: The knobs every entry sets, and how much memory each saves when on (the order of the table: most savings first).
BOOL_KNOBS = ("gradient_checkpointing", "cache_clean_on_phase_end", "monitor")
KEYS = {
    "precision",
    "float32_matmul_precision",
    "allocator_conf",
    "target_accumulation",
    "gc_every_n_train_steps",
    *BOOL_KNOBS,
}


def _switches(entry: Mapping[str, Any]) -> dict[str, bool]:
    """Which memory-saving measures an entry turns on."""
    return {
        **{knob: entry[knob] for knob in BOOL_KNOBS},
        "garbage_collector": entry["gc_every_n_train_steps"] > 0,
        "allocator_conf": bool(entry["allocator_conf"]),
        "accumulation": entry["target_accumulation"] > 1,
    }


def check_entries(presets: Mapping[str, Mapping[str, Any]]) -> None:
    """Every entry sets every knob, each to a value ``MemoryPreset`` accepts."""
    for name, entry in presets.items():
        assert set(entry) == KEYS, f"{name}: knobs {sorted(set(entry) ^ KEYS)} missing or unknown"
        assert normalize_precision(entry["precision"]) == entry["precision"], f"{name}: precision not a full name"
        assert entry["float32_matmul_precision"] in ("", "highest", "high", "medium"), f"{name}: matmul precision"
        for knob in BOOL_KNOBS:
            assert isinstance(entry[knob], bool), f"{name}: {knob} must be a bool"
        for knob in ("gc_every_n_train_steps", "target_accumulation"):
            value = entry[knob]
            assert type(value) is int and value >= (knob == "target_accumulation"), f"{name}: {knob}={value!r}"
        assert isinstance(entry["allocator_conf"], str), f"{name}: allocator_conf must be a str"
        try:
            parse_alloc_conf(entry["allocator_conf"])
        except ValueError as err:
            raise AssertionError(f"{name}: {err}") from err


def check_savings_order(presets: Mapping[str, Mapping[str, Any]]) -> None:
    """Ordered from most savings to most speed: each measure a preset turns on is on in every preset before it, the
    accumulation target never grows, the first preset turns every measure on and the last one none."""
    names = list(presets)
    targets = [presets[n]["target_accumulation"] for n in names]
    assert targets == sorted(targets, reverse=True), f"accumulation targets {targets} grow along {names}"
    for before, after in itertools.pairwise(names):
        on_before, on_after = _switches(presets[before]), _switches(presets[after])
        more = [k for k in on_after if on_after[k] and not on_before[k]]
        assert not more, f"{after} turns on {more}, which {before} (saving more) leaves off"
    first, last = _switches(presets[names[0]]), _switches(presets[names[-1]])
    assert all(first.values()), f"{names[0]} leaves {[k for k, v in first.items() if not v]} off"
    assert not any(last.values()), f"{names[-1]} turns {[k for k, v in last.items() if v]} on"


def check_tiers(tiers: Sequence[tuple[float, str, str]], presets: Mapping[str, Any]) -> None:
    """Bounds grow, the last is open; every preset is one tier's, smaller cards getting the presets that save more;
    each label's size lies within its own bounds."""
    bounds = [bound for bound, _, _ in tiers]
    assert all(b > 0 for b in bounds) and bounds == sorted(set(bounds)), f"tier bounds {bounds} do not grow"
    assert math.isinf(bounds[-1]), "the last tier must be open (every card gets a preset)"
    assert [name for _, _, name in tiers] == list(presets), "tiers must name each preset once, in savings order"
    lower = 0.0
    for bound, label, _ in tiers:
        size = re.fullmatch(r"(\d+)GB(\+?)", label)
        assert size is not None, f"tier label {label!r} is not like '16GB'"
        assert lower < int(size.group(1)) <= bound, f"tier {label!r} lies outside its bounds ({lower}, {bound}]"
        assert (size.group(2) == "+") is math.isinf(bound), f"only the open tier's label ends in '+': {label!r}"
        lower = bound


def check_batch_arithmetic(
    presets: Mapping[str, Mapping[str, Any]], largest: int = 96, plan: Callable[..., Any] = plan_accumulation
) -> None:
    """For every preset, effective batch and world size: the split keeps the effective batch and takes the fewest
    accumulation steps at or above the preset's target. ``plan`` is the arithmetic under test."""
    for name, entry in presets.items():
        target = entry["target_accumulation"]
        for world in (1, 2, 3, 8):
            for per_rank in range(1, largest + 1):
                split = plan(per_rank * world, None, world, 1, target)
                assert split.micro_batch_size * split.accumulate_grad_batches * world == per_rank * world, name
                fewest = min(d for d in range(1, per_rank + 1) if per_rank % d == 0 and d >= min(target, per_rank))
                assert split.accumulate_grad_batches == fewest, (name, world, per_rank)


def check_preset_table(presets: Mapping[str, Mapping[str, Any]], tiers: Sequence[tuple[float, str, str]]) -> None:
    """Every property above."""
    check_entries(presets)
    check_savings_order(presets)
    check_tiers(tiers, presets)
    check_batch_arithmetic(presets)
