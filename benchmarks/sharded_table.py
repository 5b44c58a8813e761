"""Will it fit, sharded? The per-rank peak of FLAN-T5-XL and a 7B decoder on 1-8 GPUs, from the planner alone.

Each model is built from its ``transformers`` config on the ``meta`` device (no weights, no download) and estimated
with ``estimate_memory(..., device="cuda", precision="bf16-mixed", gradient_checkpointing=True, world_size=N)`` on
fake tensors: nothing of the model's size is allocated. ``world_size=1`` is the single-device estimate (what one rank
of DDP holds, without DDP's gradient buckets); N > 1 is FSDP2 with ``fully_shard`` per block and at the root,
``reshard_after_forward=True``, in a fake process group of N ranks. The optimizer is AdamW (lr 1e-4) with torch's
CUDA default (the planner models the multi-tensor ``foreach`` step on one device, and the step over DTensor shards
per tensor, as CUDA's ``foreach`` kernels run it in place).

A model fits a card when its per-rank peak is within the planner's usable memory (``plan_memory``'s rule: the card's
memory less the CUDA context, less ``plan_memory``'s default margin); the cards are the 24, 40 and 80 GB ones of
``GPU_MEMORY`` (RTX4090, A100-40GB, A100-80GB). cuBLAS workspaces are those of compute capability 8.x.

    python benchmarks/sharded_table.py           # ~3 minutes on 2 cores: sharded_table.md and .json in results/
    python benchmarks/sharded_table.py --tiny --out /tmp/table.md   # tiny configs of the same models, seconds
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import platform
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _machine import machine_info  # noqa: E402  (benchmarks/_machine.py)

from lightning_memopt.planner import GPU_MEMORY, estimate_memory, plan_memory  # noqa: E402
from lightning_memopt.planner.plan import _resolve_budget  # noqa: E402  (plan_memory's usable-memory rule)
from lightning_memopt.utilities.formatting import format_bytes  # noqa: E402

__all__ = ["CARDS", "MODELS", "ModelCase", "estimate_row", "markdown_table", "usable_bytes"]

#: The cards of the table: a label and the GPU of ``GPU_MEMORY`` whose memory it is.
CARDS = {"24 GB": "RTX4090", "40 GB": "A100-40GB", "80 GB": "A100-80GB"}
WORLD_SIZES = (1, 2, 4, 8)
TINY_WORLD_SIZES = (1, 2)
GPU = "A100-80GB"  # compute capability 8.0: the cuBLAS workspaces (8.9 of the RTX4090 has the same)
#: the optimizer of the table, by the name its column gives
OPTIMIZERS = {"AdamW": functools.partial(torch.optim.AdamW, lr=1e-4)}


@dataclass(frozen=True)
class ModelCase:
    """A model of the table: its name, how to build it on the meta device, its batch (meta tensors) in words."""

    name: str
    build: Any
    batch: Any
    batch_text: str


def _meta(tokens: int, batch: int = 1) -> torch.Tensor:
    return torch.zeros(batch, tokens, dtype=torch.long, device="meta")


def _t5(tiny: bool) -> ModelCase:
    from transformers import T5Config, T5ForConditionalGeneration

    sizes: dict[str, Any] = (
        {"d_model": 64, "d_ff": 160, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4, "d_kv": 16}
        if tiny
        else {"d_model": 2048, "d_ff": 5120, "num_layers": 24, "num_decoder_layers": 24, "num_heads": 32, "d_kv": 64}
    )
    config = T5Config(
        **sizes,
        feed_forward_proj="gated-gelu",
        vocab_size=512 if tiny else 32128,
        tie_word_embeddings=False,  # FLAN-T5 (T5 v1.1) has an untied LM head
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    src, tgt = (32, 8) if tiny else (512, 128)

    def build() -> nn.Module:
        with torch.device("meta"):
            return T5ForConditionalGeneration(config)

    return ModelCase(
        "FLAN-T5-XL (3B)" if not tiny else "FLAN-T5 (tiny)",
        build,
        lambda: {"input_ids": _meta(src), "labels": _meta(tgt)},
        f"micro-batch 1, {src} source / {tgt} target tokens (unpadded)",
    )


def _decoder(tiny: bool) -> ModelCase:
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes: dict[str, Any] = (
        {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 172}
        if tiny
        else {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008}
    )
    config = LlamaConfig(**sizes, vocab_size=512 if tiny else 32000)
    tokens = 64 if tiny else 2048

    def build() -> nn.Module:
        with torch.device("meta"):
            return LlamaForCausalLM(config)

    return ModelCase(
        "7B decoder (Llama)" if not tiny else "decoder (tiny Llama)",
        build,
        lambda: {"input_ids": _meta(tokens), "labels": _meta(tokens)},
        f"micro-batch 1, {tokens} tokens",
    )


MODELS = {"t5": _t5, "decoder": _decoder}


def usable_bytes(card: str) -> int:
    """The bytes a step may take on ``card`` (a name of ``GPU_MEMORY``), by ``plan_memory``'s rule and margin."""
    margin = inspect.signature(plan_memory).parameters["margin"].default
    return _resolve_budget(card, None, "cuda", margin, "bf16-mixed").usable


