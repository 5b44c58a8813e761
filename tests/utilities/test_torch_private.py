"""utilities/_torch_private.py: the private torch calls answer honestly where they cannot act."""

from __future__ import annotations

from lightning_memopt.utilities import _torch_private


def test_allocator_history_is_neither_started_nor_stopped_where_it_cannot_be_recorded(monkeypatch):
    monkeypatch.setattr(_torch_private, "supports_memory_history", lambda: False)
    assert _torch_private.start_memory_history(1000) is False
    assert _torch_private.stop_memory_history() is False
