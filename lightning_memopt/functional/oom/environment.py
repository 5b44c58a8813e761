"""What the process runs on: allow-listed environment variables (secrets redacted), allocator settings, versions."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version

import torch

from lightning_memopt.utilities.redaction import REDACTED, is_secret_name, redact_text

__all__ = ["ALLOCATOR_ENV_VARS", "ENV_PREFIXES", "allocator_settings", "collect_environment", "collect_versions"]

#: Environment variables are reported only when their name starts with one of these prefixes (or is listed in
#: ``_ENV_NAMES``). Everything else in the environment is left out.
ENV_PREFIXES: tuple[str, ...] = (
    "CUDA_",
    "CUBLAS_",
    "CUDNN_",
    "NCCL_",
    "NVIDIA_",
    "PYTORCH_",
    "TORCH_",
    "OMP_",
    "MKL_",
    "KMP_",
    "HIP_",
    "ROCR_",
    "HSA_",
    "PL_",
    "LIGHTNING_",
)
_ENV_NAMES = frozenset({"WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"})
# REDACTED and is_secret_name live in lightning_memopt.utilities.redaction, so that the
# environment, the Markdown and the callback's report all redact by one rule.
#: The caching-allocator settings, in the order torch reads them.
ALLOCATOR_ENV_VARS: tuple[str, ...] = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def collect_environment(
    environ: Mapping[str, str] | None = None, prefixes: Sequence[str] = ENV_PREFIXES
) -> dict[str, str]:
    """Environment variables worth reporting, with secrets redacted.

    Only names starting with one of ``prefixes`` (and the launcher's rank/world-size variables) are kept;
    the value of a kept name whose words make it secret (``TORCH_HUB_TOKEN``, ``LIGHTNING_API_KEY``; see
    :func:`~lightning_memopt.utilities.redaction.is_secret_name`) is replaced by ``"<redacted>"``, and
    credentials inside the other values (``https://user:password@host``, ``?token=...``, ``Bearer ...``,
    ``password: ...``) are replaced by :func:`~lightning_memopt.utilities.redaction.redact_text`.

    Args:
        environ: The environment to read. Default: ``os.environ``.
        prefixes: Allowed name prefixes.

    Examples:
        >>> collect_environment({"NCCL_DEBUG": "INFO", "HOME": "/root", "TORCH_HUB_TOKEN": "abc",
        ...                      "PL_LOGGER_URI": "https://me:pw@host/runs"})
        {'NCCL_DEBUG': 'INFO', 'PL_LOGGER_URI': 'https://me:<redacted>@host/runs', 'TORCH_HUB_TOKEN': '<redacted>'}
    """
    environ = os.environ if environ is None else environ
    kept: dict[str, str] = {}
    for name in sorted(environ):
        if not (name.startswith(tuple(prefixes)) or name in _ENV_NAMES):
            continue
        if is_secret_name(name):
            kept[name] = REDACTED
        else:
            kept[name] = redact_text(str(environ[name]))
    return kept


def allocator_settings(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The caching-allocator settings (``PYTORCH_ALLOC_CONF`` and its per-backend forms), ``None`` when unset.

    Examples:
        >>> allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})["PYTORCH_CUDA_ALLOC_CONF"]
        'expandable_segments:True'
    """
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in ALLOCATOR_ENV_VARS}


def _version_of(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def collect_versions() -> dict[str, str | None]:
    """Versions of Python, torch (and its CUDA/ROCm), Lightning, torchmetrics and lightning-memopt.

    A distribution that is not installed is ``None``.

    Examples:
        >>> sorted(collect_versions())[:3]
        ['cuda', 'hip', 'lightning']
    """
    from lightning_memopt.__about__ import __version__

    try:
        import lightning

        lightning_version: str | None = lightning.__version__
    except (ImportError, AttributeError):  # the standalone `pytorch-lightning` distribution instead
        lightning_version = _version_of("pytorch-lightning")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "cuda": getattr(torch.version, "cuda", None),
        "hip": getattr(torch.version, "hip", None),
        "lightning": lightning_version,
        "torchmetrics": _version_of("torchmetrics"),
        "lightning_memopt": __version__,
    }
