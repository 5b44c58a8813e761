"""StreamingRetrievalMetric: equal to the functional form and the full-matrix reference, CPU storage, contract, DDP."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from lightning_memopt import StreamingRetrievalMetric
from lightning_memopt.functional.retrieval import (
    choose_block_sizes,
    retrieval_ranks,
    streaming_retrieval,
    summarize_ranks,
)
from tests.helpers.retrieval import duplicated_data, exact_scores, make_data, reference_ranks
from tests.helpers.subprocess_run import SCRIPTS, run_file


def feed(metric, video, text, ids, batch=7, **extra):
    for start in range(0, video.shape[0], batch):
        sl = slice(start, start + batch)
        metric.update(video[sl], text[sl], ids[sl], **{k: v[sl] for k, v in extra.items()})


def test_matches_reference_over_batches_with_repeated_captions():
    video, text, ids = make_data(n=50, d=6, n_captions=17, seed=0)
    metric = StreamingRetrievalMetric(top_k=(1, 5), video_block_size=8, text_block_size=5)
    feed(metric, video, text, ids)
    out = metric.compute()
    v2t, t2v = reference_ranks(video, text, text_ids=ids)
    expected = summarize_ranks(v2t, (1, 5), prefix="v2t/") | summarize_ranks(t2v, (1, 5), prefix="t2v/")
    assert list(out) == list(expected)
    for key in out:
        assert out[key].item() == pytest.approx(expected[key].item()), key
        assert out[key].dim() == 0
    assert torch.cat(metric.unique_text_ids).numel() == len(set(ids.tolist()))  # repeated captions stored once
    ranks = metric.compute_ranks()
    assert ranks.v2t.tolist() == v2t.tolist() and ranks.t2v.tolist() == t2v.tolist()


@pytest.mark.parametrize(
    "options",
    [
        {"protocol": "paired"},
        {"ties": "pessimistic"},
        {"v2t_gallery": "groups"},
        {"median": "mean"},
        {"median": "lower"},
    ],
)
def test_options_match_the_functional_form(options):
    video, text, ids = make_data(n=40, d=4, n_captions=12, seed=1)
    video_ids = torch.arange(40) // 2
    video = video[video_ids * 2]
    metric = StreamingRetrievalMetric(**options)
    feed(metric, video, text, ids, sample_ids=torch.arange(40), video_ids=video_ids)
    out = metric.compute()
    expected = streaming_retrieval(video, text, ids, video_ids=video_ids, sample_ids=torch.arange(40), **options)
    assert {k: v.item() for k, v in out.items()} == pytest.approx({k: v.item() for k, v in expected.items()})


def test_padding_repeats_count_once():
    video, text, ids = make_data(n=30, n_captions=10, seed=2)
    metric = StreamingRetrievalMetric()
    feed(metric, video, text, ids, sample_ids=torch.arange(30))
    metric.update(video[:4], text[:4], ids[:4], sample_ids=torch.arange(4))  # the sampler's padding
    once = StreamingRetrievalMetric()
    feed(once, video, text, ids, sample_ids=torch.arange(30))
    assert {k: v.item() for k, v in metric.compute().items()} == {k: v.item() for k, v in once.compute().items()}


def test_features_stored_detached_on_cpu_and_state_small():
    video = torch.randn(12, 8, requires_grad=True)
    text = (torch.randn(12, 8, requires_grad=True) * 2).to(torch.bfloat16)
    metric = StreamingRetrievalMetric()
    metric.update(video * 1.0, text, [i % 3 for i in range(12)])
    for state in (metric.video_features, metric.text_features):
        for t in state:
            assert not t.requires_grad and t.grad_fn is None and t.device.type == "cpu"
    assert metric.text_features[0].dtype == torch.bfloat16 and metric.text_features[0].shape == (3, 8)
    assert set(metric.compute()) >= {"v2t/R@1", "t2v/MeanR"}
    metric.to("meta")  # a module move never drags the accumulated features along
    assert metric.video_features[0].device.type == "cpu" and metric.device.type == "meta"


def test_contract_pickle_clone_reset_state_dict():
    video, text, ids = make_data(n=20, n_captions=6, seed=3)
    metric = StreamingRetrievalMetric(top_k=(1,))
    feed(metric, video, text, ids)
    expected = {k: v.item() for k, v in metric.compute().items()}
    for other in (pickle.loads(pickle.dumps(metric)), metric.clone()):
        other.update(video[:2], text[:2], ids[:2])  # the copy does not share the seen-caption cache
        assert {k: v.item() for k, v in other.compute().items()} != {} and other is not metric
    assert torch.cat(metric.video_features).shape[0] == 20
    metric.persistent(True)
    state = metric.state_dict()
    restored = StreamingRetrievalMetric(top_k=(1,))
    restored.persistent(True)
    restored.load_state_dict(state)
    assert {k: v.item() for k, v in restored.compute().items()} == expected
    restored.update(video[:1], text[:1], ids[:1])  # known caption: not stored twice after a load
    assert torch.cat(restored.unique_text_ids).numel() == len(set(ids.tolist()))
    metric.reset()
    assert not metric.video_features and not metric.text_features and not metric.unique_text_ids
    with pytest.raises(ValueError, match="no rows on any process"):
        metric.compute()
    feed(metric, video, text, ids)  # fully usable again after reset
    assert {k: v.item() for k, v in metric.compute().items()} == expected


def test_bad_input_and_arguments():
    metric = StreamingRetrievalMetric()
    x = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="one row per sample"):
        metric.update(x, torch.zeros(5, 3), list(range(4)))
    with pytest.raises(ValueError, match="same feature dim"):
        metric.update(x, torch.zeros(4, 2), list(range(4)))
    with pytest.raises(ValueError, match="NaN or inf"):
        metric.update(x, torch.full((4, 3), float("nan")), list(range(4)))
    with pytest.raises(ValueError, match=r"one id per row \(4\), got 3"):
        metric.update(x, x, [0, 1, 2])
    with pytest.raises(ValueError, match="`text_ids` is required"):
        metric.update(x, x)
    metric.update(x, x, list(range(4)))
    with pytest.raises(ValueError, match="feature dim 5 but earlier updates had 3"):
        metric.update(torch.zeros(2, 5), torch.zeros(2, 5), [0, 1])
    with pytest.raises(ValueError, match="`sample_ids` must be given in every update or in none"):
        metric.update(x, x, list(range(4)), sample_ids=list(range(4)))
    for kwargs, match in (
        ({"top_k": (1, 0)}, "`top_k` must be a positive int"),
        ({"ties": "stable"}, "`ties` must be one of"),
        ({"median": "upper"}, "`median` must be one of"),
        ({"video_block_size": 0}, "`video_block_size` must be a positive int"),
        ({"sync_on_compute": True}, "sync_on_compute"),
        ({"accumulate_on": "gpu"}, "`accumulate_on` must be one of"),
    ):
        with pytest.raises(ValueError, match=match):
            StreamingRetrievalMetric(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": None}, r"`top_k` must be a positive int or a non-empty list .* got None"),
        ({"top_k": ()}, r"`top_k` must be a positive int or a non-empty list .* got \(\)"),
        ({"top_k": "15"}, r"`top_k` must be a positive int or a non-empty list .* got '15'"),
        ({"top_k": {1, 5}}, r"`top_k` must be a positive int or a non-empty list .* got \{1, 5\}"),
        ({"top_k": True}, r"`top_k` must be a positive int or a non-empty list .* got True"),
        ({"top_k": (1, True)}, r"`top_k` must be a positive int, got True. .* `top_k` was \(1, True\)"),
        ({"top_k": [1, 5.0]}, r"`top_k` must be a positive int, got 5.0"),
        ({"top_k": (1, 5, 1)}, r"`top_k` must not repeat a K .* got \(1, 5, 1\)"),
        ({"protocol": None}, "`protocol` must be one of 'dedup', 'paired', got None"),
        ({"ties": True}, "`ties` must be one of 'optimistic', 'pessimistic', got True"),
        ({"v2t_gallery": "group"}, "`v2t_gallery` must be one of 'texts', 'groups', got 'group'. Did you mean"),
        ({"video_block_size": True}, "`video_block_size` must be a positive int, got True"),
        ({"text_block_size": 2.0}, "`text_block_size` must be a positive int, got 2.0"),
        ({"memory_budget_bytes": 1.5e9}, r"`memory_budget_bytes` must be a positive int, got 1500000000.0"),
        ({"sync_on_compute": "no"}, "`sync_on_compute` must be left unset .* got 'no'"),
    ],
)
def test_every_constructor_argument_is_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamingRetrievalMetric(**kwargs)


def test_top_k_takes_one_int_or_a_list():
    assert StreamingRetrievalMetric(top_k=5).top_k == (5,)
    assert StreamingRetrievalMetric(top_k=[1, 10]).top_k == (1, 10)
    assert StreamingRetrievalMetric(sync_on_compute=False).top_k == (1, 5, 10)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_update_refuses_non_float_features_naming_the_dtype(dtype):
    metric = StreamingRetrievalMetric()
    bad = torch.ones(2, 3, dtype=dtype)
    match = rf"`video_features` has dtype {dtype}, but features must be one of torch.float32, .*\.float\(\)"
    with pytest.raises(ValueError, match=match):
        metric.update(bad, torch.ones(2, 3), text_ids=[0, 1])
    with pytest.raises(ValueError, match=rf"`text_features` has dtype {dtype}"):
        metric.update(torch.ones(2, 3), bad, text_ids=[0, 1])


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([0, 2**63], r"`text_ids` must fit in int64 .* got 9223372036854775808 at position 1"),
        ([-(2**63) - 1, 0], r"`text_ids` must fit in int64 .* got -9223372036854775809 at position 0"),
        ([0, 1.5], r"`text_ids` must hold only ints or only strings, got 1.5 \(float\) at position 1"),
        ([0, True], r"`text_ids` must hold only ints or only strings, got True \(bool\) at position 1"),
        ([0, "b"], r"`text_ids` must hold only ints or only strings, got 'b' \(str\) at position 1"),
        (torch.tensor([0.0, 1.0]), r"`text_ids` must hold integer ids or strings, got a tensor of dtype torch.float32"),
        ("ab", r"`text_ids` must be a sequence of ids \(one per row\), got 'ab' \(str\)"),
        ([0, 1, 2], r"`text_ids` must have one id per row \(2\), got 3"),
    ],
)
def test_update_refuses_bad_ids(ids, match):
    metric = StreamingRetrievalMetric()
    with pytest.raises(ValueError, match=match):
        metric.update(torch.ones(2, 3), torch.ones(2, 3), text_ids=ids)
    assert metric.video_features == []  # nothing half-stored


def test_update_takes_int64_extremes_and_numpy_ids():
    import numpy as np

    metric = StreamingRetrievalMetric(top_k=1)
    metric.update(torch.eye(3), torch.eye(3), text_ids=[-(2**63), 0, 2**63 - 1], sample_ids=np.arange(3))
    assert metric.compute()["v2t/R@1"].item() == 1.0


def test_in_a_lightning_validation_loop(tmp_path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from tests.helpers.trainer import make_trainer

    video, text, ids = make_data(n=24, d=8, n_captions=9, seed=4)

    class Retrieval(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.metric = StreamingRetrievalMetric(top_k=(1, 5))

        def validation_step(self, batch, batch_idx):
            v, t, i, s = batch
            self.metric.update(self.proj(v), self.proj(t), i, sample_ids=s)

        def on_validation_epoch_end(self):
            self.log_dict(self.metric.compute())
            self.metric.reset()

    data = DataLoader(TensorDataset(video, text, ids, torch.arange(24)), batch_size=5)
    model = Retrieval()
    trainer = make_trainer(tmp_path, limit_val_batches=None)
    logged = trainer.validate(model, data, verbose=False)[0]
    with torch.no_grad():
        expected = streaming_retrieval(model.proj(video), model.proj(text), ids, top_k=(1, 5))
    assert logged == pytest.approx({k: v.item() for k, v in expected.items()})


@pytest.mark.slow
def test_two_gloo_processes_match_world_size_one(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_file(SCRIPTS / "retrieval_metric_ddp.py", tmp_path, args=(str(port),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = json.loads((tmp_path / "res_1_0.json").read_text())
    ranks = [json.loads((tmp_path / f"res_2_{r}.json").read_text()) for r in (0, 1)]
    for name, expected in single.items():
        for r, got in enumerate(ranks):
            assert {k: v for k, v in got[name].items() if k != "stored_videos"} == {
                k: v for k, v in expected.items() if k != "stored_videos"
            }, (name, r)
        # no process held all the videos (except where the other rank was empty)
        if name != "empty_rank":
            assert max(got[name]["stored_videos"] for got in ranks) < expected["stored_videos"]
    # the world-size-1 numbers are the reference's numbers
    video, text, ids = make_data(n=41, d=4, n_captions=13, seed=5)
    ids[21:25] = 99
    text[21:25] = text[21]
    ref = retrieval_ranks(video, text, ids)
    assert sorted(single["padded"]["v2t_ranks"].values()) == sorted(ref.v2t.tolist())
    assert single["padded"]["stats"] == {"num_rows": 41, "num_videos": 41, "num_texts": ref.t2v.numel(), "embed_dim": 4}
    # with exact copies split over the ranks, both world sizes give the exact answer in every block layout
    video, text, ids = duplicated_data()
    for ties in ("optimistic", "pessimistic"):
        exact_v2t, exact_t2v = reference_ranks(video, text, text_ids=ids, ties=ties, scores=exact_scores)
        for blocks in (1, 7, None):
            got = single[f"copies_{blocks}_{ties}"]
            assert [got["v2t_ranks"][str(i)] for i in range(48)] == exact_v2t.tolist(), (blocks, ties)
            assert [got["t2v_ranks"][str(i)] for i in range(48)] == exact_t2v.tolist(), (blocks, ties)


@pytest.mark.cuda
def test_cuda_metric_keeps_features_pinned_on_cpu_and_matches_cpu():
    video, text, ids = make_data(n=200, d=16, n_captions=60, seed=6)
    on_gpu = StreamingRetrievalMetric(video_block_size=32).to("cuda")
    feed(on_gpu, video.cuda(), text.cuda(), ids.cuda(), batch=32)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in on_gpu.video_features)
    torch.cuda.reset_peak_memory_stats()
    got = {k: v.item() for k, v in on_gpu.compute().items()}
    assert torch.cuda.max_memory_allocated() > 0  # the blocks ran on the GPU
    on_cpu = StreamingRetrievalMetric()
    feed(on_cpu, video, text, ids)
    assert got == {k: v.item() for k, v in on_cpu.compute().items()}


@pytest.mark.slow
def test_benchmark_quick_mode_runs(tmp_path):
    import subprocess
    import sys

    from tests.helpers.subprocess_run import REPO_ROOT

    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "retrieval.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    block = report["side_by_side"][0]
    assert set(block["ratios"]) == {"ours/floor"} and set(report["naive_over_floor"]) == {"quick"}
    own = {r["config"]: r for r in report["own_process"]}
    # the naive full matrix, torchmetrics and ours agree on the numbers they report
    assert block["results"]["ours"]["v2t/R@1"] == pytest.approx(own["naive"]["result"]["v2t/R@1"])
    assert block["results"]["ours"]["t2v/R@1"] == pytest.approx(own["naive"]["result"]["t2v/R@1"])
    tm = own["torchmetrics"]
    assert tm["result"]["v2t/R@1"] == pytest.approx(block["results"]["ours"]["v2t/R@1"])


def _state_of(video, text, ids):
    source = StreamingRetrievalMetric(top_k=(1,))
    source.persistent(True)
    source.update(video, text, ids)
    return source.state_dict()


@pytest.mark.parametrize("change", ["load", "merge", "reset-then-load"])
def test_a_state_change_never_leaves_the_caption_cache_stale(change):
    """Load a state with caption ids [5, 6] into a metric that holds [0, 1], then update with [0, 1]."""
    g = torch.Generator().manual_seed(0)
    video, text = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    held = (video[:2], text[:2], [0, 1])
    loaded = _state_of(video[2:], text[2:], [5, 6])
    results = []
    for _ in range(20):  # uninitialised gallery rows would change the answer from run to run
        metric = StreamingRetrievalMetric(top_k=(1,))
        metric.persistent(True)
        metric.update(*held)
        if change == "merge":
            other = StreamingRetrievalMetric(top_k=(1,))
            other.update(video[2:], text[2:], [5, 6])
            metric.reset()
            metric.merge_state(other)
        else:
            if change == "reset-then-load":
                metric.reset()
            metric.load_state_dict(loaded)
        metric.update(*held)
        results.append({k: v.item() for k, v in metric.compute().items()})
        # what a fresh metric fed the same data gives
        fresh = StreamingRetrievalMetric(top_k=(1,))
        fresh.update(video[2:], text[2:], [5, 6])
        fresh.update(*held)
        assert results[-1] == {k: v.item() for k, v in fresh.compute().items()}
        assert sorted(torch.cat(metric.unique_text_ids).tolist()) == [0, 1, 5, 6]
    assert all(r == results[0] for r in results)
    # the loaded state dict is the caller's: updates after a load never append to it
    assert [t.tolist() for t in loaded["unique_text_ids"]] == [[5, 6]]


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_unreleased_text_ids_state_name_is_not_loaded(wrapped):
    """No alias for a name the package never released: a ``text_ids`` key is an unexpected key, as torch says."""
    video, text, ids = make_data(n=20, n_captions=6, seed=3)
    source = StreamingRetrievalMetric(top_k=(1,))
    source.persistent(True)
    feed(source, video, text, ids)
    old = {("text_ids" if k == "unique_text_ids" else k): v for k, v in source.state_dict().items()}
    restored = StreamingRetrievalMetric(top_k=(1,))
    restored.persistent(True)
    holder = torch.nn.Module()
    holder.metric = restored
    prefix = "metric." if wrapped else ""
    with pytest.raises(RuntimeError, match=rf'Unexpected key\(s\) in state_dict: "{prefix}text_ids"'):
        (holder if wrapped else restored).load_state_dict({prefix + k: v for k, v in old.items()})
    assert not hasattr(restored, "text_ids")  # the state is `unique_text_ids`, with no second name
    assert set(source.state_dict()) >= {"unique_text_ids", "text_features"}


def test_the_repeated_caption_warning_points_at_the_callers_line():
    metric = StreamingRetrievalMetric(top_k=(1,))
    metric.update(torch.eye(2), torch.eye(2), text_ids=[0, 1])
    with pytest.warns(UserWarning, match="StreamingRetrievalMetric") as caught:
        metric.update(torch.eye(2), torch.ones(2, 2), text_ids=[0, 1])
    assert [w.filename for w in caught] == [__file__]


def test_last_compute_stats_say_what_was_ranked():
    video, text, ids = make_data(n=30, d=8, n_captions=10, seed=7)
    metric = StreamingRetrievalMetric(top_k=(1,), memory_budget_bytes=2**20)
    assert metric.last_compute_stats is None
    feed(metric, video, text, ids, sample_ids=torch.arange(30))
    metric.update(video[:3], text[:3], ids[:3], sample_ids=torch.arange(3))  # padding repeats count once
    metric.compute()
    stats = metric.last_compute_stats
    n_texts = len(set(ids.tolist()))
    assert stats == {
        "num_rows": 30,
        "num_videos": 30,
        "num_texts": n_texts,
        "embed_dim": 8,
        "block_sizes": choose_block_sizes(30, n_texts, 8, "cpu", 2**20),
        "stored_feature_bytes": (33 + n_texts) * 8 * 4,
    }
    metric.reset()  # the stats of the last compute stay readable after a reset
    assert metric.last_compute_stats == stats
    metric.update(video[:4], text[:4], ids[:4], video_ids=[0, 0, 1, 1])
    metric.compute_ranks()
    assert metric.last_compute_stats["num_rows"] == 4 and metric.last_compute_stats["num_videos"] == 2


def test_a_loaded_state_of_another_feature_dim_is_what_counts():
    metric = StreamingRetrievalMetric(top_k=(1,))
    metric.persistent(True)
    metric.update(torch.randn(2, 8), torch.randn(2, 8), [0, 1])
    metric.load_state_dict(_state_of(torch.randn(2, 4), torch.randn(2, 4), [5, 6]))
    metric.update(torch.randn(2, 4), torch.randn(2, 4), [0, 1])  # the loaded rows are 4-dim: accepted
    with pytest.raises(ValueError, match="feature dim 8 but earlier updates had 4"):
        metric.update(torch.randn(2, 8), torch.randn(2, 8), [2, 3])


def test_float64_features_rank_as_float32_with_one_warning(monkeypatch):
    import warnings

    from lightning_memopt.functional.retrieval import options

    monkeypatch.setattr(options, "_float64_warned", False)
    video, text, ids = duplicated_data()
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in (torch.float64, torch.float32):
            m = StreamingRetrievalMetric(ties="pessimistic")
            feed(m, video.to(dtype), text.to(dtype), ids)
            results.append({k: v.item() for k, v in m.compute().items()})
    assert results[0] == results[1]
    assert sum("ranked in float32" in str(w.message) for w in caught) == 1
