"""run_micro_batches without a Trainer: a fake step with a memory budget, the halving rule and the arithmetic."""

from __future__ import annotations

import weakref

import pytest
import torch

from lightning_memopt.functional.micro_batch.retry import (
    Agreement,
    MicroBatchPart,
    combine_losses,
    extend_message,
    give_up_note,
    mark_micro_batch,
    micro_batch_facts,
    micro_batch_weight,
    next_micro_batch_size,
    restore_grads,
    run_micro_batches,
    snapshot_grads,
)
from lightning_memopt.functional.micro_batch.slicing import count_samples, micro_batch_of


class Budget:
    """A step that runs out of memory above ``limit`` samples and records every call."""

    def __init__(self, limit: int, error: type[BaseException] = torch.OutOfMemoryError) -> None:
        self.limit, self.error, self.calls = limit, error, []

    def __call__(self, start: int, stop: int) -> MicroBatchPart:
        self.calls.append((start, stop))
        if stop - start > self.limit:
            raise self.error(f"simulated: {stop - start} samples")
        return MicroBatchPart(stop - start, torch.tensor(float(start)), {"stop": stop})


def test_halves_until_it_fits_then_runs_every_sample_once_from_the_start():
    events = []
    step = Budget(limit=3)
    parts, size = run_micro_batches(
        10,
        10,
        1,
        step,
        restore=lambda start: events.append("restore"),
        release=lambda: events.append("release"),
        on_halve=lambda old, new, here: events.append((old, new, here)),
    )
    assert size == 2
    assert step.calls == [(0, 10), (0, 5), (0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert [(p.samples, p.extra["stop"]) for p in parts] == [(2, 2), (2, 4), (2, 6), (2, 8), (2, 10)]
    assert events == ["restore", "release", (10, 5, True), "restore", "release", (5, 2, True)]


def test_uneven_last_micro_batch_and_no_retry_when_it_fits():
    step = Budget(limit=8)
    parts, size = run_micro_batches(10, 4, 1, step, on_halve=lambda *a: pytest.fail("no halving expected"))
    assert size == 4 and [p.samples for p in parts] == [4, 4, 2]


def test_at_the_smallest_size_the_original_error_is_raised_extended():
    step = Budget(limit=0)
    notes = []

    def give_up(err, size):
        notes.append(size)
        extend_message(err, give_up_note(size, 8, 2, 8, 2))

    with pytest.raises(torch.OutOfMemoryError, match=r"simulated: 2 samples \[AutoMicroBatch: a micro-batch of 2 "):
        run_micro_batches(8, 8, 2, step, give_up=give_up)
    assert [b - a for a, b in step.calls] == [8, 4, 2] and notes == [2]


@pytest.mark.parametrize("error", [ValueError, RuntimeError])
def test_other_errors_pass_through_untouched(error):
    step = Budget(limit=1, error=error)
    with pytest.raises(error, match="simulated: 4 samples$"):
        run_micro_batches(4, 4, 1, step)
    assert step.calls == [(0, 4)]


def test_halving_rule_weights_and_notes():
    assert [next_micro_batch_size(s, 1) for s in (9, 2, 1)] == [4, 1, None]
    assert next_micro_batch_size(5, 3) == 3 and next_micro_batch_size(3, 3) is None
    assert micro_batch_weight(3, 12, 2) == 3 / 24
    assert "down from 16 after 3 earlier halving(s)" in give_up_note(2, 16, 2, 16, 3)
    assert "down from 2 after 0" in give_up_note(2, 16, 2, None, 0)
    err = torch.OutOfMemoryError()
    extend_message(err, " note")
    assert err.args == (" note",)


def test_combined_loss_is_the_sample_weighted_mean_over_the_window():
    parts = [
        MicroBatchPart(4, torch.tensor(2.0), {}),
        MicroBatchPart(2, torch.tensor(5.0), {}),
        MicroBatchPart(2, None, {}),
    ]
    loss = combine_losses(parts, 8, accumulate=2)
    assert loss is not None and loss.dtype == torch.float32 and loss.item() == pytest.approx((4 * 2 + 2 * 5) / 8 / 2)
    assert combine_losses([MicroBatchPart(1, None, {})], 1) is None


def test_gradients_go_back_to_the_snapshot_or_to_none():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a.grad = torch.full((2,), 3.0)
    saved = snapshot_grads([a, b])
    a.grad += 1
    b.grad = torch.ones(2)
    restore_grads([a, b], saved, zeroed=True)
    assert a.grad.tolist() == [3.0, 3.0] and b.grad is None
    restore_grads([a, b], None, zeroed=True)
    assert a.grad is None
    a.grad = torch.ones(2)
    restore_grads([a], None, zeroed=False)  # nothing to go back to: left as it is
    assert a.grad.tolist() == [1.0, 1.0]


def test_an_inactive_agreement_sends_nothing():
    comm = Agreement(no_sync=lambda: pytest.fail("no reducer to hold back on one process"))
    assert comm.max(2) == 2 and not comm.active
    with comm.no_sync():
        pass


def test_micro_batches_and_sample_counts():
    x = torch.arange(6)
    assert micro_batch_of(x, 0, 6, 6) is x and micro_batch_of(x, 2, 4, 6).tolist() == [2, 3]
    assert micro_batch_of(x, 2, 4, 6, split_batch_fn=lambda b, s, e: ("mine", s, e)) == ("mine", 2, 4)
    assert count_samples({"x": x}) == 6 and count_samples(x, lambda b: 3) == 3
    # a 0-dim tensor (a scalar such as a temperature) has no samples: the next tensor tells the size
    assert count_samples({"temperature": torch.tensor(0.5), "x": x}) == 6
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="must be a positive int"):
            count_samples(x, lambda b, bad=bad: bad)


class FailsOnRetry:
    """Runs out of memory at more than 4 samples (with a tensor in its frame); raises ``ValueError`` on the retry."""

    def __init__(self) -> None:
        self.activations = None

    def __call__(self, start: int, stop: int) -> MicroBatchPart:
        if stop - start > 4:
            activations = torch.ones(1000)
            self.activations = weakref.ref(activations)
            raise torch.OutOfMemoryError("simulated")
        raise ValueError("cannot cut this batch")


def test_an_error_raised_in_a_retry_has_the_out_of_memory_error_as_its_cause_without_its_tensors():
    step = FailsOnRetry()
    with pytest.raises(ValueError, match="cannot cut") as caught:
        run_micro_batches(8, 8, 1, step)
    cause = caught.value.__cause__
    assert isinstance(cause, torch.OutOfMemoryError) and str(cause) == "simulated"
    assert cause.__traceback__ is not None  # its lines are kept, its frames' tensors are not
    assert step.activations() is None


def test_an_error_raised_while_putting_things_back_has_the_out_of_memory_error_as_its_cause():
    def restore(start):
        raise RuntimeError("restore failed")

    with pytest.raises(RuntimeError, match="restore failed") as caught:
        run_micro_batches(8, 8, 1, Budget(limit=4), restore=restore)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


def test_micro_batch_facts_mark_the_final_error_with_the_whole_batch():
    err = torch.OutOfMemoryError("x")
    assert micro_batch_facts(err) is None
    mark_micro_batch(err, 16, 1)
    assert micro_batch_facts(err) == (16, 1)


def test_a_note_is_appended_to_the_message_and_keeps_the_error_s_other_arguments():
    from lightning_memopt.functional.micro_batch.retry import extend_message

    err = OSError(28, "No space left on device")
    extend_message(err, " [noted]")
    assert err.args == (28, "No space left on device", " [noted]")
    err = RuntimeError("CUDA out of memory.", "second", "third")
    extend_message(err, " [noted]")
    assert err.args == ("CUDA out of memory. [noted]", "second", "third")


class _PeerWithMoreSamples(Agreement):
    """This rank's agreement with one peer that has ``peer_rounds`` micro-batch rounds; every call is counted."""

    def __init__(self, peer_rounds: int) -> None:
        super().__init__(active=False)
        self.peer_left, self.calls = peer_rounds, 0

    def agree(self, value, more=0):
        self.calls += 1
        self.peer_left -= 1
        return value, max(more, int(self.peer_left > 0))


def test_a_rank_with_fewer_samples_idles_through_every_round_of_its_peers():
    """Every rank agrees once per round, also in the rounds where it has no samples left: a rank that stopped
    agreeing early would leave its peers waiting in the all-reduce."""
    comm = _PeerWithMoreSamples(peer_rounds=3)
    ran = []

    def step(start, stop):
        ran.append((start, stop))
        return MicroBatchPart(stop - start, None, {})

    parts, size = run_micro_batches(2, 2, 1, step, agreement=comm)
    assert ran == [(0, 2)] and [p.samples for p in parts] == [2] and size == 2
    assert comm.calls == 3
