"""Sizes come from the data, not from arguments; a caption id given again with other features warns once."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_memopt.functional.retrieval import choose_block_sizes, retrieval_ranks
from lightning_memopt.metrics import StreamingRetrievalMetric
from tests.helpers.retrieval import make_data, reference_ranks

HUGE = 10**12


def _metric_ranks(metric):
    ranks = metric.compute_ranks()
    return ranks.v2t, ranks.t2v


@pytest.mark.parametrize(
    ("video_block", "text_block"), [(HUGE, HUGE), (HUGE, None), (None, HUGE), (HUGE, 2), (2, HUGE)]
)
def test_a_block_larger_than_the_data_is_all_rows(video_block, text_block):
    video, text, ids = make_data(n=6, d=4, n_captions=4, seed=1)
    metric = StreamingRetrievalMetric(video_block_size=video_block, text_block_size=text_block)
    metric.update(video, text, text_ids=ids)
    v2t, t2v = _metric_ranks(metric)
    ref_v2t, ref_t2v = reference_ranks(video, text, ids)
    assert torch.equal(v2t, ref_v2t) and torch.equal(t2v, ref_t2v)
    n_texts = metric.last_compute_stats["num_texts"]
    expected = (min(video_block or 6, 6), min(text_block or n_texts, n_texts))
    assert metric.last_compute_stats["block_sizes"] == expected


def test_the_functional_form_clamps_too():
    video, text, ids = make_data(n=6, d=4, seed=2)
    ranks = retrieval_ranks(video, text, ids, video_block_size=HUGE, text_block_size=HUGE)
    ref_v2t, ref_t2v = reference_ranks(video, text, ids)
    assert torch.equal(ranks.v2t, ref_v2t) and torch.equal(ranks.t2v, ref_t2v)


@pytest.mark.parametrize(("n_video", "n_text"), [(6, 3), (1, 1), (5, 40)])
def test_choose_block_sizes_never_exceeds_the_rows(n_video, n_text):
    video_block, text_block = choose_block_sizes(n_video, n_text, 8, video_block_size=HUGE, text_block_size=HUGE)
    assert (video_block, text_block) == (n_video, n_text)
    # sizes below the data are kept as given
    assert choose_block_sizes(n_video, n_text, 8, video_block_size=1, text_block_size=1) == (1, 1)


# ----------------------------------------------------------------------------------- repeated caption ids


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if "given again" in str(w.message)]


def test_a_repeated_id_with_other_features_warns_once_and_the_first_embedding_is_ranked():
    video, text, ids = make_data(n=8, d=4, seed=3)
    ids = torch.arange(8)
    metric = StreamingRetrievalMetric(top_k=(1,))
    metric.update(video[:4], text[:4], text_ids=ids[:4])
    other = text[4:8].clone()
    other[0] = text[0] + 1.0  # row 4 reuses caption id 0 with another embedding
    reused = ids[4:8].clone()
    reused[0] = 0

    def second_and_third():
        metric.update(video[4:8], other, text_ids=reused)
        metric.update(video[4:5], text[0:1] - 3.0, text_ids=[0])  # again different: no second warning

    caught = _caught(second_and_third)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "StreamingRetrievalMetric" in message and "text id 0" in message and "first embedding is kept" in message
    all_video = torch.cat([video[:8], video[4:5]])
    all_text = torch.cat([text[:4], other, text[0:1] - 3.0])
    all_ids = torch.cat([ids[:4], reused, torch.tensor([0])])
    v2t, t2v = _metric_ranks(metric)
    ref_v2t, ref_t2v = reference_ranks(all_video, all_text, all_ids)  # the reference keeps each id's first row
    assert torch.equal(v2t, ref_v2t) and torch.equal(t2v, ref_t2v)


def test_equal_repeats_stay_silent_across_updates_within_a_batch_and_after_compute():
    video, text, ids = make_data(n=12, d=4, n_captions=3, seed=4)  # 12 rows, 3 captions: many equal repeats
    metric = StreamingRetrievalMetric(top_k=(1,))

    def updates():
        metric.update(video[:6], text[:6], text_ids=ids[:6])
        metric.compute()  # concatenates the states in place
        metric.update(video[6:], text[6:].clone(), text_ids=ids[6:])
        metric.compute()

    assert _caught(updates) == []
    # the check is live: the same caption id with another embedding does warn
    caught = _caught(lambda: metric.update(video[:1], text[:1] + 1.0, text_ids=ids[:1]))
    assert len(caught) == 1 and f"text id {int(ids[0])}" in str(caught[0].message)


def test_a_repeat_within_one_batch_and_after_compute_is_checked():
    video, text, _ = make_data(n=4, d=4, seed=5)
    metric = StreamingRetrievalMetric(top_k=(1,))
    within = text.clone()
    within[3] = within[3] * 2 + 1
    caught = _caught(lambda: metric.update(video, within, text_ids=[0, 1, 2, 0]))
    assert len(caught) == 1 and "text id 0" in str(caught[0].message)

    later = StreamingRetrievalMetric(top_k=(1,))
    later.update(video[:3], text[:3], text_ids=[0, 1, 2])
    later.compute()  # the stored states are now one tensor each: the lookup is rebuilt from them
    caught = _caught(lambda: later.update(video[3:], text[2:3] + 0.5, text_ids=[2]))
    assert len(caught) == 1 and "text id 2" in str(caught[0].message)


def test_rounding_differences_do_not_warn():
    video, text, _ = make_data(n=3, d=4, seed=6, kind="gaussian")
    text = text * 100  # a relative difference of 1e-6 is then above the absolute tolerance alone
    metric = StreamingRetrievalMetric(top_k=(1,))
    metric.update(video, text, text_ids=[0, 1, 2])
    nudged = text[1:2] * (1 + 1e-6)
    assert _caught(lambda: metric.update(video[1:2], nudged, text_ids=[1])) == []
    assert len(_caught(lambda: metric.update(video[1:2], text[1:2] * 1.01, text_ids=[1]))) == 1


def test_the_functional_form_warns_for_a_repeated_id_with_other_features():
    video, text, _ = make_data(n=4, d=4, seed=7)
    same = text.clone()
    same[3] = same[0]
    assert _caught(lambda: retrieval_ranks(video, same, [0, 1, 2, 0])) == []
    other = text.clone()
    other[3] = other[0] + 0.25
    caught = _caught(lambda: retrieval_ranks(video, other, [0, 1, 2, 0]))
    assert len(caught) == 1 and "retrieval_ranks" in str(caught[0].message) and "text id 0" in str(caught[0].message)
