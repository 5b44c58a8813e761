"""Batching by memory vs fixed batches, side by side in one run: padding, steps, throughput and the worst real peak.

The data: ``--samples`` (4,000) source lengths drawn lognormal (median about 107 tokens, capped at 512) with targets
of 1 to 96 tokens drawn independently; the model: T5 shapes from a config (``t5-small`` widths, 2 + 2 layers, its
32,128-token vocabulary; nothing downloaded), AdamW, fp32 on the CPU. Four ways to batch the same epoch:

* ``fixed, max_length``: batches of 8 in a shuffled order, padded to (512, 96);
* ``fixed, longest``: the same batches padded to their longest sample (``DataCollatorWithPadding``'s default);
* ``length-grouped``: Hugging Face's ``group_by_length`` (mega-batches of 50 x 8 sorted by length), padded to the
  longest;
* ``token budget``: :class:`~lightning_memopt.TokenBudgetBatchSampler` with the table that
  :func:`~lightning_memopt.plan_token_budget` plans for the memory the fixed batches of 8 need (their costliest
  batch's estimated step, used as the budget's usable part);
* ``budget, 1st axis``: the same sampler sorting by the source alone (``group_size=None``).

Printed for each: steps per epoch, padding waste (padded tokens that are padding: sources, targets, both), real
tokens per CPU
second over ``--timed`` samples' worth of batches (a real training step each), and the worst batch (the one whose
estimated step needs the most, among the costliest by padded tokens) with its real CPU peak, counted by the
package's live-storage counter over two real steps. Goals: source padding <= 2 % sorted by the source alone, steps
<= 0.7x fixed and throughput >= 1.3x ``fixed, longest`` with the sampler's defaults, the worst real peak <= the
budget. The targets are drawn independently of the sources: sorted by the source alone, batches pad their targets
by about as much as fixed batches do; the default sorts runs of about 8 batches by the target too.

    python benchmarks/batching.py --out benchmarks/results/batching_cpu.json
    python benchmarks/batching.py --quick
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine_info
from lightning_memopt import TokenBudgetBatchSampler, estimate_memory, plan_token_budget
from lightning_memopt.functional.planning import LiveBytes

MAX_SOURCE, MAX_TARGET, FIXED = 512, 96, 8
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)


def draw_lengths(samples: int, seed: int = 0) -> list[tuple[int, int]]:
    """Source lengths lognormal (median about 107, capped at 512), targets uniform in 1..96."""
    rng = random.Random(seed)
    return [
        (min(MAX_SOURCE, max(1, int(rng.lognormvariate(4.67, 0.7)))), rng.randint(1, MAX_TARGET))
        for _ in range(samples)
    ]


def t5_model(quick: bool) -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    widths = {"d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16, "vocab_size": 1000} if quick else {}
    config = T5Config(
        num_layers=2, num_decoder_layers=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, **widths
    )
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config)


def make_batch(n: int, lengths: tuple[int, int]) -> dict[str, torch.Tensor]:
    source, target = lengths
    return {
        "input_ids": torch.ones(n, source, dtype=torch.long),
        "attention_mask": torch.ones(n, source, dtype=torch.long),
        "labels": torch.ones(n, target, dtype=torch.long),
    }


def loss_of(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


# ------------------------------------------------------------------------------------------- the four batchings


def fixed_batches(count: int, seed: int) -> list[list[int]]:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return [order[k : k + FIXED] for k in range(0, count, FIXED)]


def grouped_batches(lengths: Sequence[tuple[int, int]], seed: int, mega: int = 50) -> list[list[int]]:
    """Hugging Face's ``LengthGroupedSampler``: shuffle, mega-batches of ``mega x 8`` sorted by length (longest
    first), cut into batches of 8."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    size = mega * FIXED
    grouped = [sorted(order[k : k + size], key=lambda i: -lengths[i][0]) for k in range(0, len(order), size)]
    return [g[k : k + FIXED] for g in grouped for k in range(0, len(g), FIXED)]


def padded_to(batch: Sequence[int], lengths: Sequence[tuple[int, int]], pad_max: bool) -> tuple[int, int, int]:
    """(samples, source, target) the batch runs at."""
    if pad_max:
        return len(batch), MAX_SOURCE, MAX_TARGET
    return len(batch), max(lengths[i][0] for i in batch), max(lengths[i][1] for i in batch)


# ------------------------------------------------------------------------------------------- measurements


def real_peak(model: torch.nn.Module, shape: tuple[int, int, int]) -> int:
    """Bytes alive at most over two real AdamW steps of a copy of ``model`` at ``shape``."""
    copy_ = copy.deepcopy(model)
    batch = make_batch(shape[0], (shape[1], shape[2]))
    counter = LiveBytes()
    for t in [*copy_.parameters(), *copy_.buffers(), *batch.values()]:
        counter.track(t)
    with counter:
        optimizer = ADAMW(copy_.parameters())
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(copy_, batch)
            loss.backward()
            del loss
            optimizer.step()
    return counter.peak


def throughput(model: torch.nn.Module, shapes: list[tuple[int, int, int]], real_tokens: int) -> float:
    """Real tokens per CPU second over a real training step at each of ``shapes``."""
    copy_ = copy.deepcopy(model)
    optimizer = ADAMW(copy_.parameters())
    cpu = time.process_time()
    for n, source, target in shapes:
        optimizer.zero_grad(set_to_none=True)
        loss_of(copy_, make_batch(n, (source, target))).backward()
        optimizer.step()
    return real_tokens / (time.process_time() - cpu)


