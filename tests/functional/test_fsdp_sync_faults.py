"""functional.micro_batch.fsdp_sync at faults (release 0.2): each out-of-memory error inside a collective has a store
key of its
own, deleted once every rank that waited in the collective read it; a rank waiting in the collective reports that
error while it still waits, and the failing rank waits for that before its error leaves; tensor parallelism is named
as the cause of a refusal.

In one process: a one-process gloo group gives the store; each simulated rank has an agreement of its own (as ranks
have), so that the rank that runs out of memory and the rank that waits meet at the same agreement point.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_memopt.functional.micro_batch import fsdp_sync
from lightning_memopt.functional.micro_batch.ddp_sync import check_strategy_for_micro_batches
from lightning_memopt.functional.micro_batch.fsdp_sync import (
    AgreeingReduceScatter,
    PeerCollectiveOutOfMemoryError,
    check_fsdp_for_micro_batches,
)
from lightning_memopt.functional.micro_batch.retry import Agreement

TWO_RANKS = SimpleNamespace(size=lambda: 2)  # the collective's process group, as far as the peers are counted


@pytest.fixture(autouse=True)
def _nobody_reports(monkeypatch):
    """No other process counts its report here: a failing rank does not wait for one unless a test says so."""
    monkeypatch.setattr(fsdp_sync, "PEER_REPORT_WAIT_S", 0.0)


class Rank(Agreement):
    """One simulated rank's agreement: active, its all-reduces answered by itself (nobody else ran out of memory)."""

    def __init__(self):
        super().__init__(active=True)

    def agree(self, value, more=0):
        return value, more


def _failing_with(error):
    def collective(**kwargs):
        raise error

    return collective


def _store():
    return dist.distributed_c10d._get_default_store()


def _run(agreement, collective, group=TWO_RANKS, **kwargs):
    with agreement.step():
        return AgreeingReduceScatter(agreement)._run(collective, group=group, **kwargs)


def _oom_inside_the_collective(rank, text):
    """``rank`` runs out of memory inside the reduce-scatter: its error goes to the store."""
    with pytest.raises(torch.OutOfMemoryError, match=text) as caught:
        _run(rank, _failing_with(torch.OutOfMemoryError(text)))
    return caught.value


def test_a_later_peer_failure_in_the_same_group_is_not_reported_as_the_earlier_out_of_memory_error(
    one_process_group, monkeypatch
):
    monkeypatch.setattr(fsdp_sync, "PEER_ERROR_WAIT_S", 0.2)  # how long the second failure looks for an error
    keys_before = _store().num_keys()
    failing, waiting = Rank(), Rank()
    _oom_inside_the_collective(failing, "first failure: inside the reduce-scatter")
    gloo = RuntimeError("[gloo] Connection closed by peer")
    with pytest.raises(PeerCollectiveOutOfMemoryError, match="first failure"):
        _run(waiting, _failing_with(gloo))
    assert _store().num_keys() == keys_before  # the one reader read it: deleted
    # later, another collective of the same group fails for another reason (nothing in the store)
    later = RuntimeError("[gloo] Connection closed by peer, later")
    with pytest.raises(RuntimeError) as caught:
        _run(waiting, _failing_with(later))
    assert caught.value is later and "first failure" not in str(later)
    assert "another process stopped inside FSDP's reduce-scatter" in str(later)


def test_two_out_of_memory_errors_in_one_group_each_reach_the_waiting_rank_with_their_own_message(one_process_group):
    failing, waiting = Rank(), Rank()
    gloo = RuntimeError("[gloo] Connection closed by peer")
    for text in ("first failure", "second failure"):
        _oom_inside_the_collective(failing, text)
        with pytest.raises(PeerCollectiveOutOfMemoryError) as caught:
            _run(waiting, _failing_with(gloo))
        assert text in str(caught.value)
        assert ("first failure" in str(caught.value)) == (text == "first failure")


def test_collectives_of_another_install_use_other_keys(one_process_group, monkeypatch):
    """A new fit (a new install of the agreement) starts its agreement points at 0 again: its keys still differ."""
    monkeypatch.setattr(fsdp_sync, "PEER_ERROR_WAIT_S", 0.2)
    model = nn.Linear(2, 2)
    model.set_custom_reduce_scatter = lambda collective: setattr(model, "reduce_scatter", collective)
    model.set_custom_all_gather = lambda collective: None
    first, second = Rank(), Rank()
    fsdp_sync.install_agreement([model], first)
    with pytest.raises(torch.OutOfMemoryError), first.step():
        model.reduce_scatter._run(_failing_with(torch.OutOfMemoryError("old")), group=SimpleNamespace())
    fsdp_sync.install_agreement([model], second)
    gloo = RuntimeError("[gloo] Connection closed by peer")
    with pytest.raises(RuntimeError) as caught, second.step():
        model.reduce_scatter._run(_failing_with(gloo), group=SimpleNamespace())
    assert caught.value is gloo and "old" not in str(gloo)


# ------------------------------------------------------------------------------------------ reports before the end


