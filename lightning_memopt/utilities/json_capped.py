"""Reading a JSON file of any size for display: streamed in chunks, long strings and lists cut, with markers.

``json.load`` reads the whole file into one string and builds every value: a 300 MB report took 1.3 GB and
minutes to print. :func:`load_json_capped` reads 64 KiB at a time and keeps at most :class:`JSONLimits` of the
document; what it leaves out is skipped at the speed of a regular expression and replaced by a marker that says
how much was left out. Memory stays bounded by the limits, whatever the file's size.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["JSONLimits", "JSONReadError", "load_json_capped"]

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')  # a run of string characters that need no decoding
_ESCAPE = r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})'
_SKIP_STRING = re.compile(rf'[^"\\]*(?:{_ESCAPE}[^"\\]*)*')  # string text, escapes included
_STRING = rf'"[^"\\]*(?:{_ESCAPE}[^"\\]*)*"'


def _balanced(levels: int) -> str:
    """Text, whole strings and whole containers nested up to ``levels`` deep.

    A run of text is matched atomically (a lookahead captures it, a backreference consumes it): a container cut by
    the buffer's end is then given up on in linear time, not by trying every split of the runs.
    """
    run = ""
    for level in range(levels + 1):
        text = rf'(?=(?P<t{level}>[^"\[\]{{}}]+))(?P=t{level})'
        inner = f"|[\\[{{]{run}[\\]}}]" if run else ""
        run = rf"(?:{text}|{_STRING}{inner})*"
    return run


_SKIP = re.compile(_balanced(3))  # what the skipper steps over in one match; it stops at deeper nesting only
_NESTED = re.compile(rf"{_STRING}|[\[{{]{_balanced(2)}[\]}}]")  # what holds commas that are not the container's
_LITERALS = {"true": True, "false": False, "null": None, "NaN": float("nan"), "Infinity": float("inf")}
_NUMBER_CHARS = 1000  # longer numbers are kept as a marker (Python refuses to parse > 4300 digits anyway)


def _top_level_commas(run: str) -> int:
    """The commas in ``run`` (text the skipper stepped over) that are not inside a string or a bracket it holds."""
    if '"' in run or "[" in run or "{" in run:
        return _NESTED.sub("", run).count(",")
    return run.count(",")


@dataclass(frozen=True)
class JSONLimits:
    """What :func:`load_json_capped` keeps.

    Args:
        max_items: Items kept per list or object; the rest is one marker entry.
        max_chars: Characters kept per string (and per object key).
        max_depth: Nesting kept; deeper values become a marker.
        max_total_chars: Characters of strings kept in the whole document; then every further string is a marker.
    """

    max_items: int = 1000
    max_chars: int = 10_000
    max_depth: int = 32
    max_total_chars: int = 2_000_000


class JSONReadError(ValueError):
    """Not valid JSON: ``msg`` and the 1-based ``lineno`` where it was seen."""

    def __init__(self, msg: str, lineno: int) -> None:
        super().__init__(f"{msg} at line {lineno}")
        self.msg = msg
        self.lineno = lineno


class _Stream:
    def __init__(self, file: IO[str], chunk: int) -> None:
        self.file, self.chunk = file, chunk
        self.buf, self.pos, self.eof, self.lines_before = "", 0, False, 1

    def fill(self, need: int = 1) -> bool:
        """Make at least ``need`` characters available from ``pos``; False at the end of the file."""
        while len(self.buf) - self.pos < need and not self.eof:
            data = self.file.read(self.chunk)
            if not data:
                self.eof = True
                break
            self.lines_before += self.buf.count("\n", 0, self.pos)
            self.buf, self.pos = self.buf[self.pos :] + data, 0
        return len(self.buf) - self.pos >= need

    def error(self, msg: str) -> JSONReadError:
        return JSONReadError(msg, self.lines_before + self.buf.count("\n", 0, self.pos))

    def skip_ws(self) -> None:
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf) or not self.fill():
                return

    def peek(self) -> str:
        self.skip_ws()
        if not self.fill():
            raise self.error("Expecting value, found the end of the file")
        return self.buf[self.pos]


class _Parser:
    def __init__(self, stream: _Stream, limits: JSONLimits) -> None:
        self.s, self.limits, self.chars_left = stream, limits, limits.max_total_chars

    def value(self, depth: int) -> Any:
        c = self.s.peek()
        if (c in "[{") and depth >= self.limits.max_depth:
            return f"... (nested deeper than {self.limits.max_depth} levels, not shown: {self.skip_container()} items)"
        if c == "{":
            return self.container(depth, "}")
        if c == "[":
            return self.container(depth, "]")
        if c == '"':
            return self.string(self.limits.max_chars)
        return self.scalar()

    def container(self, depth: int, close: str) -> Any:
        s = self.s
        s.pos += 1
        kept: Any = {} if close == "}" else []
        count = 0
        if s.peek() == close:
            s.pos += 1
            return kept
        while True:
            if count >= self.limits.max_items:
                more = 1 + self.skip_rest(close)
                marker = f"... ({more} more {'keys' if close == '}' else 'items'} not shown)"
                if close == "}":
                    kept["..."] = marker
                else:
                    kept.append(marker)
                return kept
            if close == "}":
                if s.peek() != '"':
                    raise s.error("Expecting property name enclosed in double quotes")
                key = self.string(self.limits.max_chars, budget=False)
                if s.peek() != ":":
                    raise s.error("Expecting ':' delimiter")
                s.pos += 1
                kept[key] = self.value(depth + 1)
            else:
                kept.append(self.value(depth + 1))
            count += 1
            c = s.peek()
            s.pos += 1
            if c == close:
                return kept
            if c != ",":
                raise s.error(f"Expecting ',' delimiter or '{close}'")

    def string(self, max_chars: int, budget: bool = True) -> str:
        """The string at ``pos`` (its opening quote), cut at ``max_chars`` (and the document's budget)."""
        self.s.pos += 1
        limit = max(0, min(max_chars, self.chars_left) if budget else max_chars)
        parts, kept, closed = self._read_string(limit)
        rest = 0
        if not closed:
            rest = self._skip_string()
        return self._kept_text(parts, kept, rest, budget)

    def _read_string(self, limit: int) -> tuple[list[str], int, bool]:
        """Up to ``limit`` decoded characters of the string at ``pos``: its parts, their count, and whether the
        closing quote came (and was consumed) before the limit."""
        s = self.s
        parts: list[str] = []
        kept = 0
        while kept < limit:
            run = _PLAIN.match(s.buf, s.pos).group()[: limit - kept]  # type: ignore[union-attr]
            parts.append(run)
            kept += len(run)
            s.pos += len(run)
            if kept >= limit:
                break
            if s.pos >= len(s.buf):
                if not s.fill():
                    raise s.error("Unterminated string")
                continue
            c = s.buf[s.pos]
            if c == '"':
                s.pos += 1
                return parts, kept, True
            if c != "\\":
                raise s.error("Invalid control character in string")
            parts.append(self._escape())
            kept += 1
        return parts, kept, False

    def _escape(self) -> str:
        """The character of the escape at ``pos`` (``\\n``, ``\\u00e9``, ...), consumed."""
        s = self.s
        s.fill(6)
        width = 6 if s.buf[s.pos + 1 : s.pos + 2] == "u" else 2
        try:
            char = json.loads('"' + s.buf[s.pos : s.pos + width] + '"')
        except ValueError:
            raise s.error("Invalid \\escape") from None
        s.pos += width
        return str(char)

    def _skip_string(self) -> int:
        """Skip the rest of the string at ``pos`` and its closing quote; returns its length in characters of JSON
        text."""
        s = self.s
        rest = 0
        while True:
            end = _SKIP_STRING.match(s.buf, s.pos).end()  # type: ignore[union-attr]
            rest += end - s.pos
            s.pos = end
            if s.pos >= len(s.buf):
                if not s.fill():
                    raise s.error("Unterminated string")
                continue
            if s.buf[s.pos] == '"':
                s.pos += 1
                return rest
            if len(s.buf) - s.pos >= 6 or not s.fill(6):  # a backslash the pattern left: an invalid escape
                raise s.error("Invalid \\escape")

    def _kept_text(self, parts: list[str], kept: int, rest: int, budget: bool) -> str:
        text = "".join(parts)
        if any("\ud800" <= ch <= "\udfff" for ch in text):  # escaped surrogate pairs: join them
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if budget:
            self.chars_left -= kept
        return text + f"... ({rest} more characters not shown)" if rest else text

    def scalar(self) -> Any:
        s = self.s
        s.fill(_NUMBER_CHARS + 2)
        for word, value in _LITERALS.items():
            if s.buf.startswith(word, s.pos):
                s.pos += len(word)
                return value
        if s.buf.startswith("-Infinity", s.pos):
            s.pos += len("-Infinity")
            return float("-inf")
        match = _NUMBER.match(s.buf, s.pos)
        if match is None or not match.group():
            raise s.error("Expecting value")
        text = match.group()
        s.pos = match.end()
        if len(text) > _NUMBER_CHARS:
            while s.pos >= len(s.buf) and s.fill():  # the rest of an absurdly long number
                s.pos = _NUMBER.match(s.buf, s.pos).end()  # type: ignore[union-attr]
            return f"{text[:20]}... (a number of more than {_NUMBER_CHARS} characters, not shown)"
        if any(c in text for c in ".eE"):
            return float(text)
        return int(text)

    def skip_container(self) -> int:
        """Skip the list or object at ``pos``; returns how many items it held at its top level."""
        self.s.pos += 1
        close = "}" if self.s.buf[self.s.pos - 1] == "{" else "]"
        if self.s.peek() == close:
            self.s.pos += 1
            return 0
        return 1 + self.skip_rest(close)

    def skip_rest(self, close: str) -> int:
        """Skip to just after the ``close`` of the current container; returns the commas seen at its top level."""
        s = self.s
        depth, commas = 0, 0
        while True:
            end = _SKIP.match(s.buf, s.pos).end()  # type: ignore[union-attr]
            if depth == 0 and end > s.pos:
                run = s.buf[s.pos : end]
                commas += _top_level_commas(run)
            s.pos = end
            if s.pos >= len(s.buf):
                if not s.fill():
                    raise s.error(f"Expecting '{close}'")
                continue
            c = s.buf[s.pos]
            if c == '"':
                self.string(0, budget=False)
                continue
            s.pos += 1
            if c in "[{":
                depth += 1
            elif depth == 0:
                return commas
            else:
                depth -= 1


def load_json_capped(file: IO[str], limits: JSONLimits | None = None, chunk: int = 1 << 16) -> Any:
    """The JSON document in ``file`` (opened as text), keeping at most ``limits`` of it; read ``chunk`` at a time.

    The regular expressions that skip what is left out keep state per token they step over, so ``chunk`` also
    bounds their memory (64 KiB: a few MiB).

    Raises:
        JSONReadError: the file is not valid JSON (the message and the line, like ``json.JSONDecodeError``).

    Examples:
        >>> import io
        >>> load_json_capped(io.StringIO('{"a": [1, 2, 3, 4], "b": "abcdef"}'), JSONLimits(max_items=2, max_chars=3))
        {'a': [1, 2, '... (2 more items not shown)'], 'b': 'abc... (3 more characters not shown)'}
    """
    stream = _Stream(file, chunk)
    parser = _Parser(stream, limits or JSONLimits())
    value = parser.value(0)
    stream.skip_ws()
    if stream.fill():
        raise stream.error("Extra data")
    return value