def estimated(model: torch.nn.Module, shape: tuple[int, int, int]) -> int:
    batch = make_batch(shape[0], (shape[1], shape[2]))
    return estimate_memory(model, batch, optimizer=ADAMW, device="cpu", loss_fn=loss_of).peak_bytes


def worst_batch(model: torch.nn.Module, shapes: list[tuple[int, int, int]], candidates: int = 4) -> tuple:
    """The shape whose estimated step needs the most among the ``candidates`` costliest by padded tokens (each axis,
    the target weighted by the vocabulary's share of the logits)."""
    distinct = sorted(set(shapes), key=lambda s: -(s[0] * s[1] + 8 * s[0] * s[2]))[:candidates]
    needs = {shape: estimated(model, shape) for shape in distinct}
    shape = max(needs, key=needs.__getitem__)
    return shape, needs[shape]


def measure(
    name: str,
    batches: list[list[int]],
    lengths: Sequence[tuple[int, int]],
    model: torch.nn.Module,
    timed: int,
    pad_max: bool = False,
) -> dict[str, Any]:
    shapes = [padded_to(b, lengths, pad_max) for b in batches]
    real = [sum(lengths[i][k] for b in batches for i in b) for k in (0, 1)]
    padded = [sum(shape[0] * shape[1 + k] for shape in shapes) for k in (0, 1)]
    take, samples = [], 0
    for b, shape in zip(batches, shapes):  # the first batches of the epoch, about `timed` samples
        if samples >= timed:
            break
        take.append((b, shape))
        samples += len(b)
    rate = throughput(model, [s for _, s in take], sum(sum(lengths[i]) for b, _ in take for i in b))
    shape, need = worst_batch(model, shapes)
    peak = real_peak(model, shape)
    row = {
        "scheme": name,
        "steps": len(batches),
        "padding_waste": 1 - sum(real) / sum(padded),
        "source_padding_waste": 1 - real[0] / padded[0],
        "target_padding_waste": 1 - real[1] / padded[1],
        "tokens_per_cpu_second": rate,
        "worst_batch": shape,
        "worst_estimated_bytes": need,
        "worst_real_peak_bytes": peak,
    }
    print(
        f"  {name:18s} {len(batches):6d} {row['source_padding_waste']:7.1%} {row['target_padding_waste']:7.1%}"
        f" {row['padding_waste']:7.1%} {rate:12.0f}   {shape!s:16s}"
        f" {peak / 2**20:9.1f} MiB (estimate {need / 2**20:.1f})",
        flush=True,
    )
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    lengths = draw_lengths(args.samples)
    model = t5_model(args.quick)
    fixed = fixed_batches(len(lengths), seed=1)
    fixed_worst, fixed_need = worst_batch(model, [padded_to(b, lengths, False) for b in fixed])
    usable = fixed_need  # the memory fixed batches of 8 need at their costliest batch
    plan = plan_token_budget(
        model, make_batch, lengths, buckets=args.buckets, budget=int(usable / 0.9), margin=0.1, device="cpu",
        optimizer=ADAMW, loss_fn=loss_of,
    )  # fmt: skip
    print(plan, flush=True)
    sampler = TokenBudgetBatchSampler(lengths, budget=plan.table, seed=1)
    first_axis = TokenBudgetBatchSampler(lengths, budget=plan.table, seed=1, group_size=None)
    print("  padding: the share of padded tokens that are padding, in the sources, the targets and both")
    head = f"{'source':>7s} {'target':>7s} {'both':>7s} {'tokens/CPU s':>12s}   {'worst batch':16s} real peak"
    print(f"  {'scheme':18s} {'steps':>6s} {head}")
    rows = [
        measure("fixed, max_length", fixed, lengths, model, args.timed, pad_max=True),
        measure("fixed, longest", fixed, lengths, model, args.timed),
        measure("length-grouped", grouped_batches(lengths, seed=1), lengths, model, args.timed),
        measure("token budget", list(sampler), lengths, model, args.timed),
        measure("budget, 1st axis", list(first_axis), lengths, model, args.timed),
    ]
    budget_row, longest_row = rows[3], rows[1]
    goals = {
        "source padding <= 2 % (sorted by the source alone)": rows[4]["source_padding_waste"] <= 0.02,
        "steps <= 0.7x fixed": budget_row["steps"] <= 0.7 * longest_row["steps"],
        "worst real peak <= budget": max(r["worst_real_peak_bytes"] for r in rows[3:]) <= plan.usable_bytes,
        "throughput >= 1.3x fixed, longest": budget_row["tokens_per_cpu_second"]
        >= 1.3 * longest_row["tokens_per_cpu_second"],
    }
    for goal, met in goals.items():
        print(f"  {goal}: {'PASS' if met else 'FAIL'}")
    return {
        "command": "python benchmarks/batching.py" + (" --quick" if args.quick else ""),
        "machine": machine_info("cpu"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "usable_bytes": plan.usable_bytes,
        "fixed_worst_batch": fixed_worst,
        "plan": {
            "table": {str(k): v for k, v in plan.table.items()},
            "estimates": plan.estimates,
            "seconds": plan.seconds,
        },
        "rows": rows,
        "goals": goals,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--timed", type=int, default=160, help="samples' worth of batches timed per scheme")
    parser.add_argument("--quick", action="store_true", help="a tiny T5 and 400 samples, for smoke tests")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.buckets, args.timed = min(args.samples, 400), min(args.buckets, 4), min(args.timed, 32)
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
