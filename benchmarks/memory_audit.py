"""Cost of MemoryAudit: at fit start and per training step, side by side with no audit, as ratios.

Runs the same small fit (CPU by default, CUDA with ``--device cuda``) without the audit and with it, in
alternation, and times the audit's own hooks directly. Also times one ``live_tensors`` walk (the
``gc.get_objects()`` scan behind the fit-start audit and the CPU leak samples) in a process padded with
``--extra-objects`` Python objects, because that walk grows with the process.

    python benchmarks/memory_audit.py                     # CPU, writes benchmarks/results/memory_audit_cpu.json
    python benchmarks/memory_audit.py --device cuda --out benchmarks/results/gpu/memory_audit_cuda.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine_info  # benchmarks/_machine.py

from lightning_memopt import MemoryAudit
from lightning_memopt.functional.footprint import live_tensors


class Net(pl.LightningModule):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        dims = [64] + [hidden] * layers
        blocks: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*blocks, nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.body(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class HookTimer(pl.Callback):
    """Wraps another callback's hooks and adds up the time spent in them."""

    def __init__(self, inner: pl.Callback) -> None:
        self.inner = inner
        self.fit_start_s = 0.0
        self.first_step_s = 0.0  # the one-off audit after the first optimizer step
        self.batch_end_s = 0.0  # every other step: interval checks and leak samples

    def on_fit_start(self, trainer, pl_module):
        t = time.perf_counter()
        self.inner.on_fit_start(trainer, pl_module)
        self.fit_start_s += time.perf_counter() - t

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        t = time.perf_counter()
        self.inner.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == 1:
            self.first_step_s += time.perf_counter() - t
        else:
            self.batch_end_s += time.perf_counter() - t

    def setup(self, trainer, pl_module, stage):
        self.inner.setup(trainer, pl_module, stage)

    def teardown(self, trainer, pl_module, stage):
        self.inner.teardown(trainer, pl_module, stage)


def fit_once(args, root: Path, audit: MemoryAudit | None) -> dict:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.batch_size * args.steps, 64))
    loader = DataLoader(data, batch_size=args.batch_size)
    model = Net(args.hidden, args.layers)
    timer = HookTimer(audit) if audit is not None else None
    trainer = pl.Trainer(
        default_root_dir=str(root),
        accelerator=args.device,
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer] if timer else [],
    )
    t = time.perf_counter()
    trainer.fit(model, loader)
    if args.device == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t
    out = {"fit_s": total}
    if timer is not None:
        out.update(
            fit_start_hook_s=timer.fit_start_s,
            first_step_hook_s=timer.first_step_s,
            batch_end_hooks_s=timer.batch_end_s,
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--extra-objects", type=int, default=2_000_000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or f"benchmarks/results/memory_audit_{args.device}.json")
    root = Path(tempfile.mkdtemp(prefix="memopt-audit-bench-"))  # trainer output, not a result
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    fit_once(args, root, None)  # warm-up (imports, first-call costs)
    base, audited = [], []
    for _ in range(args.repeats):  # alternate so that machine load hits both alike
        base.append(fit_once(args, root, None))
        audited.append(fit_once(args, root, MemoryAudit(dirpath=root / "memory")))
    base_fit = statistics.median(r["fit_s"] for r in base)
    audit_fit = statistics.median(r["fit_s"] for r in audited)
    fit_start = statistics.median(r["fit_start_hook_s"] for r in audited)
    first_step = statistics.median(r["first_step_hook_s"] for r in audited)
    per_step_hooks = statistics.median(r["batch_end_hooks_s"] for r in audited) / (args.steps - 1)
    base_step = base_fit / args.steps

    # the gc walk in a process with many objects
    n_before = len(gc.get_objects())
    walks = {}
    for label, extra in (("process", 0), ("padded", args.extra_objects)):
        padding = [[i] for i in range(extra)]  # lists are tracked by the collector (empty dicts are not)
        t = time.perf_counter()
        live_tensors(args.device)
        walks[label] = {"objects": len(gc.get_objects()), "live_tensors_s": time.perf_counter() - t}
        del padding
    result = {
        "benchmark": "memory_audit",
        "device": args.device,
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "python": platform.python_version(),
        "machine": machine_info(args.device),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "fit_s_no_audit": base_fit,
        "fit_s_audit": audit_fit,
        "fit_time_ratio": audit_fit / base_fit,
        "fit_start_audit_s": fit_start,
        "fit_start_audit_over_step": fit_start / base_step,
        "first_step_audit_s": first_step,
        "first_step_audit_over_step": first_step / base_step,
        "per_step_audit_hooks_s": per_step_hooks,
        "per_step_audit_over_step": per_step_hooks / base_step,
        "step_s_no_audit": base_step,
        "objects_before_padding": n_before,
        "gc_walk": walks,
        "raw": {"no_audit": base, "audit": audited},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"MemoryAudit cost on {args.device}, {args.steps} steps, median of {args.repeats} alternated runs:")
    print(f"  fit time with / without audit:         {result['fit_time_ratio']:.3f}x")
    print(
        f"  one-off audits: fit start {fit_start * 1e3:.1f} ms = {result['fit_start_audit_over_step']:.1f} steps,"
        f" after the first step {first_step * 1e3:.1f} ms = {result['first_step_audit_over_step']:.1f} steps"
    )
    print(
        f"  per-step audit hooks over the other steps (leak samples included): {per_step_hooks * 1e6:.1f} us ="
        f" {result['per_step_audit_over_step']:.2%} of a step (CPU budget: leak_max_overhead = 1 %)"
    )
    for label, w in walks.items():
        print(f"  live_tensors walk over {w['objects']:,} objects ({label}): {w['live_tensors_s'] * 1e3:.1f} ms")
    print(f"  wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
