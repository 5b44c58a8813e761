"""What every part of ``lightning-memopt estimate`` shares: its error and a name's pattern."""

from __future__ import annotations

import re

__all__ = ["INT64_MAX", "NAME", "EstimateInputError", "squash"]

#: The largest int64: torch counts elements and bytes in it, the samplers count samples in it.
INT64_MAX = 2**63 - 1

#: A Python identifier (a module, class, keyword argument or batch entry name).
NAME = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")


class EstimateInputError(ValueError):
    """Bad input to ``lightning-memopt estimate``; the message is one line and names the argument.

    ``lightning-memopt estimate`` prints it after ``lightning-memopt estimate: error:`` and exits with 2.

    Examples:
        >>> err = EstimateInputError("--margin: must be a fraction in [0, 1), got 1.5; 0.1 keeps 10 % free.")
        >>> isinstance(err, ValueError), str(err).startswith("--margin:")
        (True, True)
    """


def squash(text: object) -> str:
    """``text`` (or an exception's message) on one line: runs of whitespace become one space.

    Examples:
        >>> squash("a  message   over ")
        'a message over'
    """
    return " ".join(str(text).split())
