"""A real CUDA out-of-memory error in a small transformer, reported by OOMReporter.

A 8-layer transformer language model trains on batches of short sequences (512 tokens) for three steps;
the fourth batch holds sequences long enough that the activations no longer fit on the GPU, as happens
with a long-tailed length distribution. OOMReporter writes ``oom_report_rank0.{json,md}`` and the
allocator snapshot to ``--out``; this script then checks the report and the snapshot and prints a summary.

Run from the repository root on a machine with a CUDA GPU::

    PYTHONPATH=$PWD python3 benchmarks/oom_demo.py --out benchmarks/results/gpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import sys
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_memopt import OOMReporter

VOCAB, D_MODEL, LAYERS, HEADS, BATCH, SHORT = 8192, 1024, 8, 16, 16, 512
BYTES_PER_TOKEN_ESTIMATE = 700_000  # fp32 activations kept for backward, all layers, measured roughly


class LengthTailDataset(Dataset):
    """Each item is a whole batch of token ids: short sequences, then one batch of very long ones."""

    def __init__(self, long_len: int, num_batches: int = 5, long_at: int = 3) -> None:
        self.long_len, self.num_batches, self.long_at = long_len, num_batches, long_at

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, idx: int) -> torch.Tensor:
        length = self.long_len if idx == self.long_at else SHORT
        g = torch.Generator().manual_seed(idx)
        return torch.randint(0, VOCAB, (BATCH, length + 1), generator=g)


class TinyLM(pl.LightningModule):
    def __init__(self, long_len: int) -> None:
        super().__init__()
        self.long_len = long_len
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        hidden = self.blocks(self.embed(inputs), is_causal=False)
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(LengthTailDataset(self.long_len), batch_size=None, shuffle=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--max-entries", type=int, default=20_000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("oom_demo: needs a CUDA GPU", file=sys.stderr)
        return 2
    total = torch.cuda.get_device_properties(0).total_memory
    long_len = math.ceil(3 * total / (BYTES_PER_TOKEN_ESTIMATE * BATCH))
    os.makedirs(args.out, exist_ok=True)

    reporter = OOMReporter(dirpath=args.out, record_history=True, max_entries=args.max_entries, max_listed=15)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[reporter],
        default_root_dir=args.out,
    )
    start = time.perf_counter()
    error = None
    try:
        trainer.fit(TinyLM(long_len))
    except torch.OutOfMemoryError as err:
        error = err
    elapsed = time.perf_counter() - start

    summary: dict = {
        "device": torch.cuda.get_device_name(0),
        "device_total_bytes": total,
        "long_seq_len": long_len,
        "oom_raised": error is not None,
        "seconds": round(elapsed, 1),
    }
    report_path = os.path.join(args.out, "oom_report_rank0.json")
    ok = error is not None and os.path.exists(report_path)
    if os.path.exists(report_path):
        with open(report_path) as f:
            report = json.load(f)
        summary.update(
            stage=report["when"]["stage"],
            global_step=report["when"]["global_step"],
            batch_shapes=[t["shape"] for t in report["batch"]["tensors"]],
            allocated_bytes=report["memory"]["allocated_bytes"],
            reserved_bytes=report["memory"]["reserved_bytes"],
            requested_bytes=report["memory"].get("message_requested_bytes"),
            bytes_by_category=report["holders"].get("bytes_by_category"),
            unexplained_bytes=report["holders"].get("unexplained_bytes"),
            suggestions=[s["action"] for s in report["suggestions"]],
            report_errors=report["report_errors"],
        )
        snap = report["snapshot"].get("path")
        if snap and os.path.exists(snap):
            from torch.cuda import _memory_viz

            with open(snap, "rb") as f:
                data = pickle.load(f)
            summary["snapshot_bytes"] = os.path.getsize(snap)
            summary["snapshot_viewer_html_chars"] = len(_memory_viz.trace_plot(data))
        else:
            ok = False
            summary["snapshot_missing"] = report["snapshot"]
        ok = ok and not report["report_errors"]
    with open(os.path.join(args.out, "oom_demo_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
