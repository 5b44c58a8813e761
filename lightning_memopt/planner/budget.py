"""Memory budgets: bytes, a size (``"40GB"``, ``"24GiB"``) or a GPU's name (:data:`GPU_MEMORY`)."""

from __future__ import annotations

import math

import torch

from lightning_memopt.utilities.formatting import format_bytes

__all__ = ["CUDA_CONTEXT_BYTES", "GPU_MEMORY", "parse_budget"]

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

    Example:
        >>> parse_budget("A100-40GB")[0] == int(39.4 * 1024**3), parse_budget("16GB")[:2]
        (True, (16000000000, '16GB'))
    """
    if budget is None:
        if not torch.cuda.is_available():
            raise ValueError(
                "`budget_bytes` is None and there is no CUDA device to read it from. Pass the device's memory, e.g."
                f" `budget_bytes='40GB'`, or a GPU name: {', '.join(GPU_MEMORY)}."
            )
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return int(props.total_memory), props.name, props.major >= 8
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise ValueError(f"`budget_bytes` must be bytes, a size such as '40GB' or a GPU name, got {budget!r}.")
    if isinstance(budget, (int, float)):
        if not math.isfinite(budget) or budget <= 0:
            raise ValueError(f"`budget_bytes` must be positive, got {budget!r}.")
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
            f"`budget_bytes`={budget!r} is neither a size (e.g. '40GB', '24GiB', 8e9) nor a known GPU."
            f" Known GPUs: {', '.join(GPU_MEMORY)}."
        )
    return int(value * _UNITS[unit]), budget.strip(), None
