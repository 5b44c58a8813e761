"""The CLIP-style retrieval example: data properties, a short run's artifacts, and learning above chance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from examples.clip_retrieval.data import CaptionBank, SyntheticSpec, SyntheticVideoTextDataset, assign_captions
from examples.clip_retrieval.module import ClipRetrievalDataModule, contrastive_loss
from examples.clip_retrieval.train import main

DIRECTIONS = ("v2t", "t2v")
TOP_K = (1, 5, 10)
# small towers and data: a run takes a few seconds on one CPU thread
SMALL = [
    "--vocab_size",
    "200",
    "--hidden_dim",
    "64",
    "--embed_dim",
    "32",
    "--no-plot",
    "--no-progress_bar",
    "--accelerator",
    "cpu",
]


def _run(tmp_path, *flags: str) -> dict:
    return main([*flags, *SMALL, "--root", str(tmp_path)])


def test_every_caption_is_used_and_distinct():
    dm = ClipRetrievalDataModule(num_samples=1000, num_unique_texts=150, vocab_size=200)
    dm.setup("fit")
    ids = dm.val_set.caption_ids
    assert len(ids) == 1000
    assert np.unique(ids).size == 150
    assert set(ids.tolist()) == set(range(150))
    tokens = dm.bank.tokens
    assert len({tuple(row) for row in tokens.tolist()}) == 150  # distinct token sequences, not only distinct ids
    assert bool((tokens[:, 0] > 0).all())  # no empty caption


def test_frames_vary_are_capped_and_are_deterministic():
    bank = CaptionBank(SyntheticSpec(num_unique_texts=40, vocab_size=100, max_frames=8))
    data = SyntheticVideoTextDataset(bank, 200, "val")
    batch = data.__getitems__(list(range(200)))
    counts = batch["frame_mask"].sum(1)
    assert int(counts.min()) >= 1 and int(counts.max()) == 8 and counts.unique().numel() > 2
    assert bool((batch["frames"][~batch["frame_mask"]] == 0).all())
    again = data.__getitems__([5, 3])  # another batch composition, same rows
    assert torch.equal(again["frames"][0], batch["frames"][5]) and torch.equal(again["frames"][1], batch["frames"][3])

    capped = SyntheticVideoTextDataset(
        CaptionBank(SyntheticSpec(num_unique_texts=40, vocab_size=100, max_frames=3)), 200, "val"
    )
    small = capped.__getitems__(list(range(200)))
    assert int(small["frame_mask"].sum(1).max()) == 3
    torch.testing.assert_close(small["frames"], batch["frames"][:, :3])  # the cap keeps the first frames


def test_fewer_samples_than_captions_is_refused():
    with pytest.raises(ValueError, match="num_unique_texts"):
        ClipRetrievalDataModule(num_samples=10, num_unique_texts=20)


def test_contrastive_loss_is_symmetric_and_rewards_matching_pairs():
    torch.manual_seed(0)
    video, text = F.normalize(torch.randn(6, 8), dim=1), F.normalize(torch.randn(6, 8), dim=1)
    scale = torch.tensor(20.0)
    assert contrastive_loss(video, text, scale).item() == pytest.approx(contrastive_loss(text, video, scale).item())
    assert contrastive_loss(video, video, scale).item() < contrastive_loss(video, video.roll(1, 0), scale).item()
    assert contrastive_loss(video, video, torch.tensor(100.0)).item() < 0.05  # random unit vectors in 8 dims


@pytest.mark.slow
def test_short_run_logs_retrieval_memory_and_matrix_sizes(tmp_path):
    num_samples, num_unique = 300, 60
    out = _run(
        tmp_path,
        "--num_samples",
        str(num_samples),
        "--num_unique_texts",
        str(num_unique),
        "--batch_size",
        "32",
        "--max_epochs",
        "1",
        "--max_steps",
        "3",
        "--limit_train_batches",
        "3",
        "--metric_budget_bytes",
        "65536",
    )
    metrics = out["metrics"]
    for direction in DIRECTIONS:
        for k in TOP_K:
            assert 0.0 <= metrics[f"val/{direction}/R@{k}"] <= 1.0
        assert metrics[f"val/{direction}/MedR"] >= 1.0
        assert metrics[f"val/{direction}/MeanR"] >= 1.0
    assert metrics["val/v2t/MeanR"] <= num_unique and metrics["val/t2v/MeanR"] <= num_samples

    cost = out["metric_compute"]
    assert (cost["num_videos"], cost["num_unique_texts"]) == (num_samples, num_unique)
    assert out["naive_matrix_bytes"] == num_samples**2 * 4
    assert out["naive_dedup_matrix_bytes"] == num_samples * num_unique * 4
    assert cost["budget_bytes"] == 65536 and cost["rss_growth_bytes"] >= 0
    assert cost["stored_feature_bytes_this_rank"] == (num_samples + num_unique) * 32 * 4  # float32, on CPU, deduped

    logs = out["memory_logs"]
    assert logs == [str(tmp_path / "memory" / "memory_rank0.jsonl")]
    records = [json.loads(line) for line in Path(logs[0]).read_text().splitlines()]
    assert {r["phase"] for r in records} >= {"train", "validate"}
    assert all(r["host_rss_bytes"] > 0 for r in records if r["event"] == "step")
    assert out["trainer"].global_step == 3


@pytest.mark.slow
def test_learns_retrieval_well_above_chance(tmp_path):
    num_samples, num_unique, k = 400, 100, 5
    out = _run(
        tmp_path,
        "--num_samples",
        str(num_samples),
        "--num_unique_texts",
        str(num_unique),
        "--num_train_samples",
        "2048",
        "--batch_size",
        "128",
        "--max_epochs",
        "4",
        "--lr",
        "5e-3",
        "--noise_std",
        "0.5",
        "--memory_log_every_n_steps",
        "50",
    )
    # a caption with m clips among N has a chance R@K of at most m * K / N under a random ranking
    most_clips = np.bincount(assign_captions(num_samples, num_unique, seed=0, split="val")).max()
    t2v_bound = most_clips * k / num_samples
    assert out["chance"][f"t2v/R@{k}"] <= t2v_bound < 0.15
    assert out["metrics"][f"val/t2v/R@{k}"] > max(4 * t2v_bound, 0.5)
    assert out["metrics"][f"val/v2t/R@{k}"] > max(10 * k / num_unique, 0.5)  # one caption among 100 per clip
    assert math.isfinite(out["metrics"]["val/loss"])
