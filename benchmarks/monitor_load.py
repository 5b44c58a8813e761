"""Per-step cost of MemoryMonitor + MemoryAudit at one reading per step, over 20,000 steps, against a 30 ms step.

What a user pays is the total, not the median step, so this script times whole fits of a real ``Trainer`` with a
trivial model (one ``Linear(4, 1)``, one thread: Lightning's own loop is most of the step) and adds up every second
spent inside the two callbacks' hooks:

* configurations in one process, in alternating order, ``--rounds`` pairs: no callbacks, and
  ``MemoryMonitor(log_every_n_steps=1)`` + ``MemoryAudit(leak_every_n_train_steps=1)`` writing one log file;
* per step: the seconds inside the callbacks' ``on_train_batch_end`` hooks over all steps but the first (whose
  footprint audit is a one-off), divided by the steps; split into the CPU leak walks (held by
  ``leak_max_overhead`` to a fraction of training time, so they cost a share of the step, not a fixed time) and the
  rest (the fixed cost: one reading, one record, the cheap checks);
* one-off: setup, fit start, train start, the first step's audit and the end of training, in seconds;
* the fit wall and CPU times of both configurations, and their difference per step (the machine may be shared:
  the hook totals are the steadier figure);
* verdict: the fixed per-step cost (CPU time inside the hooks, which a shared machine does not inflate; the wall
  time is printed beside it) against ``--step-ms`` (30 ms), target under 1 % (300 us).

``--profile`` runs one more fit with the callbacks under cProfile and prints the package's functions by their own
time. ``--analyze-steps N`` also writes an N-step log with the writer's own record format and reads it back with
``lightning-memopt analyze`` in a fresh interpreter, reporting its peak RSS (``ru_maxrss``).

    python benchmarks/monitor_load.py --out benchmarks/results/monitor_load_cpu.json
    python benchmarks/monitor_load.py --quick            # 200 steps, one pair
    python benchmarks/monitor_load.py --steps 5000 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine_info, quiet_trainer, time_hooks  # benchmarks/_machine.py

from lightning_memopt import MemoryAudit, MemoryMonitor
from lightning_memopt.functional.readings.memory import read_memory
from lightning_memopt.functional.readings.monitoring import Position, position_record
from lightning_memopt.utilities.jsonl import JsonlWriter

ROOT = Path(__file__).resolve().parents[1]
TARGET_FRACTION = 0.01
ONE_OFF_HOOKS = ("setup", "on_fit_start", "on_train_start", "on_train_end", "on_fit_end", "teardown")


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class HookClock:
    """Adds up the seconds inside one callback's hooks (wrapped in place): one-off hooks, and every batch end."""

    def __init__(self, callback: pl.Callback) -> None:
        self.callback = callback
        self.one_off_s: dict[str, float] = {}
        self.first_step_s = 0.0
        self.steps_s = 0.0
        self.steps_cpu_s = 0.0  # this thread's CPU time inside the per-step hooks: what a loaded machine cannot inflate
        time_hooks(callback, pl.Callback, (*ONE_OFF_HOOKS, "on_train_batch_start", "on_train_batch_end"), self._record)

    def _record(self, hook: str, trainer: pl.Trainer, spent: float, cpu: float) -> None:
        if hook in ONE_OFF_HOOKS:
            self.one_off_s[hook] = self.one_off_s.get(hook, 0.0) + spent
        elif hook == "on_train_batch_end" and trainer.global_step == 1:
            self.first_step_s += spent
        else:
            self.steps_s += spent
            self.steps_cpu_s += cpu


class WalkClock:
    """Seconds and count of MemoryAudit's CPU object walks after the first step (its leak samples)."""

    def __init__(self, audit: MemoryAudit, trainer_ref: list[pl.Trainer]) -> None:
        sampler = audit._session.sampler
        walk = sampler.walk
        self.seconds, self.count = 0.0, 0

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return walk(*args, **kwargs)
            finally:
                if trainer_ref and trainer_ref[0].global_step > 1:
                    self.seconds += time.perf_counter() - start
                    self.count += 1

        sampler.walk = timed


