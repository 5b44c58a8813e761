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
    layers = 2 * (1 + kwargs.get("bidirectional", False))  # calls of the one step run (the second is replayed)
    assert any("oneDNN's workspace" in a and f"(x{layers})" in a for a in fake.assumptions), fake.assumptions


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
    assert any("cuDNN's reserve space" in a and "not measured on a GPU" in a and "(x2)" in a for a in est.assumptions)


# ------------------------------------------------------------------------------------------------ CUDA attention


def _qkv(dtype=torch.float32, head=8, heads=(4, 4, 4), length=(16, 16), grad=False):
    q = torch.randn(2, heads[0], length[0], head, dtype=dtype, requires_grad=grad)
    k = torch.randn(2, heads[1], length[1], head, dtype=dtype, requires_grad=grad)
    v = torch.randn(2, heads[2], length[1], head, dtype=dtype, requires_grad=grad)
    return q, k, v


# (inputs, attn_mask, extra arguments, compute capability) -> the kernel torch's sdp_utils.cpp picks; the sm90 rows
# marked H200 were seen on one (torch 2.11, cuDNN 9.19, diag run of benchmarks/planner_cuda.py's cases)
BF16, HALF = torch.bfloat16, torch.float16
KERNEL_CASES = [
    ("half, no mask, sm80", _qkv(HALF), None, {}, (8, 0), "flash"),
    ("bf16, no mask, sm90 (cuDNN first)", _qkv(BF16), None, {}, (9, 0), "cudnn"),
    ("bf16, no-grad mask, sm90 (H200)", _qkv(BF16), torch.zeros(2, 4, 16, 16, dtype=BF16), {}, (9, 0), "cudnn"),
    (
        "bf16, mask requiring grad, sm90 (H200)",
        _qkv(BF16),
        torch.zeros(2, 4, 16, 16, dtype=BF16, requires_grad=True),
        {},
        (9, 0),
        "efficient",
    ),
    ("fp32 on sm90 (H200: cuDNN needs half)", _qkv(), torch.zeros(2, 4, 16, 16), {}, (9, 0), "efficient"),
    ("bf16, head 256 on sm90 (cuDNN: at most 128)", _qkv(BF16, head=256), None, {}, (9, 0), "flash"),
    (
        "permuted bias, last-dim stride 4 (T5's: H200)",
        _qkv(),
        torch.zeros(1, 16, 16, 4, requires_grad=True).permute(0, 3, 1, 2),
        {},
        (9, 0),
        "math",
    ),
    (
        "transposed query (last-dim stride 16)",
        (_qkv()[0].transpose(-1, -2).contiguous().transpose(-1, -2), *_qkv()[1:]),
        None,
        {},
        (8, 0),
        "math",
    ),
    ("half, dropout, sm80", _qkv(HALF), None, {"dropout_p": 0.1}, (8, 0), "flash"),
    ("fp32 (flash needs half)", _qkv(), None, {}, (8, 0), "efficient"),
    ("half with a mask (flash takes none)", _qkv(HALF), torch.zeros(16, 16, dtype=HALF), {}, (8, 0), "efficient"),
    ("fp32, mask requiring grad (T5)", _qkv(), torch.zeros(1, 4, 16, 16, requires_grad=True), {}, (8, 0), "efficient"),
    ("half on sm75 (no flash before sm80)", _qkv(HALF), None, {}, (7, 5), "efficient"),
    ("bf16 on sm75 (no bf16 kernels)", _qkv(BF16), None, {}, (7, 5), "math"),
    ("half, head 512 (flash: at most 256)", _qkv(HALF, head=512), None, {}, (8, 0), "efficient"),
    ("half, head 12 (not 8-aligned)", _qkv(HALF, head=12), torch.zeros(16, 16, dtype=HALF), {}, (8, 0), "math"),
    ("fp32, head 6 (not 4-aligned)", _qkv(head=6), None, {}, (8, 0), "math"),
    ("half, causal non-square", _qkv(HALF, length=(8, 16)), None, {"is_causal": True}, (8, 0), "efficient"),
    ("half, head 224 training on sm86", _qkv(HALF, head=224, grad=True), None, {}, (8, 6), "efficient"),
    ("half, grouped-query", _qkv(HALF, heads=(4, 2, 2)), None, {"enable_gqa": True}, (8, 0), "flash"),
    ("fp32, grouped-query (efficient has none)", _qkv(heads=(4, 2, 2)), None, {"enable_gqa": True}, (8, 0), "math"),
]


@pytest.mark.parametrize(
    ("qkv", "mask", "extra", "capability", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in KERNEL_CASES],
)
def test_the_attention_kernel_is_the_one_torch_s_cuda_dispatcher_picks(qkv, mask, extra, capability, expected):
    from lightning_memopt.functional.planning import attention_kernel

    assert attention_kernel(*qkv, mask, compute_capability=capability, **extra) == expected


