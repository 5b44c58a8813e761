"""Kernels whose fake implementation under-reports (``functional/planning/corrections.py``), against the real ones.

The reference is torch's real CPU kernel: the workspace it returns, or the same live-storage counter over real
tensors (``fake=False``), never a number computed here.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memopt.functional.planning import (
    cudnn_rnn_reserve_bytes,
    fake_kernel_outputs,
    onednn_lstm_workspace_bytes,
)
from lightning_memopt.planner import estimate_memory

RNN_LAYER = torch.ops.aten.mkldnn_rnn_layer.default


class _Workspaces(TorchDispatchMode):
    """Records (input shape, workspace bytes) of every real ``mkldnn_rnn_layer`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], int | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is RNN_LAYER:
            ws = out[3]
            self.seen.append((tuple(args[0].shape), None if ws is None else ws.untyped_storage().nbytes()))
        return out


def _real_workspaces(lstm: nn.Module, x: torch.Tensor) -> list[tuple[tuple[int, ...], int | None]]:
    with _Workspaces() as mode:
        lstm(x)
    return mode.seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_onednn_lstm_workspace_model_equals_the_real_kernel_s_on_random_shapes(dtype):
    rng = random.Random(0)
    for _ in range(12):
        time, batch, inputs, hidden = rng.randint(1, 30), rng.randint(1, 12), rng.randint(1, 200), rng.randint(1, 200)
        seen = _real_workspaces(nn.LSTM(inputs, hidden).to(dtype), torch.randn(time, batch, inputs, dtype=dtype))
        assert seen, "the LSTM did not run oneDNN's kernel"
        ((shape, nbytes),) = seen
        assert shape[:2] == (time, batch)
        assert onednn_lstm_workspace_bytes(time, batch, inputs, hidden, dtype.itemsize) == nbytes, (time, batch)


def test_each_layer_and_direction_has_its_workspace_and_batch_first_input_arrives_time_major():
    lstm = nn.LSTM(24, 40, num_layers=2, bidirectional=True, batch_first=True)
    seen = _real_workspaces(lstm, torch.randn(3, 50, 24))  # batch 3, 50 steps
    assert [s for s, _ in seen] == [(50, 3, 24)] * 2 + [(50, 3, 80)] * 2  # the upper layer reads both directions
    assert [n for _, n in seen] == [onednn_lstm_workspace_bytes(50, 3, 24, 40)] * 2 + [
        onednn_lstm_workspace_bytes(50, 3, 80, 40)
    ] * 2
    with torch.no_grad():  # no workspace without grad mode: nothing to correct
        assert [n for _, n in _real_workspaces(lstm, torch.randn(3, 50, 24))] == [None] * 4


class _LSTMLoss(nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.lstm = nn.LSTM(24, 48, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0].pow(2).mean()


@pytest.mark.parametrize(
    "kwargs",
    [{"num_layers": 2}, {"num_layers": 2, "bidirectional": True, "batch_first": True, "dropout": 0.1}],
    ids=["2-layer", "bidirectional"],
)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_an_lstm_estimate_on_fake_tensors_equals_the_real_cpu_step(kwargs, precision):
    torch.manual_seed(0)
    model, x = _LSTMLoss(**kwargs), torch.randn(12, 10, 24)
    fake = estimate_memory(model, x, device="cpu", precision=precision)
    real = estimate_memory(model, x, device="cpu", precision=precision, fake=False)
    assert fake.peak_bytes == real.peak_bytes
    assert (fake.peak_phase, fake.peak_step) == (real.peak_phase, real.peak_step)


def _fake_layer_call(target: str, train: bool = True) -> tuple[int, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        lstm, x = nn.LSTM(24, 32), torch.randn(16, 8, 24)
        h = torch.zeros(8, 32)
        args = (x, lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0, h, h)
        args += (False, [], 2, 32, 1, True, False, False, train)
        out = RNN_LAYER(*args)
        fixed = fake_kernel_outputs(target)(RNN_LAYER, args, {}, out)
        return out[3].untyped_storage().nbytes(), fixed[3].untyped_storage().nbytes()


def test_a_fake_workspace_is_given_the_target_kernel_s_size():
    assert _fake_layer_call("cpu") == (0, onednn_lstm_workspace_bytes(16, 8, 24, 32))
    assert _fake_layer_call("cuda") == (0, cudnn_rnn_reserve_bytes(16, 8, 32, gates=4))
    assert _fake_layer_call("cpu", train=False) == (0, 0)  # inference: the real kernel keeps none either
    with pytest.raises(ValueError, match="`target` must be 'cpu' or 'cuda', got 'tpu'"):
        fake_kernel_outputs("tpu")


def test_a_real_workspace_is_left_alone():
    lstm, x = nn.LSTM(8, 8), torch.randn(4, 2, 8)
    h = torch.zeros(2, 8)
    args = (x, lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0, h, h)
    args += (False, [], 2, 8, 1, True, False, False, True)
    out = RNN_LAYER(*args)
    assert fake_kernel_outputs("cpu")(RNN_LAYER, args, {}, out) is out


def test_the_cuda_estimate_of_an_lstm_holds_the_reserve_space():
    torch.manual_seed(0)
    model, x = _LSTMLoss(num_layers=2), torch.randn(12, 10, 24)
    est = estimate_memory(model, x, device="cuda")
    # no correction: what the fake kernels alone report
    from lightning_memopt.functional.planning import count_training_steps

    plain = count_training_steps(
        model,
        x,
        lambda m, b, i: m(b),
        lambda m: [torch.optim.AdamW(m.parameters(), foreach=True)],
        block_bytes=512,
    )
    reserve = 2 * cudnn_rnn_reserve_bytes(12, 10, 48)  # two layers, kept from forward to backward
    assert est.phase_peaks["forward"] == plain.phase_peaks["forward"] + reserve
