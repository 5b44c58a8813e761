"""The Trainer-free estimation core (``lightning_memopt.functional.planning``), driven directly."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lightning_memopt.functional.planning import (
    FakeStepError,
    LiveBytes,
    count_training_steps,
    cuda_autocast,
    kernel_scratch,
    use_foreach,
)

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def sgd(model):
    return [SGD(model.parameters())]


def summed(model, batch, step):
    return model(batch).sum()


# ------------------------------------------------------------------------------------------------ the counter


def test_the_counter_follows_a_storage_from_creation_to_free_under_its_latest_label():
    counter = LiveBytes(block_bytes=512)
    x = torch.ones(100)  # 400 bytes: one 512-byte block
    counter.track(x, "batch")
    counter.track(x[10:], "other")  # a view: the same storage, counted once
    assert (counter.now, counter.totals) == (512, {"batch": 512})
    assert counter.info(x) == (512, "batch", 1, 0)
    counter.relabel(x, "gradients")
    assert counter.totals == {"batch": 0, "gradients": 512} and counter.info(x)[1] == "gradients"
    y = torch.ones(200)  # 800 bytes: two blocks
    counter.relabel(y, "optimizer_states")  # unknown: counted first
    assert (counter.now, counter.peak) == (1536, 1536) and counter.peak_totals["optimizer_states"] == 1024
    del x
    assert counter.now == 1024 and counter.totals["gradients"] == 0 and counter.peak == 1536
    assert LiveBytes().storage_bytes(y) == 800 and LiveBytes(512).storage_bytes(y) == 1024


def test_a_softmax_kernel_s_own_copy_of_a_non_contiguous_input_is_counted_while_it_runs():
    n = 256 * 256
    x, y, grad = torch.randn(256, 256), torch.randn(256, 256).softmax(1), torch.ones(256, 256)

    def peak(run):
        with LiveBytes(scratch=kernel_scratch) as counter:
            for t in (x, y, grad):
                counter.track(t)
            run()
        return counter.peak - 3 * n * 4

    assert peak(lambda: torch.log_softmax(x, 1)) == n * 4  # contiguous: the output only
    assert peak(lambda: torch.log_softmax(x.T, 1)) == 2 * n * 4  # transposed: and a contiguous copy inside
    assert peak(lambda: torch.softmax(x.T, 1)) == 2 * n * 4
    backward = torch.ops.aten._softmax_backward_data
    assert peak(lambda: backward(grad, y, 1, torch.float32)) == n * 4
    assert peak(lambda: backward(grad.T, y.T, 1, torch.float32)) == 3 * n * 4  # both copied inside


# ------------------------------------------------------------------------------------------------ the steps


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_two_steps_of_a_linear_layer_peak_in_the_second_forward_with_the_first_gradients_alive(fake):
    d, b = 64, 32
    model = nn.Linear(d, d, bias=False)
    count = count_training_steps(model, torch.randn(b, d), summed, sgd, fake=fake)
    assert count.peak_bytes == 4 * (2 * d * d + 2 * b * d) + 4  # W, its gradient, x, y and the loss
    assert (count.peak_phase, count.peak_step) == ("forward", 1)
    assert count.at_peak["gradients"] == count.gradient_bytes == 4 * d * d
    assert count.parameter_bytes == count.trainable_parameter_bytes == 4 * d * d and count.batch_bytes == 4 * b * d
    assert sum(count.at_peak.values()) == count.peak_bytes
    assert model.weight.grad is None  # a twin ran, not the model
    one = count_training_steps(model, torch.randn(b, d), summed, sgd, fake=fake, steps=1)
    assert one.peak_bytes < count.peak_bytes and one.peak_step == 0  # no gradient yet in the first forward
    rounded = count_training_steps(model, torch.randn(b, d), summed, sgd, fake=fake, block_bytes=512)
    assert rounded.peak_bytes == count.peak_bytes - 4 + 512  # the 4-byte loss takes a whole block


def test_states_made_by_the_optimizer_step_that_peaks_count_as_optimizer_states():
    """AdamW over one large weight: step 0's update peaks with both moments and the step counter made."""
    model = nn.Linear(256, 256, bias=False)
    count = count_training_steps(model, torch.randn(2, 256), summed, lambda m: [torch.optim.AdamW(m.parameters())])
    assert (count.peak_phase, count.peak_step) == ("optimizer step", 0)
    assert count.at_peak["optimizer_states"] == count.optimizer_state_bytes == 2 * 4 * 256 * 256 + 4
    assert count.at_peak["temporaries"] > 0