class _BiasAttention(nn.Module):
    """Self-attention with a learned position bias given as ``attn_mask``, as T5 does."""

    def __init__(self, heads: int = 4, length: int = 64, head: int = 8) -> None:
        super().__init__()
        self.heads, self.head = heads, head
        self.qkv = nn.Linear(heads * head, 3 * heads * head)
        self.bias = nn.Parameter(torch.zeros(1, heads, length, length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, dropout_p=0.1)
        return out.pow(2).mean()


def test_attention_with_a_mask_that_requires_grad_is_estimated_for_cuda_without_the_scores():
    """T5's case: the learned bias goes in as ``attn_mask``; CUDA's memory-efficient kernel keeps no L x L scores."""
    torch.manual_seed(0)
    model, x = _BiasAttention(), torch.randn(8, 64, 32)
    cpu = estimate_memory(model, x, device="cpu")
    cuda = estimate_memory(model, x, device="cuda")
    scores = 8 * 4 * 64 * 64 * 4
    assert cpu.phase_peaks["forward"] - cuda.phase_peaks["forward"] >= 2 * scores  # the CPU keeps scores, probs
    assert any("memory-efficient" in a and "x1" in a and "sm80" in a for a in cuda.assumptions)  # the step run


def test_the_memory_efficient_stand_in_gives_every_input_its_gradient():
    from lightning_memopt.functional.planning import cuda_attention

    q, k, v = _qkv(grad=True, length=(16, 24))  # cross-attention: the bias is 16 x 24, not square
    bias = torch.zeros(1, 4, 16, 24, requires_grad=True)
    with cuda_attention() as kernels:
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    out.sum().backward()
    assert kernels == {"efficient": 1} and out.shape == q.shape
    assert [t.grad.shape for t in (q, k, v, bias)] == [q.shape, k.shape, v.shape, bias.shape]


def test_the_gpu_decides_the_kernel():
    from lightning_memopt.functional.planning import cuda_attention

    q, k, v = _qkv(BF16)
    for capability, expected in (((8, 0), {"flash": 1}), ((7, 5), {"math": 1})):
        with cuda_attention(compute_capability=capability) as kernels:
            nn.functional.scaled_dot_product_attention(q, k, v)
        assert kernels == expected


# ------------------------------------------------------------------------------------------------ normalizations


def _norm_call(norm: str, x: torch.dtype, w: torch.dtype) -> tuple:
    """(op, args) of a normalization over a ``x`` input with ``w`` weights, made in the current (fake or no) mode."""
    weight = torch.randn(8, dtype=w)
    aten = torch.ops.aten
    if norm == "batch_norm":
        running = torch.rand(8, dtype=w)
        return aten.native_batch_norm.default, (torch.randn(4, 8, 5, 5, dtype=x), weight, weight, running, running)
    if norm == "layer_norm":
        return aten.native_layer_norm.default, (torch.randn(4, 6, 8, dtype=x), [8], weight, weight, 1e-5)
    return aten.native_group_norm.default, (torch.randn(4, 8, 5, 5, dtype=x), weight, weight, 4, 8, 25, 2, 1e-5)


@pytest.mark.parametrize("norm", ["batch_norm", "layer_norm", "group_norm"])
@pytest.mark.parametrize(
    ("x", "w"), [(BF16, torch.float32), (HALF, torch.float32), (BF16, BF16)], ids=["bf16-fp32", "fp16-fp32", "bf16"]
)
def test_normalization_statistics_get_the_real_kernel_s_dtype(norm, x, w):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def call(op, args):
        return op(*args, True, 0.1, 1e-5) if norm == "batch_norm" else op(*args)

    real = call(*_norm_call(norm, x, w))
    with FakeTensorMode():
        op, args = _norm_call(norm, x, w)
        args = (*args, True, 0.1, 1e-5) if norm == "batch_norm" else args
        fake = op(*args)
        fixed = fake_kernel_outputs("cpu")(op, args, {}, fake)
    assert [(t.dtype, t.shape) for t in fixed] == [(t.dtype, t.shape) for t in real]
    assert (fake[1].dtype == real[1].dtype) == (x == w)  # the fake kernel alone is wrong exactly when they differ


def test_a_batch_norm_network_under_bf16_autocast_is_estimated_to_the_byte():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 4, 3), nn.GroupNorm(2, 4))
    x = torch.randn(8, 3, 20, 20)
    fake = estimate_memory(model, x, device="cpu", precision="bf16-mixed")
    real = estimate_memory(model, x, device="cpu", precision="bf16-mixed", fake=False)
    assert fake.peak_bytes == real.peak_bytes


