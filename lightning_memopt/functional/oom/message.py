"""The numbers an allocator puts in its out-of-memory message."""

from __future__ import annotations

import re

__all__ = ["MESSAGE_FIELDS", "parse_oom_message"]

_UNITS = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*(bytes|byte|b|kib|mib|gib|tib|kb|mb|gb|tb)\b"
_PATTERNS = {
    "requested_bytes": rf"tried to allocate {_SIZE}",
    "device_total_bytes": rf"total capacity of {_SIZE}",
    "device_free_bytes": rf"of which {_SIZE} is free",
    "process_in_use_bytes": rf"this process has {_SIZE} memory in use",
    "pytorch_allocated_bytes": rf"{_SIZE} is allocated by pytorch",
    "reserved_unallocated_bytes": rf"{_SIZE} is reserved by pytorch but unallocated",
}
#: The fields :func:`parse_oom_message` returns, in order (the report has them as ``memory.message_<field>``).
MESSAGE_FIELDS: tuple[str, ...] = tuple(_PATTERNS)


def _to_bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.lower()])


def parse_oom_message(message: str) -> dict[str, int | None]:
    """The numbers an allocator puts in its out-of-memory message, in bytes (``None`` when absent).

    Examples:
        >>> msg = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which"
        ...        " 1.50 GiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 6.00 GiB is"
        ...        " reserved by PyTorch but unallocated.")
        >>> fields = parse_oom_message(msg)
        >>> fields["requested_bytes"] == 2 * 1024**3, fields["reserved_unallocated_bytes"] == 6 * 1024**3
        (True, True)
    """
    result: dict[str, int | None] = {}
    for field, pattern in _PATTERNS.items():
        match = re.search(pattern, message or "", flags=re.IGNORECASE)
        if match:
            result[field] = _to_bytes(match.group(1), match.group(2))
        else:
            result[field] = None
    return result
