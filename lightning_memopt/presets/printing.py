"""How a :class:`~lightning_memopt.MemoryPreset` prints itself: every knob, its value and why it is set."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_memopt.presets.preset import MemoryPreset

__all__ = ["describe"]


def describe(preset: MemoryPreset) -> str:
    """``preset.describe()``: a table of every knob, its value and why it is set."""
    rows = [
        (
            "precision",
            preset.precision,
            "MemoryPrecision mode; 'auto' = bf16 on GPUs with native bf16, fp16+scaler on"
            " older GPUs, fp32 on CPU. Halves activation memory.",
        ),
        (
            "float32_matmul_precision",
            preset.float32_matmul_precision or "unchanged",
            "'high' lets fp32 matmuls use TF32 on Ampere+; restored after fit.",
        ),
        (
            "gradient_checkpointing",
            preset.gradient_checkpointing,
            "recompute block activations in backward: far less activation memory for ~1 extra forward.",
        ),
        (
            "checkpoint_modules",
            preset.checkpoint_modules or "HF switch / nn.Transformer layers",
            "which blocks to checkpoint.",
        ),
        ("effective_batch_size", preset.effective_batch_size, "samples per optimizer step over all ranks (kept)."),
        ("batch_size (micro)", preset.batch_size, "samples per forward pass and rank: peak memory scales with it.")
        if not preset.auto_micro_batch
        else (
            "batch_size (per device)",
            preset.batch_size,
            "samples per DataLoader batch and rank (the whole per-device batch).",
        ),
        (
            "accumulate_grad_batches",
            preset.accumulate_grad_batches,
            "effective / (micro x devices x nodes): same gradients as the full batch."
            if not preset.auto_micro_batch
            else "AutoMicroBatch accumulates the micro-batches of each batch itself.",
        ),
        ("devices x num_nodes", f"{preset.devices} x {preset.num_nodes}", "world size used in the arithmetic."),
        ("auto_micro_batch", preset.auto_micro_batch, _auto_micro_batch_reason(preset)),
        ("gradient_clip_val", preset.gradient_clip_val, "gradient norm clipping (None = off)."),
        (
            "allocator_conf",
            preset.allocator_conf or "unchanged",
            "expandable segments reduce fragmentation; applied at setup, given back at teardown.",
        ),
        ("memory_fraction", preset.memory_fraction, "cap on this process's share of device memory (None = all)."),
        (
            "cache_clean_on_phase_end",
            preset.cache_clean_on_phase_end,
            "CacheCleaner: return cached blocks between train and validation.",
        ),
        (
            "gc_every_n_steps",
            preset.gc_every_n_steps or "off",
            "GarbageCollector: collect cycles holding tensors on all ranks at the same step.",
        ),
        ("monitor", preset.monitor, "MemoryMonitor: per-phase peaks and threshold warnings."),
        (
            "dataloader",
            ", ".join(f"{k}={v}" for k, v in preset.dataloader_kwargs().items() if k != "batch_size"),
            "recommended: batches prepared ahead cost num_workers x prefetch_factor x batch of host memory"
            " (preset.dataloader_kwargs()).",
        ),
    ]
    title = f"MemoryPreset {preset.name!r}" + (f" (tier {preset.tier})" if preset.tier else "")
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(str(r[1])) for r in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{k:<{width}}  {v!s:<{vwidth}}  {why}" for k, v, why in rows]
    return "\n".join(lines)


def _auto_micro_batch_reason(preset: MemoryPreset) -> str:
    if not preset.auto_micro_batch:
        return (
            "off: an out-of-memory error ends the run (True: AutoMicroBatch splits the per-device batch and"
            " halves on out-of-memory)."
        )
    start = "the whole batch" if preset.micro_batch_size is None else f"{preset.micro_batch_size}"
    size = f" ({preset.batch_size})" if preset.batch_size is not None else ""
    return (
        f"the DataLoader yields the whole per-device batch{size} and AutoMicroBatch splits it into"
        f" micro-batches (from {start}), halving on out-of-memory with the same effective batch."
    )
