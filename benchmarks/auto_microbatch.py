"""AutoMicroBatch at a fixed micro-batch vs Lightning's own accumulation at the same micro-batch, and one recovery.

Both configurations make the same optimizer steps over the same samples: ours gets batches of ``--batch`` and splits
them into micro-batches of ``--micro``; Lightning gets batches of ``--micro`` with ``accumulate_grad_batches =
batch / micro``. They alternate in one process (A B A B ...), and the ratio of total wall time and of total process
CPU time is printed (target: <= 1.03). A third run starts at the whole batch under a simulated memory budget of
``--micro`` samples and measures what one recovery costs: seconds from the out-of-memory error to the end of that
optimizer step, next to a normal step.

    python benchmarks/auto_microbatch.py --out benchmarks/results/auto_microbatch_cpu.json
    python benchmarks/auto_microbatch.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine_info  # benchmarks/_machine.py

from lightning_memopt import AutoMicroBatch


class Model(pl.LightningModule):
    def __init__(self, width: int, batch: int, n: int, budget: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
        )
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g))
        self.batch, self.budget = batch, budget
        self.oom_at: list[float] = []
        self.step_ends: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.budget is not None and x.shape[0] > self.budget:
            self.oom_at.append(time.perf_counter())
            raise torch.OutOfMemoryError(f"simulated: {x.shape[0]} samples over a budget of {self.budget}")
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_ends.append(time.perf_counter())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch, shuffle=False)


def fit(model: Model, steps: int, root: Path, accumulate: int = 1, callbacks: list | None = None) -> tuple:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=callbacks or [],
    )
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit(model)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a few seconds, for smoke tests")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.width, args.batch, args.micro, args.steps, args.repeats = 64, 32, 8, 4, 1
    torch.set_num_threads(1)
    root = Path("/tmp/auto_microbatch_bench")
    n = args.batch * args.steps
    accumulate = args.batch // args.micro
    totals = {"ours": [0.0, 0.0], "lightning": [0.0, 0.0]}
    runs: list[dict] = []
    fit(Model(args.width, args.micro, n), 2, root, accumulate)  # warm-up: imports, first-call costs
    for r in range(args.repeats):
        order = ("ours", "lightning") if r % 2 == 0 else ("lightning", "ours")
        for name in order:
            if name == "ours":
                wall, cpu = fit(
                    Model(args.width, args.batch, n),
                    args.steps,
                    root,
                    callbacks=[AutoMicroBatch(micro_batch_size=args.micro)],
                )
            else:
                wall, cpu = fit(Model(args.width, args.micro, n), args.steps, root, accumulate)
            totals[name][0] += wall
            totals[name][1] += cpu
            runs.append({"config": name, "wall_seconds": wall, "cpu_seconds": cpu})
            print(f"  {name:9s}: {wall:.3f} s wall, {cpu:.3f} s CPU", flush=True)
    wall_ratio = totals["ours"][0] / totals["lightning"][0]
    cpu_ratio = totals["ours"][1] / totals["lightning"][1]
    print(
        f"AutoMicroBatch / Lightning accumulation, {args.repeats} x {args.steps} steps of {args.batch} samples in"
        f" micro-batches of {args.micro}: wall {wall_ratio:.3f}x, CPU {cpu_ratio:.3f}x"
        f" -> {'PASS' if wall_ratio <= 1.03 and cpu_ratio <= 1.03 else 'FAIL'} (target <= 1.03)"
    )

    # one recovery: start at the whole batch under a budget of `micro` samples (halvings down to it)
    model = Model(args.width, args.batch, n, budget=args.micro)
    callback = AutoMicroBatch()
    fit(model, 3, root, callbacks=[callback])
    first_oom, first_end = model.oom_at[0], model.step_ends[0]
    recovery = first_end - first_oom
    normal = model.step_ends[2] - model.step_ends[1]
    print(
        f"one recovery ({len(model.oom_at)} out-of-memory errors, micro-batch {args.batch} -> "
        f"{callback.micro_batch_size}): {recovery:.3f} s from the first error to the end of that step;"
        f" a normal step {normal:.3f} s"
    )
    result = {
        "command": "python benchmarks/auto_microbatch.py" + (" --quick" if args.quick else ""),
        "machine": machine_info("cpu"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "ratio_wall": wall_ratio,
        "ratio_cpu": cpu_ratio,
        "target": 1.03,
        "runs": runs,
        "recovery": {
            "seconds_from_first_oom_to_step_end": recovery,
            "normal_step_seconds": normal,
            "oom_errors": len(model.oom_at),
            "micro_batch_size": callback.micro_batch_size,
        },
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