def test_a_step_that_reads_a_value_raises_fake_step_error_naming_the_operator():
    def reads(model, batch, step):
        y = model(batch)
        return y.sum() * float(y.max().item() > 0)

    with pytest.raises(FakeStepError, match=r"operator `aten._local_scalar_dense[^`]*` cannot run") as info:
        count_training_steps(nn.Linear(8, 8), torch.randn(4, 8), reads, sgd)
    assert info.value.op.startswith("aten._local_scalar_dense")
    assert count_training_steps(nn.Linear(8, 8), torch.randn(4, 8), reads, sgd, fake=False).peak_bytes > 0


def test_the_step_s_own_errors_pass_through_unchanged():
    def broken(model, batch, step):
        raise KeyError("labels")

    with pytest.raises(KeyError, match="labels"):
        count_training_steps(nn.Linear(8, 8), torch.randn(4, 8), broken, sgd)


# ------------------------------------------------------------------------------------------------ CUDA modelling


def test_cuda_autocast_runs_cuda_s_float32_functions_in_float32():
    x, weight = torch.randn(4, 8), torch.randn(8, 8)
    ln = nn.LayerNorm(8)

    def dtypes():
        h = nn.functional.linear(x, weight)
        return (
            h.dtype,
            ln(h).dtype,
            torch.softmax(h, -1).dtype,
            h.sum().dtype,
            (h**2).dtype,
            h.exp().dtype,
            h.sum(dtype=torch.bfloat16).dtype,
        )

    bf16, fp32 = torch.bfloat16, torch.float32
    with torch.autocast("cpu", dtype=bf16):
        assert dtypes() == (bf16, bf16, bf16, bf16, bf16, bf16, bf16)  # the CPU's lists
        with cuda_autocast():
            assert dtypes() == (bf16, fp32, fp32, fp32, fp32, fp32, bf16)  # CUDA's (explicit dtype= is kept)
    with cuda_autocast():  # without autocast nothing changes
        assert dtypes()[:2] == (fp32, fp32)
        assert nn.functional.linear(x.bfloat16(), weight.bfloat16()).sum().dtype == bf16


def test_foreach_is_set_only_where_it_was_left_to_torch():
    params = [nn.Parameter(torch.zeros(2))]
    default, explicit = torch.optim.AdamW(params), torch.optim.AdamW(params, foreach=False)
    fused = torch.optim.AdamW(params, fused=True)
    assert use_foreach([explicit, fused]) is False
    assert explicit.param_groups[0]["foreach"] is False and fused.param_groups[0]["foreach"] is None
    assert use_foreach([explicit, default]) is True and default.param_groups[0]["foreach"] is True


def test_cuda_attention_repeats_grouped_key_value_heads_as_torch_does():
    """Grouped-query attention (``enable_gqa``): 4 query heads share 2 key/value heads; the fused stand-in gives
    torch's own result, and 4-d inputs with other head counts and no ``enable_gqa`` still reach torch (its error)."""
    from lightning_memopt.functional.planning import cuda_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 5, 8, generator=g) for heads in (4, 2, 2))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with cuda_attention():
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with pytest.raises(RuntimeError):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got, expected)