# ------------------------------------------------------------------------------------------------ CUDA dropout, math


def test_a_cuda_dropout_keeps_a_bool_mask_where_the_cpu_keeps_one_of_the_input_s_dtype():
    # seen on an H200: CUDA's fused native_dropout keeps (output, bool mask); the CPU keeps a float32 noise tensor
    from lightning_memopt.functional.planning import LiveBytes, cuda_dropout

    x = torch.randn(64, 256, requires_grad=True)
    with LiveBytes() as cpu:
        on_cpu = nn.functional.dropout(x, 0.1)
    with LiveBytes() as cuda, cuda_dropout():
        on_cuda = nn.functional.dropout(x, 0.1)
    assert cpu.now - cuda.now == 3 * x.numel()  # 4-byte noise against a 1-byte mask; both keep a 4-byte output
    assert on_cuda.grad_fn._saved_result1.dtype == torch.bool and on_cpu.shape == on_cuda.shape
    with cuda_dropout():  # evaluation, p=0 and in-place dropout take the CPU's way on CUDA too
        assert nn.functional.dropout(x, 0.1, training=False) is x
        assert nn.functional.dropout(x.detach().clone(), 0.1, inplace=True).grad_fn is None


def test_cuda_s_math_attention_computes_half_precision_in_float32_and_keeps_a_bool_dropout_mask():
    # seen op for op on an H200 (torch 2.11): T5's permuted bias sent bf16 attention to the math kernel, which ran in
    # float32 (the L x L scores 4 bytes an element, twice the CPU kernel's) and dropped out through native_dropout
    from lightning_memopt.functional.planning import cuda_attention

    q = torch.randn(2, 4, 16, 8, dtype=BF16, requires_grad=True)
    bias = torch.zeros(1, 16, 16, 4, dtype=BF16).permute(0, 3, 1, 2)
    with cuda_attention((9, 0)) as kernels:
        out = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias, dropout_p=0.1)
    assert kernels == {"math": 1} and out.dtype == BF16
    saved = {}
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack += [f for f, _ in node.next_functions]
        for name in ("_saved_result", "_saved_result1"):
            if isinstance(getattr(node, name, None), torch.Tensor):
                saved[type(node).__name__] = getattr(node, name).dtype
    assert saved == {"SafeSoftmaxBackward0": torch.float32, "NativeDropoutBackward0": torch.bool}


class _Distilled(nn.Module):
    """A student regressed onto a frozen teacher: the loss's inputs are the student's and teacher's outputs."""

    def __init__(self, loss):
        super().__init__()
        self.student, self.teacher, self.loss = nn.Linear(16, 64), nn.Linear(16, 64), loss

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x)
        return self.loss(self.student(x), target)


@pytest.mark.parametrize(
    "loss",
    [nn.functional.mse_loss, nn.functional.smooth_l1_loss, lambda a, b: nn.functional.mse_loss(a, b, reduction="sum")],
    ids=["mse-mean", "smooth-l1", "mse-sum"],
)
@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_a_reduced_mse_or_smooth_l1_loss_keeps_the_elementwise_loss_storage_as_the_real_kernel(loss, stage):
    """The CPU kernel reduces into the elementwise loss's storage: the scalar it returns holds batch x 64 floats."""
    x = torch.randn(64, 16)
    kwargs = {"loss_fn": lambda m, b: m(b)} if stage == "fit" else {}
    fake = estimate_memory(_Distilled(loss), x, device="cpu", stage=stage, **kwargs)
    real = estimate_memory(_Distilled(loss), x, device="cpu", stage=stage, fake=False, **kwargs)
    assert fake.peak_bytes == real.peak_bytes
    assert any(a.startswith("mse_loss/smooth_l1_loss reduced to a scalar") for a in fake.assumptions)


class _Bag(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(50, 8, mode=mode), nn.Linear(8, 2)

    def forward(self, ids, offsets=None):
        return self.head(self.bag(ids, offsets)).sum()


@pytest.mark.parametrize("mode", ["mean", "max", "sum"])
@pytest.mark.parametrize(
    "batch",
    [(torch.randint(0, 50, (4, 6)),), (torch.randint(0, 50, (10,)), torch.tensor([0, 3, 7]))],
    ids=["bags-of-rows", "offsets"],
)
@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_an_embedding_bag_s_index_to_bag_map_is_one_element_longer_as_the_real_kernel_s(mode, batch, stage):
    kwargs = {"loss_fn": lambda m, b: m(*b)} if stage == "fit" else {}
    fake = estimate_memory(_Bag(mode), batch, device="cpu", stage=stage, **kwargs)
    real = estimate_memory(_Bag(mode), batch, device="cpu", stage=stage, fake=False, **kwargs)
    assert fake.peak_bytes == real.peak_bytes
