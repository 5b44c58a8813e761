import statistics
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_memopt.functional.audit.leaks import (
    GradFnHolder,
    HolderWatch,
    LeakSampler,
    detect_growth,
    grad_fn_holders,
    growth_message,
    leak_message,
    metric_states_requiring_grad,
    tensors_with_grad_fn,
)
from lightning_memopt.functional.footprint import LiveTensor


def test_steady_growth_detected_with_slope_and_first_step():
    steps = list(range(10, 110, 10))
    values = [5000] * 3 + [5000 + 640 * (s - 30) for s in steps[3:]]
    g = detect_growth(steps, values, min_bytes_per_step=100, min_rising_fraction=0.6)
    assert g.growing
    assert g.first_step == 40
    assert g.total_bytes == 640 * 70
    assert g.num_samples == 10
    assert g.bytes_per_step > 100


def test_flat_one_off_jump_and_sawtooth_are_not_growth():
    steps = list(range(10, 110, 10))
    assert not detect_growth(steps, [100] * 10, 1).growing
    jump = [100, 100, 9000, 9000, 9000, 9000, 9000, 9000, 9000, 9000]
    assert not detect_growth(steps, jump, 1).growing
    saw = [100, 200, 100, 200, 100, 200, 100, 200, 100, 200]
    assert not detect_growth(steps, saw, 1).growing
    shrinking = list(range(1000, 0, -100))
    assert not detect_growth(steps, shrinking, 1).growing


def test_threshold_and_min_samples():
    steps = [1, 2, 3, 4]
    values = [0, 10, 20, 30]
    assert detect_growth(steps, values, 10).growing
    assert not detect_growth(steps, values, 11).growing
    assert not detect_growth(steps[:2], values[:2], 1).growing
    assert detect_growth(steps[:2], values[:2], 1, min_samples=2).growing
    with pytest.raises(ValueError, match="`steps` and `values`"):
        detect_growth([1, 2], [1], 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=3, max_size=30))
def test_constant_or_nonincreasing_series_never_growing(values):
    steps = list(range(len(values)))
    assert not detect_growth(steps, sorted(values, reverse=True), 0).growing
    assert not detect_growth(steps, [values[0]] * len(values), 0).growing


def test_tensors_with_grad_fn_walks_containers_and_counts_once():
    w = torch.ones(4, requires_grad=True)
    y = w * 3
    nested = {"a": [y, y, w.detach()], "b": deque([(w + 1,)]), "s": "text", "m": nn.Linear(1, 1)}
    assert tensors_with_grad_fn(nested) == (2, 32)
    assert tensors_with_grad_fn([w]) == (0, 0)  # a leaf requiring grad has no history
    deep = [[[[[[y]]]]]]
    assert tensors_with_grad_fn(deep, max_depth=2) == (0, 0)
    loop = []
    loop.append(loop)
    assert tensors_with_grad_fn(loop) == (0, 0)


class _Leaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 3)
        self.head = nn.Linear(3, 1)
        self.losses = []
        self.cache = {}
        self.clean = []

    def step(self):
        out = self.head(self.body(torch.ones(2, 3)))
        loss = out.sum()
        self.losses.append(loss)
        self.head.last = out  # an attribute of a submodule
        self.clean.append(loss.detach())


def test_grad_fn_holders_names_attributes_of_module_and_submodules():
    net = _Leaky()
    for _ in range(5):
        net.step()
    holders = grad_fn_holders(net)
    assert holders[0] == GradFnHolder("self.losses", 5, 20)
    assert GradFnHolder("self.head.last", 1, 8) in holders
    assert not any(h.path in ("self.clean", "self.cache") for h in holders)
    assert grad_fn_holders(nn.Linear(2, 2)) == []


def test_metric_states_requiring_grad_with_torchmetrics():
    torchmetrics = pytest.importorskip("torchmetrics")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)
            self.mse = torchmetrics.MeanSquaredError()
            self.cat = torchmetrics.CatMetric()

    net = Net()
    pred = net.lin(torch.ones(3, 2)).squeeze(-1)
    net.mse.update(pred.detach(), torch.zeros(3))
    assert metric_states_requiring_grad(net) == []
    net.cat.update(pred)  # keeps the graph
    assert metric_states_requiring_grad(net) == ["self.cat.value"]


@pytest.mark.slow
def test_a_dataset_kept_as_an_attribute_is_not_walked_but_a_history_beside_it_is_found():
    """300k token lists in `self.data` cost the leak scan almost nothing; a growing history is still counted."""
    import time

    from lightning_memopt.functional.audit.leaks import grad_fn_holders

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)
            self.data = [[i % 97 for i in range(20)] for _ in range(300_000)]
            self.splits = {"train": self.data, "history": []}

    module = Holder()
    start = time.perf_counter()
    assert grad_fn_holders(module) == []
    assert time.perf_counter() - start < 0.25  # the whole walk took seconds
    w = torch.ones(3, requires_grad=True)
    for i in range(500):
        module.splits["history"].append({"step": i, "loss": w * i})
    holders = grad_fn_holders(module)
    assert [(h.path, h.num_tensors) for h in holders] == [("self.splits", 500)]


def test_a_climb_that_falls_back_to_where_it_started_is_not_growth():
    # Rises in 4 of 5 intervals with a slope of about 29 bytes per step, but ends where it began.
    g = detect_growth(list(range(6)), [0, 100, 200, 300, 400, 0], min_bytes_per_step=10)
    assert g.rising_fraction == 0.8 and g.bytes_per_step > 10 and g.total_bytes == 0
    assert not g.growing


