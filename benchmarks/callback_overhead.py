"""Total fit time with the per-step callbacks at their defaults, side by side with none, in a large process.

What a user pays is the whole fit, not the median step: a callback that does nothing on 24 steps out of 25 and
a full ``gc.collect()`` on the 25th has a perfect median and a 2x mean. So this script times whole fits:

* the process holds a tokenised dataset as Python lists of ints (``--objects`` lists, 1,000,000 by default),
  built before any fit and used as the training data, because a full collection scans every one of them;
* one torch thread (``--threads``), a small token model whose step takes about 25 ms on an idle 2-core
  AMD EPYC machine, 13.6 ms in the committed result (``--width``, ``--batch``),
  ``--steps`` optimizer steps per fit (1,000);
* configurations interleaved in one process: no callbacks against MemoryMonitor + CacheCleaner +
  GarbageCollector + OOMReporter at their defaults, in alternating order, ``--rounds`` pairs; and each
  callback alone (plus ``GarbageCollector(generation=2)``, the old default), ``--single-rounds`` times;
* verdict: total fit wall time of all four / none, target <= 1.02. Each callback's share is the time spent
  inside its hooks during the all-four fits, and its fit time alone minus the baseline's;
* MemoryAudit, reported on its own: the seconds of its one-off audits (fit start, first step; target
  <= 0.5 s each at a million objects) and its cost per step;
* per-call costs in this process: ``gc.collect`` of each generation, with and without ``gc.freeze()``;
* every callback at its defaults on a small model (``--small-*``): the CPU they add per optimizer step after the
  first steps, side by side with none (target <= 0.3 ms and <= 1 % of a 30 ms step), each one's time in its hooks;
* MemoryAudit's fit-start and first-step audits in fresh processes holding ``--scan-small`` and ``--scan-large``
  unrelated objects (target: the large / small ratio <= 1.5; ``--quick``: one process, topped up between the two).

Time spent in Python's collector (every collection, automatic or not) is recorded through ``gc.callbacks``.
The machine may be shared: the CPU time of the process is printed next to the wall time.

    python benchmarks/callback_overhead.py --out benchmarks/results/callback_overhead_cpu.json
    python benchmarks/callback_overhead.py --quick        # smoke run: small process, short fits, one round
    python benchmarks/callback_overhead.py --accelerator gpu --out benchmarks/results/gpu/callback_overhead.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine_info, quiet_trainer, time_hooks  # benchmarks/_machine.py

from lightning_memopt import (
    AllocatorSettings,
    AutoMicroBatch,
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryAudit,
    MemoryMonitor,
    OOMReporter,
)
from lightning_memopt.functional.audit.leaks import grad_fn_holders
from lightning_memopt.functional.footprint import live_tensors
from lightning_memopt.functional.readings.memory import empty_device_cache

TARGET = 1.02
AUDIT_TARGET_S = 0.5
#: Goal of the per-step section: CPU added per step by every callback at its defaults, on the small model ...
STEP_TARGET_MS = 0.3
#: ... and as a share of a 30 ms step.
STEP_SHARE_TARGET, REFERENCE_STEP_MS = 0.01, 30.0
#: Goal of the scan section: the fit-start audit at a million unrelated objects over the audit at ten thousand.
SCAN_RATIO_TARGET = 1.5
VOCAB = 256


# ------------------------------------------------------------------------------------------------ data and model
def tokenised_dataset(n: int, length: int) -> list[list[int]]:
    """``n`` token lists: ``n`` container objects the collector tracks (small ints are shared, not tracked)."""
    return [[(i * 31 + j * 7) % VOCAB for j in range(length)] for i in range(n)]


class Tokens(Dataset):
    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[int]:
        return self.rows[index]


def collate(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows)


class TokenModel(pl.LightningModule):
    """Embedding, mean over the tokens, three linear layers; the target is the mean token id.

    The token lists are passed to ``fit`` as a DataLoader, not kept as an attribute of the module (see
    ``attribute_scan_cost`` for what MemoryAudit pays when they are).
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.net = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
        )

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        pred = self.net(self.embed(batch).mean(1)).squeeze(1)
        return nn.functional.mse_loss(pred, batch.float().mean(1) / VOCAB)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(rows: list[list[int]], batch: int) -> DataLoader:
    return DataLoader(Tokens(rows), batch_size=batch, shuffle=False, collate_fn=collate)


