"""Memory budgets: bytes, a size (``"40GB"``, ``"24GiB"``) or a GPU's name (:data:`GPU_MEMORY`)."""

from __future__ import annotations

import math
import os
import re

import torch

from lightning_memopt.utilities.formatting import format_bytes

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "GPU_COMPUTE_CAPABILITY",
    "GPU_MEMORY",
    "cublas_workspace_bytes",
    "cublas_workspace_config",
    "gpu_compute_capability",
    "parse_budget",
]

#: Memory torch reports for common GPUs (``total_memory`` of ``torch.cuda.get_device_properties``, GiB) and whether
#: they compute bf16 in hardware. The usable part is this minus the CUDA context and the plan's margin.
GPU_MEMORY: dict[str, tuple[float, bool]] = {
    "T4": (14.7, False),
    "V100-16GB": (15.8, False),
    "V100-32GB": (31.7, False),
    "A10G": (22.1, True),
    "L4": (22.0, True),
    "RTX3090": (23.7, True),
    "RTX4090": (23.6, True),
    "A100-40GB": (39.4, True),
    "A100-80GB": (79.1, True),
    "L40S": (44.4, True),
    "H100-80GB": (79.1, True),
    "H200": (139.8, True),
}
#: Compute capability of each GPU of :data:`GPU_MEMORY` (``torch.cuda.get_device_capability``): the cuBLAS workspace
#: depends on it (:func:`cublas_workspace_bytes`).
GPU_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "T4": (7, 5),
    "V100-16GB": (7, 0),
    "V100-32GB": (7, 0),
    "A10G": (8, 6),
    "L4": (8, 9),
    "RTX3090": (8, 6),
    "RTX4090": (8, 9),
    "A100-40GB": (8, 0),
    "A100-80GB": (8, 0),
    "L40S": (8, 9),
    "H100-80GB": (9, 0),
    "H200": (9, 0),
}
#: Memory the CUDA context and the kernels' code take on the device before any tensor (assumed; 0.3-1 GiB in practice).
CUDA_CONTEXT_BYTES = 512 * 1024**2
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}


def parse_budget(budget: int | float | str | None) -> tuple[int, str, bool | None]:
    """``(bytes, label, bf16 in hardware or None)`` of a budget: bytes, ``"40GB"``, ``"24GiB"`` or a GPU name.

    ``None`` reads the current CUDA device. ``GB`` is 10^9 bytes and ``GiB`` 2^30, as written.

    Examples:
        >>> parse_budget("A100-40GB")[0] == int(39.4 * 1024**3), parse_budget("16GB")[:2]
        (True, (16000000000, '16GB'))
    """
    if budget is None:
        if not torch.cuda.is_available():
            raise ValueError(
                "`budget` is None and there is no CUDA device to read it from. Pass the device's memory, e.g."
                f" `budget='40GB'`, or a GPU name: {', '.join(GPU_MEMORY)}."
            )
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return int(props.total_memory), props.name, props.major >= 8
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise ValueError(f"`budget` must be bytes, a size such as '40GB' or a GPU name, got {budget!r}.")
    if isinstance(budget, (int, float)):
        if not math.isfinite(budget) or budget <= 0:
            raise ValueError(f"`budget` must be positive, got {budget!r}.")
        return int(budget), format_bytes(int(budget)), None
    names = {name.upper(): name for name in GPU_MEMORY}
    key = budget.strip().upper().replace(" ", "")
    if key in names:
        gib, bf16 = GPU_MEMORY[names[key]]
        return int(gib * 1024**3), names[key], bf16
    number = key.rstrip("KMGTIB")
    unit = key[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"`budget`={budget!r} is neither a size (e.g. '40GB', '24GiB', 8e9) nor a known GPU."
            f" Known GPUs: {', '.join(GPU_MEMORY)}."
        )
    return int(value * _UNITS[unit]), budget.strip(), None


def gpu_compute_capability(gpu: str | tuple[int, int]) -> tuple[tuple[int, int], str]:
    """``((major, minor), label)`` of a GPU name from :data:`GPU_MEMORY` or a compute capability such as ``(9, 0)``.

    Examples:
        >>> gpu_compute_capability("h100-80gb"), gpu_compute_capability((8, 0))
        (((9, 0), 'H100-80GB'), ((8, 0), 'sm80'))
    """
    if isinstance(gpu, str):
        names = {name.upper(): name for name in GPU_COMPUTE_CAPABILITY}
        key = gpu.strip().upper().replace(" ", "")
        if key not in names:
            raise ValueError(
                f"`gpu`={gpu!r} is not a known GPU. Known GPUs: {', '.join(GPU_COMPUTE_CAPABILITY)}; or pass its"
                " compute capability, e.g. `gpu=(9, 0)`."
            )
        return GPU_COMPUTE_CAPABILITY[names[key]], names[key]
    if (
        isinstance(gpu, tuple)
        and len(gpu) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in gpu)
    ):
        return (gpu[0], gpu[1]), f"sm{gpu[0]}{gpu[1]}"
    raise ValueError(
        f"`gpu` must be a GPU name ({', '.join(GPU_COMPUTE_CAPABILITY)}) or a compute capability such as (9, 0),"
        f" got {gpu!r}."
    )


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None, config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace (per handle and stream), as torch chooses it (``getChosenWorkspaceSize`` in
    ``aten/src/ATen/cuda/CublasHandlePool.cpp``).

    ``CUBLAS_WORKSPACE_CONFIG`` (``config``, e.g. ``":4096:8"`` or ``":4096:2:16:8"``) sums ``SIZE KiB x COUNT``
    over its ``:SIZE:COUNT`` pairs; without it (or where it has no pair, as torch warns) the default is 32 MiB
    (``:4096:8``) on compute capability 9.0 (H100, H200) and 8 MiB + 128 KiB (``:4096:2:16:8``) elsewhere; ``None``
    (unknown GPU) takes the latter.

    Examples:
        >>> cublas_workspace_bytes((9, 0)) // 1024, cublas_workspace_bytes((8, 0)) // 1024
        (32768, 8320)
        >>> cublas_workspace_bytes((9, 0), ":16:8") // 1024  # the deterministic setting's smaller workspace
        128
    """
    default = 4096 * 8 * 1024 if compute_capability == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        return default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublas_workspace_config() -> str | None:
    """``CUBLAS_WORKSPACE_CONFIG`` of this process's environment (the training job is assumed to have the same)."""
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG")