def estimate_row(case: ModelCase, world_size: int) -> dict:
    """One row: for each optimizer, the per-rank peak, where it is, its parts, and the seconds of the estimate."""
    model = case.build()
    row: dict[str, Any] = {
        "model": case.name,
        "gpus": world_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": case.batch_text,
    }
    for name, optimizer in OPTIMIZERS.items():
        started = time.perf_counter()
        try:
            est = estimate_memory(
                case.build(),
                case.batch(),
                device="cuda",
                precision="bf16-mixed",
                optimizer=optimizer,
                gradient_checkpointing=True,
                world_size=world_size,
                gpu=GPU,
            )
        except Exception as err:  # a row of the table, not a crash: reported with the error
            row[name] = {"error": f"{type(err).__name__}: {err}", "call_seconds": time.perf_counter() - started}
            continue
        row[name] = {
            "peak_bytes": est.peak_bytes,
            "peak_phase": est.peak_phase,
            "at_peak": est.at_peak,
            "parameter_bytes": est.parameter_bytes,
            "sharding": str(est.sharding) if est.sharding is not None else "none (one device; DDP per rank)",
            "estimate_seconds": est.seconds,
            "call_seconds": time.perf_counter() - started,
            "fits": {label: est.peak_bytes <= usable_bytes(card) for label, card in CARDS.items()},
        }
    return row


def _cells(result: dict) -> list[str]:
    if "error" in result:
        return ["failed", "", "", ""]
    return [format_bytes(result["peak_bytes"]), *("yes" if result["fits"][label] else "no" for label in CARDS)]


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table: model x GPUs; per-rank peak and fits on 24/40/80 GB, for each optimizer."""
    head = ["model", "GPUs"]
    for name in OPTIMIZERS:
        head += [f"per-rank peak, {name}", *(f"fits {label}" for label in CARDS)]
    head.append("estimate s")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        cells = [row["model"], str(row["gpus"])]
        for name in OPTIMIZERS:
            cells += _cells(row[name])
        cells.append(" / ".join(f"{row[name]['call_seconds']:.1f}" for name in OPTIMIZERS))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _notes(cases: list[ModelCase], world_sizes: tuple[int, ...]) -> str:
    usable = ", ".join(f"{label} ({card}): {format_bytes(usable_bytes(card))}" for label, card in CARDS.items())
    batches = "; ".join(f"{c.name}: {c.batch_text}" for c in cases)
    return (
        f"bf16-mixed, AdamW (lr 1e-4), gradient checkpointing on, {batches}; GPUs {', '.join(map(str, world_sizes))}:"
        " 1 is the single-device estimate (one DDP rank, DDP's gradient buckets not counted), more is FSDP2"
        " (fully_shard per block and at the root, reshard_after_forward=True). Usable memory (the card less the"
        f" 512 MiB CUDA context, less plan_memory's 10 % margin): {usable}. Estimated on fake tensors from a meta"
        " model (no weights allocated); estimate s: seconds of each estimate on the CPU. The sharded CUDA model is"
        " checked on a GPU by tests/test_planner_sharded_cuda.py (one real FSDP2 rank of 2 or 4 on a fake process"
        " group: within 0.5 % of the allocator's peak on an H200). The activations at the forward peak do not shrink"
        " with more GPUs: with bf16-mixed (autocast) each rank keeps a bf16 copy of every all-gathered weight until"
        " the forward ends (autocast's cache); FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16) instead of"
        " autocast avoids it (not estimated here)."
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny configs of the same models, 1 and 2 GPUs: seconds")
    parser.add_argument("--models", default="t5,decoder", help="comma-separated: t5, decoder")
    parser.add_argument("--out", default=None, help="the Markdown file (the JSON goes beside it, .json)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    out = Path(args.out or REPO / "benchmarks" / "results" / "sharded_table.md")
    world_sizes = TINY_WORLD_SIZES if args.tiny else WORLD_SIZES
    cases = [MODELS[name.strip()](args.tiny) for name in args.models.split(",")]
    t0 = time.perf_counter()
    rows = []
    for case in cases:
        for world_size in world_sizes:
            rows.append(estimate_row(case, world_size))
            print(f"  {case.name}, {world_size} GPU(s): done at {time.perf_counter() - t0:.0f} s", flush=True)
    command = " ".join(["python benchmarks/sharded_table.py", *sys.argv[1:]])
    text = f"{markdown_table(rows)}\n\n{_notes(cases, world_sizes)}\n\nMade by `{command}`.\n"
    print()
    print(text)
    result = {
        "benchmark": "sharded_table",
        "command": command,
        "tiny": args.tiny,
        "gpu_memory": {label: GPU_MEMORY[card][0] for label, card in CARDS.items()},
        "usable_bytes": {label: usable_bytes(card) for label, card in CARDS.items()},
        "python": platform.python_version(),
        "machine": machine_info("cpu"),
        "rows": rows,
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "total_seconds": time.perf_counter() - t0,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"total {result['total_seconds']:.0f} s; wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