# ------------------------------------------------------------------------------------------------ clocks
class GcClock:
    """Seconds and counts of every collection Python runs while active, by generation (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            generation = info["generation"]
            self.seconds[generation] += time.perf_counter() - self._start
            self.counts[generation] += 1

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


HOOKS = (
    "setup",
    "on_fit_start",
    "on_train_start",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "teardown",
)


class HookClock:
    """Times the hooks of one callback instance (wrapped in place): one-off hooks in total, batch ends one by one."""

    def __init__(self, callback: pl.Callback) -> None:
        self.name = type(callback).__name__
        self.callback = callback
        self.one_off_s: dict[str, float] = {}
        self.batch_end: list[tuple[int, float]] = []  # (global_step after the step, seconds)
        time_hooks(callback, pl.Callback, HOOKS, self._record)

    def _record(self, hook: str, trainer: pl.Trainer, spent: float, cpu: float) -> None:
        if hook == "on_train_batch_end":
            self.batch_end.append((trainer.global_step, spent))
        else:
            self.one_off_s[hook] = self.one_off_s.get(hook, 0.0) + spent

    @property
    def seconds(self) -> float:
        return sum(self.one_off_s.values()) + sum(s for _, s in self.batch_end)


def time_methods(obj: object, names: tuple[str, ...]) -> dict[str, list[float]]:
    """Wrap bound methods of ``obj`` in place and return the per-call seconds they will record."""
    spent: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        fn = getattr(obj, name)

        def timed(*args: Any, _fn: Callable[..., Any] = fn, _name: str = name) -> Any:
            start = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                spent[_name].append(time.perf_counter() - start)

        setattr(obj, name, timed)
    return spent


# ------------------------------------------------------------------------------------------------ configurations
PER_STEP = ("MemoryMonitor", "CacheCleaner", "GarbageCollector", "OOMReporter")


def build(config: str) -> list[pl.Callback]:
    makers: dict[str, Callable[[], pl.Callback]] = {
        "MemoryMonitor": MemoryMonitor,
        "CacheCleaner": CacheCleaner,
        "GarbageCollector": GarbageCollector,
        "OOMReporter": OOMReporter,
        "MemoryAudit": MemoryAudit,
        "GarbageCollector(generation=2)": lambda: GarbageCollector(generation=2),
    }
    if config == "none":
        return []
    if config == "all four":
        return [makers[name]() for name in PER_STEP]
    return [makers[config]()]


def run_fit(config: str, rows: list[list[int]], args: argparse.Namespace, steps: int) -> dict[str, Any]:
    callbacks = build(config)
    clocks = [HookClock(cb) for cb in callbacks]
    audit_parts: dict[str, list[float]] = {}
    for cb in callbacks:
        if isinstance(cb, MemoryAudit):
            # the audits are the callback's; the per-interval samples are its Trainer-free session's
            audit_parts = {
                **time_methods(cb, ("_audit",)),
                **time_methods(cb._session, ("holder_sample", "leak_sample")),
            }
    with tempfile.TemporaryDirectory() as root:
        trainer = quiet_trainer(root, callbacks, steps, args.accelerator)
        torch.manual_seed(0)
        model = TokenModel(args.width)
        data = loader(rows, args.batch)
        gc.collect()  # every fit starts with no garbage waiting
        with GcClock() as gc_clock:
            wall, cpu = time.perf_counter(), time.process_time()
            trainer.fit(model, train_dataloaders=data)
            if torch.cuda.is_available() and args.accelerator in ("gpu", "cuda"):
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        left_behind = gc.collect()  # garbage no collection during the fit freed (untimed)
    assert trainer.global_step == steps, (config, trainer.global_step)
    result: dict[str, Any] = {
        "config": config,
        "steps": steps,
        "wall_s": wall,
        "cpu_s": cpu,
        "garbage_left_behind": left_behind,
        "gc_seconds_by_generation": gc_clock.seconds,
        "gc_collections_by_generation": gc_clock.counts,
        "hooks": {
            c.name: {"seconds": c.seconds, "one_off_s": c.one_off_s, "batch_end_s": sum(s for _, s in c.batch_end)}
            for c in clocks
        },
    }
    for clock in clocks:
        cb = clock.callback
        if isinstance(cb, GarbageCollector):
            result["hooks"][clock.name].update(collect_calls=cb.calls, collect_seconds=cb.seconds)
        if isinstance(cb, MemoryMonitor):
            fired = [s for step, s in clock.batch_end if step % cb._interval == 0]
            result["hooks"][clock.name].update(readings=len(fired), reading_seconds=sum(fired))
        if isinstance(cb, MemoryAudit):
            first = [s for step, s in clock.batch_end if step == 1]
            result["hooks"][clock.name].update(
                fit_start_audit_s=clock.one_off_s.get("on_fit_start", 0.0),
                first_step_audit_s=sum(first),
                audits_s=audit_parts["_audit"],
                holder_samples_s=audit_parts["holder_sample"],
                leak_walks_s=audit_parts["leak_sample"],
                batch_end_after_first_step_s=sum(s for step, s in clock.batch_end if step != 1),
                leak_every_n_train_steps=cb.leak_every_n_train_steps,
            )
    return result


# ------------------------------------------------------------------------------------------------ per-call costs
def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    spent = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        spent.append(time.perf_counter() - start)
    return 1000 * statistics.median(spent)


def attribute_scan_cost(rows: list[list[int]], width: int) -> float:
    """Seconds of one of MemoryAudit's attribute scans (every leak interval) of a module that keeps the data."""
    model = TokenModel(width)
    model.rows = rows  # what `self.data = data` in a LightningModule's __init__ does
    start = time.perf_counter()
    grad_fn_holders(model)
    return time.perf_counter() - start


