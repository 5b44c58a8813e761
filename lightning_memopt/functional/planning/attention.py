"""Attention on a CUDA target: the kernel torch's dispatcher picks and the memory it holds, on fake CPU tensors.

:func:`attention_kernel` follows torch's ``sdp_utils.cpp`` (checked on an H200); :func:`cuda_attention` makes
``scaled_dot_product_attention`` hold the chosen kernel's memory: cuDNN and flash (the output and float32 row
statistics), memory-efficient (:class:`_EfficientAttention`) or math as CUDA runs it (:func:`_cuda_math`: half
precision computed in float32, dropout's mask kept as bool).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_memopt.functional.planning.cuda import DEFAULT_COMPUTE_CAPABILITY

__all__ = ["attention_assumption", "attention_kernel", "cuda_attention"]

#: Memory-efficient attention pads an attention bias's last dimension to a multiple of this (torch's ``pad_bias``).
_MEM_EFF_BIAS_ALIGNMENT = 16
_HALF = (torch.float16, torch.bfloat16)


def attention_kernel(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    compute_capability: tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY,
) -> str:
    """The kernel torch's CUDA dispatcher picks for ``scaled_dot_product_attention``: ``"cudnn"``, ``"flash"``,
    ``"efficient"`` (memory-efficient) or ``"math"``, in torch's default order.

    The rules of torch's ``sdp_utils.cpp`` that decide it for dense 4-d inputs, checked against torch 2.11 on an H200
    (``benchmarks/planner_cuda.py``): every fused kernel needs the last dimension of query, key, value and
    ``attn_mask`` to have stride 1 (a permuted bias, such as T5's learned position bias, goes to math). On sm90 and
    sm100 torch built with CUDA 13 (and cuDNN newer than 9.15) tries cuDNN first: float16/bfloat16, an ``attn_mask``
    that does not require grad, head sizes of at most 128 in multiples of 8, more than one key. Flash needs
    float16/bfloat16, no ``attn_mask``, equal head sizes of at most 256 (192 when training on sm86/sm89), a square
    sequence when causal, and sm80 or newer; memory-efficient takes float32 too and an ``attn_mask`` (one that
    requires grad included: its backward computes the bias gradient), needs equal query/key head sizes aligned to 8
    elements for half precision (4 for float32 on sm80+), the same number of key and query heads, and sm50 or newer;
    bfloat16 needs sm80 for both. Otherwise math.

    Args:
        query / key / value / attn_mask / dropout_p / is_causal / enable_gqa: the call's arguments.
        compute_capability: the GPU's ``(major, minor)``; default sm80 (A100).

    Examples:
        >>> q = torch.randn(2, 4, 16, 64)
        >>> attention_kernel(q, q, q), attention_kernel(q.half(), q.half(), q.half())
        ('efficient', 'flash')
        >>> attention_kernel(q.half(), q.half(), q.half(), compute_capability=(7, 5))  # Turing: no flash
        'efficient'
        >>> attention_kernel(q.half(), q.half(), q.half(), compute_capability=(9, 0))  # Hopper: cuDNN first
        'cudnn'
        >>> bias = torch.zeros(1, 16, 16, 4).permute(0, 3, 1, 2)  # a permuted bias: last-dimension stride 4
        >>> attention_kernel(q, q, q, bias)
        'math'
    """
    dtype = query.dtype
    heads_equal = query.size(1) == key.size(1) == value.size(1)
    if dtype == torch.bfloat16 and compute_capability < (8, 0):
        return "math"
    if any(t.stride(-1) != 1 for t in (query, key, value)) or (attn_mask is not None and attn_mask.stride(-1) != 1):
        return "math"  # torch's check_last_dim_stride_equals_1_dense, for every fused kernel on a GPU
    if _cudnn_first(query, key, value, attn_mask, compute_capability):
        return "cudnn"
    head, value_head = query.size(-1), value.size(-1)
    grad = any(t.requires_grad for t in (query, key, value))
    flash_head_limit = 192 if grad and compute_capability in ((8, 6), (8, 9)) else 256
    if (
        dtype in _HALF
        and attn_mask is None
        and compute_capability >= (8, 0)
        and head == key.size(-1) == value_head
        and head <= flash_head_limit
        and not (is_causal and query.size(-2) != key.size(-2))
        and (heads_equal or enable_gqa)
    ):
        return "flash"
    alignment = _efficient_alignment(dtype, compute_capability)
    if (
        dtype in (torch.float32, *_HALF)
        and compute_capability >= (5, 0)
        and heads_equal
        and head == key.size(-1)
        and head % alignment == 0
        and value_head % alignment == 0
    ):
        return "efficient"
    return "math"


def _efficient_alignment(dtype: torch.dtype, compute_capability: tuple[int, int]) -> int:
    """The multiple of elements the memory-efficient kernel needs head sizes in."""
    if dtype in _HALF:
        return 8
    if compute_capability >= (8, 0):
        return 4
    return 1


def _cudnn_first(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, compute_capability: tuple[int, int]
) -> bool:
    """Whether cuDNN attention, first in torch's order on sm90/sm100 (CUDA 13 builds), takes the call."""
    if compute_capability[0] not in (9, 10) or query.dtype not in _HALF:
        return False
    heads = (query.size(-1), value.size(-1))
    return (
        (attn_mask is None or not attn_mask.requires_grad)
        and all(h <= 128 and h % 8 == 0 for h in heads)
        and query.size(-1) == key.size(-1)
        and key.size(-2) != 1
    )


_KERNEL_TEXT = {
    "cudnn": "cuDNN (fused kernels: output and float32 row statistics, no L x L matrix)",
    "flash": "flash (fused kernels: output and log-sum-exp, no L x L matrix)",
    "efficient": "memory-efficient (fused kernels: output, log-sum-exp and the bias, no L x L matrix)",
    "math": "math (the L x L scores kept for backward)",
}


def attention_assumption(kernels: dict[str, int], compute_capability: tuple[int, int] | None = None) -> str:
    """The estimate's words for the attention kernels :func:`cuda_attention` chose (``{kernel: calls}``).

    Examples:
        >>> attention_assumption({"efficient": 12})
        "attention (scaled_dot_product_attention) as CUDA's dispatcher picks it on sm80: memory-efficient (fused \
kernels: output, log-sum-exp and the bias, no L x L matrix) x12"
    """
    major, minor = compute_capability or DEFAULT_COMPUTE_CAPABILITY
    head = f"attention (scaled_dot_product_attention) as CUDA's dispatcher picks it on sm{major}{minor}"
    if not kernels:
        return f"{head}: fused kernels (no call seen)"
    return f"{head}: " + ", ".join(f"{_KERNEL_TEXT[k]} x{n}" for k, n in sorted(kernels.items()))


class _EfficientAttention(torch.autograd.Function):
    """Memory-efficient attention's memory on any device: the output and a float32 log-sum-exp (rows rounded up to
    32) kept for backward with the inputs and the bias; backward makes the input gradients, a float32 row sum, and a
    bias gradient (last dimension padded to 16) where the bias requires grad. No values are computed."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None) -> Tensor:
        b, h, length = query.shape[:3]
        out = query.new_empty((b, length, h, value.size(-1))).transpose(1, 2)  # CUDA's layout: (B, L, H, D)
        rows = -(-length // 32) * 32 if any(t.requires_grad for t in (query, key, value)) else 0
        lse = query.new_empty((b, h, rows), dtype=torch.float32)
        ctx.save_for_backward(query, key, value, bias, out, lse)
        ctx.bias_grad = bias is not None and bias.requires_grad
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, bias, _, _ = ctx.saved_tensors
        delta = query.new_empty(query.shape[:3], dtype=torch.float32)  # held while the gradients are made
        grads = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        del delta
        grad_bias = None
        if ctx.bias_grad:
            last = bias.size(-1)
            padded = -(-last // _MEM_EFF_BIAS_ALIGNMENT) * _MEM_EFF_BIAS_ALIGNMENT
            grad_bias = bias.new_empty((*bias.shape[:-1], padded))[..., :last]
        return (*grads, grad_bias)


def _efficient_bias(mask: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """The bias memory-efficient attention receives: float, last dimension padded to 16 where its strides are not,
    expanded to ``(B, H, L, S)`` (torch's ``preprocess_mask``)."""
    if mask.dtype == torch.bool:
        mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill(mask.logical_not(), float("-inf"))
    align = _MEM_EFF_BIAS_ALIGNMENT
    if any(stride % align for stride in mask.stride()[:-1]):
        last = mask.size(-1)
        mask = torch.nn.functional.pad(mask, (0, -(-last // align) * align - last))[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def _float_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask as the additive float mask torch's math kernel makes of it (0 kept, -inf masked)."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask.logical_not(), float("-inf"))


@torch.autocast("cpu", enabled=False)  # a kernel's own ops: autocast acted on the call, not inside it
def _floating_to(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` when it holds floating-point values; other tensors as they are."""
    if t.is_floating_point():
        return t.to(dtype)
    return t


def _scale_magnitude(scale: float | None, query: Tensor) -> float:
    """The size of the softmax scale: ``|scale|`` when given, else ``1 / sqrt(head size)``."""
    if scale is not None:
        return abs(scale)
    return 1.0 / math.sqrt(query.size(-1))


def _cuda_math(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """torch's math attention as CUDA runs it, op for op (``_scaled_dot_product_attention_math``): float16/bfloat16
    inputs computed in float32 unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` (the CPU
    kernel computes them in their own precision), and dropout through CUDA's fused kernel, whose mask is kept as bool
    (the CPU's holds a mask in the scores' dtype). Seen op for op on an H200 (torch 2.11)."""
    origin = query.dtype
    if origin in _HALF and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        query, key, value = query.float(), key.float(), value.float()
    factor = math.sqrt(_scale_magnitude(scale, query))
    query = query * (-factor if scale is not None and scale < 0 else factor)
    if is_causal:
        length, source = query.size(-2), key.size(-2)
        attn_mask = torch.ones(length, source, dtype=torch.bool).tril()
    if enable_gqa and query.size(-3) != key.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        scores = scores.add(_float_mask(attn_mask, query.dtype))
    weights = torch.ops.aten._safe_softmax(scores, -1)
    if dropout_p > 0.0:
        weights = torch.ops.aten.native_dropout(weights, dropout_p, True)[0]
    return torch.matmul(weights, value).to(origin)


@contextlib.contextmanager
def cuda_attention(compute_capability: tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY) -> Iterator[dict[str, int]]:
    """``scaled_dot_product_attention`` holding the memory of the kernel CUDA would pick, on fake CPU tensors.

    The CPU picks its own kernels (math, with the ``L x L`` scores kept for backward, whenever there is a mask or
    dropout). Here :func:`attention_kernel` picks as torch's CUDA dispatcher would for the call's dtype, mask and
    ``compute_capability``, and the call holds that kernel's memory: flash and cuDNN (the CPU flash kernel: the
    output and a float32 log-sum-exp), memory-efficient (:class:`_EfficientAttention`: the output, a float32
    log-sum-exp, the padded bias and, in backward, the bias gradient) or math (torch's math kernel, as CUDA runs
    it). The attribute
    ``torch.nn.functional.scaled_dot_product_attention`` is replaced, so calls from ``F.multi_head_attention_forward``
    and Hugging Face models are seen; code that imported the function by name before keeps the original. Inputs that
    are not 4-d, or have other head counts without ``enable_gqa``, go to the original.

    Yields:
        ``{kernel: calls}``, filled as the calls come (for the estimate's assumptions).

    Examples:
        >>> q = torch.randn(2, 4, 16, 8, requires_grad=True)
        >>> bias = torch.zeros(1, 4, 16, 16, requires_grad=True)  # a learned position bias (T5)
        >>> with cuda_attention() as kernels:
        ...     torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias, dropout_p=0.1).shape
        torch.Size([2, 4, 16, 8])
        >>> kernels
        {'efficient': 1}
    """
    original = torch.nn.functional.scaled_dot_product_attention
    chosen: dict[str, int] = {}

    def fused(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        kw: dict[str, Any] = {"scale": scale, "enable_gqa": enable_gqa}
        if query.dim() != 4 or key.dim() != 4 or (query.size(1) != key.size(1) and not enable_gqa):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
        if torch.is_autocast_enabled("cpu"):  # CUDA's autocast runs attention in the lower precision, mask included
            low = torch.get_autocast_dtype("cpu")
            query, key, value = (_floating_to(t, low) for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(low)
        kernel = attention_kernel(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, compute_capability)
        chosen[kernel] = chosen.get(kernel, 0) + 1
        if kernel == "math":
            return _cuda_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if kernel == "efficient":
            bias = None
            if attn_mask is not None:
                bias = _efficient_bias(attn_mask, query, key)
            return _EfficientAttention.apply(query, key, value, bias)
        if query.size(1) != key.size(1):
            repeat = query.size(1) // key.size(1)
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )[0]

    torch.nn.functional.scaled_dot_product_attention = fused
    try:
        yield chosen
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
