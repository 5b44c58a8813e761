"""Ties are decided by ``ties=``, never by rounding: exact duplicates of a positive tie with it in every layout."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_memopt.functional.retrieval import (
    count_ranks,
    embedding_keys,
    pair_scores,
    plan_retrieval,
    positive_thresholds,
    retrieval_ranks,
    streaming_retrieval,
)
from tests.helpers.retrieval import duplicated_data, exact_scores, reference_ranks


def test_the_minimal_case_of_two_equal_captions():
    video = torch.tensor([[1.0, 2.0**-24, 1.5 * 2.0**-24], [0.0, 0.0, 1.0]])
    text = torch.ones(2, 3)
    assert retrieval_ranks(video, text, text_ids=[0, 1]).v2t.tolist() == [0, 0]
    assert retrieval_ranks(video, text, text_ids=[0, 1], ties="pessimistic").v2t.tolist() == [1, 1]
    assert streaming_retrieval(video, text, text_ids=[0, 1], top_k=(1,))["v2t/R@1"].item() == 1.0


@pytest.mark.parametrize("ties", ["optimistic", "pessimistic"])
@pytest.mark.parametrize("blocks", [1, 7, None])
@pytest.mark.parametrize("options", [{}, {"protocol": "paired"}, {"v2t_gallery": "groups", "video_ids": "pairs"}])
def test_exact_duplicates_match_an_exact_reference_in_every_layout(ties, blocks, options):
    video, text, ids = duplicated_data()
    options = dict(options)
    if options.get("video_ids") == "pairs":  # two captions per video; copies of videos and captions as above
        options["video_ids"] = ids // 2
        video = video[(ids // 2) * 2].clone()
    expected_v2t, expected_t2v = reference_ranks(video, text, text_ids=ids, ties=ties, scores=exact_scores, **options)
    got = retrieval_ranks(
        video, text, text_ids=ids, ties=ties, video_block_size=blocks, text_block_size=blocks, **options
    )
    assert got.v2t.tolist() == expected_v2t.tolist()
    assert got.t2v.tolist() == expected_t2v.tolist()


def test_ties_rule_alone_separates_the_duplicates():
    """The copies are exactly the difference between the two `ties` answers (nothing else ties here)."""
    video, text, ids = duplicated_data()
    opt = retrieval_ranks(video, text, text_ids=ids)
    pes = retrieval_ranks(video, text, text_ids=ids, ties="pessimistic")
    v2t_copies = torch.zeros(48, dtype=torch.int64)
    v2t_copies[[*range(6), *range(30, 36), 12, 42, 43]] = torch.tensor([1] * 12 + [2, 2, 2])
    t2v_copies = torch.zeros(48, dtype=torch.int64)
    t2v_copies[[*range(6, 12), *range(36, 42), 12, 42, 43]] = torch.tensor([1] * 12 + [2, 2, 2])
    assert (pes.v2t - opt.v2t).tolist() == v2t_copies.tolist()
    assert (pes.t2v - opt.t2v).tolist() == t2v_copies.tolist()


@pytest.mark.parametrize("side", ["captions", "videos"])
def test_ten_queries_embedded_twice_at_realistic_size(side):
    """N=1000, d=512, ten captions (or videos) embedded twice under new ids: each copy of the positive is one tie."""
    gen = torch.Generator().manual_seed(0)
    video = torch.nn.functional.normalize(torch.randn(1000, 512, generator=gen), dim=1)
    text = torch.nn.functional.normalize(video + 0.1 * torch.randn(1000, 512, generator=gen), dim=1)
    copies, originals = torch.arange(990, 1000), torch.arange(10)
    feats = text if side == "captions" else video
    feats[copies] = feats[originals]
    opt = retrieval_ranks(video, text, text_ids=torch.arange(1000))
    pes = retrieval_ranks(video, text, text_ids=torch.arange(1000), ties="pessimistic")
    # reference: float64 scores for everything but the copy, which is a tie by identity
    scores = video.double() @ text.double().T
    if side == "videos":
        scores = scores.T  # t2v: text queries over the video gallery
    queries = torch.cat([originals, copies])
    twin = torch.cat([copies, originals])  # the exact copy of each query's positive
    expected = []
    for q, c in zip(queries.tolist(), twin.tolist()):
        others = torch.ones(1000, dtype=torch.bool)
        others[[q, c]] = False
        gap = (scores[q, others] - scores[q, q]).abs().min().item()
        assert gap > 1e-6  # nothing but the copy is near a tie: float32 rounding cannot decide any other item
        expected.append(int((scores[q, others] > scores[q, q]).sum()))
    got_opt, got_pes = (opt.v2t, pes.v2t) if side == "captions" else (opt.t2v, pes.t2v)
    assert got_opt[queries].tolist() == expected
    assert got_pes[queries].tolist() == [e + 1 for e in expected]


def test_float64_features_are_ranked_in_float32_and_say_so_once(monkeypatch):
    from lightning_memopt.functional.retrieval import options

    monkeypatch.setattr(options, "_float64_warned", False)
    video, text, ids = duplicated_data()
    video64 = video.double() + 1e-12  # float64 values that round to the float32 ones
    text64 = text.double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = retrieval_ranks(video64, text64, text_ids=ids, ties="pessimistic")
        retrieval_ranks(video64, text64, text_ids=ids)
    expected = retrieval_ranks(video, text, text_ids=ids, ties="pessimistic")
    assert got.v2t.tolist() == expected.v2t.tolist() and got.t2v.tolist() == expected.t2v.tolist()
    messages = [str(w.message) for w in caught if "float64" in str(w.message)]
    assert len(messages) == 1 and "ranked in float32" in messages[0]


def test_pair_scores_are_the_same_bits_in_any_chunk_and_for_any_copy():
    gen = torch.Generator().manual_seed(1)
    video, text = torch.randn(300, 96, generator=gen), torch.randn(300, 96, generator=gen)
    video[150:] = video[:150]
    pv, pt = torch.arange(300), torch.arange(300) % 150
    whole = pair_scores(video, text, pv, pt)
    assert torch.equal(whole[:150], whole[150:])  # copies of the same pair
    for chunk in (1, 7, 1024):
        assert torch.equal(pair_scores(video, text, pv, pt, chunk=chunk), whole)
    assert torch.equal(pair_scores(video.flip(0), text, 299 - pv, pt), whole)


def test_row_keys_see_signed_zeros_as_equal_and_read_every_dtype():
    x = torch.tensor([[0.0, 1.5, -2.0], [-0.0, 1.5, -2.0], [0.0, 1.5, 2.0]])
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        k = embedding_keys(x.to(dtype))
        assert k[0] == k[1] and k[0] != k[2]


def test_copies_on_another_process_tie_through_the_keys_it_shares():
    """Two shards: rank 1 holds a copy of rank 0's positive video; the shared keys make rank 1 count it as a tie."""
    video, text, ids = duplicated_data()
    plan = plan_retrieval(ids, ids, ids)
    scores = pair_scores(video, text, plan.pair_video, plan.pair_text)
    t_thr = positive_thresholds(scores, plan.pair_text, 48)
    keys = embedding_keys(video)
    _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    shared = counts[inverse[plan.pair_video]] > 1
    positive_keys = (plan.pair_text[shared], keys[plan.pair_video[shared]])
    for ties in ("optimistic", "pessimistic"):
        whole = retrieval_ranks(video, text, text_ids=ids, ties=ties).t2v
        total = torch.zeros(48, dtype=torch.int64)
        for lo, hi in ((0, 20), (20, 48)):  # rows 6-11 on the first shard, their copies 36-41 on the second
            mask = (plan.pair_video >= lo) & (plan.pair_video < hi)
            pv, pt = plan.pair_video[mask] - lo, plan.pair_text[mask]
            v_thr = positive_thresholds(scores[mask], pv, hi - lo)
            total += count_ranks(
                video[lo:hi],
                text,
                pv,
                pt,
                v_thr,
                t_thr,
                ties=ties,
                positive_scores=scores[mask],
                positive_video_keys=positive_keys,
                video_block_size=7,
                text_block_size=5,
            )[1]
        assert total.tolist() == whole.tolist()


@pytest.mark.parametrize("tie_chunk", [3, 1 << 22])
def test_one_caption_for_every_row_is_one_big_tie(monkeypatch, tie_chunk):
    """300 rows sharing one caption embedding (paired protocol): every caption ties with every other, in chunks."""
    from lightning_memopt.functional.retrieval import ties as tie_cells

    monkeypatch.setattr(tie_cells, "_TIE_CHUNK", tie_chunk)
    gen = torch.Generator().manual_seed(2)
    video = torch.randn(300, 24, generator=gen)
    text = torch.randn(1, 24, generator=gen).expand(300, 24).contiguous()
    for ties, expected in (("optimistic", 0), ("pessimistic", 299)):
        got = retrieval_ranks(video, text, protocol="paired", ties=ties, video_block_size=64, text_block_size=50)
        assert got.v2t.tolist() == [expected] * 300
        # t2v: text i's positive is video i; the other videos score by their own embeddings (no ties among them)
        scores = video.double() @ text[0].double()
        assert got.t2v.tolist() == [int((scores > scores[i]).sum()) for i in range(300)]