def per_call_costs(device: torch.device, repeats: int) -> dict[str, float]:
    costs = {
        "tracked_objects": float(len(gc.get_objects())),
        "gc_collect_gen0_ms": _median_ms(lambda: gc.collect(0), repeats),
        "gc_collect_gen1_ms": _median_ms(lambda: gc.collect(1), repeats),
        "gc_collect_gen2_ms": _median_ms(lambda: gc.collect(2), repeats),
        "live_tensors_walk_ms": _median_ms(lambda: live_tensors("cpu"), repeats),
    }
    gc.collect()
    gc.freeze()  # what GarbageCollector(freeze_after_setup=True) does
    try:
        costs["gc_collect_gen2_after_freeze_ms"] = _median_ms(lambda: gc.collect(2), repeats)
    finally:
        gc.unfreeze()
    if device.type == "cuda":

        def release() -> None:
            x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # something cached to release
            del x
            torch.cuda.synchronize()
            empty_device_cache(device)

        costs["empty_cache_ms"] = _median_ms(release, repeats)

        def allocate() -> None:
            x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
            torch.cuda.synchronize()
            del x

        def allocate_after_empty_cache() -> None:
            empty_device_cache(device)
            torch.cuda.synchronize()
            allocate()

        # what a call costs afterwards: the next allocation of that size goes to the driver again
        costs["alloc_256MiB_from_cache_ms"] = _median_ms(allocate, repeats)
        costs["alloc_256MiB_after_empty_cache_ms"] = _median_ms(allocate_after_empty_cache, repeats)
    else:
        costs["empty_cache_ms"] = float("nan")  # CPU: CacheCleaner does nothing
    return costs