def run_fit(config: str, steps: int, root: Path, profile: cProfile.Profile | None = None) -> dict[str, Any]:
    callbacks: list[pl.Callback] = []
    if config == "monitor+audit":
        callbacks = [
            MemoryMonitor(dirpath=root / "memory", log_every_n_steps=1),
            MemoryAudit(dirpath=root / "memory", leak_every_n_train_steps=1),
        ]
    clocks = [HookClock(cb) for cb in callbacks]
    trainer_ref: list[pl.Trainer] = []
    walks = [WalkClock(cb, trainer_ref) for cb in callbacks if isinstance(cb, MemoryAudit)]
    trainer = quiet_trainer(root, callbacks, steps, limit_val_batches=0)
    trainer_ref.append(trainer)
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.zeros(steps, 4)), batch_size=1)
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    try:
        trainer.fit(Tiny(), train_dataloaders=data)
    finally:
        if profile is not None:
            profile.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert trainer.global_step == steps, (config, trainer.global_step)
    log = root / "memory" / "memory_rank0.jsonl"
    result: dict[str, Any] = {"config": config, "steps": steps, "wall_s": wall, "cpu_s": cpu}
    if clocks:
        walk_s = sum(w.seconds for w in walks)
        steps_s = sum(c.steps_s for c in clocks)
        steps_cpu_s = sum(c.steps_cpu_s for c in clocks)
        result.update(
            per_step_hooks_s=steps_s,
            per_step_walks_s=walk_s,
            leak_walks=sum(w.count for w in walks),
            fixed_per_step_us=1e6 * (steps_s - walk_s) / (steps - 1),
            fixed_per_step_cpu_us=1e6 * max(steps_cpu_s - walk_s, 0.0) / (steps - 1),
            walks_per_step_us=1e6 * walk_s / (steps - 1),
            one_off_s={type(c.callback).__name__: {**c.one_off_s, "first_step": c.first_step_s} for c in clocks},
            log_lines=log.read_bytes().count(b"\n"),
            log_bytes=log.stat().st_size,
        )
    return result


def profile_fit(steps: int) -> str:
    """The package's functions by their own time during one fit with the callbacks."""
    profile = cProfile.Profile()
    with tempfile.TemporaryDirectory() as tmp:
        run_fit("monitor+audit", steps, Path(tmp), profile)
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats("lightning_memopt", 25)
    return out.getvalue()


#: Runs in the child: its peak RSS (Linux's VmHWM, reset after the imports) before and after ``analyze``. A child
#: starts with its parent's ``ru_maxrss`` (this process holds hundreds of MiB), so that figure would say nothing.
CHILD = r"""
import json, sys
from lightning_memopt.cli import main
import lightning_memopt.analysis.memory_log  # noqa: F401  (part of the baseline)


def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


with open("/proc/self/clear_refs", "w") as f:  # reset the peak: what the imports took does not count
    f.write("5")
base = peak_rss()
code = main(sys.argv[1:])
print("RESULT " + json.dumps({"exit_code": code, "baseline_rss_bytes": base, "peak_rss_bytes": peak_rss()}),
      file=sys.stderr)
"""


