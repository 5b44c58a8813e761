"""The OOM report's sample lengths: read from padding masks and -100-padded labels (counts only), and the tips they
lead to: pad to the longest sample, batch samples of similar length."""

from __future__ import annotations

import torch

from lightning_memopt.functional.oom.batch import describe_batch
from lightning_memopt.functional.oom.markdown import render_markdown
from lightning_memopt.functional.oom.suggestions import suggest_fixes

LENGTHS = [5, 17, 40, 9, 12, 33, 8, 21]


def _hf_batch(padded_to=512):
    mask = torch.zeros(len(LENGTHS), padded_to, dtype=torch.long)
    labels = torch.full((len(LENGTHS), 48), -100)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
        labels[i, : n // 2] = 7
    return {"input_ids": torch.randint(5, 100, (len(LENGTHS), padded_to)), "attention_mask": mask, "labels": labels}


def test_lengths_come_from_the_padding_mask_and_the_labels_and_hold_no_data_values():
    found = describe_batch(_hf_batch())["lengths"]
    assert [f["path"] for f in found] == ["batch['attention_mask']", "batch['labels']"]
    mask = found[0]
    assert (mask["samples"], mask["padded_to"], mask["longest"], mask["shortest"]) == (8, 512, 40, 5)
    assert mask["median"] == sorted(LENGTHS)[4] and mask["lengths"] == LENGTHS
    assert mask["padding_share"] == 1 - sum(LENGTHS) / (8 * 512)
    assert found[1]["lengths"] == [n // 2 for n in LENGTHS]
    assert "input_ids" not in str(found)  # token ids are data: never read


def test_a_batch_without_masks_has_no_lengths():
    assert "lengths" not in describe_batch({"x": torch.zeros(4, 3), "y": torch.zeros(4)})
    assert "lengths" not in describe_batch({"mask": torch.zeros(4, 3)})  # a float tensor is no padding mask


def _tips(lengths):
    return suggest_fixes(
        stage="train",
        allocated_bytes=10_000,
        reserved_bytes=10_500,
        bytes_by_category={"parameters": 1000, "gradients": 1000, "optimizer_states": 2000, "buffers": 0},
        unexplained_bytes=6000,
        micro_batch_size=8,
        accumulate_grad_batches=1,
        precision="bf16-mixed",
        lengths=lengths,
    )


def test_a_batch_padded_beyond_its_longest_sample_is_told_to_pad_to_the_longest():
    tips = _tips(describe_batch(_hf_batch())["lengths"])
    first = tips[0]
    assert first["action"].startswith("Pad each batch to its longest sample")
    assert first["saves_bytes"] == int(6000 * (1 - 40 / 512))  # the activations' share that is padding
    assert "8 samples padded to 512, the longest has 40" in first["why"]


def test_a_batch_padded_to_its_longest_but_mostly_padding_is_told_to_group_by_length():
    batch = _hf_batch(padded_to=40)
    del batch["labels"]  # padded beyond their longest: they would ask to pad to the longest first
    tips = _tips(describe_batch(batch)["lengths"])
    group = [t for t in tips if t["action"].startswith("Batch samples of similar length")]
    assert len(group) == 1 and "TokenBudgetBatchSampler" in group[0]["action"]
    padding = 1 - sum(LENGTHS) / (len(LENGTHS) * 40)  # padded to the longest, 40
    assert group[0]["why"].endswith(f"{100 * padding:.0f} % of the batch's positions are padding.")
    assert not any(t["action"].startswith("Pad each batch") for t in tips)


def test_little_padding_gives_no_padding_tip():
    lengths = [{"path": "m", "samples": 8, "padded_to": 40, "longest": 40, "shortest": 38, "median": 39,
                "padding_share": 0.03, "lengths": []}]  # fmt: skip
    assert not any("padding" in t["why"] for t in _tips(lengths))


def test_the_markdown_lists_the_lengths():
    report = {"batch": describe_batch(_hf_batch())}
    text = render_markdown(report)
    assert "Sample lengths (from the padding masks)" in text
    assert "| batch['attention_mask'] | 8 | 512 | 40 |" in text
