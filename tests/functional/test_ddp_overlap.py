"""The reduction overlapped with backward, on a real process group of one (gloo): buckets, the window, late gradients,
a round without backward, and the completion an agreement runs after an out-of-memory error. The protocol between
two ranks is tested by tests/callbacks/test_auto_micro_batch_ddp_overlap.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memopt.functional.micro_batch.ddp_overlap import OverlappedReduction, gradient_buckets
from lightning_memopt.functional.micro_batch.retry import Agreement, PeerOutOfMemoryError


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 8)
        self.mix = nn.Parameter(torch.randn(8, 8).t())  # not contiguous
        self.last = nn.Linear(8, 1)


def _model() -> _Model:
    return _Model()


def _loss(model: _Model, x: torch.Tensor, reuse: bool = False) -> torch.Tensor:
    h = torch.tanh(model.first(x))
    if reuse:  # the first layer's gradient comes in twice, the second time in a backward of its own (reentrant)
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(model.first(t[:, :4])), h, use_reentrant=True)
        h = torch.cat([h, h], dim=1)[:, :8]
    return model.last(h @ model.mix).pow(2).mean()


def _expected_grads(x: torch.Tensor, reuse: bool = False) -> list[torch.Tensor]:
    model = _model()
    _loss(model, x, reuse).backward()
    return [p.grad.clone() for p in model.parameters()]


def _reduction(model: nn.Module, bucket_bytes: int = 40) -> OverlappedReduction:
    return OverlappedReduction(list(model.parameters()), Agreement(True, "cpu"), bucket_bytes=bucket_bytes)


def test_buckets_go_last_parameter_first_within_the_cap_one_dtype_each():
    sizes = ((2, torch.float32), (2, torch.float64), (3, torch.float64), (20, torch.float64))
    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in sizes]
    assert gradient_buckets(params, bucket_bytes=64, first_bucket_bytes=8) == [[3], [2, 1], [0]]
    assert gradient_buckets(params, bucket_bytes=256, first_bucket_bytes=168) == [[3], [2, 1], [0]]
    assert gradient_buckets(params, bucket_bytes=256, first_bucket_bytes=184) == [[3, 2], [1], [0]]
    assert gradient_buckets(params, bucket_bytes=64, first_bucket_bytes=184) == [[3], [2, 1], [0]]  # first <= cap


@pytest.mark.parametrize("reuse", [False, True])
def test_a_window_averages_every_gradient_as_a_plain_backward_gives_it(one_process_group, reuse):
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    model = _model()
    reduction = _reduction(model)
    reduction.arm(more=False)
    reduction.wrap_backward(lambda loss: loss.backward())(_loss(model, x, reuse))
    assert reduction.reduced and reduction.launched_in_backward >= 2
    assert reduction.late_windows == int(reuse)
    for got, expected in zip((p.grad for p in model.parameters()), _expected_grads(x, reuse)):
        assert torch.allclose(got, expected, atol=1e-7)
    assert model.mix.grad.stride() == model.mix.stride()  # laid out as its parameter
    reduction.remove()


def test_a_backward_outside_a_window_is_left_alone(one_process_group):
    model = _model()
    reduction = _reduction(model)
    grads_before = reduction.launched_in_backward
    reduction.wrap_backward(lambda loss: loss.backward())(_loss(model, torch.ones(4, 4)))  # not armed
    assert not reduction.reduced and reduction.launched_in_backward == grads_before
    assert all(p.grad is not None for p in model.parameters())


def test_a_rank_with_more_micro_batches_makes_every_rank_leave_the_reduction_to_after_the_batch(one_process_group):
    model = _model()
    reduction = _reduction(model)
    reduction.arm(more=True)
    reduction.wrap_backward(lambda loss: loss.backward())(_loss(model, torch.ones(4, 4)))
    assert not reduction.reduced and reduction.launched_in_backward == 0


def test_a_first_round_without_backward_still_runs_its_window_and_keeps_missing_gradients_missing(one_process_group):
    model = _model()
    model.last.weight.grad = torch.full_like(model.last.weight, 2.0)  # from an earlier batch of the window
    reduction = _reduction(model)
    reduction.arm(more=False)
    reduction.finish_step()
    assert reduction.reduced and not reduction.armed
    assert torch.equal(model.last.weight.grad, torch.full_like(model.last.weight, 2.0))
    assert [p.grad is None for p in model.parameters()] == [True, True, True, False, True]  # mix, first, last


def test_out_of_memory_inside_the_window_leaves_it_to_the_agreement_which_completes_it_first(one_process_group):
    model = _model()
    agreement = Agreement(True, "cpu")
    reduction = OverlappedReduction(list(model.parameters()), agreement, bucket_bytes=40)

    def backward(loss):
        loss.backward(retain_graph=True)  # the last layers' buckets start
        raise torch.OutOfMemoryError("simulated: in the middle of backward")

    reduction.arm(more=False)
    with pytest.raises(torch.OutOfMemoryError):
        reduction.wrap_backward(backward)(_loss(model, torch.ones(4, 4)))
    assert agreement.before_agreeing == reduction.complete  # the window is open
    agreement.in_step = True
    agreement.before_collective()  # inside the window no point agrees: every rank runs the collective
    assert agreement.points == 0
    assert agreement.agree(1, 0) == (1, 0)
    assert agreement.before_agreeing is None and not reduction.reduced


def test_the_window_point_tells_a_rank_that_another_one_ran_out_of_memory(one_process_group, monkeypatch):
    model = _model()
    agreement = Agreement(True, "cpu")
    reduction = OverlappedReduction(list(model.parameters()), agreement, bucket_bytes=40)
    real = agreement.start_point
    monkeypatch.setattr(agreement, "start_point", lambda value, more: real(1, more))  # as another rank's flag
    reduction.arm(more=False)
    with pytest.raises(PeerOutOfMemoryError):
        reduction.wrap_backward(lambda loss: loss.backward())(_loss(model, torch.ones(4, 4)))
    assert reduction.launched_in_backward == 0 and agreement.before_agreeing is None
    assert all(p.grad is not None for p in model.parameters())  # the local backward's, put back by the retry


def test_a_new_set_of_trainable_parameters_needs_a_new_reduction(one_process_group):
    model = _model()
    reduction = _reduction(model)
    params = list(model.parameters())
    assert reduction.matches(params) and not reduction.matches(params[1:])
    reduction.remove()
    model.zero_grad()
    _loss(model, torch.ones(4, 4)).backward()  # the hooks are gone: nothing happens in them
    assert reduction.launched_in_backward == 0
