"""Formatting helpers for reports and console output."""

from __future__ import annotations

import textwrap

__all__ = ["WIDTH", "format_bytes", "printable", "wrap_to_width"]

#: Characters a terminal acts on instead of showing: C0 controls (ESC starts ANSI sequences, CR rewrites the line,
#: LF starts a new one), DEL, C1 controls (0x9B is a one-byte CSI), bidirectional overrides and isolates (they
#: reorder what is shown), the marks that steer them, and the Unicode line and paragraph separators.
_UNSAFE = [
    *range(0x00, 0x20),
    0x7F,
    *range(0x80, 0xA0),
    0x061C,
    0x200E,
    0x200F,
    0x2028,
    0x2029,
    *range(0x202A, 0x202F),
    *range(0x2066, 0x206A),
]
_NAMED = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
_ONE_LINE = {c: _NAMED.get(c, f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNSAFE}
_LINES = {c: text for c, text in _ONE_LINE.items() if c not in (0x09, 0x0A)}


def printable(text: object, keep_newlines: bool = False) -> str:
    """``str(text)`` safe to print on a terminal: control and bidirectional characters written as escapes.

    Use it on every text from the user or from a file that reaches the console (paths, log fields, report
    values): ESC, CR, C1 controls and bidi overrides become ``\\x1b``, ``\\r``, ``\\x9b``, ``\\u202e`` and so on,
    so a value can neither colour, move or hide output nor pose as another line. ``keep_newlines=True`` keeps
    ``\\n`` and ``\\t`` (for a whole multi-line text whose values were escaped on their own).

    Examples:
        >>> printable("run\\n\\x1b[31mERROR: forged\\x1b[0m \\u202eexe.txt")
        'run\\\\n\\\\x1b[31mERROR: forged\\\\x1b[0m \\\\u202eexe.txt'
        >>> printable("two\\nlines\\r", keep_newlines=True)
        'two\\nlines\\\\r'
    """
    return str(text).translate(_LINES if keep_newlines else _ONE_LINE)


def format_bytes(num: int | float | None) -> str:
    """Human-readable bytes (binary units).

    Examples:
        >>> format_bytes(3 * 1024**3), format_bytes(None), format_bytes(512)
        ('3.00 GiB', 'n/a', '512 B')
    """
    if num is None:
        return "n/a"
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"  # pragma: no cover


#: Columns a printout may take.
WIDTH = 100


def wrap_to_width(text: str) -> str:
    """``text`` with every line longer than :data:`WIDTH` columns wrapped, its continuation indented under it.

    Words are never split (a path stays whole to copy, on a line of its own if it is longer than the width); a line
    keeps its indentation, and a bullet (``- ``) continues under its text.

    Examples:
        >>> print(wrap_to_width("GradientCheckpointing: wrapped 3 module(s): " + ", ".join(["encoder.layers.0"] * 6)))
        GradientCheckpointing: wrapped 3 module(s): encoder.layers.0, encoder.layers.0, encoder.layers.0,
          encoder.layers.0, encoder.layers.0, encoder.layers.0
        >>> print(wrap_to_width("  - " + "a long assumption " * 6))
          - a long assumption a long assumption a long assumption a long assumption a long assumption a long
            assumption
    """
    return "\n".join(_wrap_line(line) for line in text.split("\n"))


def _wrap_line(line: str) -> str:
    if len(line) <= WIDTH:
        return line
    body = line.lstrip(" ")
    indent = len(line) - len(body) + 2  # under a bullet's text, or hanging under a plain line
    wrapper = textwrap.TextWrapper(
        WIDTH, subsequent_indent=" " * indent, break_long_words=False, break_on_hyphens=False
    )
    return wrapper.fill(line)
