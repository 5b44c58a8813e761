"""What CUDA does differently from the CPU, modelled on fake CPU tensors.

The allocator's 512-byte blocks (:data:`CUDA_BLOCK_BYTES`), the cuBLAS workspaces (:data:`CUBLAS_WORKSPACE_BYTES`),
attention through the kernel CUDA's dispatcher picks (:func:`attention_kernel`, :func:`cuda_attention`), CUDA's
autocast lists (:func:`cuda_autocast`) and ``foreach`` optimizers (:func:`use_foreach`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = [
    "CUBLAS_WORKSPACE_BYTES",
    "CUDA_AUTOCAST_FP32",
    "CUDA_BLOCK_BYTES",
    "DEFAULT_COMPUTE_CAPABILITY",
    "attention_assumption",
    "attention_kernel",
    "cuda_attention",
    "cuda_autocast",
    "use_foreach",
]

#: The CUDA caching allocator hands out blocks in multiples of 512 bytes.
CUDA_BLOCK_BYTES = 512
#: cuBLAS workspaces taken from the caching allocator by default: 4096 KiB x 2 + 16 KiB x 8 per (handle, stream), one
#: for forward and one for backward's own thread (``CUBLAS_WORKSPACE_CONFIG`` changes it; sm90 GPUs take 32 MiB).
CUBLAS_WORKSPACE_BYTES = 2 * (2 * 4096 + 8 * 16) * 1024


#: The GPU assumed for choices that depend on it (attention kernels) when the caller names none: an A100 (sm80).
DEFAULT_COMPUTE_CAPABILITY = (8, 0)
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

    Example:
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
    alignment = 8 if dtype in _HALF else (4 if compute_capability >= (8, 0) else 1)
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

    Example:
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

    Example:
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
            query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(low)
        kernel = attention_kernel(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, compute_capability)
        chosen[kernel] = chosen.get(kernel, 0) + 1
        if kernel == "math":
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, None, **kw
            )[0]
        if kernel == "efficient":
            bias = None if attn_mask is None else _efficient_bias(attn_mask, query, key)
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


#: Functions CUDA's autocast runs in float32 (torch's autocast op reference); the CPU's autocast leaves most of them in
#: the lower precision (layer_norm, group_norm, softmax, log_softmax, exp, pow, sum, ... stay bf16 there).
CUDA_AUTOCAST_FP32 = frozenset(
    {
        "__pow__",
        "__rdiv__",
        "__rpow__",
        "__rtruediv__",
        "acos",
        "asin",
        "binary_cross_entropy_with_logits",
        "cosh",
        "cosine_embedding_loss",
        "cdist",
        "cosine_similarity",
        "cross_entropy",
        "cumprod",
        "cumsum",
        "dist",
        "erfinv",
        "exp",
        "expm1",
        "group_norm",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "layer_norm",
        "log",
        "log_softmax",
        "log10",
        "log1p",
        "log2",
        "margin_ranking_loss",
        "mse_loss",
        "multilabel_margin_loss",
        "multi_margin_loss",
        "nll_loss",
        "norm",
        "normalize",
        "pdist",
        "poisson_nll_loss",
        "pow",
        "prod",
        "reciprocal",
        "rsqrt",
        "sinh",
        "smooth_l1_loss",
        "soft_margin_loss",
        "softmax",
        "softmin",
        "softplus",
        "sum",
        "renorm",
        "tan",
        "triplet_margin_loss",
    }
)


def _to_float32(value: Any) -> Any:
    if isinstance(value, Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


class _CudaAutocastFloat32(TorchFunctionMode):
    """Casts the half-precision inputs of :data:`CUDA_AUTOCAST_FP32` functions to float32 while CPU autocast is on."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (
            getattr(func, "__name__", None) in CUDA_AUTOCAST_FP32
            and kwargs.get("dtype") is None  # an explicit dtype= is not autocast
            and torch.is_autocast_enabled("cpu")
        ):
            args, kwargs = tree_map(_to_float32, args), tree_map(_to_float32, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """Inside CPU autocast, run the functions CUDA's autocast runs in float32 (:data:`CUDA_AUTOCAST_FP32`) in float32.

    Their bf16/fp16 inputs are cast to float32 first, as CUDA's autocast does, so their outputs (and what they save
    for backward) have CUDA's sizes. Functions called from inside another torch function (e.g. the softmax inside
    ``F.multi_head_attention_forward``) keep the CPU's behaviour.

    Example:
        >>> x = torch.randn(2, 4)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast():
        ...     torch.softmax(x.bfloat16(), -1).dtype
        torch.float32
    """
    with _CudaAutocastFloat32():
        yield


def use_foreach(optimizers: list[torch.optim.Optimizer]) -> bool:
    """Set ``foreach=True`` where it was left to torch (``None``), as torch's default does on CUDA; whether any was.

    Groups with ``fused=True`` are left alone.

    Example:
        >>> optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
        >>> use_foreach([optimizer]), optimizer.param_groups[0]["foreach"]
        (True, True)
    """
    changed = False
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
                changed = True
    return changed
