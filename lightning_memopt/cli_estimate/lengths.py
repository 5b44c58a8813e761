"""What ``lightning-memopt estimate --lengths FILE --length-buckets N`` reads: the dataset's lengths and the buckets."""

from __future__ import annotations

from pathlib import Path

from lightning_memopt.cli_estimate.common import EstimateInputError

__all__ = ["parse_buckets", "read_lengths"]

#: The most samples read from a ``--lengths`` file.
MAX_SAMPLES = 10_000_000


def read_lengths(path: str) -> list[tuple[int, ...]]:
    """One sample per line: its length, or its lengths separated by commas (``512,96``); blank lines and ``#``
    comments are skipped.

    Raises:
        EstimateInputError: naming the file, the line and what it holds.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise EstimateInputError(f"--lengths: cannot read {path!r} ({type(err).__name__}: {err}).") from None
    lengths: list[tuple[int, ...]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = [part.strip() for part in line.split(",")]
        if not all(part.isdigit() and int(part) > 0 for part in parts) or (lengths and len(parts) != len(lengths[0])):
            axes = len(lengths[0]) if lengths else "one or more"
            raise EstimateInputError(
                f"--lengths: {path}, line {number}: {line[:60]!r} is not {axes} positive int(s) separated by commas"
                " (one sample per line, e.g. 512 or 512,96)."
            )
        lengths.append(tuple(int(part) for part in parts))
        if len(lengths) > MAX_SAMPLES:
            raise EstimateInputError(f"--lengths: {path} has more than {MAX_SAMPLES:,} samples; pass a sample of them.")
    if not lengths:
        raise EstimateInputError(f"--lengths: {path} holds no sample (one length, or lengths, per line).")
    return lengths


def parse_buckets(text: str | None) -> int | list[tuple[int, ...]]:
    """``--length-buckets``: a count (``16``: at the quantiles of the lengths) or the buckets (``128,512`` for one
    axis, ``128x32,512x96`` for two).

    Examples:
        >>> parse_buckets("16"), parse_buckets("128,512"), parse_buckets("128x32,512x96")
        (16, [(128,), (512,)], [(128, 32), (512, 96)])
    """
    if text is None:
        return 16
    text = text.strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    try:
        buckets = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        buckets = []
    if not buckets or any(v < 1 for b in buckets for v in b) or len({len(b) for b in buckets}) != 1:
        raise EstimateInputError(
            f"--length-buckets: {text!r} is neither a count (16) nor bucket lengths (128,512, or 128x32,512x96 for"
            " two axes)."
        )
    return buckets
