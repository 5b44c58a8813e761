"""Recognising out-of-memory errors and finding the batch that was being processed when one happened.

:func:`is_out_of_memory_error` is the one place in the package that decides whether an exception is an
out-of-memory error. :func:`find_in_traceback` reads locals (``batch``, ``batch_idx``) from the frames of a
traceback, innermost first: Lightning's ``on_exception`` hook runs after the exception left the loop, but the
traceback still holds the frames that were running.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

__all__ = ["FrameLocal", "OOM_MESSAGE_PATTERNS", "find_in_traceback", "is_out_of_memory_error"]

#: Message fragments (lower case) of out-of-memory errors raised without ``torch.OutOfMemoryError``: other
#: backends (MPS, XPU, ROCm), CUDA errors surfaced by the runtime or a library (cuBLAS, cuDNN, cuFFT, cuSOLVER,
#: NCCL) and the host allocator.
OOM_MESSAGE_PATTERNS: tuple[str, ...] = (
    "cuda out of memory",
    "cuda error: out of memory",
    "cudaerrormemoryallocation",
    "hip out of memory",
    "hip error: out of memory",
    "hiperroroutofmemory",
    "mps backend out of memory",
    "xpu out of memory",
    "xpu error: out of memory",
    "ur_result_error_out_of_device_memory",
    "ze_result_error_out_of_device_memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cufft_alloc_failed",
    "cusolver_status_alloc_failed",
    "cusparse_status_alloc_failed",
    "defaultcpuallocator: can't allocate memory",
    "out of memory. tried to allocate",
)

_MAX_CHAIN = 8
# Backend errors that say "out of memory" in a sentence the patterns above do not list.
_GENERIC = re.compile(r"\b(?:out of (?:device )?memory|failed to allocate)\b", re.IGNORECASE)
_DEVICE_WORDS = re.compile(r"\b(?:cuda|gpu|device|hip|rocm|mps|xpu|cublas|cudnn|allocator)\b", re.IGNORECASE)


def _oom_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [MemoryError]
    for owner in (torch, getattr(torch, "cuda", None)):
        cls = getattr(owner, "OutOfMemoryError", None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            types.append(cls)
    return tuple(types)


def _message_says_oom(err: BaseException) -> bool:
    try:
        message = str(err)
    except Exception:
        return False
    lowered = message.lower()
    if any(pattern in lowered for pattern in OOM_MESSAGE_PATTERNS):
        return True
    # "out of memory" / "failed to allocate" next to a device word, e.g. "XPU error: out of device memory".
    return bool(_GENERIC.search(message) and _DEVICE_WORDS.search(message))


def is_out_of_memory_error(err: BaseException | None) -> bool:
    """Whether ``err`` is an out-of-memory error of any device, library or the host.

    Checks, in order: ``isinstance(err, torch.OutOfMemoryError)`` (CUDA and the backends that use it), Python's
    ``MemoryError`` (host), then the messages of other backends and libraries (MPS, XPU, ROCm, cuBLAS, cuDNN
    allocation failures, ``CUDA error: out of memory`` from the runtime, the CPU allocator). Errors that wrap
    an out-of-memory error (``raise ... from oom``, or raised while handling one) count too, up to 8 links deep.
    Lightning's ``is_oom_error`` reads CUDA message text only and misses most of these.

    ``OOMReporter`` decides with this function; use it where your own code must tell an out-of-memory error from
    a bug, e.g. to retry a step with less memory and let every other error through::

        try:
            loss = step(batch)
        except Exception as err:
            if not is_out_of_memory_error(err):
                raise
            loss = step_in_halves(batch)

    Args:
        err: Any exception, or ``None``.

    Returns:
        ``True`` for an out-of-memory error, or an error caused by one; ``False`` otherwise (and for ``None``).

    Examples:
        >>> is_out_of_memory_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_out_of_memory_error(RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"))
        True
        >>> is_out_of_memory_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
        True
        >>> is_out_of_memory_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
        >>> try:
        ...     try:
        ...         raise torch.OutOfMemoryError("CUDA out of memory.")
        ...     except torch.OutOfMemoryError as oom:
        ...         raise RuntimeError("training step 12 failed") from oom
        ... except RuntimeError as err:
        ...     wrapped = err
        >>> is_out_of_memory_error(wrapped)
        True
    """
    oom_types = _oom_error_types()
    seen: set[int] = set()
    current = err
    for _ in range(_MAX_CHAIN):
        if current is None or id(current) in seen:
            return False
        seen.add(id(current))
        if isinstance(current, oom_types):
            return True
        if isinstance(current, (RuntimeError, OSError, ValueError)) and _message_says_oom(current):
            return True
        current = current.__cause__ or current.__context__
    return False


@dataclass(frozen=True)
class FrameLocal:
    """A local variable found in a traceback frame.

    Args:
        name: The variable's name.
        value: Its value.
        function: The function whose frame held it.
        location: ``"<file>:<line>"`` of that frame when the error passed through it.
    """

    name: str
    value: Any
    function: str
    location: str


def _frames(tb: TracebackType | None) -> list[TracebackType]:
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    return frames


def find_in_traceback(tb: TracebackType | None, name: str, max_frames: int = 200) -> FrameLocal | None:
    """The innermost frame local called ``name`` in traceback ``tb``, or ``None`` if no frame has one.

    Args:
        tb: A traceback (``err.__traceback__``).
        name: The local's name, e.g. ``"batch"``.
        max_frames: Look at most at this many innermost frames.

    Examples:
        >>> def step(batch):
        ...     raise torch.OutOfMemoryError("boom")
        >>> try:
        ...     step(batch=[1, 2])
        ... except torch.OutOfMemoryError as err:
        ...     found = find_in_traceback(err.__traceback__, "batch")
        >>> found.value, found.function
        ([1, 2], 'step')
    """
    for entry in reversed(_frames(tb)[-max_frames:]):
        try:
            frame = entry.tb_frame
            f_locals = frame.f_locals
            if name not in f_locals:
                continue
            code = frame.f_code
            return FrameLocal(name, f_locals[name], code.co_name, f"{code.co_filename}:{entry.tb_lineno}")
        except Exception:  # a frame whose locals cannot be read: skip it
            continue
    return None