def test_one_sample_says_nothing():
    g = detect_growth([7], [5000], min_bytes_per_step=1)
    assert (g.growing, g.bytes_per_step, g.first_step, g.total_bytes, g.num_samples) == (False, 0.0, None, 0, 1)


def test_grad_fn_holders_walk_as_many_container_levels_as_asked():
    def net_keeping(depth):
        net = nn.Linear(2, 1)
        kept = net(torch.ones(1, 2)).sum()
        for _ in range(depth):
            kept = [kept]
        net.kept = kept
        return net

    assert [h.path for h in grad_fn_holders(net_keeping(4))] == ["self.kept"]
    assert grad_fn_holders(net_keeping(5)) == []  # deeper than the default max_depth=4
    assert [h.path for h in grad_fn_holders(net_keeping(5), max_depth=5)] == ["self.kept"]


# ---------------------------------------------------------------- the watches over a fit (fake clock and walk)
def _tensor(nbytes: int) -> LiveTensor:
    return LiveTensor((nbytes,), "torch.uint8", "cpu", nbytes, False, False, None)


class _Walk:
    """A walk over the objects that takes ``seconds`` of the fake clock and finds ``live`` bytes."""

    def __init__(self, now: list[float], seconds: float) -> None:
        self.now, self.seconds, self.live, self.calls = now, seconds, 0, 0

    def __call__(self, device, names=None):
        self.now[0] += self.seconds
        self.calls += 1
        return [_tensor(self.live)]


def test_cpu_walks_wait_until_training_time_pays_for_them():
    now = [0.0]
    walk = _Walk(now, seconds=1.0)
    sampler = LeakSampler(3, 1, max_overhead=0.5, clock=lambda: now[0], walk=walk)
    sampler.restart()
    assert sampler.due(has_device_memory=False)  # the first walk is free: its cost is not known yet
    assert sampler.live_bytes("cpu") == 0
    now[0] += 1.875
    assert not sampler.due(has_device_memory=False)  # 1 s of walking needs 2 s of training at 50 %
    assert sampler.due(has_device_memory=True)  # allocator readings cost nothing: never wait
    now[0] += 0.125
    assert sampler.due(has_device_memory=False)
    assert LeakSampler(3, 1, None, clock=lambda: now[0], walk=walk).due(has_device_memory=False)


def test_growth_is_reported_once_the_window_is_full_and_only_when_it_grows():
    sampler = LeakSampler(4, 50, None, walk=lambda device, names=None: [])
    verdicts = [sampler.add(step, 1000 + 10 * step) for step in (10, 20, 30, 40)]
    assert verdicts[:3] == [None, None, None]
    assert verdicts[3] is None  # 100 bytes per 10 steps = 10 bytes/step, below 50: not reported
    steep = LeakSampler(4, 50, None)
    found = [steep.add(step, 1000 * step) for step in (10, 20, 30, 40)][-1]
    assert found is not None and found.bytes_per_step == 1000.0 and found.first_step == 20
    assert list(steep.samples) == [(10, 10000), (20, 20000), (30, 30000), (40, 40000)]
    text = growth_message(found, [10, 40], "cpu", allocated=False)
    assert text.startswith("Live tensor memory on cpu grows by 1000 B per optimizer step (1000 bytes/step")


@pytest.mark.parametrize(
    ("window", "min_bytes", "match"),
    [(2, 1, "`leak_window` must be at least 3"), (3, 0, "`leak_min_bytes_per_step`"), (3, True, "got True")],
)
def test_bad_window_or_threshold(window, min_bytes, match):
    with pytest.raises(ValueError, match=match):
        LeakSampler(window, min_bytes, None)


def test_an_attribute_holding_more_tensors_with_history_every_sample_is_named():
    watch = HolderWatch(3)
    steady = GradFnHolder("self.cache", 1, 4)
    assert watch.add(1, [steady, GradFnHolder("self.losses", 1, 4)]) is None
    assert watch.add(2, [steady, GradFnHolder("self.losses", 2, 8)]) is None
    found = watch.add(3, [steady, GradFnHolder("self.losses", 3, 12)])
    assert found is not None and found.holder.path == "self.losses"
    assert found.describe() == (
        "self.losses holds more tensors with autograd history at every sample (1 at step 1, 3 at step 3:"
        " 1 per optimizer step, 12 B of tensors plus the graphs they keep alive)."
    )
    flat = HolderWatch(3)
    assert [flat.add(s, [steady]) for s in (1, 2, 3)] == [None, None, None]


def test_leak_message_names_the_holders_and_the_causes():
    message = leak_message(2, "X grows.", [GradFnHolder("self.losses", 3, 12)])
    assert message.startswith("MemoryAudit [rank 2]: X grows. Attributes holding tensors with autograd history:")
    assert "self.losses (3 tensors with grad_fn)" in message and "loss.detach()" in message


def test_the_slope_is_the_standard_librarys_least_squares():
    steps = [42451, 271494, 424605, 441002, 509533, 536111, 794773, 933489, 962839]
    values = [59291608580, 39670118931, 29347482742, 28390353523, 26131056249, 86921774442, 95084235166, 31054642443]
    values.append(24216975577)
    expected = statistics.linear_regression(steps, values).slope
    assert detect_growth(steps, values, 1).bytes_per_step == expected  # to the last bit: a plain sum differs there
    assert detect_growth([5, 5, 5], [1, 2, 3], 1).bytes_per_step == 0.0  # every sample at one step: no trend
