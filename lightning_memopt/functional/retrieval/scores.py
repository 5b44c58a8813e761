"""Exact scores: the positive pairs' scores (the same bits everywhere), row keys, thresholds, full-fp32 blocks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["embedding_keys", "full_fp32_matmul", "pair_scores", "positive_thresholds"]

# Positive pairs are scored in chunks whose float64 buffer holds about this many bytes (two buffers, reused): big
# enough that per-operation latency does not add up, small enough to stay in cache (512 rows of 512 dims).
_PAIR_CHUNK_BYTES = 1 << 21
# Row keys read this many evenly spaced columns: cheap next to the block products, and rows that agree on all of
# them are compared in full before they count as duplicates.
_KEY_COLUMNS = 32
# Odd multipliers below 2**26: 32 products of int32 bits and these stay far inside int64 (no overflow anywhere).
_KEY_MULTIPLIERS = torch.tensor(
    [(2654435761 * (i + 1)) % (1 << 26) | 1 for i in range(_KEY_COLUMNS)], dtype=torch.int64
)


@contextlib.contextmanager
def full_fp32_matmul() -> Iterator[None]:
    """Multiply float32 matrices in full precision inside the block (TF32 off), restoring the setting after.

    Examples:
        >>> before = torch.get_float32_matmul_precision()
        >>> with full_fp32_matmul():
        ...     inside = torch.get_float32_matmul_precision()
        >>> inside, torch.get_float32_matmul_precision() == before
        ('highest', True)
    """
    try:
        previous = torch.get_float32_matmul_precision()
    except RuntimeError:  # the newer per-backend API (`torch.backends.*.fp32_precision`) is in use: leave it alone
        previous = None
    if previous is not None and previous != "highest":
        torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        if previous is not None and previous != "highest":
            torch.set_float32_matmul_precision(previous)


def pair_scores(video: Tensor, text: Tensor, pair_video: Tensor, pair_text: Tensor, chunk: int | None = None) -> Tensor:
    """Scores of the positive pairs: float64 dot products of the float32 features in a fixed order, rounded to float32.

    The products of float32 values are exact in float64, and the sum halves each row repeatedly with elementwise adds,
    so the order depends only on the feature dim, never on the chunk, the device, the process or a BLAS kernel's
    choice: equal feature rows give bit-identical scores, which is what lets an exact copy of a positive tie with it
    (see :mod:`~lightning_memopt.functional.retrieval.ties`). Features are rounded to float32 first, as the blocks
    are. ``chunk`` is the number of pairs per chunk (``None``: what fills a 2 MiB float64 buffer).

    Examples:
        >>> v, t = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0], [0.5, 0.5]])
        >>> pair_scores(v, t, torch.tensor([0, 0]), torch.tensor([0, 1]))
        tensor([1.0000, 1.5000])
    """
    n_pairs, dim = pair_video.numel(), video.shape[1]
    out = torch.empty(n_pairs, dtype=torch.float32, device=video.device)
    if n_pairs == 0:
        return out
    padded_dim = 1 << max(dim - 1, 0).bit_length()  # a power of two: the sum halves the row until one column is left
    if chunk is None:
        chunk = max(64, _PAIR_CHUNK_BYTES // (8 * padded_dim))
    rows = min(chunk, n_pairs)
    # two float64 buffers reused for every chunk; the padding columns [dim, padded_dim) stay zero
    products_buf = torch.zeros(rows, padded_dim, dtype=torch.float64, device=video.device)
    text_buf = torch.empty(rows, dim, dtype=torch.float64, device=video.device)
    for start in range(0, n_pairs, chunk):
        m = min(chunk, n_pairs - start)
        videos = pair_video[start : start + m].to(video.device)
        texts = pair_text[start : start + m].to(text.device)
        products, text_rows = products_buf[:m], text_buf[:m]
        products[:, :dim].copy_(video.index_select(0, videos).float())
        text_rows.copy_(text.index_select(0, texts).to(video.device).float())
        products[:, :dim].mul_(text_rows)
        width = padded_dim
        while width > 1:
            width //= 2
            products[:, :width].add_(products[:, width : 2 * width])
        out[start : start + m] = products[:, 0]
    return out


def embedding_keys(features: Tensor) -> Tensor:
    """An int64 key per row, equal for rows with equal values (``-0.0`` equals ``0.0``); int64 on CPU.

    Read from up to 32 evenly spaced columns of the float32 values with integer arithmetic only, so the key is the
    same on every device and process. Different rows can share a key: treat equal keys as candidates and compare.

    Examples:
        >>> x = torch.tensor([[1.0, -0.0], [1.0, 0.0], [2.0, 0.0]])
        >>> k = embedding_keys(x)
        >>> bool(k[0] == k[1]), bool(k[0] == k[2])
        (True, False)
    """
    n_rows, dim = features.shape
    if dim == 0:
        return torch.zeros(n_rows, dtype=torch.int64)
    n_columns = min(dim, _KEY_COLUMNS)
    columns = torch.div(torch.arange(n_columns) * (dim - 1), max(n_columns - 1, 1), rounding_mode="floor")
    sample = features.index_select(1, columns.to(features.device)).float() + 0.0  # + 0.0 turns -0.0 into 0.0
    bits = sample.view(torch.int32).to(torch.int64)
    return (bits * _KEY_MULTIPLIERS[:n_columns].to(bits.device)).sum(1).cpu()


def positive_thresholds(scores: Tensor, index: Tensor, size: int) -> Tensor:
    """Best positive score per query: ``max`` of ``scores`` grouped by ``index`` (``-inf`` where none).

    Examples:
        >>> positive_thresholds(torch.tensor([0.5, 2.0, -1.0]), torch.tensor([0, 0, 2]), 3).tolist()
        [2.0, -inf, -1.0]
    """
    out = torch.full((size,), float("-inf"), dtype=torch.float32, device=scores.device)
    return out.scatter_reduce_(0, index.to(scores.device), scores.float(), reduce="amax")
