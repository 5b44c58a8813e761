"""``estimate_generation``: Hugging Face's ``generate`` at a length, against real CPU ``generate`` runs counted by the
same live-storage counter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memopt import estimate_generation
from lightning_memopt.functional.planning import LiveBytes

transformers = pytest.importorskip("transformers")


def _gpt2(vocab: int = 500) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=256, bos_token_id=0, eos_token_id=1
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _t5() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=200, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config).eval()


def _prompt(batch: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(2, 200, (batch, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones(batch, length, dtype=torch.long)}


def _real_generate_peak(model, prompt, **kwargs) -> int:
    """A real CPU ``generate`` to the last token (no end-of-sequence stop), in inference mode as Lightning predicts."""
    counter = LiveBytes()
    for t in [*model.parameters(), *model.buffers(), *prompt.values()]:
        counter.track(t)
    with counter, torch.inference_mode():
        out = model.generate(**prompt, eos_token_id=None, pad_token_id=None, **kwargs)
    assert out.shape[-1] >= kwargs["max_new_tokens"]  # it ran to the end
    return counter.peak


@pytest.mark.parametrize(
    ("build", "beams"), [(_gpt2, 1), (_gpt2, 3), (_t5, 1)], ids=["gpt2-greedy", "gpt2-3-beams", "t5-greedy"]
)
def test_a_generation_estimate_is_within_5_percent_of_a_real_cpu_generate(build, beams):
    model, prompt = build(), _prompt(4, 24)
    est = estimate_generation(model, prompt, max_new_tokens=32, num_beams=beams, device="cpu")
    real = _real_generate_peak(model, prompt, max_new_tokens=32, num_beams=beams, do_sample=False)
    assert est.peak_bytes == pytest.approx(real, rel=0.05)
    assert est.stage == "generate" and str(est).startswith("Estimated peak memory of a `generate` call on cpu")
    assert est.assumptions[0].startswith("Hugging Face generate: a prompt of 24 tokens, 32 new tokens")
    assert any("3 beams estimated as 3 x the batch (12 sequences)" in a for a in est.assumptions) == (beams == 3)
    assert not any(a.startswith("trainer.") for a in est.assumptions)


def test_the_kv_cache_grows_with_the_new_tokens_and_a_meta_prompt_estimates_as_a_real_one():
    model = _gpt2()
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in _prompt(8, 4).items()}
    peaks = [estimate_generation(model, meta, max_new_tokens=n, device="cpu").peak_bytes for n in (16, 32, 48)]
    growth = peaks[1] - peaks[0]
    assert peaks[2] - peaks[1] == growth  # affine in the new tokens: the peak is at the last one
    assert growth >= 2 * 2 * 8 * 16 * 64 * 4  # at least keys and values: 2 layers, 8 sequences, 16 tokens
    assert peaks[2] == estimate_generation(model, _prompt(8, 4), max_new_tokens=48, device="cpu").peak_bytes
    sampled = estimate_generation(model, meta, max_new_tokens=48, device="cpu", generate_kwargs={"do_sample": True})
    assert sampled.peak_bytes >= peaks[2]  # sampling's probabilities beside the logits


@pytest.mark.parametrize(
    ("model", "batch", "kwargs", "match"),
    [
        (nn.Linear(2, 2), _prompt(1, 2), {}, r"`model` must have a Hugging Face `generate` method, got Linear"),
        (_gpt2, [torch.zeros(1, 2)], {}, r"`batch` must be a dict with the prompt's `input_ids`"),
        (_gpt2, _prompt(1, 2), {"generate_kwargs": {"max_length": 9}}, r"sets \['max_length'\]"),
        (_gpt2, _prompt(1, 2), {"max_new_tokens": 0}, r"`max_new_tokens`"),
        (_gpt2, _prompt(1, 2), {"num_beams": 0}, r"`num_beams`"),
    ],
)
def test_bad_arguments_are_named(model, batch, kwargs, match):
    model = model() if callable(model) and not isinstance(model, nn.Module) else model
    with pytest.raises(ValueError, match=match):
        estimate_generation(model, batch, **{"max_new_tokens": 4, **kwargs})
