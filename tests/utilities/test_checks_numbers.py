"""Numbers of any real type are accepted and stored as Python floats; reading a device this process cannot use is a
clear error (and one warning in a monitoring hook)."""

from __future__ import annotations

import fractions
import warnings

import pytest
import torch

import lightning_memopt.functional.readings.memory as mem
from lightning_memopt import MemoryAudit, MemoryMonitor, read_memory
from lightning_memopt.callbacks._memory_log import GuardedReader
from lightning_memopt.utilities.checks import check_fraction, check_non_negative_number, check_positive_number
from lightning_memopt.utilities.warnings import WarnOnce

np = pytest.importorskip("numpy")


@pytest.mark.parametrize(
    "value", [np.float32(0.9), np.float64(0.9), np.float16(0.5), fractions.Fraction(9, 10), np.int64(1), 1]
)
def test_any_real_number_is_a_fraction_stored_as_a_python_float(value):
    out = check_fraction("warn_threshold", value)
    assert type(out) is float and out == float(value)
    assert type(check_positive_number("x", value)) is float
    assert type(check_non_negative_number("x", value)) is float


#: Refused although some pass for numbers elsewhere: (value, hint in the fraction error). A bool is never a number.
REFUSED = [
    (True, ""),
    (np.bool_(True), ""),
    (torch.tensor(0.5), "Pass a Python number, e.g. `value.item()`."),
    (np.array(0.5), "Pass a Python number, e.g. `value.item()`."),
    ("0.9", ""),
    (np.float32("nan"), ""),
    (np.float32(90), "Did you mean 0.9 (90 %)?"),
    (10**400, ""),
]


def test_only_real_numbers_in_range_are_fractions_and_none_only_where_allowed():
    assert check_fraction("warn_threshold", np.float32(0.5)) == 0.5  # the widening this guards
    assert check_fraction("f", None, allow_none=True) is None
    assert check_positive_number("f", None, allow_none=True) is None
    for value, hint in REFUSED:
        with pytest.raises(ValueError, match=r"`warn_threshold` must be a fraction in \(0, 1\], got ") as info:
            check_fraction("warn_threshold", value)
        assert hint in str(info.value), value
    for value in (True, np.bool_(False), torch.tensor(2.0), "2", np.float32("inf"), -np.float64(1), None):
        with pytest.raises(ValueError, match="`x` must be a finite, non-negative number, got "):
            check_non_negative_number("x", value)


def test_callbacks_take_numpy_fractions_and_store_python_floats():
    monitor = MemoryMonitor(warn_threshold=np.float32(0.9))
    assert type(monitor.warn_threshold) is float
    audit = MemoryAudit(duplicate_fraction=np.float32(0.5), leak_max_overhead=np.float64(0.01))
    assert type(audit.duplicate_fraction) is float and audit.duplicate_fraction == 0.5
    assert type(audit.leak_max_overhead) is float and audit.leak_max_overhead == 0.01


# ------------------------------------------------------------------------------------------- read_memory


# ids never the bare word "cuda": tests/conftest.py skips tests with that keyword on a machine without a GPU
@pytest.mark.parametrize(
    "device",
    ["cuda:0", "cuda", 0, torch.device("cuda", 1), "xpu:0"],
    ids=["cuda:0", "current-cuda", "index-0", "cuda:1", "xpu:0"],
)
def test_reading_a_device_without_its_backend_is_a_clear_error(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as info:
        read_memory(device)
    message = str(info.value)
    assert "is not available in this process" in message
    assert "cuda" in message or "xpu" in message
    assert "Pass `'cpu'`" in message


def test_an_index_past_the_visible_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    expected = r"`device` is 'cuda:2', but this process sees 2 CUDA device\(s\) \(indices 0 to 1\)"
    with pytest.raises(ValueError, match=expected):
        read_memory("cuda:2")
    assert read_memory("cpu").host_rss_bytes is not None  # devices without allocator readings still read
    assert read_memory("meta").allocated_bytes is None


def test_a_monitoring_reader_turns_the_error_into_one_warning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reader = GuardedReader(mem.DeviceMemory("cuda:0"), WarnOnce(), "MemoryMonitor")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        readings = [reader.read(), reader.read()]
    assert readings == [None, None]
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith("MemoryMonitor: reading memory failed") and "cuda:0" in said[0]


def test_a_numpy_memory_fraction_is_stored_as_a_python_float():
    numpy = pytest.importorskip("numpy")
    from lightning_memopt import AllocatorSettings, MemoryPreset

    for holder in (
        AllocatorSettings(memory_fraction=numpy.float32(0.5)),
        MemoryPreset(memory_fraction=numpy.float32(0.5)),
    ):
        assert type(holder.memory_fraction) is float and holder.memory_fraction == 0.5
