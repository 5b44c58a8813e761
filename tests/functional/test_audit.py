"""The MemoryAudit core, driven by a fake allocator and a list that collects what it emits."""

from __future__ import annotations

import gc
import json

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt.functional.audit.leaks import LeakSampler
from lightning_memopt.functional.audit.loaders import fit_loaders, named_loaders
from lightning_memopt.functional.audit.session import AuditSession
from lightning_memopt.functional.footprint import live_tensors, storage_key
from lightning_memopt.functional.readings.memory import DeviceMemory
from tests.helpers.fake_device import FakeAllocator


class Sink(list):
    """The ``emit`` of a session: keeps ``(event, batch_idx, keys)`` and returns a record like the callback's."""

    def __call__(self, reading, event, batch_idx, **keys):
        self.append((event, batch_idx, keys))
        return {"event": event, **keys}


def _session(memory, window=3, rank=0, **kwargs):
    sampler = LeakSampler(window, 1, None, walk=lambda device, names=None: [])
    return AuditSession(memory, sampler, 0.5, 5, collect_garbage=False, rank=rank, **kwargs)


def test_allocated_bytes_rising_every_sample_are_a_leak_reported_once_with_the_holders():
    fake = FakeAllocator()
    session, sink = _session(fake), Sink()

    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)
            self.kept = [self.lin(torch.ones(1, 2)).sum()]

    for step in (10, 20, 30):
        fake.set(1000 * step)
        session.leak_sample(Leaky(), step, batch_idx=step - 1, emit=sink)
    [(event, batch_idx, keys)] = sink
    assert (event, batch_idx, keys["check"]) == ("warning", 29, "leak")
    assert keys["bytes_per_step"] == 1000.0 and keys["first_step"] == 20
    assert keys["samples"] == [(10, 10000), (20, 20000), (30, 30000)]
    assert keys["grad_fn_holders"] == [{"path": "self.kept", "num_tensors": 1, "bytes": 4}]
    assert "Allocated memory on cuda:0 grows by" in keys["message"] and session.leak_reported
    assert session.leak is not None and session.leak.bytes_per_step == 1000.0
    session.new_fit(resumed=True)  # a resumed run keeps its samples and verdict
    assert session.leak_reported and len(session.sampler.samples) == 3
    session.new_fit(resumed=False)
    assert not session.leak_reported and session.leak is None and not session.sampler.samples


def test_the_fit_start_audit_emits_one_record_and_the_duplicates_warning_once():
    model = nn.Linear(64, 32)
    stray = [p.detach().double().clone() for p in model.parameters()]  # a leftover copy in another dtype
    session, sink = _session(DeviceMemory("cpu")), Sink()
    session.sampler.walk = live_tensors
    result = session.audit(model, [], "fit_start", sink)
    session.audit(model, [], "first_step", sink)
    events = [(event, keys.get("audit", keys.get("check"))) for event, _, keys in sink]
    assert events == [("audit", "fit_start"), ("warning", "duplicates"), ("audit", "first_step")]
    assert result.duplicates.bytes >= (64 * 32 + 32) * 8 and session.warn_duplicates
    assert session.last_audit == {"event": "audit", **sink[2][2]}
    audit = sink[0][2]
    assert audit["footprint_device_bytes"] == (64 * 32 + 32) * 4 and audit["unexplained_bytes"] is None
    assert list(audit["largest_unowned"][0]) == ["shape", "dtype", "device", "bytes", "requires_grad", "has_grad_fn"]
    json.dumps(sink)
    del stray


def test_loader_findings_warn_once_on_rank_zero_and_other_ranks_only_write():
    loader = DataLoader(TensorDataset(torch.zeros(8, 4)), batch_size=4, num_workers=1, persistent_workers=True)
    named = fit_loaders(DataLoader(TensorDataset(torch.zeros(8, 4))), [loader])
    for rank, expected in ((0, ["warning", "dataloaders"]), (1, ["dataloaders"])):
        session, sink = _session(DeviceMemory("cpu"), rank=rank), Sink()
        session.start_loaders(named, sink)
        assert session.unmeasured == dict(named)
        measured = session.measure_loader("val", [torch.zeros(4, 4)], sink)
        assert measured is session.loaders[-1] and measured.batch_bytes == 4 * 4 * 4
        assert session.measure_loader("val", [torch.zeros(4, 4)], sink) is None  # measured once
        assert [event for event, _, _ in sink] == expected
        assert [info.name for info in session.loaders] == ["train", "val"]
        session.new_fit(resumed=False)  # the next fit audits its own loaders
        assert session.loaders == [] and session.unmeasured == {}
    assert named_loaders("val", {"a": 1}) == [("val[a]", 1)]


class _Fixed:
    """A walk that sees fixed tensors (named from ``names``) and counts its calls."""

    def __init__(self, tensors):
        self.tensors, self.calls = tensors, 0

    def __call__(self, device, names=None):
        self.calls += 1
        return [t for t in live_tensors(device, names) if any(t.key == storage_key(x) for x in self.tensors)]


def test_the_full_collection_runs_only_when_a_tensor_nobody_holds_could_be_garbage(monkeypatch):
    from lightning_memopt.functional.audit import session as audit_module

    collections = []
    monkeypatch.setattr(audit_module.gc, "collect", lambda *args: collections.append(args) or 0)
    model, batch = nn.Linear(4, 2), torch.ones(3, 4)
    session = AuditSession(DeviceMemory("cpu"), LeakSampler(3, 1, None), 0.5, 5, collect_garbage=True)
    # the model's own tensors, and a batch the caller holds: nothing can be garbage, no collection
    session.sampler.walk = walk = _Fixed([*model.parameters(), batch])
    session.audit(model, [], "first_step", Sink(), alive=({"batch": batch}, None))
    assert collections == [] and walk.calls == 1
    # a tensor nobody named and nobody passed in: collected, then walked again
    session.audit(model, [], "first_step", Sink())
    assert collections == [()] and walk.calls == 3
    # collect_garbage=False never collects
    session.collect_garbage = False
    session.audit(model, [], "first_step", Sink())
    assert collections == [()]


def test_a_copy_of_the_weights_in_a_garbage_cycle_is_collected_before_it_is_reported():
    model = nn.Linear(64, 32)

    class Cycle:
        pass

    cycle = Cycle()
    cycle.me, cycle.copy = cycle, [p.detach().double().clone() for p in model.parameters()]
    session = AuditSession(DeviceMemory("cpu"), LeakSampler(3, 1, None), 0.5, 5, collect_garbage=True)
    enabled = gc.isenabled()
    gc.disable()  # only the audit's own collection may free the cycle
    try:
        del cycle  # unreachable, freed only by a full collection
        result = session.audit(model, [], "fit_start", Sink())
    finally:
        if enabled:
            gc.enable()
    assert result.duplicates.num_tensors == 0
