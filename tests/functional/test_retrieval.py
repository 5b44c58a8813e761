"""Chunked retrieval ranks against an independent full-matrix reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_memopt.functional.retrieval import (
    as_id_tensor,
    choose_block_sizes,
    count_ranks,
    full_fp32_matmul,
    pair_scores,
    plan_retrieval,
    positive_thresholds,
    retrieval_ranks,
    streaming_retrieval,
    summarize_rank_histogram,
    summarize_ranks,
)
from tests.helpers.retrieval import make_data, quantized, reference_ranks


def assert_matches(video, text, **kw):
    expected_v2t, expected_t2v = reference_ranks(video, text, **{k: v for k, v in kw.items() if k in REF_KEYS})
    got = retrieval_ranks(video, text, **kw)
    assert got.v2t.tolist() == expected_v2t.tolist()
    assert got.t2v.tolist() == expected_t2v.tolist()
    return got


REF_KEYS = {"text_ids", "video_ids", "sample_ids", "protocol", "v2t_gallery", "ties"}


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("n", [1, 7, 45])
@pytest.mark.parametrize("blocks", [(1, 1), (3, 5), (16, 7), (1000, 1000), (None, None)])
def test_matches_reference_across_sizes_and_blocks(n, blocks):
    video, text, ids = make_data(n=n, n_captions=max(1, n // 3), seed=n)
    assert_matches(video, text, text_ids=ids, video_block_size=blocks[0], text_block_size=blocks[1])


@pytest.mark.parametrize("ties", ["optimistic", "pessimistic"])
@pytest.mark.parametrize("protocol", ["dedup", "paired"])
def test_exact_ties_and_protocols(ties, protocol):
    video, text, ids = make_data(n=37, d=4, n_captions=9, seed=1)  # d=4 with 17 levels: many exact ties
    got = assert_matches(video, text, text_ids=ids, protocol=protocol, ties=ties, video_block_size=5, text_block_size=4)
    assert got.t2v_gallery_size == 37
    assert got.v2t_gallery_size == (len(set(ids.tolist())) if protocol == "dedup" else 37)


def test_ties_change_the_answer_and_dedup_matters():
    video, text, ids = make_data(n=60, d=4, n_captions=10, seed=2)
    opt = retrieval_ranks(video, text, ids, ties="optimistic")
    pes = retrieval_ranks(video, text, ids, ties="pessimistic")
    assert (pes.v2t >= opt.v2t).all() and (pes.v2t > opt.v2t).any()
    paired = retrieval_ranks(video, text, ids, protocol="paired")
    paired_pes = retrieval_ranks(video, text, ids, protocol="paired", ties="pessimistic")
    # repeated captions are exact ties of the positive under the paired protocol
    assert (paired_pes.v2t > paired.v2t).any()


def test_negative_scores():
    gen = torch.Generator().manual_seed(3)
    video = -quantized(gen, (30, 6), low=1, high=9)
    captions = quantized(gen, (30, 6), low=1, high=9)
    ids = torch.arange(30)
    got = assert_matches(video, captions, text_ids=ids, video_block_size=4, text_block_size=7)
    assert (got.v2t > 0).any()  # all scores < 0, and the positives are still ranked, not dropped


def test_multiple_positives_with_video_ids():
    video, text, ids = make_data(n=48, d=6, n_captions=30, seed=4)
    video_ids = torch.arange(48) // 4  # 12 videos with 4 caption rows each
    video = video[video_ids * 4]  # the same video feature on each of its rows
    for gallery in ("texts", "groups"):
        for ties in ("optimistic", "pessimistic"):
            got = assert_matches(
                video,
                text,
                text_ids=ids,
                video_ids=video_ids,
                v2t_gallery=gallery,
                ties=ties,
                video_block_size=5,
                text_block_size=3,
            )
            assert got.v2t.numel() == 12


def test_group_max_differs_from_best_of_captions():
    video, text, _ = make_data(n=200, d=8, seed=5, kind="normal")
    video_ids = torch.arange(200) // 5
    video = video[video_ids * 5]
    best = retrieval_ranks(video, text, torch.arange(200), video_ids=video_ids)
    group = retrieval_ranks(video, text, torch.arange(200), video_ids=video_ids, v2t_gallery="groups")
    assert best.v2t_gallery_size == 200 and group.v2t_gallery_size == 40
    assert (group.v2t <= best.v2t).all() and not torch.equal(group.v2t, best.v2t)
    assert torch.equal(group.t2v, best.t2v)


def test_sample_ids_drop_padding_repeats_and_string_ids():
    video, text, ids = make_data(n=20, n_captions=8, seed=6)
    sample_ids = [*range(20), 0, 1, 2]
    video2 = torch.cat([video, video[:3]])
    text2 = torch.cat([text, text[:3]])
    names = [f"caption {int(i)}" for i in torch.cat([ids, ids[:3]])]
    got = assert_matches(video2, text2, text_ids=as_id_tensor(names, "text_ids"), sample_ids=sample_ids)
    plain = retrieval_ranks(video, text, ids)
    assert torch.equal(got.v2t, plain.v2t) and sorted(got.t2v.tolist()) == sorted(plain.t2v.tolist())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_features_accumulate_in_fp32(dtype):
    video, text, ids = make_data(n=33, d=16, n_captions=11, seed=7)
    got = assert_matches(video.to(dtype), text.to(dtype), text_ids=ids, video_block_size=8, text_block_size=3)
    ref = retrieval_ranks(video, text, ids)
    assert torch.equal(got.v2t, ref.v2t) and torch.equal(got.t2v, ref.t2v)


def test_positive_never_beats_itself_with_gaussian_features():
    # the positive's own score is the largest in each row; any rounding mismatch would show as rank > 0
    gen = torch.Generator().manual_seed(8)
    feats = torch.randn(300, 512, generator=gen)
    got = retrieval_ranks(feats, feats.clone(), torch.arange(300), video_block_size=64, text_block_size=100)
    assert got.v2t.sum() == 0 and got.t2v.sum() == 0
    got = retrieval_ranks(feats, feats.clone(), torch.arange(300), ties="pessimistic", video_block_size=7)
    assert got.v2t.sum() == 0


def test_gaussian_features_match_reference():
    video, text, ids = make_data(n=80, d=32, n_captions=50, seed=9, kind="normal")
    assert_matches(video, text, text_ids=ids, video_block_size=9, text_block_size=11)


def test_tf32_setting_is_restored_and_blocks_run_in_fp32():
    video, text, ids = make_data(n=20, seed=10)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        got = retrieval_ranks(video, text, ids)
        assert torch.get_float32_matmul_precision() == "medium"
        with full_fp32_matmul():
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)
    assert torch.equal(got.v2t, retrieval_ranks(video, text, ids).v2t)


def test_video_shards_sum_to_the_whole():
    """The distributed identity: counting disjoint video shards against all texts and summing t2v is exact."""
    video, text, ids = make_data(n=50, d=6, n_captions=20, seed=11)
    plan = plan_retrieval(torch.arange(50), torch.arange(50), ids)
    vid = video[plan.video_rows]
    txt = torch.stack([text[(ids == k).nonzero()[0, 0]] for k in plan.text_keys])
    scores = pair_scores(vid, txt, plan.pair_video, plan.pair_text)
    v_thr = positive_thresholds(scores, plan.pair_video, 50)
    t_thr = positive_thresholds(scores, plan.pair_text, txt.shape[0])
    whole_v, whole_t = count_ranks(vid, txt, plan.pair_video, plan.pair_text, v_thr, t_thr)
    parts_v, parts_t = [], torch.zeros_like(whole_t)
    for lo, hi in ((0, 17), (17, 17), (17, 50)):  # includes an empty shard
        mask = (plan.pair_video >= lo) & (plan.pair_video < hi)
        v, t = count_ranks(
            vid[lo:hi],
            txt,
            plan.pair_video[mask] - lo,
            plan.pair_text[mask],
            v_thr[lo:hi],
            t_thr,
            video_block_size=4,
            text_block_size=6,
        )
        parts_v.append(v)
        parts_t += t
    assert torch.equal(torch.cat(parts_v), whole_v) and torch.equal(parts_t, whole_t)


# ------------------------------------------------------------------------------------------ summaries
@pytest.mark.parametrize("median", ["floor", "mean", "lower"])
@pytest.mark.parametrize("n", [1, 2, 7, 10])
def test_summaries_match_numpy(median, n):
    gen = torch.Generator().manual_seed(n)
    ranks = torch.randint(0, 12, (n,), generator=gen)
    out = summarize_ranks(ranks, top_k=(1, 5, 10, 50), median=median, prefix="x/")
    r = ranks.numpy()
    for k in (1, 5, 10, 50):
        assert out[f"x/R@{k}"].item() == pytest.approx(float(np.mean(r < k)))
    expected = {
        "floor": math.floor(np.median(r)) + 1,
        "mean": float(np.median(r)) + 1,
        "lower": float(np.sort(r)[(n - 1) // 2]) + 1,
    }[median]
    assert out["x/MedR"].item() == pytest.approx(expected)
    assert out["x/MeanR"].item() == pytest.approx(float(r.mean()) + 1)
    assert all(v.dim() == 0 for v in out.values())


def test_streaming_retrieval_keys():
    video, text, ids = make_data(n=25, n_captions=10, seed=12)
    out = streaming_retrieval(video, text, ids)
    assert list(out) == [f"{d}/{m}" for d in ("v2t", "t2v") for m in ("R@1", "R@5", "R@10", "MedR", "MeanR")]
    assert all(0 <= out[f"{d}/R@{k}"].item() <= 1 for d in ("v2t", "t2v") for k in (1, 5, 10))


def test_block_sizes_follow_the_budget():
    assert choose_block_sizes(117_000, 23_000, 512) == (2048, 4096)
    bv, bt = choose_block_sizes(117_000, 23_000, 512, memory_budget_bytes=64 * 2**20)
    assert (bt * 2 + 512) * 4 * bv + 23_000 * 512 * 4 <= 64 * 2**20
    assert choose_block_sizes(10, 3, 4) == (10, 3)
    assert choose_block_sizes(10, 3, 4, video_block_size=2, text_block_size=1) == (2, 1)
    assert choose_block_sizes(100_000, 20_000, 512, device="cuda")[1] == 20_000


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"video_features": torch.zeros(3, 4), "text_features": torch.zeros(2, 4)}, "one row per sample"),
        ({"video_features": torch.zeros(3, 4), "text_features": torch.zeros(3, 5)}, "same feature dim"),
        ({"video_features": torch.full((3, 4), float("nan")), "text_features": torch.zeros(3, 4)}, "NaN or inf"),
        ({"video_features": torch.zeros(3, 4), "text_features": torch.tensor([[float("inf")] * 4] * 3)}, "NaN or inf"),
        ({"video_features": torch.zeros(0, 4), "text_features": torch.zeros(0, 4)}, "empty"),
        ({"video_features": torch.zeros(3), "text_features": torch.zeros(3)}, "2-D float tensor"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        retrieval_ranks(text_ids=list(range(kwargs["video_features"].shape[0])), **kwargs)


def test_bad_ids_and_options():
    x = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"`text_ids` must have one id per row \(3\), got 2"):
        retrieval_ranks(x, x, [0, 1])
    with pytest.raises(ValueError, match="`text_ids` is required"):
        retrieval_ranks(x, x)
    with pytest.raises(ValueError, match="only ints or only strings"):
        retrieval_ranks(x, x, [0, "a", 1])
    with pytest.raises(ValueError, match=r"dtype torch\.float32"):
        retrieval_ranks(x, x, torch.zeros(3))
    with pytest.raises(ValueError, match="`ties` must be one of"):
        retrieval_ranks(x, x, [0, 1, 2], ties="random")
    with pytest.raises(ValueError, match="`protocol` must be one of"):
        retrieval_ranks(x, x, [0, 1, 2], protocol="open_clip")
    with pytest.raises(ValueError, match="zero queries"):
        summarize_rank_histogram(torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"video_block_size": True}, "`video_block_size` must be a positive int, got True"),
        ({"text_block_size": 0}, "`text_block_size` must be a positive int, got 0"),
        ({"memory_budget_bytes": True}, "`memory_budget_bytes` must be a positive int, got True"),
        ({"memory_budget_bytes": 2.0**31}, "`memory_budget_bytes` must be a positive int, got 2147483648.0"),
        ({"device": 3.5}, r"`device` must be a torch.device, .* got 3.5 \(float\)"),
        ({"device": "gpu"}, r"`device` must be a torch.device, .* got 'gpu' \(str\)"),
        ({"v2t_gallery": None}, "`v2t_gallery` must be one of 'texts', 'groups', got None"),
        ({"video_features": torch.eye(3, dtype=torch.int64)}, r"`video_features` has dtype torch.int64, but features"),
        ({"text_features": [[1.0]] * 3}, r"`text_features` must be a 2-D float tensor \(rows x dim\), got list"),
        ({"text_ids": [0, 1, 2**64]}, r"`text_ids` must fit in int64 .* got 18446744073709551616 at position 2"),
        ({"sample_ids": torch.tensor([0, 1, 2**63 + 1], dtype=torch.uint64)}, "`sample_ids` must fit in int64"),
        ({"video_ids": [[0], [1], [2]]}, r"`video_ids` must hold only ints or only strings, got \[0\] \(list\)"),
    ],
)
def test_ranks_check_every_argument_first(kwargs, match):
    args = {"video_features": torch.eye(3), "text_features": torch.eye(3), "text_ids": [0, 1, 2], **kwargs}
    with pytest.raises(ValueError, match=match):
        retrieval_ranks(**args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": None}, r"`top_k` must be a positive int or a non-empty list of distinct positive ints, got None"),
        ({"top_k": (0,)}, "`top_k` must be a positive int, got 0"),
        ({"top_k": [5, 5]}, r"`top_k` must not repeat a K .* got \[5, 5\]"),
        ({"median": "upper"}, "`median` must be one of 'floor', 'mean', 'lower', got 'upper'"),
    ],
)
def test_streaming_retrieval_checks_top_k_and_median(kwargs, match):
    with pytest.raises(ValueError, match=match):
        streaming_retrieval(torch.eye(2), torch.eye(2), [0, 1], **kwargs)
    if "top_k" in kwargs:
        with pytest.raises(ValueError, match=match):
            summarize_ranks(torch.tensor([0, 1]), **kwargs)


# ------------------------------------------------------------------------------------------ properties
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 18),
    d=st.integers(1, 5),
    n_captions=st.integers(1, 18),
    bv=st.integers(1, 20),
    bt=st.integers(1, 20),
    seed=st.integers(0, 2**16),
    protocol=st.sampled_from(["dedup", "paired"]),
    ties=st.sampled_from(["optimistic", "pessimistic"]),
    grouped=st.booleans(),
)
def test_property_matches_reference(n, d, n_captions, bv, bt, seed, protocol, ties, grouped):
    video, text, ids = make_data(n=n, d=d, n_captions=n_captions, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    video_ids = torch.randint(0, max(1, n // 2), (n,), generator=gen) if grouped else None
    if video_ids is not None:
        first = {int(v): i for i, v in reversed(list(enumerate(video_ids.tolist())))}
        video = video[[first[int(v)] for v in video_ids]]
    got = assert_matches(
        video,
        text,
        text_ids=ids,
        video_ids=video_ids,
        protocol=protocol,
        ties=ties,
        v2t_gallery="groups" if grouped else "texts",
        video_block_size=bv,
        text_block_size=bt,
    )
    assert ((got.v2t >= 0) & (got.v2t < got.v2t_gallery_size)).all()
    assert ((got.t2v >= 0) & (got.t2v < got.t2v_gallery_size)).all()


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_blocks_match_cpu_even_with_tf32_requested(dtype):
    video, text, ids = make_data(n=300, d=16, n_captions=90, seed=13)
    cpu = retrieval_ranks(video, text, ids, video_block_size=64, text_block_size=50)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 would perturb near-ties; blocks must run in full fp32
    try:
        gpu = retrieval_ranks(
            video.cuda().to(dtype), text.cuda().to(dtype), ids, video_block_size=64, text_block_size=50
        )
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
    assert torch.equal(gpu.v2t, cpu.v2t) and torch.equal(gpu.t2v, cpu.t2v)
    feats = torch.randn(500, 512, generator=torch.Generator().manual_seed(0))
    self_ranks = retrieval_ranks(feats.cuda(), feats.cuda(), torch.arange(500))
    assert self_ranks.v2t.sum() == 0 and self_ranks.t2v.sum() == 0
