"""The planner's speed goals, for ``benchmarks/planner.py --speed-only``: CPU seconds of what users wait for.

* a BERT-base estimate (Hugging Face ``BertForSequenceClassification``, default config, built on the meta device;
  batch 32 x 512 tokens, a CUDA target at 32-true): the mean CPU seconds of 3 estimates after one warm-up (goal < 1);
* a plan for a Llama-2-7B shape (32 layers, width 4096, 2048 tokens) on 8 x A100-80GB with an effective batch of 64
  (``plan_memory``: DDP ruled out by its model states, FSDP2 searched): its CPU seconds (goal < 15);
* a 16-bucket token-budget table for the T5-small shape of ``benchmarks/batching.py`` (2 + 2 layers, 4,000 lengths,
  1.14 GiB usable, a CPU target): the CPU seconds of ``plan_token_budget`` (goal < 20).

CPU seconds are ``time.process_time()`` of this process (one torch thread): the sum over cores, what a loaded CI
machine or a laptop pays. The goals are the estimator issue's; a FAIL line says by how much.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GOALS = {"bert_base_estimate": 1.0, "llama_7b_plan": 15.0, "t5_small_table": 20.0}


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.long, device="meta")


def bert_base_estimate(repeats: int = 3) -> dict[str, Any]:
    import transformers

    from lightning_memopt import estimate_memory

    with torch.device("meta"):
        model = transformers.BertForSequenceClassification(transformers.BertConfig())
    batch = {"input_ids": _meta(32, 512), "attention_mask": _meta(32, 512), "labels": _meta(32)}
    estimate_memory(model, batch)  # warm-up: imports and first-call caches
    started = time.process_time()
    for _ in range(repeats):
        estimate = estimate_memory(model, batch)
    seconds = (time.process_time() - started) / repeats
    return {"cpu_seconds": seconds, "peak_bytes": estimate.peak_bytes, "repeats": repeats}


def llama_7b_plan() -> dict[str, Any]:
    import transformers

    from lightning_memopt import plan_memory

    config = transformers.LlamaConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008, vocab_size=32000
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)

    def batch_fn(size: int) -> dict[str, torch.Tensor]:
        tokens = _meta(size, 2048)
        return {"input_ids": tokens, "labels": tokens}

    started = time.process_time()
    plan = plan_memory(model, batch_fn, effective_batch_size=64, budget="A100-80GB", devices=8, progress=lambda _: None)
    seconds = time.process_time() - started
    return {
        "cpu_seconds": seconds,
        "estimates": len(plan.trials),
        "strategy": plan.strategy,
        "micro_batch_size": plan.micro_batch_size,
        "gradient_checkpointing": plan.gradient_checkpointing,
    }


def t5_small_table() -> dict[str, Any]:
    from benchmarks.batching import ADAMW, draw_lengths, loss_of, make_batch, t5_model
    from lightning_memopt import plan_token_budget

    model, lengths = t5_model(quick=False), draw_lengths(4000)
    usable = int(1.14 * 2**30)
    started = time.process_time()
    plan = plan_token_budget(
        model, make_batch, lengths, buckets=16, budget=int(usable / 0.9), margin=0.1, device="cpu", optimizer=ADAMW,
        loss_fn=loss_of,
    )  # fmt: skip
    seconds = time.process_time() - started
    return {"cpu_seconds": seconds, "estimates": plan.estimates, "buckets": len(plan.table)}


def run() -> dict[str, Any]:
    """Every case, printed with its goal; the JSON rows."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rows: dict[str, Any] = {}
    for name, case in (("bert_base_estimate", bert_base_estimate), ("llama_7b_plan", llama_7b_plan),
                       ("t5_small_table", t5_small_table)):  # fmt: skip
        row = case()
        row["goal_cpu_seconds"] = GOALS[name]
        row["pass"] = row["cpu_seconds"] < GOALS[name]
        rows[name] = row
        extra = {k: v for k, v in row.items() if k not in ("cpu_seconds", "goal_cpu_seconds", "pass")}
        print(
            f"{'PASS' if row['pass'] else 'FAIL'}  {name}: {row['cpu_seconds']:.2f} CPU s (goal < {GOALS[name]:g});"
            f" {extra}",
            flush=True,
        )
    return rows
