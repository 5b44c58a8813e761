"""What a retry puts back (functional/micro_batch/retry_state.py): random states, metric states, logged results,
buffers."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torchmetrics import CatMetric, MeanMetric

from lightning_memopt.functional.micro_batch.retry_state import (
    BufferKeeper,
    MetricStates,
    RetrySnapshot,
    collect_rng_states,
    find_parts,
    set_rng_states,
)

# ------------------------------------------------------------------------------------------------ random states


def draws():
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_the_cpu_python_and_numpy_generators_draw_again_what_they_drew_after_the_snapshot():
    states = collect_rng_states()
    first = draws()
    set_rng_states(states)
    assert draws() == first
    assert draws() != first  # the generators really move on


class FakeCuda:
    """An initialised accelerator with two devices, each generator state a tensor."""

    def __init__(self, initialised=True):
        self.initialised = initialised
        self.states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
        self.reads = 0

    def is_initialized(self):
        return self.initialised

    def get_rng_state_all(self):
        self.reads += 1
        return [s.clone() for s in self.states]

    def set_rng_state_all(self, states):
        self.states = [s.clone() for s in states]


@pytest.mark.parametrize("name", ["cuda", "xpu"], ids=["nvidia-fake", "intel-fake"])
def test_every_generator_of_an_initialised_accelerator_is_put_back(monkeypatch, name):
    fake = FakeCuda()
    monkeypatch.setattr(torch, name, fake, raising=False)
    states = collect_rng_states()
    fake.states = [torch.tensor([9, 9], dtype=torch.uint8)] * 2  # the attempt advanced both devices
    set_rng_states(states)
    assert [s.tolist() for s in fake.states] == [[1, 2], [3, 4]]


def test_an_accelerator_not_initialised_is_not_initialised_by_the_snapshot(monkeypatch):
    fake = FakeCuda(initialised=False)
    monkeypatch.setattr(torch, "cuda", fake)
    states = collect_rng_states()
    assert fake.reads == 0 and states.accelerators == {}


# ------------------------------------------------------------------------------------------------ metrics, results


def test_tensor_and_list_states_and_update_counts_are_put_back_even_after_two_failed_attempts():
    mean, cat = MeanMetric(), CatMetric()
    mean.update(torch.tensor([1.0, 3.0]))
    cat.update(torch.tensor([1.0]))
    kept = MetricStates([mean, cat])
    for attempt in range(2):  # the restored states are copies: the second attempt's in-place updates do not reach them
        mean.update(torch.tensor([100.0 + attempt] * 4))
        cat.update(torch.tensor([5.0, 6.0]))
        kept.restore()
        assert mean.compute().item() == 2.0 and mean.update_count == 1
        assert cat.compute().reshape(-1).tolist() == [1.0] and cat.update_count == 1


def test_a_logged_key_added_by_a_failed_attempt_is_removed_and_a_replaced_one_comes_back():
    results = {"training_step.loss": MeanMetric()}
    results["training_step.loss"].update(torch.tensor(2.0))
    original = results["training_step.loss"]
    snapshot = RetrySnapshot(nn.Linear(1, 1), results, rng=False)
    results["training_step.new"] = MeanMetric()
    results["training_step.loss"] = MeanMetric()
    original.update(torch.tensor(10.0))
    snapshot.restore()
    assert list(results) == ["training_step.loss"] and results["training_step.loss"] is original
    assert original.compute().item() == 2.0


def test_metrics_among_the_submodules_are_found():
    module = nn.Module()
    module.metrics = nn.ModuleDict({"acc": MeanMetric()})
    snapshot = RetrySnapshot(module, None, rng=False)
    module.metrics["acc"].update(torch.tensor(1.0))
    snapshot.restore()
    assert module.metrics["acc"].update_count == 0


def test_nothing_is_kept_when_switched_off():
    module = nn.BatchNorm1d(2)
    module.acc = MeanMetric()
    snapshot = RetrySnapshot(module, None, rng=False, metrics=False, buffers=None)
    module(torch.randn(4, 2))
    module.acc.update(torch.tensor(1.0))
    before = torch.rand(1)
    assert snapshot.restore() == []
    assert int(module.num_batches_tracked) == 1 and module.acc.update_count == 1
    assert not torch.equal(torch.rand(1), before)


# ------------------------------------------------------------------------------------------------ buffers


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("table", torch.arange(1000.0))  # a large buffer no batch changes
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        return self.bn(x) + self.table[:3]


def test_buffers_are_copied_once_then_only_those_batches_change():
    model, keeper = WithBuffers(), BufferKeeper()
    kept = keeper.keep(find_parts(model).buffers)
    assert all(b.copy is not None for b in kept)  # nothing learned yet: every buffer
    model(torch.randn(8, 3))
    keeper.learn(kept)
    assert keeper.changing == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    copied = {b.key for b in keeper.keep(find_parts(model).buffers) if b.copy is not None}
    assert copied == keeper.changing  # the large table is no longer copied


def test_batchnorm_statistics_are_put_back_after_one_and_after_two_failed_attempts():
    model, keeper = WithBuffers(), BufferKeeper()
    model(torch.randn(8, 3))  # some statistics to go back to
    start = {k: v.clone() for k, v in model.state_dict().items()}
    kept = keeper.keep(find_parts(model).buffers)
    for _ in range(2):
        model(torch.randn(8, 3))
        assert keeper.restore(kept) == []
        for key, value in model.state_dict().items():
            assert torch.equal(value, start[key]), key


def test_a_replaced_buffer_is_put_back_and_one_changed_in_place_without_a_copy_is_named():
    model, keeper = WithBuffers(), BufferKeeper()
    keeper.learn(keeper.keep(find_parts(model).buffers))  # a batch that changed nothing
    kept = keeper.keep(find_parts(model).buffers)
    table = model.table
    model.table = torch.zeros(1000)  # replaced: put back without a copy
    model.steps.add_(1)  # changed in place, never before: cannot be put back
    assert keeper.restore(kept) == ["steps"]
    assert model.table is table and torch.equal(table, torch.arange(1000.0))
    assert "steps" in keeper.changing  # copied from now on
    assert keeper.restore(kept) == []  # said once


def test_buffers_of_a_lazy_module_not_materialised_yet_are_left_alone():
    model = nn.LazyBatchNorm1d()
    snapshot = RetrySnapshot(model, None, rng=False, buffers=BufferKeeper())  # running_mean is not a tensor yet
    model(torch.randn(4, 3))
    assert snapshot.restore() == []
    assert int(model.num_batches_tracked) == 0  # the counter was a tensor from the start: put back


def test_a_large_buffer_changed_in_place_is_kept_in_one_reused_host_copy_and_put_back():
    from lightning_memopt.functional.micro_batch import retry_state

    class Queue(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("queue", torch.zeros(retry_state.HOST_COPY_BYTES // 4 * 2))  # 2 MiB of float32
            self.register_buffer("small", torch.zeros(4))

        def forward(self, step):
            self.queue.add_(step)  # in place, every batch
            self.small.add_(step)

    module, keeper = Queue(), BufferKeeper()
    for _ in range(3):  # batch 0 learns which buffers change; batches 1 and 2 copy only those
        snapshot = RetrySnapshot(module, None, buffers=keeper)
        module(1.0)
        snapshot.succeeded()
    copies = dict(keeper._copies)
    assert set(copies) == {"queue", "small"} and all(c.device.type == "cpu" for c in copies.values())
    snapshot = RetrySnapshot(module, None, buffers=keeper)
    assert all(keeper._copies[k] is copies[k] for k in copies)  # reused: no new allocation per batch
    module(5.0)  # a failed attempt
    assert snapshot.restore() == []
    assert module.queue.eq(3.0).all() and module.small.eq(3.0).all()
    assert keeper.copied_bytes() == module.queue.nbytes + module.small.nbytes


def test_a_batchnorm_first_used_by_a_retried_batch_gets_its_statistics_back():
    # batch 0 does not use the BatchNorm (nothing learned about it); batch 1's failed attempt is its first use: its
    # kernels change the running statistics without moving their version counters
    model = nn.ModuleDict({"linear": nn.Linear(3, 3), "bn": nn.BatchNorm1d(3)})
    keeper = BufferKeeper()
    snapshot = RetrySnapshot(model, None, buffers=keeper)
    model["linear"](torch.randn(4, 3))
    snapshot.succeeded()
    snapshot = RetrySnapshot(model, None, buffers=keeper)
    model["bn"](torch.randn(8, 3) * 5 + 2)  # the failed attempt
    assert snapshot.restore() == []  # nothing lost, no warning naming only num_batches_tracked
    assert model["bn"].running_mean.eq(0).all() and model["bn"].running_var.eq(1).all()
    assert int(model["bn"].num_batches_tracked) == 0
