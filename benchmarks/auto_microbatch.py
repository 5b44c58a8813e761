"""AutoMicroBatch at a fixed micro-batch vs Lightning's own accumulation at the same micro-batch, and one recovery.

Both configurations make the same optimizer steps over the same samples: ours gets batches of ``--batch`` and splits
them into micro-batches of ``--micro``; Lightning gets batches of ``--micro`` with ``accumulate_grad_batches =
batch / micro``. They alternate in one process (A B A B ...), and the ratio of total wall time and of total process
CPU time is printed (target: <= 1.03). A third run starts at the whole batch under a simulated memory budget of
``--micro`` samples and measures what one recovery costs: seconds from the out-of-memory error to the end of that
optimizer step, next to a normal step.

The snapshot a retry restores from (random states, metric states and ``self.log`` results, changed buffers) is
taken before every batch that may be retried; its cost is measured without a Trainer on five modules (this MLP, a
BatchNorm CNN, the CNN with a 64 MiB constant buffer, an MLP with torchmetrics metrics and 20 logged results, a
12-layer BERT when transformers is installed): time to take it and learn from it, and bytes copied, on the first
batch (every buffer copied, the module walked) and after it.

    python benchmarks/auto_microbatch.py --out benchmarks/results/auto_microbatch_cpu.json
    python benchmarks/auto_microbatch.py --quick
    python benchmarks/auto_microbatch.py --snapshot-only
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
from lightning_memopt.functional.retry_state import BufferKeeper, RetrySnapshot, find_parts


def _cnn(big_buffer_mib: int = 0) -> nn.Module:
    layers: list[nn.Module] = []
    for c_in, c_out in ((3, 32), (32, 64), (64, 64), (64, 128)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
    model = nn.Sequential(*layers)
    if big_buffer_mib:
        model.register_buffer("table", torch.zeros(big_buffer_mib * 2**20 // 4))  # a constant lookup table
    return model


class _WithMetrics(nn.Module):
    def __init__(self, results: dict) -> None:
        import torchmetrics

        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.Linear(64, 10))
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10)
        self.f1 = torchmetrics.classification.MulticlassF1Score(num_classes=10, average="macro")
        self.results = results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        target = torch.randint(0, 10, (x.shape[0],))
        self.accuracy(logits, target)
        self.f1(logits, target)
        for metric in self.results.values():
            metric.update(logits.mean())
        return logits


def _with_metrics() -> tuple[nn.Module, dict]:
    import torchmetrics

    results = {f"training_step.value_{i}": torchmetrics.MeanMetric() for i in range(20)}
    return _WithMetrics(results), results


def snapshot_cost(repeats: int) -> list[dict]:
    """Seconds and bytes of the retry snapshot per batch, first batch and later batches, on four modules."""
    mlp = Model(512, 256, 256).net
    cnn, big = _cnn(), _cnn(64)
    metrics_model, results = _with_metrics()
    cases = [
        ("MLP 512 (no buffers)", mlp, None, torch.randn(8, 512)),
        ("CNN with BatchNorm", cnn, None, torch.randn(2, 3, 8, 8)),
        ("CNN + 64 MiB constant buffer", big, None, torch.randn(2, 3, 8, 8)),
        ("MLP + 2 torchmetrics + 20 logged", metrics_model, results, torch.randn(8, 64)),
    ]
    try:
        import transformers

        config = transformers.BertConfig(
            num_hidden_layers=12, hidden_size=64, num_attention_heads=4, intermediate_size=128
        )
        bert = transformers.BertModel(config)
        cases.append(("BERT structure, 12 layers, 231 modules", bert, None, torch.randint(0, 100, (2, 16))))
    except ImportError:
        pass
    rows = []
    for name, module, logged, x in cases:
        keeper, parts = BufferKeeper(), None
        timings, sizes = [], []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            snapshot = RetrySnapshot(module, logged, buffers=keeper, parts=parts)
            taken = time.perf_counter() - start
            module(x)  # the batch: BatchNorm statistics change
            start = time.perf_counter()
            snapshot.succeeded()
            parts = parts or find_parts(module)  # as AutoMicroBatch does: found again after the first batch only
            timings.append(taken + time.perf_counter() - start)
            sizes.append(snapshot.tensor_bytes())
        snapshot = RetrySnapshot(module, logged, buffers=keeper, parts=parts)
        module(x)
        start = time.perf_counter()
        snapshot.restore()
        restore = time.perf_counter() - start
        later = sorted(timings[1:])[len(timings[1:]) // 2]
        rows.append(
            {
                "module": name,
                "first_batch_seconds": timings[0],
                "first_batch_bytes": sizes[0],
                "later_batch_seconds_median": later,
                "later_batch_bytes": sizes[-1],
                "restore_seconds": restore,
            }
        )
        print(
            f"  snapshot, {name:38s}: first batch {timings[0] * 1e6:9.0f} us {sizes[0]:>10,d} B;"
            f" later {later * 1e6:7.0f} us {sizes[-1]:>8,d} B; restore {restore * 1e6:7.0f} us",
            flush=True,
        )
    return rows


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
    parser.add_argument("--snapshot-only", action="store_true", help="only the retry snapshot's cost")
    args = parser.parse_args()
    if args.quick:
        args.width, args.batch, args.micro, args.steps, args.repeats = 64, 32, 8, 4, 1
    torch.set_num_threads(1)
    snapshots = snapshot_cost(5 if args.quick else 50)
    if args.snapshot_only:
        return 0
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
        "snapshot": snapshots,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
