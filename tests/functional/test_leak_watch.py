"""The MemoryAudit leak core, driven by a fake clock, a fake object walk and fake holders passed in."""

from __future__ import annotations

import pytest

from lightning_memopt.functional.footprint import LiveTensor
from lightning_memopt.functional.leak_watch import HolderWatch, LeakSampler, growth_message, leak_message
from lightning_memopt.functional.leaks import GradFnHolder
from lightning_memopt.functional.trend import least_squares_slope


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


def test_least_squares_slope():
    assert least_squares_slope([0, 1, 2, 3], [1, 3, 5, 7]) == 2.0
    assert least_squares_slope([1, 2, 3], [5, 5, 5]) == 0.0
    assert least_squares_slope([2, 2], [0, 9]) == 0.0
    with pytest.raises(ValueError, match="one length"):
        least_squares_slope([1, 2], [1])