# ------------------------------------------------------------------------------------------------ report
def pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def summarise(fits: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {}
    for fit in fits:
        by.setdefault(fit["config"], []).append(fit)
    base_wall = statistics.mean(f["wall_s"] for f in by["none"])
    base_cpu = statistics.mean(f["cpu_s"] for f in by["none"])
    pairs = [(b, a) for b, a in zip(by["none"], by["all four"])]
    all_four = by["all four"]
    summary: dict[str, Any] = {
        "baseline_fit_wall_s": base_wall,
        "baseline_step_ms": 1000 * base_wall / steps,
        "total_ratio_wall": sum(f["wall_s"] for f in all_four) / sum(f["wall_s"] for f in by["none"]),
        "total_ratio_cpu": sum(f["cpu_s"] for f in all_four) / sum(f["cpu_s"] for f in by["none"]),
        "pair_ratios_wall": [a["wall_s"] / b["wall_s"] for b, a in pairs],
        "pair_ratios_cpu": [a["cpu_s"] / b["cpu_s"] for b, a in pairs],
        "configs": {},
        "share_in_all_four": {},
    }
    summary["median_pair_ratio_wall"] = statistics.median(summary["pair_ratios_wall"])
    summary["passed"] = summary["total_ratio_wall"] <= TARGET
    for config, runs in by.items():
        wall = statistics.mean(f["wall_s"] for f in runs)
        cpu = statistics.mean(f["cpu_s"] for f in runs)
        summary["configs"][config] = {
            "fits": len(runs),
            "mean_wall_s": wall,
            "mean_cpu_s": cpu,
            "ratio_wall": wall / base_wall,
            "ratio_cpu": cpu / base_cpu,
            "gc_seconds": statistics.mean(sum(f["gc_seconds_by_generation"]) for f in runs),
            "gc_collections_by_generation": runs[0]["gc_collections_by_generation"],
            "garbage_left_behind": statistics.mean(f["garbage_left_behind"] for f in runs),
            "hook_seconds": statistics.mean(sum(h["seconds"] for h in f["hooks"].values()) for f in runs),
        }
    for name in PER_STEP:
        hook_s = statistics.mean(f["hooks"][name]["seconds"] for f in all_four)
        fit_s = statistics.mean(f["wall_s"] for f in all_four)
        summary["share_in_all_four"][name] = {
            "hook_seconds": hook_s,
            "share_of_fit": hook_s / fit_s,
            "per_step_ms": 1000 * hook_s / steps,
        }
    return summary


def print_report(
    summary: dict[str, Any], fits: list[dict[str, Any]], costs: dict[str, float], steps: int, objects: int
) -> None:
    base = summary["configs"]["none"]
    print(
        f"\n{objects:,} token lists held ({costs['tracked_objects']:,.0f} objects tracked by gc);"
        f" {steps}-step fits; baseline step {summary['baseline_step_ms']:.1f} ms"
        f" (fit {base['mean_wall_s']:.2f} s wall)"
    )
    print(
        f"{'configuration':32s}{'fits':>5s}{'wall s':>9s}{'ratio':>8s}{'cpu s':>9s}{'ratio':>8s}"
        f"{'in gc s':>9s}{'hooks s':>9s}{'left':>6s}  collections gen0/1/2"
    )
    for config, row in summary["configs"].items():
        counts = "/".join(str(c) for c in row["gc_collections_by_generation"])
        print(
            f"{config:32s}{row['fits']:5d}{row['mean_wall_s']:9.2f}{row['ratio_wall']:8.3f}{row['mean_cpu_s']:9.2f}"
            f"{row['ratio_cpu']:8.3f}{row['gc_seconds']:9.3f}{row['hook_seconds']:9.3f}"
            f"{row['garbage_left_behind']:6.0f}  {counts}"
        )
    print(
        "('in gc s': seconds in every collection Python ran during the fit, automatic ones included; 'hooks s':"
        " seconds inside the callbacks' hooks; 'left': unreachable objects a full collection found after the fit)"
    )
    print("\nshare of each callback in the all-four fits (time inside its hooks / fit time), and alone vs none:")
    for name, share in summary["share_in_all_four"].items():
        alone = summary["configs"].get(name)
        alone_text = (
            f"alone: fit {pct(alone['ratio_wall'] - 1)} wall, {pct(alone['ratio_cpu'] - 1)} cpu" if alone else ""
        )
        print(
            f"  {name:18s}{share['hook_seconds']:8.3f} s  {100 * share['share_of_fit']:6.3f}% of the fit"
            f"  {share['per_step_ms']:7.4f} ms/step   {alone_text}"
        )
    ratios = ", ".join(f"{r:.3f}" for r in summary["pair_ratios_wall"])
    print(
        f"\nall four / none, total fit wall time: {summary['total_ratio_wall']:.3f}"
        f" (pairs: {ratios}; median {summary['median_pair_ratio_wall']:.3f}),"
        f" cpu time {summary['total_ratio_cpu']:.3f}"
    )
    own = summary["configs"]["all four"]["hook_seconds"]
    print(
        f"time inside the four callbacks' hooks: {own:.3f} s per fit, {100 * own / base['mean_wall_s']:.3f}% of"
        " the baseline fit (the part of the ratio that is not the machine's noise)"
    )
    print(f"target <= {TARGET} over {steps}-step fits: {'PASS' if summary['passed'] else 'FAIL'}")
    gcs = [f for f in fits if f["config"] == "all four"]
    if gcs:
        gc_hook = gcs[0]["hooks"]["GarbageCollector"]
        calls = gc_hook["collect_calls"]
        print(
            f"GarbageCollector at its defaults: {calls} gc.collect(1) calls per fit,"
            f" {1000 * gc_hook['collect_seconds'] / max(calls, 1):.3f} ms per call,"
            f" {1000 * gc_hook['collect_seconds'] / steps:.5f} ms per step"
        )
    mm = gcs[0]["hooks"]["MemoryMonitor"] if gcs else None
    if mm:
        print(
            f"MemoryMonitor at its defaults: {mm['readings']} readings per fit,"
            f" {1000 * mm['reading_seconds'] / max(mm['readings'], 1):.3f} ms per reading,"
            f" {1000 * mm['batch_end_s'] / steps:.5f} ms per step; one-off {sum(mm['one_off_s'].values()):.3f} s"
        )
    for name in ("CacheCleaner", "OOMReporter"):
        hook = gcs[0]["hooks"][name] if gcs else None
        if hook:
            print(
                f"{name} at its defaults: {1000 * hook['batch_end_s'] / steps:.5f} ms per step;"
                f" one-off {sum(hook['one_off_s'].values()):.3f} s"
            )
    old = summary["configs"].get("GarbageCollector(generation=2)")
    if old:
        print(
            f"GarbageCollector(generation=2) (the previous default): fit {pct(old['ratio_wall'] - 1)} wall,"
            f" {old['gc_seconds']:.2f} s in gc per fit"
        )
    audits = [f["hooks"]["MemoryAudit"] for f in fits if f["config"] == "MemoryAudit"]
    if audits:
        a = audits[0]
        ma = summary["configs"]["MemoryAudit"]
        walks = a["leak_walks_s"]
        print(f"\nMemoryAudit at its defaults (reported apart; {objects:,} token lists held):")
        print(
            f"  one-off audits: fit start {a['fit_start_audit_s']:.3f} s, first step {a['first_step_audit_s']:.3f} s"
            f" (target <= {AUDIT_TARGET_S} s each: "
            f"{'PASS' if max(a['fit_start_audit_s'], a['first_step_audit_s']) <= AUDIT_TARGET_S else 'FAIL'})"
        )
        print(
            f"  per step after the first: {1000 * a['batch_end_after_first_step_s'] / steps:.4f} ms"
            f" ({len(a['holder_samples_s'])} attribute scans, {1000 * sum(a['holder_samples_s']):.1f} ms in all;"
            f" {len(walks)} object walks, {sum(walks):.3f} s in all"
            f"{f', {1000 * statistics.mean(walks):.1f} ms each' if walks else ''})"
        )
        print(f"  fit alone vs none: {pct(ma['ratio_wall'] - 1)} wall, {pct(ma['ratio_cpu'] - 1)} cpu")
        scan = costs["audit_attribute_scan_with_data_on_module_s"]
        print(
            f"  had the LightningModule kept the token lists as an attribute: {scan:.2f} s per attribute scan,"
            f" i.e. {1000 * scan / audits[0]['leak_every_n_train_steps']:.0f} ms per step at leak_every_n_train_steps="
            f"{audits[0]['leak_every_n_train_steps']}"
        )
    print(
        "\nper call here: gc.collect(0) {gc_collect_gen0_ms:.3f} ms, gc.collect(1) {gc_collect_gen1_ms:.3f} ms,"
        " gc.collect(2) {gc_collect_gen2_ms:.1f} ms ({gc_collect_gen2_after_freeze_ms:.3f} ms after gc.freeze()),"
        " live_tensors walk {live_tensors_walk_ms:.1f} ms, empty_cache {empty_cache_ms:.3f} ms".format(**costs)
    )
    if "alloc_256MiB_after_empty_cache_ms" in costs:
        print(
            "          a 256 MiB allocation after empty_cache {alloc_256MiB_after_empty_cache_ms:.3f} ms vs from the"
            " cache {alloc_256MiB_from_cache_ms:.3f} ms".format(**costs)
        )


# ------------------------------------------------------------------------------------------------ per step, all
ALL_CALLBACKS = (
    "MemoryMonitor",
    "CacheCleaner",
    "GarbageCollector",
    "OOMReporter",
    "MemoryAudit",
    "AutoMicroBatch",
    "GradientCheckpointing",
    "AllocatorSettings",
)
ALL_HOOKS = tuple(name for name in vars(pl.Callback) if name.startswith("on_") or name in ("setup", "teardown"))


def build_all() -> list[pl.Callback]:
    """Every callback of the package at its defaults (the ones that do nothing on this device included)."""
    makers: list[Callable[[], pl.Callback]] = [
        MemoryMonitor,
        CacheCleaner,
        GarbageCollector,
        OOMReporter,
        MemoryAudit,
        AutoMicroBatch,
        GradientCheckpointing,
        AllocatorSettings,
    ]
    return [make() for make in makers]


class StepProbe(pl.Callback):
    """Process CPU time at the end of optimizer step ``warm`` and of the last step: the steady per-step cost,
    after the one-off work of fit start and the first step."""

    def __init__(self, warm: int) -> None:
        self.warm = warm
        self.marks: dict[str, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warm:
            self.marks["warm"] = time.process_time()
        self.marks["last"] = time.process_time()


def small_fit(config: str, rows: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """One fit of the small model (``--small-width``, ``--small-batch``): steady and whole-fit CPU per step, and
    the CPU inside each callback's hooks after step ``warm``."""
    steps, warm = args.small_steps, args.small_warm
    probe = StepProbe(warm)
    callbacks = build_all() if config == "all" else []
    inside: dict[str, float] = {type(cb).__name__: 0.0 for cb in callbacks}
    for cb in callbacks:

        def record(hook: str, trainer: pl.Trainer, spent: float, cpu: float, _name: str = type(cb).__name__) -> None:
            if trainer.global_step > warm:
                inside[_name] += cpu

        time_hooks(cb, pl.Callback, ALL_HOOKS, record)
    with tempfile.TemporaryDirectory() as root:
        trainer = quiet_trainer(root, [probe, *callbacks], steps, args.accelerator)
        torch.manual_seed(0)
        model, data = TokenModel(args.small_width), loader(rows, args.small_batch)
        gc.collect()
        cpu = time.process_time()
        trainer.fit(model, train_dataloaders=data)
        cpu = time.process_time() - cpu
    assert trainer.global_step == steps, (config, trainer.global_step)
    return {
        "config": config,
        "steps": steps,
        "cpu_s": cpu,
        "fit_cpu_ms_per_step": 1000 * cpu / steps,
        "steady_cpu_ms_per_step": 1000 * (probe.marks["last"] - probe.marks["warm"]) / (steps - warm),
        "hooks_cpu_ms_per_step": {name: 1000 * s / (steps - warm) for name, s in inside.items()},
    }


def per_step_section(rows: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """``none`` and ``all`` in alternating order, ``--small-rounds`` pairs; the added CPU per step of each pair."""
    fits = []
    for r in range(args.small_rounds):
        for config in ("none", "all") if r % 2 == 0 else ("all", "none"):
            fits.append(small_fit(config, rows, args) | {"round": r})
            print(
                f"small model, round {r}: {config:5s} {fits[-1]['steady_cpu_ms_per_step']:.3f} ms cpu per step"
                f" (whole fit {fits[-1]['fit_cpu_ms_per_step']:.3f})",
                flush=True,
            )
    by = {c: [f for f in fits if f["config"] == c] for c in ("none", "all")}
    added = [a["steady_cpu_ms_per_step"] - b["steady_cpu_ms_per_step"] for b, a in zip(by["none"], by["all"])]
    added_fit = [a["fit_cpu_ms_per_step"] - b["fit_cpu_ms_per_step"] for b, a in zip(by["none"], by["all"])]
    base = statistics.median(f["steady_cpu_ms_per_step"] for f in by["none"])
    median_added = statistics.median(added)
    shares = {name: statistics.median(f["hooks_cpu_ms_per_step"][name] for f in by["all"]) for name in ALL_CALLBACKS}
    return {
        "steps": args.small_steps,
        "warm_steps": args.small_warm,
        "baseline_cpu_ms_per_step": base,
        "added_cpu_ms_per_step": added,
        "median_added_cpu_ms_per_step": median_added,
        "added_whole_fit_cpu_ms_per_step": added_fit,
        "median_added_whole_fit_cpu_ms_per_step": statistics.median(added_fit),
        "hooks_cpu_ms_per_step": shares,
        "share_of_30ms_step": median_added / REFERENCE_STEP_MS,
        "passed": median_added <= STEP_TARGET_MS and median_added / REFERENCE_STEP_MS <= STEP_SHARE_TARGET,
        "fits": fits,
    }


def print_per_step(section: dict[str, Any]) -> None:
    added = ", ".join(f"{a:+.3f}" for a in section["added_cpu_ms_per_step"])
    print(
        f"\nall {len(ALL_CALLBACKS)} callbacks at their defaults on the small model, {section['steps']}-step fits"
        f" (baseline {section['baseline_cpu_ms_per_step']:.3f} ms CPU per step), after step {section['warm_steps']}:"
    )
    print(f"  CPU added per step: median {section['median_added_cpu_ms_per_step']:+.3f} ms (pairs: {added})")
    for name, ms in section["hooks_cpu_ms_per_step"].items():
        print(f"    inside {name:22s} hooks {1000 * ms:8.2f} us per step")
    print(
        "  (the rest: Lightning calling every hook of every callback, and AutoMicroBatch's batch loop, which runs"
        " outside the hooks)"
    )
    print(f"  whole fit, one-off audits included: {section['median_added_whole_fit_cpu_ms_per_step']:+.3f} ms per step")
    print(
        f"  target <= {STEP_TARGET_MS} ms and <= {100 * STEP_SHARE_TARGET:g} % of a {REFERENCE_STEP_MS:g} ms step"
        f" ({100 * section['share_of_30ms_step']:.2f} %): {'PASS' if section['passed'] else 'FAIL'}"
    )


# ------------------------------------------------------------------------------------------------ audit scan
def scan_in_this_process(extra: int, repeats: int, width: int, held: list | None = None) -> dict[str, Any]:
    """MemoryAudit's fit-start and first-step audits (thread CPU seconds, median of ``repeats`` fits) with
    ``extra`` unrelated lists held by this process (``held``: lists it holds already, topped up to ``extra``)."""
    held = [] if held is None else held
    held.extend(tokenised_dataset(max(0, extra - len(held)), 8))
    rows = tokenised_dataset(64, 8)
    starts, firsts = [], []
    for _ in range(repeats):
        audit = MemoryAudit(detect_leaks=False)
        spent: dict[str, float] = {}

        def record(hook: str, trainer: pl.Trainer, wall: float, cpu: float, _spent: dict[str, float] = spent) -> None:
            key = "fit_start" if hook == "on_fit_start" else f"{hook}@{trainer.global_step}"
            _spent[key] = _spent.get(key, 0.0) + cpu

        time_hooks(audit, pl.Callback, ("on_fit_start", "on_train_batch_end"), record)
        with tempfile.TemporaryDirectory() as root:
            trainer = quiet_trainer(root, [audit], 2)
            model = TokenModel(width)
            gc.collect()  # no garbage of the previous fit waiting: the audit then has no reason to collect
            trainer.fit(model, train_dataloaders=loader(rows, 8))
        starts.append(spent["fit_start"])
        firsts.append(spent["on_train_batch_end@1"])
    return {
        "extra_objects": extra,
        "tracked_objects": len(gc.get_objects()),
        "held": len(held),
        "fit_start_cpu_s": statistics.median(starts),
        "first_step_cpu_s": statistics.median(firsts),
    }


def scan_children(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """:func:`scan_in_this_process` at each of ``sizes``, one after the other, in a fresh process."""
    command = [sys.executable, __file__, "--scan-child", ",".join(map(str, sizes)), "--repeats", str(repeats)]
    proc = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scan_section(args: argparse.Namespace) -> dict[str, Any]:
    """The fit-start scan in fresh processes holding ``--scan-small`` and ``--scan-large`` unrelated objects (with
    ``--quick`` one process, its objects topped up from the small count to the large one)."""
    sizes = [args.scan_small, args.scan_large]
    if args.quick:
        found = scan_children(sizes, args.repeats)
    else:
        found = [run for size in sizes for run in scan_children([size], args.repeats)]
    runs = {str(size): run for size, run in zip(sizes, found)}
    small, large = runs[str(args.scan_small)], runs[str(args.scan_large)]
    ratio = large["fit_start_cpu_s"] / small["fit_start_cpu_s"]
    return {
        "runs": runs,
        "fit_start_ratio": ratio,
        "first_step_ratio": large["first_step_cpu_s"] / small["first_step_cpu_s"],
        "passed": ratio <= SCAN_RATIO_TARGET,
    }


def print_scan(section: dict[str, Any]) -> None:
    print("\nMemoryAudit's one-off audits (thread CPU, median) in fresh processes holding unrelated objects:")
    for run in section["runs"].values():
        print(
            f"  {run['extra_objects']:>10,} unrelated lists ({run['tracked_objects']:,} tracked objects):"
            f" fit start {1000 * run['fit_start_cpu_s']:.1f} ms, first step {1000 * run['first_step_cpu_s']:.1f} ms"
        )
    print(
        f"  fit start, large / small: {section['fit_start_ratio']:.2f}x"
        f" (first step {section['first_step_ratio']:.2f}x);"
        f" target <= {SCAN_RATIO_TARGET}x: {'PASS' if section['passed'] else 'FAIL'}"
    )


# ------------------------------------------------------------------------------------------------ main
def quiet() -> None:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_memopt").setLevel(logging.ERROR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--objects", type=int, default=1_000_000, help="token lists held by the process")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per list")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per fit")
    parser.add_argument("--rounds", type=int, default=4, help="none / all-four pairs, in alternating order")
    parser.add_argument("--single-rounds", type=int, default=1, help="fits of each callback alone")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads for torch (1 keeps step times steady on a shared machine)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each per-call measurement")
    parser.add_argument("--small-steps", type=int, default=1000, help="optimizer steps per small-model fit")
    parser.add_argument("--small-warm", type=int, default=20, help="steps before the steady per-step clock starts")
    parser.add_argument("--small-rounds", type=int, default=6, help="none / all pairs of small-model fits")
    parser.add_argument("--small-width", type=int, default=32, help="width of the small model")
    parser.add_argument("--small-batch", type=int, default=16, help="batch of the small model")
    parser.add_argument("--scan-small", type=int, default=10_000, help="unrelated objects of the small scan process")
    parser.add_argument("--scan-large", type=int, default=1_000_000, help="unrelated objects of the large one")
    parser.add_argument("--scan-child", default=None, help=argparse.SUPPRESS)  # "N" or "N1,N2"
    parser.add_argument("--quick", action="store_true", help="smoke run: 5,000 lists, 12-step fits, one round")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.scan_child is not None:  # one process of the scan section: its results as the last line of stdout
        quiet()
        held: list = []
        sizes = [int(size) for size in args.scan_child.split(",")]
        print(json.dumps([scan_in_this_process(size, args.repeats, 32, held) for size in sizes]))
        return
    if args.quick:
        args.objects, args.steps, args.rounds, args.single_rounds, args.repeats = 5_000, 12, 1, 1, 1
        args.small_steps, args.small_warm, args.small_rounds, args.scan_large = 40, 10, 1, 50_000
    if args.objects * args.tokens < args.steps * args.batch:
        parser.error("--objects must hold at least --steps x --batch samples (one epoch, no epoch boundaries)")
    torch.set_num_threads(args.threads)
    quiet()
    started = time.perf_counter()
    machine = machine_info(args.accelerator)
    rows = tokenised_dataset(args.objects, args.tokens)
    gc.collect()
    run_fit("none", rows, args, min(args.steps, 50))  # warm-up: imports, allocator, first-call costs

    singles = [
        "MemoryMonitor",
        "CacheCleaner",
        "GarbageCollector",
        "OOMReporter",
        "GarbageCollector(generation=2)",
        "MemoryAudit",
    ]
    fits: list[dict[str, Any]] = []
    for r in range(args.rounds):
        pair = ["none", "all four"] if r % 2 == 0 else ["all four", "none"]
        order = pair + (singles[r:] + singles[:r] if r < args.single_rounds else [])
        for config in order:
            fit = run_fit(config, rows, args, args.steps)
            fit["round"] = r
            fits.append(fit)
            print(f"round {r}: {config:32s} {fit['wall_s']:7.2f} s wall {fit['cpu_s']:7.2f} s cpu", flush=True)
    device = torch.device("cuda", 0) if args.accelerator in ("gpu", "cuda") else torch.device("cpu")
    costs = per_call_costs(device, args.repeats)
    costs["audit_attribute_scan_with_data_on_module_s"] = attribute_scan_cost(rows, args.width)
    summary = summarise(fits, args.steps)
    print_report(summary, fits, costs, args.steps, args.objects)
    per_step = per_step_section(rows, args)
    print_per_step(per_step)
    scan = scan_section(args)
    print_scan(scan)
    result = {
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "machine": machine,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "target_total_ratio": TARGET,
        "audit_target_s": AUDIT_TARGET_S,
        "summary": summary,
        "per_step_all_callbacks": per_step,
        "step_target_ms": STEP_TARGET_MS,
        "audit_scan": scan,
        "scan_ratio_target": SCAN_RATIO_TARGET,
        "per_call": costs,
        "fits": fits,
        "benchmark_seconds": time.perf_counter() - started,
    }
    print(f"benchmark took {result['benchmark_seconds']:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
