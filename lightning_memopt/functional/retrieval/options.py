"""The options of the retrieval functions (protocols, ties, medians), their defaults, and the feature checks."""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_memopt.utilities.state import state_error

__all__ = [
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "FEATURE_DTYPES",
    "MEDIANS",
    "PROTOCOLS",
    "TIES",
    "V2T_GALLERIES",
    "Median",
    "Protocol",
    "Ties",
    "V2TGallery",
    "check_features",
    "check_state_tensors",
    "repeated_text_message",
]

#: Default working-set budget for one block computation (score block, comparison buffer, upcast features).
DEFAULT_MEMORY_BUDGET_BYTES = 2 * 1024**3

Protocol = Literal["dedup", "paired"]
Ties = Literal["optimistic", "pessimistic"]
Median = Literal["floor", "mean", "lower"]
V2TGallery = Literal["texts", "groups"]

PROTOCOLS = ("dedup", "paired")
TIES = ("optimistic", "pessimistic")
MEDIANS = ("floor", "mean", "lower")
V2T_GALLERIES = ("texts", "groups")

#: Feature dtypes accepted (blocks are multiplied in float32 whatever the storage dtype; float64 is rounded to float32).
FEATURE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

_float64_warned = False


def blocks_device(device: torch.device | str | None, video: Tensor) -> torch.device:
    """Where blocks are computed: ``device`` when given, else where ``video`` is."""
    if device is not None:
        return torch.device(device)
    return video.device


def _warn_if_float64(*features: Tensor) -> None:
    """Say once per process that float64 features are ranked in float32 (the blocks are float32 products)."""
    global _float64_warned
    if _float64_warned or not any(x.dtype == torch.float64 for x in features):
        return
    _float64_warned = True
    warnings.warn(
        "Retrieval features of dtype float64 are ranked in float32: every score is computed from the features"
        " rounded to float32, as if `.float()` had been called on them (ties between exact copies stay exact). Pass"
        " float32 features to silence this.",
        UserWarning,
        stacklevel=3,
    )


def check_features(video_features: Tensor, text_features: Tensor) -> None:
    """Raise a ``ValueError`` naming the argument unless both are finite 2-D float tensors of the same shape.

    Warns once per process when either is float64 (it is ranked in float32).

    Examples:
        >>> check_features(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16))  # valid: returns None
    """
    allowed = ", ".join(str(d) for d in FEATURE_DTYPES)
    for name, x in (("video_features", video_features), ("text_features", text_features)):
        if not isinstance(x, Tensor):
            raise ValueError(
                f"`{name}` must be a 2-D float tensor (rows x dim), got {type(x).__name__}. Convert it with"
                " `torch.as_tensor(...)`."
            )
        if x.dim() != 2:
            raise ValueError(f"`{name}` must be a 2-D float tensor (rows x dim), got shape {tuple(x.shape)}.")
        if x.dtype not in FEATURE_DTYPES:
            raise ValueError(
                f"`{name}` has dtype {x.dtype}, but features must be one of {allowed}. Pass the embeddings, not"
                " ids or masks, or cast them with `.float()`."
            )
    if video_features.shape[0] != text_features.shape[0]:
        raise ValueError(
            f"`video_features` and `text_features` must have one row per sample each, got {video_features.shape[0]}"
            f" and {text_features.shape[0]} rows. Pass the features of the same samples."
        )
    if video_features.shape[1] != text_features.shape[1]:
        raise ValueError(
            f"`video_features` and `text_features` must have the same feature dim, got {video_features.shape[1]}"
            f" and {text_features.shape[1]}. Project both modalities into the shared embedding space first."
        )
    for name, x in (("video_features", video_features), ("text_features", text_features)):
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise ValueError(f"`{name}` contains NaN or inf values; retrieval ranks are undefined for them.")
    _warn_if_float64(video_features, text_features)


def repeated_text_message(ids: Tensor, repeated: Tensor, kept: Tensor, owner: str) -> str | None:
    """The warning for caption ids given again with other features, or ``None`` when every repeat matches.

    ``repeated[i]`` is a later embedding of caption ``ids[i]``, ``kept[i]`` the one ranked (its first). Features
    match when they are equal up to rounding (``torch.isclose`` with ``rtol = max(1e-4, 8 * eps)`` of ``kept``'s
    dtype, ``atol=1e-6``): a caption embedded again in another batch stays silent.

    Examples:
        >>> ids, kept = torch.tensor([4, 9]), torch.ones(2, 3)
        >>> repeated_text_message(ids, kept.clone(), kept, "f") is None
        True
        >>> print(repeated_text_message(ids, torch.tensor([[1.0, 1, 1], [0, 1, 1]]), kept, "f"))  # doctest: +ELLIPSIS
        f: text id 9 was given again with other features (largest difference 1); the first embedding is kept ...
    """
    if ids.numel() == 0:
        return None
    repeated = repeated.detach().to(device=kept.device, dtype=kept.dtype)
    rtol = max(1e-4, 8 * torch.finfo(kept.dtype).eps)
    differs = ~torch.isclose(repeated, kept, rtol=rtol, atol=1e-6).all(dim=1)
    if not bool(differs.any()):
        return None
    first = int(torch.nonzero(differs)[0, 0])
    gap = float((repeated[first].float() - kept[first].float()).abs().max())
    return (
        f"{owner}: text id {int(ids[first])} was given again with other features (largest difference {gap:.3g});"
        " the first embedding is kept and later ones are ignored (captions are deduplicated by `text_ids`). Give"
        " each distinct caption its own id, or use protocol='paired' to rank every row's own text."
    )


def _has_state_dims(part: Tensor, features: bool) -> bool:
    """Whether a tensor of a list state has its dims: 2-D in a feature dtype for ``*features`` states, else 1-D."""
    if features:
        return part.dim() == 2 and part.dtype in FEATURE_DTYPES
    return part.dim() == 1


def check_state_tensors(owner: str, key: str, value: Any) -> None:
    """Raise a ``ValueError`` naming ``owner``, ``key`` and the value unless a loaded list state holds its tensors.

    ``*features`` states hold 2-D float tensors (rows x dim), the id states 1-D int64 tensors; a state is a list of
    them, or one tensor once concatenated. Losing rows of an evaluation is not harmless, so nothing starts fresh.

    Examples:
        >>> check_state_tensors("M", "sample_ids", [torch.arange(3)])  # valid: returns None
    """
    features = key.endswith("features")
    expected = "a list of 2-D float tensors" if features else "a list of 1-D int64 tensors"
    parts = [value] if isinstance(value, Tensor) else value
    if not isinstance(parts, (list, tuple)) or not all(isinstance(part, Tensor) for part in parts):
        raise state_error(owner, key, expected, value)
    for part in parts:
        good = _has_state_dims(part, features)
        if not good or (not features and part.dtype != torch.int64):
            raise state_error(owner, key, expected, value)
