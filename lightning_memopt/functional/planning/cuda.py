"""What CUDA does differently from the CPU, modelled on fake CPU tensors.

The allocator's 512-byte blocks (:data:`CUDA_BLOCK_BYTES`), the cuBLAS workspaces (:data:`CUBLAS_WORKSPACE_BYTES`),
attention through the fused kernels (:func:`cuda_attention`), CUDA's autocast lists (:func:`cuda_autocast`) and
``foreach`` optimizers (:func:`use_foreach`).
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
    "cuda_attention",
    "cuda_autocast",
    "use_foreach",
]

#: The CUDA caching allocator hands out blocks in multiples of 512 bytes.
CUDA_BLOCK_BYTES = 512
#: cuBLAS workspaces taken from the caching allocator by default: 4096 KiB x 2 + 16 KiB x 8 per (handle, stream), one
#: for forward and one for backward's own thread (``CUBLAS_WORKSPACE_CONFIG`` changes it; sm90 GPUs take 32 MiB).
CUBLAS_WORKSPACE_BYTES = 2 * (2 * 4096 + 8 * 16) * 1024


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` as CUDA's fused kernels hold memory: no ``L x L`` attention matrix.

    On CUDA, flash or memory-efficient attention keep the output and a per-row log-sum-exp for backward; the CPU
    falls back to the math path (which keeps the full attention matrix) whenever there is a mask or dropout. The
    attribute ``torch.nn.functional.scaled_dot_product_attention`` is replaced (so calls from
    ``F.multi_head_attention_forward`` and Hugging Face models are seen) with the CPU flash kernel, whose memory is
    the fused kernels'. Inputs that are not 4-d, or have other head counts without ``enable_gqa``, go to the original.
    Code that imported the function by name before keeps the original.
    """
    original = torch.nn.functional.scaled_dot_product_attention

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
        if query.dim() != 4 or key.dim() != 4 or (query.size(1) != key.size(1) and not enable_gqa):
            return original(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        if query.size(1) != key.size(1):
            repeat = query.size(1) // key.size(1)
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out[0]

    torch.nn.functional.scaled_dot_product_attention = fused
    try:
        yield
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
