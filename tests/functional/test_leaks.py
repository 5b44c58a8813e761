from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_memopt.functional.leaks import (
    GradFnHolder,
    detect_growth,
    grad_fn_holders,
    metric_states_requiring_grad,
    tensors_with_grad_fn,
)


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

    from lightning_memopt.functional.leaks import grad_fn_holders

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
