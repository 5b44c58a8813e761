"""utilities.formatting.printable: what reaches a terminal carries no control or bidi character."""

import logging
import warnings

import pytest

from lightning_memopt.utilities.formatting import printable
from lightning_memopt.utilities.namespaces import rank_zero_info
from lightning_memopt.utilities.warnings import WarnOnce, log, warn_every_time

UNSAFE = [
    ("\x1b", "\\x1b"),  # ESC: starts ANSI sequences (colours, cursor moves, window titles)
    ("\r", "\\r"),  # back to the start of the line: overwrites what was printed
    ("\n", "\\n"),
    ("\t", "\\t"),
    ("\x00", "\\x00"),
    ("\x07", "\\x07"),  # BEL
    ("\x08", "\\x08"),  # backspace
    ("\x0b", "\\x0b"),
    ("\x0c", "\\x0c"),
    ("\x1f", "\\x1f"),
    ("\x7f", "\\x7f"),  # DEL
    ("\x80", "\\x80"),
    ("\x85", "\\x85"),  # NEL: a newline on some terminals
    ("\x9b", "\\x9b"),  # one-byte CSI
    ("\x9d", "\\x9d"),  # one-byte OSC
    ("\x9f", "\\x9f"),
    ("\u061c", "\\u061c"),
    ("\u200e", "\\u200e"),
    ("\u200f", "\\u200f"),
    ("\u2028", "\\u2028"),
    ("\u2029", "\\u2029"),
    ("\u202a", "\\u202a"),
    ("\u202b", "\\u202b"),
    ("\u202c", "\\u202c"),
    ("\u202d", "\\u202d"),
    ("\u202e", "\\u202e"),  # right-to-left override: "exe.txt" shows as "txt.exe"
    ("\u2066", "\\u2066"),
    ("\u2067", "\\u2067"),
    ("\u2068", "\\u2068"),
    ("\u2069", "\\u2069"),
]
SAFE = [
    "plain text",
    "/data/run 1/oom",
    "caf\u00e9 \u00a0\u00ff",
    "\u65e5\u672c\u8a9e",
    "\U0001f600",
    "a\\nb",
    "\u2030",
]


@pytest.mark.parametrize(("char", "escaped"), UNSAFE)
def test_every_control_and_bidi_character_is_written_as_an_escape(char, escaped):
    assert printable(f"a{char}b") == f"a{escaped}b"
    kept = char if char in "\n\t" else escaped
    assert printable(f"a{char}b", keep_newlines=True) == f"a{kept}b"


@pytest.mark.parametrize("text", SAFE)
def test_printable_text_is_left_as_it_is(text):
    assert printable(text) == text == printable(text, keep_newlines=True)


def test_the_package_logger_escapes_paths_and_messages(caplog):
    path = "/tmp/oom\nlightning_memopt: WARNING forged \x1b[31mred\u202e"
    with caplog.at_level("INFO", logger="lightning_memopt"):
        log.warning("report written to %s (rank %d)", path, 3)
        log.info("two lines\nkept, \x1b[2J not")
    first, second = (r.getMessage() for r in caplog.records)
    assert first == "report written to /tmp/oom\\nlightning_memopt: WARNING forged \\x1b[31mred\\u202e (rank 3)"
    assert second == "two lines\nkept, \\x1b[2J not"


def test_warnings_and_rank_zero_messages_are_escaped(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        WarnOnce().warn("k", "bad \x1b]0;title\x07 path\nsecond line")
        warn_every_time("\u202eevil")
    # one line each: a newline in a path (a dirpath) cannot pose as another warning line
    assert [str(w.message) for w in caught] == ["bad \\x1b]0;title\\x07 path\\nsecond line", "\\u202eevil"]
    with caplog.at_level(logging.INFO):
        rank_zero_info("preset \x1b[1mbold\x1b[0m")
    assert "preset \\x1b[1mbold\\x1b[0m" in caplog.text and "\x1b" not in caplog.text
