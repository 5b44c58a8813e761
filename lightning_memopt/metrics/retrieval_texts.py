"""Where ``StreamingRetrievalMetric`` keeps each caption it stored: a cache derived from its text states."""

from __future__ import annotations

import bisect
from typing import Any

import torch
from torch import Tensor

__all__ = ["StoredTexts"]


def _chunks(state: Any) -> list[Tensor]:
    """A list state as its tensors (a synced state is one tensor)."""
    return [state] if isinstance(state, Tensor) else list(state)


class StoredTexts:
    """Caption id -> position in the ``text_features`` state, valid for the exact state objects it was built from.

    A load, merge, sync, reset or in-place concatenation replaces the state's objects: :meth:`positions` notices
    (by the state's length and its first and last tensors) and rebuilds from the state itself.

    Example:
        >>> texts = StoredTexts()
        >>> ids = [torch.tensor([7, 3])]
        >>> texts.positions(ids)
        {7: 0, 3: 1}
        >>> ids.append(torch.tensor([5])); texts.stored(ids, [5])
        >>> texts.positions(ids)[5], texts.features([torch.zeros(2, 1), torch.ones(1, 1)], [5]).tolist()
        (2, [[1.0]])
    """

    def __init__(self) -> None:
        self._positions: dict[int, int] = {}
        self._starts: list[int] = [0]  # where each chunk of the state starts, and the total at the end
        self._token: tuple[Any, ...] | None = None

    @staticmethod
    def _token_of(state: Any) -> tuple[Any, ...]:
        if isinstance(state, Tensor):
            return (state,)
        return (len(state), state[0] if state else None, state[-1] if state else None)

    def _same(self, state: Any) -> bool:
        token, cached = self._token_of(state), self._token
        return (
            cached is not None
            and len(token) == len(cached)
            and all(a is b if not isinstance(a, int) else a == b for a, b in zip(token, cached))
        )

    def positions(self, id_state: Any) -> dict[int, int]:
        """Each stored caption id's position in the concatenated state (the first one, if an id is there twice)."""
        if not self._same(id_state):
            self._positions, self._starts, at = {}, [0], 0
            for chunk in _chunks(id_state):
                for text_id in chunk.tolist():
                    self._positions.setdefault(int(text_id), at)
                    at += 1
                self._starts.append(at)
            self._token = self._token_of(id_state)
        return self._positions

    def stored(self, id_state: Any, ids: list[int]) -> None:
        """Record that ``ids`` were just appended to ``id_state`` as one chunk."""
        at = self._starts[-1]
        for offset, text_id in enumerate(ids):
            self._positions.setdefault(text_id, at + offset)
        self._starts.append(at + len(ids))
        self._token = self._token_of(id_state)

    def features(self, feature_state: Any, ids: list[int]) -> Tensor:
        """The stored features of ``ids`` (each must be stored), one row per id, on the state's device."""
        chunks = _chunks(feature_state)
        if len(chunks) != len(self._starts) - 1:  # not cut as the ids are: index the whole
            whole = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            return whole[[self._positions[text_id] for text_id in ids]]
        rows = []
        for text_id in ids:
            at = self._positions[text_id]
            chunk = bisect.bisect_right(self._starts, at) - 1
            rows.append(chunks[chunk][at - self._starts[chunk]])
        return torch.stack(rows)

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]