# ------------------------------------------------------------------------------------------------ accumulation, manual


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
@pytest.mark.parametrize("accumulate", [2, 3])
def test_a_later_micro_batch_s_backward_holds_the_kept_gradient_and_the_new_one(accumulate, fake):
    d, b = 64, 32
    model = nn.Linear(d, d, bias=False)
    plain = count_training_steps(model, torch.randn(b, d), summed, sgd, fake=fake)
    count = count_training_steps(model, torch.randn(b, d), summed, sgd, fake=fake, accumulate_grad_batches=accumulate)
    # W, its kept gradient, x, the new gradient before it is added; the loss (divided) and two scalar gradients
    assert count.peak_bytes == 4 * (3 * d * d + b * d) + 3 * 4 > plain.peak_bytes
    assert (count.peak_phase, count.peak_step, count.peak_micro_batch) == ("backward", 0, 1)
    assert count.at_peak["gradients"] == 4 * d * d and count.accumulate_grad_batches == accumulate
    assert (plain.peak_micro_batch, plain.accumulate_grad_batches) == (0, 1)


def test_a_manual_step_with_counted_optimizers_and_backward_counts_as_the_automatic_one():
    """A step that zeroes, backpropagates and steps itself (through what ``manual`` hands it) counts the same bytes
    in the same phases as Lightning's automatic order."""
    model, x = nn.Linear(64, 64), torch.randn(32, 64)
    handed = {}

    def bind(twin, optimizers, backward):
        handed.update(optimizers=optimizers, backward=backward)

    def manual_step(twin, batch, step):
        (opt,) = handed["optimizers"]
        loss = twin(batch).sum()
        opt.zero_grad()
        handed["backward"](loss)
        del loss  # as the automatic order drops it before the optimizer step
        opt.step()

    adam = functools.partial(torch.optim.Adam, lr=0.1)
    automatic = count_training_steps(model, x, summed, lambda m: [adam(m.parameters())])
    manual = count_training_steps(model, x, manual_step, lambda m: [adam(m.parameters())], manual=bind)
    assert manual.peak_bytes == automatic.peak_bytes
    assert (manual.peak_phase, manual.peak_step) == (automatic.peak_phase, automatic.peak_step)
    assert manual.at_peak == automatic.at_peak and manual.optimizer_state_bytes == automatic.optimizer_state_bytes > 0
    wrapper = handed["optimizers"][0]
    assert isinstance(wrapper.optimizer, torch.optim.Adam) and wrapper.param_groups is wrapper.optimizer.param_groups