def analyze_long_log(steps: int) -> dict[str, Any]:
    """Write a ``steps``-step log with :class:`JsonlWriter` and :func:`position_record`; analyze it in a child."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory_rank0.jsonl"
        writer = JsonlWriter(path)
        reading = read_memory("cpu")
        start = time.perf_counter()
        writer.write(position_record(reading, 0, "train", "phase_start", Position(0, 0, None, "run")))
        for step in range(1, steps + 1):
            writer.write(position_record(reading, 0, "train", "step", Position(0, step, step - 1, "run")))
        writer.write(position_record(reading, 0, "train", "phase_end", Position(0, steps, None, "run")))
        writer.close()
        written_s = time.perf_counter() - start
        size = path.stat().st_size
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, "analyze", str(path)], capture_output=True, text=True, env=env
        )
        seconds = time.perf_counter() - start
    line = next((ln for ln in proc.stderr.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"analyze did not report its memory (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    child = json.loads(line[len("RESULT ") :])
    return {
        "steps": steps,
        "log_bytes": size,
        "write_s": written_s,
        "analyze_s": seconds,
        **child,
        "growth_rss_bytes": child["peak_rss_bytes"] - child["baseline_rss_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="optimizer steps per fit")
    parser.add_argument("--rounds", type=int, default=1, help="none / monitor+audit pairs, in alternating order")
    parser.add_argument("--step-ms", type=float, default=30.0, help="the training step the cost is compared with")
    parser.add_argument("--profile", action="store_true", help="one more fit under cProfile; print the hot spots")
    parser.add_argument("--analyze-steps", type=int, default=0, help="also analyze a log of this many steps")
    parser.add_argument("--quick", action="store_true", help="smoke run: 200 steps, one pair")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 200, 1
    if args.steps < 2:
        parser.error(f"`--steps` must be at least 2, got {args.steps}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_memopt").setLevel(logging.ERROR)

    started = time.perf_counter()
    machine = machine_info("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        run_fit("monitor+audit", min(args.steps, 200), Path(tmp) / "warm-up")  # imports, first-call costs
    fits = []
    for r in range(args.rounds):
        for config in ("none", "monitor+audit") if r % 2 == 0 else ("monitor+audit", "none"):
            with tempfile.TemporaryDirectory() as tmp:
                fit = run_fit(config, args.steps, Path(tmp))
            fit["round"] = r
            fits.append(fit)
            print(f"round {r}: {config:14s} {fit['wall_s']:7.2f} s wall {fit['cpu_s']:7.2f} s cpu", flush=True)

    base = [f for f in fits if f["config"] == "none"]
    with_cb = [f for f in fits if f["config"] == "monitor+audit"]
    mean = lambda rows, key: sum(f[key] for f in rows) / len(rows)  # noqa: E731
    fixed_us = mean(with_cb, "fixed_per_step_us")
    fixed_cpu_us = mean(with_cb, "fixed_per_step_cpu_us")
    walks_us = mean(with_cb, "walks_per_step_us")
    step_us = 1000 * args.step_ms
    summary = {
        "baseline_step_us": 1e6 * mean(base, "wall_s") / args.steps,
        "fixed_per_step_us": fixed_us,
        "fixed_per_step_cpu_us": fixed_cpu_us,
        "leak_walks_per_step_us": walks_us,
        "leak_walks_per_fit": mean(with_cb, "leak_walks"),
        "all_per_step_us": fixed_us + walks_us,
        "wall_difference_per_step_us": 1e6 * (mean(with_cb, "wall_s") - mean(base, "wall_s")) / args.steps,
        "cpu_difference_per_step_us": 1e6 * (mean(with_cb, "cpu_s") - mean(base, "cpu_s")) / args.steps,
        "fixed_fraction_of_step": fixed_cpu_us / step_us,
        "fixed_wall_fraction_of_step": fixed_us / step_us,
        "step_ms": args.step_ms,
        "target_fraction": TARGET_FRACTION,
        "passed": fixed_cpu_us / step_us < TARGET_FRACTION,
        "log_bytes_per_step": mean(with_cb, "log_bytes") / args.steps,
    }
    print(
        f"\n{args.steps}-step fits, trivial model: baseline step {summary['baseline_step_us']:.0f} us"
        f" (Lightning's loop); inside MemoryMonitor + MemoryAudit, one reading and one record a step:"
    )
    print(
        f"  fixed cost {fixed_cpu_us:.1f} us/step of CPU time = {100 * summary['fixed_fraction_of_step']:.3f}% of a"
        f" {args.step_ms:g} ms step (target < {100 * TARGET_FRACTION:g}%: {'PASS' if summary['passed'] else 'FAIL'});"
        f" {fixed_us:.1f} us/step of wall time ({100 * summary['fixed_wall_fraction_of_step']:.3f}%; above the CPU"
        " time: waiting for a core on a shared machine)"
    )
    print(
        f"  CPU leak walks: {summary['leak_walks_per_fit']:.0f} per fit, {walks_us:.1f} us/step here (held to"
        " `leak_max_overhead` = 1% of the training time: a share of the step, not a fixed cost; none on a GPU)"
    )
    print(
        f"  fit time with / without, per step: {summary['wall_difference_per_step_us']:+.1f} us wall,"
        f" {summary['cpu_difference_per_step_us']:+.1f} us cpu (one-offs included; the machine may be shared)"
    )
    for name, parts in with_cb[-1]["one_off_s"].items():
        print(f"  one-off {name}: " + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items() if v >= 0.0005))
    print(f"  log: {summary['log_bytes_per_step']:.0f} bytes a step")
    result: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "machine": machine,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "summary": summary,
        "fits": fits,
    }
    if args.analyze_steps:
        analysis = analyze_long_log(args.analyze_steps)
        result["analyze"] = analysis
        print(
            f"\nanalyze on a {analysis['steps']}-step log ({analysis['log_bytes'] / 2**20:.1f} MiB):"
            f" peak RSS {analysis['peak_rss_bytes'] / 2**20:.1f} MiB, {analysis['growth_rss_bytes'] / 2**20:.1f} MiB"
            f" above the interpreter with the command line imported; {analysis['analyze_s']:.1f} s"
        )
    if args.profile:
        text = profile_fit(args.steps)
        print("\n" + text)
    result["benchmark_seconds"] = time.perf_counter() - started
    print(
        f"benchmark took {result['benchmark_seconds']:.0f} s; peak RSS {resource.getrusage(0).ru_maxrss / 1024:.0f} MiB"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
