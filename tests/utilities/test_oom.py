"""Out-of-memory detection and batch lookup in tracebacks."""

import pytest
import torch

from lightning_memopt.utilities.oom import find_in_traceback, is_out_of_memory_error

OOM_MESSAGES = [
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.10 GiB",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
    "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.00 GB, max allowed: 18.13 GB).",
    "XPU out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.11 GiB total capacity)",
    "HIP out of memory. Tried to allocate 1.00 GiB",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB",
    "UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY",
    "XPU error: out of device memory",
]
NOT_OOM = [
    "mat1 and mat2 shapes cannot be multiplied (4x3 and 2x2)",
    "CUDA error: device-side assert triggered",
    "Expected all tensors to be on the same device",
    "out of range",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "failed to allocate a port for the rendezvous store",
]


def test_torch_out_of_memory_error_by_type_whatever_its_message():
    assert is_out_of_memory_error(torch.OutOfMemoryError("anything"))
    assert is_out_of_memory_error(torch.cuda.OutOfMemoryError(""))
    assert is_out_of_memory_error(MemoryError())


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_other_backends_and_libraries_by_message(message):
    assert is_out_of_memory_error(RuntimeError(message))


@pytest.mark.parametrize("message", NOT_OOM)
def test_other_errors_are_not_oom(message):
    assert not is_out_of_memory_error(RuntimeError(message))


def test_non_runtime_errors_and_none_are_not_oom():
    assert not is_out_of_memory_error(None)
    assert not is_out_of_memory_error(KeyboardInterrupt())
    assert not is_out_of_memory_error(TypeError("CUDA out of memory"))  # wrong family: a bug, not an OOM


def test_wrapped_oom_is_found_through_cause_and_context():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError as inner:
            raise ValueError("step failed") from inner
    except ValueError as outer:
        assert is_out_of_memory_error(outer)
    try:
        try:
            raise RuntimeError("CUDA error: out of memory")
        except RuntimeError:
            raise KeyError("during handling")  # noqa: B904 - implicit context on purpose
    except KeyError as outer:
        assert is_out_of_memory_error(outer)


def test_self_referencing_chain_terminates():
    err = RuntimeError("no")
    err.__context__ = err
    assert not is_out_of_memory_error(err)


def test_message_that_raises_in_str_is_not_oom():
    class Weird(RuntimeError):
        def __str__(self):
            raise ValueError("boom")

    assert not is_out_of_memory_error(Weird())


def _outer(batch, batch_idx):
    helper = 1  # noqa: F841
    return _inner([batch])


def _inner(values):
    batch = {"x": torch.ones(2)}  # noqa: F841 - found by the lookup
    raise torch.OutOfMemoryError("CUDA out of memory")


def test_find_in_traceback_returns_innermost_frame_local():
    with pytest.raises(torch.OutOfMemoryError) as info:
        _outer("outer batch", 7)
    tb = info.value.__traceback__
    batch = find_in_traceback(tb, "batch")
    assert batch.function == "_inner" and isinstance(batch.value, dict)
    assert batch.location.endswith(f":{_inner.__code__.co_firstlineno + 2}")
    idx = find_in_traceback(tb, "batch_idx")
    assert idx.value == 7 and idx.function == "_outer"
    assert find_in_traceback(tb, "nothing_called_this") is None
    assert find_in_traceback(None, "batch") is None