def test_a_true_half_precision_estimate_keeps_integer_buffers_integer():
    """``bf16-true`` casts the floating parameters and buffers; an integer buffer (position ids) stays int64."""

    class WithIds(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("ids", torch.arange(1000))

        def forward(self, x):
            return self.lin(x)

    model = WithIds()
    from lightning_memopt import estimate_memory

    estimate = estimate_memory(model, torch.randn(4, 8), precision="bf16-true", device="cpu")
    assert estimate.buffer_bytes == model.ids.nbytes  # 8000: not cast to 2-byte bf16
    assert estimate.parameter_bytes == sum(p.numel() for p in model.parameters()) * 2  # these are


class _Synthetic:
    """A plan's trials over a made-up need per micro-batch: records each size estimated."""

    def __init__(self, need, usable):
        from lightning_memopt.planner.search import PlanTrial, Trials

        class Runs(Trials):
            def fits(runs, size, checkpointing):
                ok = need(size) <= usable
                runs.trials.append(PlanTrial(size, "32-true", checkpointing, int(need(size)), ok, 0.0))
                return ok

        self.runs = Runs(
            nn.Linear(2, 2), lambda b: None, batch_per_device=64, usable=usable, world=1, precision="32-true",
            optimizer=None, device="cpu", loss_fn=None,
        )  # fmt: skip

    def largest(self, sizes):
        return self.runs.largest_fitting(False, sizes), [t.micro_batch_size for t in self.runs.trials]


def test_the_search_predicts_between_the_ends_and_verifies_one_size():
    sizes = [1, 2, 4, 8, 16, 32, 64]
    chosen, tried = _Synthetic(lambda s: 100 + 10 * s, usable=300).largest(sizes)  # affine: 16 fits, 32 does not
    assert (chosen, tried) == (16, [64, 1, 16])
    # concave: the line under-predicts, the verification fails and a search below the failed size finds the answer
    chosen, tried = _Synthetic(lambda s: 100 + 60 * s**0.5, usable=300).largest(sizes)
    assert chosen == 8 and tried == [64, 1, 16, 8]  # below 16, the largest first: no size estimated twice
    # convex: the line over-predicts; the size verified fits (the plan is safe, maybe not the largest)
    chosen, tried = _Synthetic(lambda s: 100 + s * s, usable=300).largest(sizes)
    assert 100 + chosen * chosen <= 300 and len(tried) <= 3


def _choose_over(need, usable, sizes=(1, 2, 4, 8)):
    """``_choose`` with checkpointing ``"auto"`` over a made-up ``need(size, checkpointing)``; the trials run."""
    from lightning_memopt.planner.search import PlanTrial, Trials, _choose

    class Runs(Trials):
        def fits(runs, size, checkpointing):
            if any((t.micro_batch_size, t.gradient_checkpointing) == (size, checkpointing) for t in runs.trials):
                return need(size, checkpointing) <= usable
            ok = need(size, checkpointing) <= usable
            runs.trials.append(PlanTrial(size, "32-true", checkpointing, int(need(size, checkpointing)), ok, 0.0))
            return ok

    runs = Runs(
        nn.Linear(2, 2), lambda b: None, batch_per_device=8, usable=usable, world=1, precision="32-true",
        optimizer=None, device="cpu", loss_fn=None,
    )  # fmt: skip
    chosen = _choose(runs, list(sizes), "auto")
    return chosen, [(t.micro_batch_size, t.gradient_checkpointing) for t in runs.trials]


def test_the_size_the_line_predicts_without_checkpointing_is_estimated_only_if_chosen():
    # without checkpointing 1 and 2 fit (the line says 2); checkpointed, 8 fits: 2 is never estimated
    chosen, tried = _choose_over(lambda s, ckpt: 40 + (5 if ckpt else 25) * s, usable=100)
    assert (chosen, tried) == ((8, True), [(8, False), (1, False), (8, True)])
    # checkpointing does not double it: the predicted 2 is chosen, so it is estimated
    chosen, tried = _choose_over(lambda s, ckpt: 40 + (20 if ckpt else 25) * s, usable=100)
    assert chosen == (2, False) and tried[-1] == (2, False)
    # the line promised 2 but it does not fit: 1 is chosen without, and checkpointing is searched again from 2
    chosen, tried = _choose_over(lambda s, ckpt: (60 if ckpt else 40) * s + (70 if s == 2 and not ckpt else 0),
                                 usable=130)  # fmt: skip
    assert chosen == (2, True) and (2, False) in tried and tried[-1] == (2, True)


# ------------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("margin", [1.5, 1, 1.0, 10, -0.1, float("nan"), float("inf"), True, "0.1", None])
def test_plan_memory_refuses_a_margin_outside_zero_to_one_naming_value_and_fix(margin):
    from lightning_memopt.planner import plan_memory

    with pytest.raises(ValueError) as raised:
        plan_memory(nn.Linear(2, 2), lambda b: torch.zeros(b, 2), effective_batch_size=8, margin=margin, device="cpu")
    message = str(raised.value)
    assert message.startswith(f"`margin` must be a fraction in [0, 1), got {margin!r}.") and "`margin=0.1`" in message


@pytest.mark.parametrize("margin", [0, 0.0, 0.5, 0.999])
def test_plan_memory_accepts_a_margin_in_zero_to_one(margin):
    from lightning_memopt.planner import plan_memory

    with pytest.raises(ValueError, match="`device`"):  # the margin passed: the next argument is the one refused
        plan_memory(nn.Linear(2, 2), lambda b: torch.zeros(b, 2), effective_batch_size=8, margin=margin, device="tpu")


def test_the_estimate_table_rules_off_its_header_and_its_peak_row():
    from lightning_memopt import estimate_memory

    lines = estimate_memory(nn.Linear(64, 64), torch.randn(8, 64), device="cpu").table().splitlines()
    rule = "-" * len(lines[0])
    assert lines[0].startswith("at the peak") and lines[1] == rule
    peak = next(i for i, line in enumerate(lines) if line.startswith("peak ("))
    assert lines[peak - 1] == rule and lines[peak - 2] not in (rule, lines[0])
    assert [i for i, line in enumerate(lines) if line == rule] == [1, peak - 1]
