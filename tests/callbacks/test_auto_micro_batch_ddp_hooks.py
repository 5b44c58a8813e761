"""AutoMicroBatch under DDP keeps the user's communication hook: run on DDP's buckets once per optimizer step.

The fast tests build a one-process DDP module (gloo, world size 1) in this process. The slow ones read one 2-process
run of ``tests/scripts/amb_ddp_hooks.py`` (fp16 compression and PowerSGD, rank 1 alone out of memory at the forward
or backward of the first or last micro-batch) and compare it with Lightning's own DDP accumulation.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from lightning_memopt.functional.micro_batch.ddp_sync import (
    check_ddp_for_micro_batches,
    comm_hook_name,
    gradient_reduction,
    reduce_with_comm_hook,
)
from lightning_memopt.functional.micro_batch.retry import Agreement
from tests.helpers.subprocess_run import SCRIPTS, run_file


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))


def _ddp(module, **kwargs):
    # buckets of 10 KB: several of them (without `find_unused_parameters` DDP starts with one bucket for everything)
    return DistributedDataParallel(module, bucket_cap_mb=0.01, find_unused_parameters=True, **kwargs)


def _backward(ddp):
    with ddp.no_sync():  # as AutoMicroBatch runs every micro-batch
        ddp(torch.randn(5, 64)).square().sum().backward()


def test_hook_names(one_process_group):
    python_hook = _ddp(_model())
    python_hook.register_comm_hook(None, default_hooks.fp16_compress_hook)
    builtin = _ddp(_model())
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert comm_hook_name(python_hook) == "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook"
    assert comm_hook_name(builtin) == "BuiltinCommHookType.FP16_COMPRESS"
    assert comm_hook_name(_ddp(_model())) is None
    assert gradient_reduction(_ddp(_model())) is None  # no hook: the plain average
    assert gradient_reduction(python_hook) is not None


@pytest.mark.parametrize("as_view", [False, True], ids=["grad-copies", "gradient_as_bucket_view"])
def test_the_hook_reduces_every_bucket_once_and_its_result_becomes_the_gradients(one_process_group, as_view):
    ddp = _ddp(_model(), gradient_as_bucket_view=as_view)
    calls = []

    def doubling_hook(state, bucket):
        calls.append((bucket.index(), bucket.is_last(), [tuple(p.shape) for p in bucket.parameters()]))
        future = torch.futures.Future()
        future.set_result(bucket.buffer() * 2)  # a "reduction" whose effect is visible
        return future

    ddp.register_comm_hook(None, doubling_hook)
    _backward(ddp)
    assert calls == []  # no_sync: DDP's reducer never ran the hook
    params = list(ddp.module.parameters())
    local = [p.grad.clone() for p in params]
    params[-1].grad = None  # a parameter without a gradient on this rank, left out of the reduction
    reduce_with_comm_hook(ddp, params[:-1])
    assert len(calls) > 2 and [i for i, _, _ in calls] == list(range(len(calls)))
    assert [last for _, last, _ in calls] == [False] * (len(calls) - 1) + [True]
    assert sorted(s for _, _, shapes in calls for s in shapes) == sorted(tuple(p.shape) for p in params)
    for p, g in zip(params[:-1], local[:-1]):
        torch.testing.assert_close(p.grad, 2 * g, rtol=0, atol=0)
    assert params[-1].grad is None


def test_average_gradients_hands_every_gradient_any_rank_has_to_the_hook(one_process_group):
    module = _model()
    params = list(module.parameters())
    for p in params[:-1]:
        p.grad = torch.ones_like(p)
    seen = []
    Agreement(True, "cpu").average_gradients(params, reduce=lambda ps: seen.extend(ps))
    assert [id(p) for p in seen] == [id(p) for p in params[:-1]]  # none for the gradient no rank has
    assert params[-1].grad is None


def test_the_plain_average_all_reduces_at_most_a_bucket_at_a_time(one_process_group, monkeypatch):
    module = _model()  # 64x64 weights: 16 KiB of fp32 gradient each
    params = list(module.parameters())
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i + 1))
    sizes = []
    all_reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording)
    Agreement(True, "cpu").average_gradients(params, bucket_bytes=20 * 1024)
    grad_bytes = [p.numel() * p.element_size() for p in params]
    assert sizes[0] == len(params) * 8  # the flags of which parameters have a gradient (int64)
    assert sum(sizes[1:]) == sum(grad_bytes) and len(sizes) > 2
    assert max(sizes[1:]) <= max(20 * 1024, *grad_bytes)  # a larger gradient goes alone
    for i, p in enumerate(params):  # one process: the average is the gradient itself, each in its place
        assert torch.equal(p.grad, torch.full_like(p, float(i + 1)))


def test_a_hook_that_cannot_run_on_buckets_is_refused_naming_the_hook_and_the_choice(one_process_group):
    ddp = _ddp(_model())
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    ddp._use_python_reducer = True  # DDP under compiled autograd: hooks get single gradients, no buckets
    with pytest.raises(ValueError, match=r"`torch\..*fp16_compress_hook`.*Remove the hook .* or remove AutoMicroBatch"):
        check_ddp_for_micro_batches(ddp)


def test_delayed_all_reduce_is_refused_when_fit_starts(one_process_group):
    module = _model()
    delayed = [("0.weight", module[0].weight)]
    ddp = _ddp(module, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=module[2].weight)
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=ddp))
    with pytest.raises(ValueError, match=r"`delay_all_reduce_named_params`.*or remove AutoMicroBatch"):
        AutoMicroBatch().on_fit_start(trainer, None)
    AutoMicroBatch().on_fit_start(SimpleNamespace(strategy=SimpleNamespace(model=_ddp(_model()))), None)  # plain DDP


# ------------------------------------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def hooks_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("amb_ddp_hooks")
    start = time.monotonic()
    proc = run_file(SCRIPTS / "amb_ddp_hooks.py", directory, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return directory, time.monotonic() - start


def _load(directory, name):
    return [torch.load(directory / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)]


def _assert_same_as_lightning(directory, name, hook):
    ranks, refs = _load(directory, name), _load(directory, f"ref_{hook}")
    for rank, ref in zip(ranks, refs):
        assert rank["step"] == ref["step"] == 3
        assert ref["calls"] == [(0, 0, True), (1, 0, True), (2, 0, True)]  # one bucket, once per optimizer step
        assert rank["calls"] == ref["calls"], name
        assert rank["powersgd"] == ref["powersgd"], name
        for key, value in ref["weights"].items():
            assert torch.equal(rank["weights"][key], value), (name, key)
    return ranks


@pytest.mark.slow
@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_the_registered_hook_runs_as_under_lightning_ddp_accumulation(hooks_run, hook):
    directory, _ = hooks_run
    ranks = _assert_same_as_lightning(directory, f"ours_none_{hook}", hook)
    assert [r["retries"] for r in ranks] == [0, 0]
    if hook == "powersgd":  # it counted one iteration per optimizer step and compressed in the last one
        iterations, before, after = ranks[0]["powersgd"]
        assert iterations == 3 and 0 < after < before


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "forward_first_fp16",
        "forward_last_fp16",
        "backward_first_fp16",
        "backward_last_fp16",
        "backward_last_powersgd",
    ],
)
def test_an_oom_on_one_rank_never_hangs_and_the_hook_still_runs_once_per_step(hooks_run, case):
    directory, seconds = hooks_run
    assert seconds < 300  # the script ran 9 fits; a hang would have waited for the 300 s DDP time-out
    ranks = _assert_same_as_lightning(directory, f"ours_{case}", case.rsplit("_", 1)[1])
    first_tries = [4, 2] if "_first_" in case else [4, 4, 2]  # out of memory in the first or the second micro-batch
    for rank in ranks:  # both ranks halved together, 4 -> 2, and rank 0 (plenty of memory) followed rank 1
        assert (rank["micro"], rank["retries"]) == (2, 1)
        assert rank["sizes"][: len(first_tries)] == first_tries


# ------------------------------------------------------------------------------------------- the cost model


def _benchmark():
    import importlib.util
    import sys

    from tests.helpers.subprocess_run import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # it imports benchmarks/_machine.py
    try:
        spec = importlib.util.spec_from_file_location(
            "auto_microbatch_bench", REPO_ROOT / "benchmarks/auto_microbatch.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    return module


def test_the_sync_cost_model_in_its_two_limits():
    model = _benchmark().ddp_sync_model
    ring = 2 * (8 - 1) / 8  # bytes a ring all-reduce moves per byte of gradient, 8 ranks
    # communication-bound, 10 equal buckets: DDP starts when the first bucket is ready, 1/10 into backward
    slow = model(10e9, 1e9, backward_s=1.0, world_size=8, bucket_bytes=1e9)
    assert slow["all_reduce_s"] == pytest.approx(10 * ring)
    assert slow["reducer_s"] == pytest.approx(0.1 + 10 * ring)
    assert slow["added_s"] == pytest.approx(1.0 - 0.1)
    # compute-bound: DDP hides all but the last bucket's all-reduce behind backward
    fast = model(10e9, 1000e9, backward_s=1.0, world_size=8, bucket_bytes=1e9)
    assert fast["reducer_s"] == pytest.approx(1.0 + ring * 1e9 / 1000e9)
    assert fast["added_s"] == pytest.approx(ring * 9e9 / 1000e9)
    # one bucket: DDP cannot overlap either, nothing is lost
    assert model(1e9, 10e9, backward_s=1.0, bucket_bytes=2e9)["added_s"] == pytest.approx(0.0)


def test_benchmark_prints_the_ddp_sync_model_and_your_case(tmp_path, monkeypatch, capsys):
    import json

    out = tmp_path / "ddp.json"
    args = ["--ddp-model-only", "--grad-gb", "5.2", "--bus-gbps", "20", "--backward-s", "0.2", "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["auto_microbatch.py", *args])  # in this process: the model starts nothing
    assert _benchmark().main() == 0
    assert "your case: 5.2 GB of gradients at 20.0 GB/s" in capsys.readouterr().out
    result = json.loads(out.read_text())
    links = {row["link"] for row in result["ddp_sync_model"]}
    assert "PCIe 4.0 x16, 8 GPUs" in links and len(result["ddp_sync_model"]) == 10
    assert all(0 <= row["added_s"] <= min(row["backward_s"], row["all_reduce_s"]) for row in result["ddp_sync_model"])
    assert result["your_case"]["explicit_s"] == pytest.approx(0.2 + 2 * 7 / 8 * 5.2 / 20)
    # a batch that runs whole overlaps as DDP's reducer does, plus the round's small all-reduce
    for row in result["ddp_sync_model"]:
        assert row["overlap_s"] == pytest.approx(row["reducer_s"] + row["overlap_added_s"])
        assert row["overlap_added_s"] < row["added_s"]
