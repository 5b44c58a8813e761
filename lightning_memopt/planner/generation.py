"""Will ``generate`` fit? The peak memory of Hugging Face generation at a length, predicted on fake tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_memopt.planner.estimate import MemoryEstimate, estimate_memory
from lightning_memopt.utilities.checks import check_positive_int

__all__ = ["estimate_generation"]


def _check(model: Any, batch: Any, generate_kwargs: Any) -> None:
    if not callable(getattr(model, "generate", None)):
        raise ValueError(
            f"`model` must have a Hugging Face `generate` method, got {type(model).__name__}. Pass the model that"
            " generates (e.g. `module.model` of a LightningModule that wraps it)."
        )
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), Tensor):
        raise ValueError(
            "`batch` must be a dict with the prompt's `input_ids` (and its `attention_mask`), as `generate(**batch)`"
            f" takes it, got {type(batch).__name__}."
        )
    taken = {"max_new_tokens", "num_beams", "eos_token_id", "max_length"} & set(generate_kwargs)
    if taken:
        raise ValueError(
            f"`generate_kwargs` sets {sorted(taken)}, which `estimate_generation` sets itself. Pass `max_new_tokens=`"
            " and `num_beams=` to it; every sequence runs to `max_new_tokens` (no end-of-sequence stop)."
        )


def _with_values(name: str, value: Any) -> Any:
    """A prompt tensor on the meta device as a real one of its shape (``generate`` checks the ids' values, which do
    not change its memory): zeros, ones for an attention mask (no padding)."""
    if not isinstance(value, Tensor) or value.device.type != "meta" or value.is_floating_point():
        return value
    fill = torch.ones if "mask" in name else torch.zeros
    return fill(value.shape, dtype=value.dtype)


def estimate_generation(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    max_new_tokens: int,
    num_beams: int = 1,
    precision: str = "32-true",
    device: str = "cuda",
    gpu: str | tuple[int, int] | None = None,
    fake: bool = True,
    generate_kwargs: Mapping[str, Any] | None = None,
) -> MemoryEstimate:
    """Predict the peak memory of ``model.generate(**batch, max_new_tokens=...)``, without a GPU.

    Runs Hugging Face's ``generate`` on a fake twin, as :func:`~lightning_memopt.estimate_memory` runs a step
    (``stage="predict"``: eval and inference mode, no gradients): the prompt's forward, then one forward per new token
    with the KV cache growing to prompt + ``max_new_tokens`` tokens. Every sequence runs to ``max_new_tokens``
    (the end-of-sequence stop is switched off: the longest generation is the one that must fit). Beam search stops on
    scores a fake tensor does not have: ``num_beams`` > 1 is estimated as ``num_beams`` times the batch decoded
    greedily, which holds the same KV cache and logits (a small GPT-2 with 3 beams: within 0.3 % of the real CPU
    peak); beam search's own token and score tensors are not counted. Each new token is a forward on fake tensors:
    the estimate takes longer the more tokens are generated (a 2-layer GPT-2: about 25 ms a token on a CPU). A
    prompt given on the meta device is given values (token ids 0, an attention mask of ones), which ``generate``
    checks and which do not change its memory.

    Args:
        model: a Hugging Face model with ``generate`` (built on the meta device or on the CPU).
        batch: ``{"input_ids": ..., "attention_mask": ...}``, the prompt (CPU or meta tensors).
        max_new_tokens: tokens generated after the prompt.
        num_beams: beams of beam search (1: greedy decoding or sampling).
        precision: as for :func:`~lightning_memopt.estimate_memory` (``"bf16-true"`` for a model loaded in bf16).
        device: as for :func:`~lightning_memopt.estimate_memory`.
        gpu: as for :func:`~lightning_memopt.estimate_memory`.
        fake: as for :func:`~lightning_memopt.estimate_memory` (``False``: a real CPU ``generate``).
        generate_kwargs: more arguments for ``generate`` (``do_sample``, ``use_cache``, ...).

    Returns:
        a :class:`~lightning_memopt.MemoryEstimate` with ``stage="generate"``.

    Raises:
        ValueError: ``model`` has no ``generate``, ``batch`` has no ``input_ids``, or ``generate_kwargs`` sets what
            the function sets.

    Examples:
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=512)
        >>> with torch.device("meta"):
        ...     gpt2 = transformers.GPT2LMHeadModel(config)
        >>> prompt = {"input_ids": torch.empty(8, 4, dtype=torch.long, device="meta")}
        >>> short, long = (estimate_generation(gpt2, prompt, max_new_tokens=n, device="cpu") for n in (4, 96))
        >>> cache_growth = 2 * 2 * 8 * 92 * 64 * 4  # keys and values, 2 layers, 8 sequences, 92 tokens more
        >>> long.peak_bytes - short.peak_bytes >= cache_growth, long.stage
        (True, 'generate')
    """
    generate_kwargs = dict(generate_kwargs or {})
    _check(model, batch, generate_kwargs)
    check_positive_int("max_new_tokens", max_new_tokens)
    check_positive_int("num_beams", num_beams, hint="1 decodes greedily (or samples).")
    # no end-of-sequence stop; no padding token, whose checks read the prompt's values (a right-padding warning)
    arguments = {"pad_token_id": None, **generate_kwargs}
    arguments.update(max_new_tokens=max_new_tokens, num_beams=1, eos_token_id=None)
    prompt = {k: _with_values(k, v) for k, v in batch.items()}

    def per_beam(t: Any) -> Any:
        if isinstance(t, Tensor):
            return t.repeat_interleave(num_beams, 0)
        return t

    sequences = tree_map(per_beam, prompt)

    def generate(twin: nn.Module, prompt: dict[str, Any]) -> Any:
        return cast(Any, twin).generate(**prompt, **arguments)

    estimate = estimate_memory(
        model, sequences, precision=precision, device=device, gpu=gpu, fake=fake, steps=1, stage="predict",
        loss_fn=generate,
    )  # fmt: skip
    shape = tuple(batch["input_ids"].shape)
    said = [
        f"Hugging Face generate: a prompt of {shape[-1]} tokens, {max_new_tokens} new tokens, every sequence to"
        " the end (no end-of-sequence stop); the KV cache and the logits of each step counted"
    ]
    if num_beams > 1:
        said.append(
            f"{num_beams} beams estimated as {num_beams} x the batch ({shape[0] * num_beams} sequences) decoded"
            " greedily: beam search's own token and score tensors not counted"
        )
    kept = [a for a in estimate.assumptions if not a.startswith("trainer.")]
    return dataclasses.replace(estimate, stage="generate", assumptions=(*said, *kept))
