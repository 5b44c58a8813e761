"""Append-only JSON Lines writer used by the callbacks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

__all__ = ["JsonlWriter"]


class JsonlWriter:
    """Appends one JSON object per line to ``path`` and flushes after every line.

    The file is opened lazily and in append mode, so a resumed run adds to what is already there and a
    run killed mid-write loses at most its last line. Not picklable state is dropped on pickling.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "log.jsonl")
        >>> w = JsonlWriter(path); w.write({"a": 1}); w.close()
        >>> open(path).read()
        '{"a": 1}\\n'
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: TextIO | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open between writes
        self._file.write(json.dumps(record, allow_nan=False, default=_default) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_file": None}


def _default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)
