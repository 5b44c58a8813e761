"""The counted borrowing of process-wide settings: first in applies, last out gives back, whatever the order."""

from __future__ import annotations

import copy
import pickle
import random
import threading
import time
import warnings

import pytest

from lightning_memopt.utilities import _torch_private
from lightning_memopt.utilities.shared_state import borrow, borrowers
from lightning_memopt.utilities.warnings import WarnOnce


class Setting:
    """A stand-in for a process-wide setting, counting how often it was applied and given back."""

    def __init__(self, value="default") -> None:
        self.value = value
        self.applied = 0
        self.restored = 0

    def apply(self, value):
        before, self.value = self.value, value
        self.applied += 1

        def restore():
            self.value = before
            self.restored += 1

        return restore


@pytest.fixture
def key(request):
    name = f"test.{request.node.name}"
    yield name
    assert borrowers(name) == 0  # every test gives back what it borrowed


def test_first_in_applies_and_the_last_out_gives_back_in_any_order(key):
    setting = Setting()
    leases = [borrow(key, "on", setting.apply) for _ in range(3)]
    assert setting.value == "on" and setting.applied == 1 and borrowers(key) == 3
    for lease in (leases[0], leases[2]):  # the first one out is not the last: nothing is given back yet
        lease.release()
        assert setting.value == "on" and setting.restored == 0
    leases[1].release()
    assert setting.value == "default" and setting.restored == 1 and borrowers(key) == 0


def test_release_is_idempotent(key):
    setting = Setting()
    first, second = borrow(key, "on", setting.apply), borrow(key, "on", setting.apply)
    first.release()
    first.release()  # teardown after on_exception: still counted once
    assert setting.value == "on" and first.held is False and second.held is True
    second.release()
    assert setting.value == "default" and setting.restored == 1


def test_a_different_value_runs_with_the_first_ones_and_warns_once(key):
    setting, warn = Setting(), WarnOnce()
    first = borrow(key, "high", setting.apply)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = borrow(key, "medium", setting.apply, warn, who="Thing")
        third = borrow(key, "medium", setting.apply, warn, who="Thing")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and messages[0].startswith(f"Thing asked for `{key}` = 'medium' while another run")
    assert "holds 'high'" in messages[0]
    assert second.in_effect == third.in_effect == "high" and second.value == "medium"
    assert setting.value == "high" and setting.applied == 1
    for lease in (first, second, third):
        lease.release()
    assert setting.value == "default"


def test_apply_that_applies_nothing_holds_nothing(key):
    calls = []
    assert borrow(key, 1, lambda v: calls.append(v)) is None
    assert borrow(key, 2, lambda v: calls.append(v)) is None  # asked again: nobody holds the key
    assert calls == [1, 2] and borrowers(key) == 0


def test_apply_that_raises_holds_nothing(key):
    def fail(value):
        raise OSError("refused")

    with pytest.raises(OSError, match="refused"):
        borrow(key, 1, fail)
    setting = Setting()
    lease = borrow(key, 1, setting.apply)  # the next borrower is the first one in
    assert setting.applied == 1
    lease.release()


def test_a_give_back_that_raises_reaches_the_releaser_and_the_next_borrower_starts_afresh(key):
    def apply(value):
        def restore():
            raise ValueError("cannot give back")

        return restore

    lease = borrow(key, 1, apply)
    with pytest.raises(ValueError, match="cannot give back"):
        lease.release()
    assert borrowers(key) == 0 and lease.held is False
    setting = Setting()
    borrow(key, 2, setting.apply).release()
    assert setting.applied == setting.restored == 1


@pytest.mark.parametrize("clone", [lambda x: pickle.loads(pickle.dumps(x)), copy.deepcopy])
def test_a_copy_of_a_lease_holds_nothing(key, clone):
    setting = Setting()
    lease = borrow(key, "on", setting.apply)
    copied = clone(lease)
    assert copied.held is False and copied.key == key
    copied.release()  # does not count down the original's hold
    assert setting.value == "on" and borrowers(key) == 1
    lease.release()
    assert setting.value == "default"


class SlowSetting(Setting):
    """Lets the other threads run between reading the state and writing it: a race shows without the lock."""

    def apply(self, value):
        before = self.value
        time.sleep(0.0002)
        self.value = value
        self.applied += 1

        def restore():
            time.sleep(0.0002)
            self.value = before
            self.restored += 1

        return restore


def test_many_threads_borrowing_at_once_end_where_they_started(key):
    setting = SlowSetting()
    seen_wrong: list[str] = []
    start = threading.Barrier(8)

    def worker(seed):
        rng = random.Random(seed)
        start.wait()
        for _ in range(50):
            lease = borrow(key, "on", setting.apply)
            if setting.value != "on":  # while any lease is held, the setting is applied
                seen_wrong.append(setting.value)
            if rng.random() < 0.5:
                threading.Event().wait(0)  # yield to the other threads
            lease.release()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen_wrong == [] and setting.value == "default"
    assert setting.applied == setting.restored >= 1


def test_allocator_history_is_started_by_the_first_and_stopped_by_the_last(monkeypatch):
    calls = []
    monkeypatch.setattr(_torch_private, "_history_enabled", lambda: False)
    monkeypatch.setattr(_torch_private, "start_memory_history", lambda n: calls.append(("start", n)) or True)
    monkeypatch.setattr(_torch_private, "stop_memory_history", lambda: calls.append(("stop",)) or True)
    first = _torch_private.borrow_memory_history(1000)
    with pytest.warns(UserWarning, match="OOMReporter asked for `cuda.memory_history` = 50 while another run"):
        second = _torch_private.borrow_memory_history(50)
    first.release()
    assert calls == [("start", 1000)]  # the second reporter still records
    second.release()
    assert calls == [("start", 1000), ("stop",)]


def test_allocator_history_the_application_records_is_never_stopped(monkeypatch):
    calls = []
    monkeypatch.setattr(_torch_private, "_history_enabled", lambda: True)
    monkeypatch.setattr(_torch_private, "start_memory_history", lambda n: calls.append(("start", n)) or True)
    monkeypatch.setattr(_torch_private, "stop_memory_history", lambda: calls.append(("stop",)) or True)
    lease = _torch_private.borrow_memory_history(1000)
    assert lease is not None and lease.held  # recording: the report gets a snapshot
    lease.release()
    assert calls == []


def test_a_borrower_that_comes_while_the_first_applies_waits_and_then_joins(key):
    entered, go = threading.Event(), threading.Event()
    applied: list[object] = []
    leases = []

    def apply(value):
        applied.append(value)
        entered.set()
        go.wait(10)  # the first borrower is in the middle of applying
        return lambda: applied.append("given back")

    first = threading.Thread(target=lambda: leases.append(borrow(key, 1, apply)))
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=lambda: leases.append(borrow(key, 1, apply)))
    second.start()
    second.join(0.3)
    waited = second.is_alive()  # it may not see the setting as free, nor join before it is applied
    go.set()
    first.join(10)
    second.join(10)
    assert waited and applied == [1] and borrowers(key) == 2
    for lease in leases:
        lease.release()
    assert applied == [1, "given back"]
