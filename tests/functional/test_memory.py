import dataclasses
import json
import os

import pytest
import torch

from lightning_memopt.functional.readings import host_memory
from lightning_memopt.functional.readings import memory as mem
from lightning_memopt.functional.readings.memory import (
    MEMORY_FIELDS,
    MemoryReading,
    empty_device_cache,
    memory_record,
    read_memory,
    reset_peak_memory,
)
from tests.helpers.memory_records import RECORD_KEYS


def test_cpu_reading_has_host_figures_and_null_device_figures():
    reading = read_memory("cpu")
    assert reading.device == "cpu"
    assert isinstance(reading.host_rss_bytes, int) and reading.host_rss_bytes > 10 * 2**20
    for field in MEMORY_FIELDS:
        if field != "host_rss_bytes":
            assert getattr(reading, field) is None, field
    assert reset_peak_memory("cpu") is False
    assert empty_device_cache("cpu") is False


def test_host_rss_tracks_a_large_allocation():
    before = read_memory("cpu").host_rss_bytes
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = read_memory("cpu").host_rss_bytes
    assert after - before > 48 * 2**20
    del block


def test_host_rss_is_read_from_proc_without_asking_psutil(monkeypatch):
    class Broken:
        def memory_info(self):
            raise RuntimeError("no psutil here")

    import psutil

    monkeypatch.setattr(host_memory, "_PROCESS", Broken())
    value = host_memory.host_rss_bytes()
    assert value is not None  # Linux has /proc/self/statm
    # an independent reading of the same thing (psutil itself, unpatched): bytes, not pages
    assert abs(value - psutil.Process().memory_info().rss) < 64 * 2**20


def test_host_rss_without_proc_comes_from_psutil(monkeypatch):
    import psutil

    no_proc = host_memory._StatmReader()
    no_proc.failed = True  # what a system without /proc gives
    monkeypatch.setattr(host_memory, "_STATM", no_proc)
    value = host_memory.host_rss_bytes()
    assert value is not None and abs(value - psutil.Process().memory_info().rss) < 64 * 2**20


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.exists("/proc/self/statm"), reason="needs fork and /proc")
def test_host_rss_in_a_forked_child_is_the_childs_own():
    host_memory.host_rss_bytes()  # the parent's descriptor of its statm is open now
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: 256 MiB more than its parent, read through the package and independently
        try:
            block = bytearray(256 * 2**20)
            block[::4096] = b"x" * len(block[::4096])
            value = host_memory.host_rss_bytes()
            with open("/proc/self/statm") as f:
                own = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            os.write(write_end, f"{value} {own}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    value, own = (int(x) for x in os.read(read_end, 100).split())
    os.close(read_end)
    os.waitpid(pid, 0)
    parent = host_memory.host_rss_bytes()
    # the child's own figure, not the parent's: they differ by the child's 256 MiB (less what a CUDA process's
    # parent holds that fork does not copy, 335 MB on a GPU machine), far more than the reading's tolerance
    assert abs(own - parent) > 32 * 2**20 and abs(value - own) < 16 * 2**20


def _visible_gpus(monkeypatch, count):
    """A process that sees ``count`` CUDA devices (for the parts of torch.cuda the readings ask first)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_cuda_reading_maps_allocator_stats(monkeypatch):
    stats = {
        "allocated_bytes.all.current": 100,
        "reserved_bytes.all.current": 300,
        "active_bytes.all.current": 120,
        "allocated_bytes.all.peak": 250,
        "reserved_bytes.all.peak": 400,
        "num_alloc_retries": 2,
        "num_ooms": 1,
    }
    seen = {}
    _visible_gpus(monkeypatch, 2)
    monkeypatch.setattr(mem, "supports_device_memory", lambda device: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: seen.setdefault("stats", device) and stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (700, 1000))
    reading = read_memory(torch.device("cuda", 1))
    assert seen["stats"] == torch.device("cuda", 1)
    assert reading.device == "cuda:1"
    assert (reading.allocated_bytes, reading.reserved_bytes, reading.active_bytes) == (100, 300, 120)
    assert (reading.peak_allocated_bytes, reading.peak_reserved_bytes) == (250, 400)
    assert (reading.device_free_bytes, reading.device_total_bytes) == (700, 1000)
    assert (reading.num_alloc_retries, reading.num_ooms) == (2, 1)
    assert reading.fraction_of_total("reserved_bytes") == pytest.approx(0.3)


def test_missing_allocator_keys_are_null_not_invented(monkeypatch):
    _visible_gpus(monkeypatch, 1)
    monkeypatch.setattr(mem, "supports_device_memory", lambda device: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"allocated_bytes.all.current": 5})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1, 2))
    reading = read_memory(torch.device("cuda", 0))
    assert reading.allocated_bytes == 5
    assert reading.reserved_bytes is None and reading.num_ooms is None


def test_record_follows_the_jsonl_schema_and_serialises():
    reading = read_memory("cpu")
    record = memory_record(reading, rank=1, phase="validate", event="step", epoch=2, global_step=7, batch_idx=3)
    assert list(record) == RECORD_KEYS
    assert json.loads(json.dumps(record)) == record
    assert record["rank"] == 1 and record["phase"] == "validate" and record["device"] == "cpu"


def test_reading_is_frozen():
    reading = MemoryReading(time=0.0, device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        reading.allocated_bytes = 3  # type: ignore[misc]
    assert reading.fraction_of_total("allocated_bytes") is None


@pytest.mark.parametrize(
    ("bad", "hint"),
    [
        (3.5, ""),
        (True, "A bool is not a device index"),
        (-1, "Device indices start at 0"),
        ("gpu0", "torch says: "),
        ([0], ""),
        (b"cpu", ""),
    ],
)
def test_read_memory_refuses_what_is_not_a_device(bad, hint):
    with pytest.raises(ValueError) as info:
        read_memory(bad)
    message = str(info.value)
    assert message.startswith(
        "`device` must be a torch.device, a device string such as 'cuda:0' or 'cpu', a CUDA device index (int >= 0)"
        f" or None, got {bad!r} ({type(bad).__name__})."
    )
    assert hint in message


@pytest.mark.parametrize("good", ["cpu", torch.device("cpu"), "meta"])
def test_read_memory_accepts_devices_without_allocator_readings(good):
    assert read_memory(good).allocated_bytes is None


@pytest.mark.cuda
def test_real_cuda_reading_and_peak_reset():
    device = torch.device("cuda", torch.cuda.current_device())
    reset_peak_memory(device)
    base = read_memory(device)
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    during = read_memory(device)
    assert during.allocated_bytes - base.allocated_bytes >= 256 * 2**20
    assert during.peak_allocated_bytes >= during.allocated_bytes
    assert during.device_total_bytes == torch.cuda.get_device_properties(device).total_memory
    assert during.device_free_bytes is not None and during.host_rss_bytes > 0
    del x
    assert reset_peak_memory(device)
    after = read_memory(device)
    assert after.peak_allocated_bytes < during.peak_allocated_bytes
    reserved_before = after.reserved_bytes
    assert empty_device_cache(device)
    assert read_memory(device).reserved_bytes <= reserved_before
