"""Step-time overhead of MemoryMonitor + CacheCleaner + GarbageCollector at their defaults.

Runs the same small model with and without the three callbacks, alternating the two configurations
in one process (A B A B ...) so that both see the same machine state, and prints the ratio of median
step times (target: <= 1.02). Also measures what one ``empty_cache()`` and one ``gc.collect()`` cost
here, since those are what the callbacks add on the steps where they fire.

    python benchmarks/callback_overhead.py                 # CPU
    python benchmarks/callback_overhead.py --accelerator gpu --out benchmarks/results/gpu/callback_overhead.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine_info  # benchmarks/_machine.py

from lightning_memopt import CacheCleaner, GarbageCollector, MemoryMonitor
from lightning_memopt.functional.memory import empty_device_cache


class StepTimer(pl.Callback):
    """Wall time from one batch start to the next: includes every callback hook and the data loading."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t: float | None = None

    def _now(self, pl_module) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = self._now(pl_module)
        if self._t is not None:
            self.times.append(now - self._t)
        self._t = now


class Empty(pl.Callback):
    """A callback that does nothing: what Lightning's hook dispatch costs per added callback."""


class MLP(pl.LightningModule):
    def __init__(self, width: int, n: int, batch: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 1))
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g))
        self.batch = batch

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch, shuffle=False)


def run_once(config: str, steps: int, args: argparse.Namespace, root: Path) -> list[float]:
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer]
    if config == "all three":
        callbacks += [MemoryMonitor(dirpath=root / "memory"), CacheCleaner(), GarbageCollector()]
    elif config == "three empty":
        callbacks += [Empty(), Empty(), Empty()]
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, max_steps=steps, logger=False, callbacks=callbacks,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(root))
    torch.manual_seed(0)
    trainer.fit(MLP(args.width, steps * args.batch, args.batch))
    return timer.times[args.warmup:]


def per_call_costs(device: torch.device, repeats: int = 20) -> dict[str, float]:
    costs = {}
    t = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect(2)
        t.append(time.perf_counter() - start)
    costs["gc_collect_gen2_ms"] = 1000 * statistics.median(t)
    t = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect(0)
        t.append(time.perf_counter() - start)
    costs["gc_collect_gen0_ms"] = 1000 * statistics.median(t)
    gc.freeze()  # what GarbageCollector(freeze_after_setup=True) does
    try:
        t = []
        for _ in range(repeats):
            start = time.perf_counter()
            gc.collect(2)
            t.append(time.perf_counter() - start)
        costs["gc_collect_gen2_after_freeze_ms"] = 1000 * statistics.median(t)
    finally:
        gc.unfreeze()
    if device.type == "cuda":
        t = []
        for _ in range(repeats):
            x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # something cached to release
            del x
            torch.cuda.synchronize()
            start = time.perf_counter()
            empty_device_cache(device)
            t.append(time.perf_counter() - start)
        costs["empty_cache_ms"] = 1000 * statistics.median(t)
        # and what it costs afterwards: the next allocation goes to the driver again
        t = []
        for _ in range(repeats):
            empty_device_cache(device)
            torch.cuda.synchronize()
            start = time.perf_counter()
            x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
            torch.cuda.synchronize()
            t.append(time.perf_counter() - start)
            del x
        cold = statistics.median(t)
        t = []
        for _ in range(repeats):
            start = time.perf_counter()
            x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
            torch.cuda.synchronize()
            t.append(time.perf_counter() - start)
            del x
        costs["alloc_256MiB_after_empty_cache_ms"] = 1000 * cold
        costs["alloc_256MiB_from_cache_ms"] = 1000 * statistics.median(t)
    else:
        costs["empty_cache_ms"] = float("nan")  # CPU: CacheCleaner does nothing
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=300, help="steps per run")
    parser.add_argument("--rounds", type=int, default=4, help="A/B pairs")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--root", default="outputs/bench_callback_overhead")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (1 keeps step times steady on a shared machine)")
    args = parser.parse_args()
    if args.accelerator == "cpu":
        torch.set_num_threads(args.threads)

    import warnings

    warnings.filterwarnings("ignore")
    root = Path(args.root)
    base: list[float] = []
    with_cb: list[float] = []
    empty: list[float] = []
    for _ in range(args.rounds):
        base += run_once("none", args.steps, args, root)
        with_cb += run_once("all three", args.steps, args, root)
        empty += run_once("three empty", args.steps, args, root)
    device = torch.device("cuda", 0) if args.accelerator in ("gpu", "cuda") else torch.device("cpu")
    result = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "machine": machine_info(args.accelerator),
        "steps_measured_each": len(base),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "width": args.width,
        "batch": args.batch,
        "median_step_ms_none": 1000 * statistics.median(base),
        "median_step_ms_all_three": 1000 * statistics.median(with_cb),
        "mean_step_ms_none": 1000 * statistics.mean(base),
        "mean_step_ms_all_three": 1000 * statistics.mean(with_cb),
        "median_step_ms_three_empty": 1000 * statistics.median(empty),
        "mean_step_ms_three_empty": 1000 * statistics.mean(empty),
        **per_call_costs(device),
    }
    result["median_ratio"] = result["median_step_ms_all_three"] / result["median_step_ms_none"]
    result["mean_ratio"] = result["mean_step_ms_all_three"] / result["mean_step_ms_none"]
    print(f"device: {result['device']}  (torch {result['torch']}, lightning {result['lightning']})")
    result["median_ratio_three_empty"] = result["median_step_ms_three_empty"] / result["median_step_ms_none"]
    print(f"{'':24s}{'none':>10s}{'all three':>11s}{'ratio':>8s}{'3 empty cbs':>13s}{'ratio':>8s}")
    for stat in ("median", "mean"):
        a, b = result[f"{stat}_step_ms_none"], result[f"{stat}_step_ms_all_three"]
        c = result[f"{stat}_step_ms_three_empty"]
        print(f"{stat + ' step time (ms)':24s}{a:10.3f}{b:11.3f}{b / a:8.3f}{c:13.3f}{c / a:8.3f}")
    print("('3 empty cbs': three callbacks that do nothing, i.e. what Lightning's hook dispatch alone costs)")
    result["median_ratio_vs_three_empty"] = result["median_step_ms_all_three"] / result["median_step_ms_three_empty"]
    print(f"the callbacks' own work (all three / 3 empty cbs, median): {result['median_ratio_vs_three_empty']:.3f}")
    print(f"target: median ratio <= 1.02 at a {result['median_step_ms_none']:.1f} ms step ->"
          f" {'met' if result['median_ratio'] <= 1.02 else 'NOT met'}")
    print("per call:  gc.collect(2) {gc_collect_gen2_ms:.2f} ms ({gc_collect_gen2_after_freeze_ms:.2f} ms after"
          " gc.freeze()), gc.collect(0) {gc_collect_gen0_ms:.3f} ms, empty_cache {empty_cache_ms:.3f} ms"
          .format(**result))
    if "alloc_256MiB_after_empty_cache_ms" in result:
        print("           a 256 MiB allocation after empty_cache {alloc_256MiB_after_empty_cache_ms:.3f} ms"
              " vs from the cache {alloc_256MiB_from_cache_ms:.3f} ms".format(**result))
    print("GarbageCollector's default (full collection every 25 steps) adds gc.collect(2)/25 per step on average;"
          " the mean ratio shows it.")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
