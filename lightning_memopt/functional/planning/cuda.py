"""What CUDA does differently from the CPU, modelled on fake CPU tensors.

The allocator's 512-byte blocks (:data:`CUDA_BLOCK_BYTES`), the cuBLAS workspaces (:data:`CUBLAS_WORKSPACE_BYTES`),
CUDA's autocast lists (:func:`cuda_autocast`), its fused dropout (:func:`cuda_dropout`) and ``foreach`` optimizers
(:func:`use_foreach`). Attention through the kernel CUDA's dispatcher picks is in ``attention.py``.
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
    "cuda_autocast",
    "cuda_dropout",
    "use_foreach",
]

#: The CUDA caching allocator hands out blocks in multiples of 512 bytes.
CUDA_BLOCK_BYTES = 512
#: cuBLAS workspaces taken from the caching allocator by default: 4096 KiB x 2 + 16 KiB x 8 per (handle, stream), one
#: for forward and one for backward's own thread (``CUBLAS_WORKSPACE_CONFIG`` changes it; sm90 GPUs take 32 MiB).
CUBLAS_WORKSPACE_BYTES = 2 * (2 * 4096 + 8 * 16) * 1024


#: The GPU assumed for choices that depend on it (attention kernels) when the caller names none: an A100 (sm80).
DEFAULT_COMPUTE_CAPABILITY = (8, 0)
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

    Examples:
        >>> x = torch.randn(2, 4)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast():
        ...     torch.softmax(x.bfloat16(), -1).dtype
        torch.float32
    """
    with _CudaAutocastFloat32():
        yield


class _CudaDropout(TorchFunctionMode):
    """``F.dropout`` in training through the fused kernel CUDA takes (``native_dropout``: the mask kept as bool)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            names = ("input", "p", "training", "inplace")
            given = {**dict(zip(names, args)), **kwargs}
            x, p = given.get("input"), float(given.get("p", 0.5))
            fused = given.get("training", True) and not given.get("inplace", False) and 0.0 < p < 1.0
            if fused and isinstance(x, Tensor) and x.is_floating_point() and x.numel() > 0:
                return torch.ops.aten.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_dropout() -> Iterator[None]:
    """``torch.nn.functional.dropout`` (``nn.Dropout``) in training as CUDA runs it, on fake CPU tensors.

    On a CUDA tensor torch takes the fused ``native_dropout`` kernel, which keeps a bool mask (1 byte an element) for
    backward; on the CPU dropout keeps a random tensor of the input's dtype (4 bytes an element in float32). An
    in-place dropout takes the CPU's way on CUDA too and is left alone. Seen on an H200: the float32 masks were the
    whole of a T5 estimate's 53 MB (13 %) over the measured peak.

    Examples:
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> with cuda_dropout():
        ...     y = torch.nn.functional.dropout(x, 0.1)
        >>> type(y.grad_fn).__name__, y.grad_fn._saved_result1.dtype  # the mask kept for backward
        ('NativeDropoutBackward0', torch.bool)
    """
    with _CudaDropout():
        yield


def use_foreach(optimizers: list[torch.optim.Optimizer]) -> bool:
    """Set ``foreach=True`` where it was left to torch (``None``), as torch's default does on CUDA; whether any was.

    Groups with ``fused=True`` are left alone.

    Examples:
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