def _frames(traceback):
    names = []
    while traceback is not None:
        names.append(traceback.tb_frame.f_code.co_name)
        traceback = traceback.tb_next
    return names


def _key(rank, generation=0, ahead=0):
    """The store key of ``rank``'s last agreement point (``ahead=1``: of its next one)."""
    return f"{fsdp_sync._STORE_PREFIX}/{generation}/{rank.points + ahead}"


def _poll(key, counter=False):
    """Wait until ``key`` is in the store (``counter``: until that counter is 1 or more), polling: a FileStore's
    blocking wait holds it against other threads."""
    deadline = time.monotonic() + 300  # a hang guard
    while not (int(_store().add(key, 0)) >= 1 if counter else _store().check([key])):
        assert time.monotonic() < deadline, f"{key} never came"
        time.sleep(0.01)


def test_a_rank_waiting_in_the_collective_reports_the_error_while_it_waits_and_ends_with_that_object(
    one_process_group, monkeypatch
):
    monkeypatch.setattr(fsdp_sync, "WATCH_PERIOD_S", 0.02)
    keys_before = _store().num_keys()
    failing, waiting = Rank(), Rank()
    _oom_inside_the_collective(failing, "inside the reduce-scatter")
    key, reported, released = _key(failing), [], threading.Event()

    stacks = []

    def report(error):  # OOMReporter's part: called from the watching thread while the collective still runs
        reported.append((error, threading.current_thread() is threading.main_thread(), released.is_set()))
        stacks.append(_frames(error.__traceback__))

    def waits_for_the_report(**kwargs):  # the collective: released once the waiting rank counted its report
        _poll(f"{key}/reported", counter=True)
        released.set()
        raise RuntimeError("[gloo] Connection closed by peer")

    owner = object()
    fsdp_sync.report_peer_failures(owner, report)
    try:
        with pytest.raises(PeerCollectiveOutOfMemoryError, match="inside the reduce-scatter") as caught:
            _run(waiting, waits_for_the_report)
    finally:
        fsdp_sync.report_peer_failures(owner, None)
    ((error, on_main_thread, after_release),) = reported
    assert caught.value is error and not on_main_thread and not after_release
    assert "waits_for_the_report" in stacks[0]  # reported with the stack the rank waits in (the report's position)
    assert "waits_for_the_report" not in _frames(caught.value.__traceback__)  # raised with its own traceback only
    assert _store().num_keys() == keys_before  # the error, its readers and its reports: deleted


def test_the_failing_rank_waits_for_the_others_reports_before_its_error_leaves(one_process_group, monkeypatch):
    monkeypatch.setattr(fsdp_sync, "PEER_REPORT_WAIT_S", 300.0)  # not a hang guard: the count comes first
    failing, counted = Rank(), threading.Event()
    key = _key(failing, ahead=1)

    def count_when_written():  # the other rank: its report is written once the error is in the store
        _poll(key)
        counted.set()
        _store().add(f"{key}/reported", 1)

    other = threading.Thread(target=count_when_written)
    other.start()
    error = torch.OutOfMemoryError("inside the reduce-scatter")
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _run(failing, _failing_with(error))
    other.join()
    assert caught.value is error and counted.is_set()  # the very error, raised after the other rank counted


def test_the_failing_rank_stops_waiting_for_reports_after_its_bound(one_process_group, monkeypatch):
    monkeypatch.setattr(fsdp_sync, "PEER_REPORT_WAIT_S", 0.1)
    error = torch.OutOfMemoryError("inside the reduce-scatter")
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _run(Rank(), _failing_with(error))
    assert caught.value is error


# ----------------------------------------------------------------------------------------------- tensor parallelism


def test_the_strategy_check_names_tensor_parallelism_as_the_cause():
    with pytest.raises(ValueError, match=r"under tensor parallelism \(tensor_parallel_size=2 > 1\)") as caught:
        check_strategy_for_micro_batches("ModelParallelStrategy", 2, is_ddp=False, tensor_parallel_size=2)
    assert "ModelParallelStrategy(tensor_parallel_size=1)" in str(caught.value)  # the fix
    with pytest.raises(ValueError) as other:  # FSDP1: no word of tensor parallelism as its cause
        check_strategy_for_micro_batches("FSDPStrategy", 2, is_ddp=False)
    assert "under tensor parallelism" not in str(other.value)


@pytest.fixture
def fake_two_ranks():
    """Rank 0 of a fake process group of 2 (torch's test backend: collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_sharding_check_names_tensor_parallelism_as_the_cause(fake_two_ranks):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = nn.Sequential(nn.Linear(4, 4))
    parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    with pytest.raises(ValueError, match=r"tensor parallelism is the cause: parameter `0.weight`") as caught:
        check_fsdp_for_micro_batches(model)
    assert "tensor_parallel_size=2 (> 1)" in str(caught.value)
    plain = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
    with pytest.raises(ValueError, match="2-dimensional mesh") as hsdp:
        check_fsdp_for_micro_batches(plain)
    assert "tensor parallelism is the cause" not in str(hsdp.value)
