"""The readable form of an out-of-memory report: one helper per Markdown section."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_memopt.functional.oom.suggestions import percent
from lightning_memopt.utilities.checks import is_finite_number
from lightning_memopt.utilities.formatting import format_bytes, printable
from lightning_memopt.utilities.redaction import redact_secrets

__all__ = ["render_markdown"]

_RAW_CHARS = 200
Lines = list[str]


def _cell(value: Any) -> str:
    """A value on one line (control characters escaped: the report is printed to terminals), ``|`` escaped."""
    return printable("n/a" if value is None else value).replace("|", "\\|")


def _size(value: Any) -> str:
    """Bytes as text; a value that is not a number (a hand-edited report) is shown as it is."""
    if value is None or is_finite_number(value):
        return format_bytes(value)
    return _cell(value)


def _shape(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _raw(value: Any) -> str:
    """Compact JSON of ``value`` on one line, cut at 200 characters."""
    try:
        text = json.dumps(value, default=repr, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # keys JSON cannot hold, a cycle, too deep: its repr
        text = repr(value)
    text = text.replace("\n", " ")
    return text if len(text) <= _RAW_CHARS else text[: _RAW_CHARS - 3] + "..."


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    for types, name in (
        ((Mapping,), "an object"),
        ((list, tuple), "a list"),
        ((str,), "a string"),
        ((int, float), "a number"),
        ((type(None),), "null"),
    ):
        if isinstance(value, types):
            return name
    return f"a {type(value).__name__}"


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Lines:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _fence(text: str) -> Lines:
    return ["```", text.rstrip("\n"), "```", ""]


def _iso(timestamp: Any) -> str:
    try:
        return datetime.datetime.fromtimestamp(float(timestamp), tz=datetime.timezone.utc).isoformat(timespec="seconds")
    except (TypeError, ValueError, OverflowError, OSError):  # not a time: shown as it is
        return _cell(timestamp)


def _flatten(mapping: Mapping[Any, Any], prefix: str = "", depth: int = 0) -> Iterable[tuple[str, Any]]:
    """``(dotted.name, value)`` pairs of a nested mapping; lists and deep parts as compact JSON."""
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and depth < 4:
            yield from _flatten(value, name + ".", depth + 1)
        elif isinstance(value, (Mapping, list, tuple)):
            yield name, _raw(value)
        else:
            yield name, value


_WANTED: dict[Any, str] = {Mapping: "an object", list: "a list", str: "a string"}


class _Shape:
    """Reads the parts of a report, noting those whose type is not what ``OOMReporter`` writes."""

    def __init__(self) -> None:
        self.unexpected: list[str] = []

    def get(self, parent: Mapping[str, Any], key: str, expected: type, where: str = "") -> Any:
        value = parent.get(key)
        if not value:
            return {} if expected is Mapping else []
        if isinstance(value, expected):
            return value
        self.note(f"{where}{key}", value, expected)
        return {} if expected is Mapping else []

    def items(self, values: Iterable[Any], where: str) -> list[Mapping[str, Any]]:
        """The objects of a list; the other entries are noted and left out."""
        kept = []
        for i, value in enumerate(values):
            if isinstance(value, Mapping):
                kept.append(value)
            else:
                self.note(f"{where}[{i}]", value, Mapping)
        return kept

    def note(self, where: str, value: Any, expected: type) -> None:
        wanted = _WANTED.get(expected, expected.__name__)
        self.unexpected.append(f"`{where}` (expected {wanted}, got {_kind(value)}): {_raw(value)}")


# ---------------------------------------------------------------------------------------------------- sections


def _title(when: Mapping[str, Any]) -> Lines:
    return [
        printable(
            f"# Out-of-memory report: rank {when.get('rank', '?')} of {when.get('world_size', '?')},"
            f" {when.get('stage', '?')}, global step {when.get('global_step', '?')}"
        ),
        "",
    ]


def _when(when: Mapping[str, Any]) -> Lines:
    if not when:
        return []
    rows: list[tuple[str, Any]] = [
        ("time (UTC)", _iso(when.get("time"))),
        ("rank / world size", f"{when.get('rank')} / {when.get('world_size')}"),
    ]
    if "host" in when:
        rows.append(("node / host", f"{when.get('node_rank')} / {when.get('host')}"))
    rows += [
        ("trainer function", when.get("fn")),
        ("stage", when.get("stage")),
        ("epoch", when.get("epoch")),
        ("global step", when.get("global_step")),
        ("batch index", when.get("batch_idx")),
        ("device", when.get("device")),
    ]
    return ["## When and where", "", *_table(["field", "value"], rows)]


_RELATIONS = {"cause": "Its direct cause", "context": "Raised while handling"}


def _error(error: Mapping[str, Any], shape: _Shape) -> Lines:
    if not error:
        return []
    lines = ["## Error", "", f"`{_cell(error.get('type'))}` raised at {_cell(error.get('location'))}", ""]
    lines += _fence(str(error.get("message", "")))
    for entry in shape.items(shape.get(error, "chain", list, "error."), "error.chain"):
        head = f"{_relation(entry.get('relation'))}: `{_cell(entry.get('type'))}`"
        lines += [f"{head} raised at {_cell(entry.get('location'))}", ""]
        lines += _fence(str(entry.get("message", "")))
    return lines


def _relation(relation: Any) -> str:
    """How a chained exception relates to the one above it, in words; an unknown relation as it is."""
    if isinstance(relation, str) and relation in _RELATIONS:
        return _RELATIONS[relation]
    return _cell(relation)


def _suggestions(suggestions: list[Mapping[str, Any]]) -> Lines:
    if not suggestions:
        return []
    lines = ["## Suggestions (try in this order)", ""]
    for tip in suggestions:
        saves = tip.get("saves_bytes")
        estimate = ""
        if is_finite_number(saves) and saves:
            estimate = f" (frees about {format_bytes(saves)})"
        lines.append(printable(f"{tip.get('rank')}. **{tip.get('action')}**{estimate}. {tip.get('why')}"))
    return [*lines, ""]


def _batch(batch: Mapping[str, Any], shape: _Shape) -> Lines:
    if not batch:
        return []
    lines = ["## Failing batch", ""]
    if batch.get("found_in"):
        lines += [f"Read from the local `batch` of `{_cell(batch.get('found_in'))}`.", ""]
    else:
        lines += ["No local named `batch` was found in the traceback.", ""]
    tensors = shape.items(shape.get(batch, "tensors", list, "batch."), "batch.tensors")
    if tensors:
        lines += _table(
            ["tensor", "shape", "dtype", "device", "size"],
            [
                (t.get("path"), _shape(t.get("shape")), t.get("dtype"), t.get("device"), _size(t.get("bytes")))
                for t in tensors
            ],
        )
    if batch.get("truncated"):
        lines += [f"({batch.get('num_tensors')} tensors in all; the first {len(tensors)} are listed.)", ""]
    lengths = shape.items(shape.get(batch, "lengths", list, "batch."), "batch.lengths")
    if lengths:
        lines += ["Sample lengths (from the padding masks):", ""]
        lines += _table(
            ["from", "samples", "padded to", "longest", "median", "shortest", "padding"],
            [
                (
                    found.get("path"),
                    found.get("samples"),
                    found.get("padded_to"),
                    found.get("longest"),
                    found.get("median"),
                    found.get("shortest"),
                    _percent(found.get("padding_share")),
                )
                for found in lengths
            ],
        )
    return lines


def _percent(share: Any) -> str:
    return f"{100 * share:.0f} %" if isinstance(share, (int, float)) and not isinstance(share, bool) else "n/a"


def _memory_value(key: Any, value: Any) -> Any:
    """A memory field as shown: a ``*_bytes`` field as a size, any other as it is."""
    if str(key).endswith("_bytes"):
        return _size(value)
    return value


def _memory(memory: Mapping[str, Any]) -> Lines:
    if not memory:
        return []
    rows = [
        (key, _memory_value(key, value))
        for key, value in memory.items()
        if key not in ("summary", "time") and not isinstance(value, (Mapping, list, tuple))
    ]
    return ["## Memory at failure", "", *_table(["field", "value"], rows)]


def _holders(holders: Mapping[str, Any], allocated: Any, shape: _Shape) -> Lines:
    if not holders:
        return []
    by_cat = shape.get(holders, "bytes_by_category", Mapping, "holders.")
    cat_rows = [(name, _size(value), percent(value, allocated)) for name, value in by_cat.items()]
    unexplained = holders.get("unexplained_bytes")
    cat_rows.append(
        ("unexplained (activations, temporaries, other tensors)", _size(unexplained), percent(unexplained, allocated))
    )
    lines = ["## Who holds memory", "", f"On `{_cell(holders.get('device'))}`:", ""]
    lines += _table(["category", "bytes", "of allocated"], cat_rows)
    rows = shape.items(shape.get(holders, "rows", list, "holders."), "holders.rows")
    if rows:
        lines += ["By dtype and device (all devices):", ""]
        lines += _table(
            ["category", "dtype", "device", "tensors", "bytes"],
            [
                (r.get("category"), r.get("dtype"), r.get("device"), r.get("num_tensors"), _size(r.get("bytes")))
                for r in rows
            ],
        )
    top = shape.items(shape.get(holders, "top_tensors", list, "holders."), "holders.top_tensors")
    if top:
        lines += [f"Largest live tensors on `{_cell(holders.get('device'))}`:", ""]
        lines += _table(
            ["#", "name", "shape", "dtype", "size", "requires grad", "from autograd"],
            [
                (
                    i + 1,
                    t.get("name") or "(unnamed)",
                    _shape(t.get("shape", ())),
                    t.get("dtype"),
                    _size(t.get("bytes")),
                    t.get("requires_grad"),
                    t.get("has_grad_fn"),
                )
                for i, t in enumerate(top)
            ],
        )
    return lines


def _config(config: Mapping[str, Any], shape: _Shape) -> Lines:
    if not config:
        return []
    lines = ["## Configuration", ""]
    lines += _table(
        ["setting", "value"], [(k, v) for k, v in config.items() if not isinstance(v, (Mapping, list, tuple))]
    )
    for title, key in (("Allocator settings", "allocator"), ("Versions", "versions")):
        section = shape.get(config, key, Mapping, "config.")
        if section:
            lines += [f"{title}:", "", *_table(["name", "value"], section.items())]
    return lines


def _sharding_value(key: Any, value: Any) -> Any:
    """A sharding field as shown: a ``*_bytes`` field as a size, a list as compact JSON, any other as it is."""
    if str(key).endswith("_bytes"):
        return _size(value)
    if isinstance(value, list):
        return _raw(value)
    return value


def _sharding(sharding: Mapping[str, Any]) -> Lines:
    if not sharding:
        return []
    local, whole = sharding.get("local_parameter_bytes"), sharding.get("unsharded_parameter_bytes")
    rows = [(key, _sharding_value(key, value)) for key, value in sharding.items() if not isinstance(value, Mapping)]
    lines = ["## Sharding", ""]
    if sharding.get("sharded"):
        lines += [
            printable(
                f"Parameters are sharded ({sharding.get('kind')}, {sharding.get('num_units')} units, over"
                f" {sharding.get('data_parallel_size')} ranks): {_size(local)} on this rank of {_size(whole)}"
                " unsharded; gradients and optimizer states are shards too."
            ),
            "",
        ]
    return lines + _table(["field", "value"], rows)


def _hparams(hparams: Mapping[str, Any]) -> Lines:
    if not hparams:
        return []
    return ["## Hyperparameters (`hparams`, secrets redacted)", "", *_table(["name", "value"], _flatten(hparams))]


def _snapshot(snapshot: Mapping[str, Any]) -> Lines:
    if not snapshot:
        return []
    if snapshot.get("path"):
        text = f"Written to `{snapshot['path']}`. {snapshot.get('how_to_open', '')}"
        return ["## Allocator snapshot", "", printable(text), ""]
    return ["## Allocator snapshot", "", printable(f"Not written: {snapshot.get('reason', 'unknown reason')}"), ""]


def _environment(environment: Mapping[str, Any]) -> Lines:
    if not environment:
        return []
    return ["## Environment (allow-listed, secrets redacted)", "", *_table(["name", "value"], environment.items())]


def _summary(summary: Any, shape: _Shape) -> Lines:
    if summary and isinstance(summary, str):
        return ["## Allocator summary (`memory_summary()`)", "", *_fence(summary)]
    if summary:
        shape.note("memory.summary", summary, str)
    return []


def _listed(title: str, entries: Sequence[Any]) -> Lines:
    if not entries:
        return []
    return [title, "", *(f"- {printable(entry)}" for entry in entries), ""]


def render_markdown(report: Mapping[str, Any]) -> str:
    """The readable form of an OOM report dict (as written to ``oom_report_rank{r}.json``).

    Sections that are missing from ``report`` are left out, so a partial report still renders. A section or
    entry of an unexpected type (a hand-edited or truncated report) is listed, as raw JSON, under "Parts of
    this report with an unexpected shape" and the rest renders as usual. Credentials are redacted first
    (:func:`~lightning_memopt.utilities.redaction.redact_secrets`), whatever the report holds.
    ``docs/oom-report.md`` lists the sections.

    Examples:
        >>> text = render_markdown({"when": {"rank": 0, "world_size": 1, "stage": "train", "global_step": 7},
        ...     "error": {"type": "torch.OutOfMemoryError", "message": "CUDA out of memory."}})
        >>> text.splitlines()[0]
        '# Out-of-memory report: rank 0 of 1, train, global step 7'
    """
    if not isinstance(report, Mapping):
        found = printable(_raw(report))
        return f"# Out-of-memory report\n\nNot a report: expected an object, got {_kind(report)}: {found}\n"
    report = redact_secrets(report)
    shape = _Shape()
    # The parts are read in this order, which is also the order of "unexpected shape" entries.
    when = shape.get(report, "when", Mapping)
    lines = _title(when) + _when(when)
    lines += _error(shape.get(report, "error", Mapping), shape)
    lines += _suggestions(shape.items(shape.get(report, "suggestions", list), "suggestions"))
    lines += _batch(shape.get(report, "batch", Mapping), shape)
    memory = shape.get(report, "memory", Mapping)
    lines += _memory(memory)
    lines += _holders(shape.get(report, "holders", Mapping), memory.get("allocated_bytes"), shape)
    lines += _config(shape.get(report, "config", Mapping), shape)
    lines += _sharding(shape.get(report, "sharding", Mapping))
    lines += _hparams(shape.get(report, "hparams", Mapping))
    lines += _snapshot(shape.get(report, "snapshot", Mapping))
    lines += _environment(shape.get(report, "environment", Mapping))
    lines += _summary(memory.get("summary"), shape)
    lines += _listed("## Parts of this report that could not be gathered", shape.get(report, "report_errors", list))
    lines += _listed("## Parts of this report with an unexpected shape", shape.unexpected)
    # Values were put on one line each above; what remains (a multi-line error message or allocator summary in a
    # code block) keeps its newlines and loses every other control character: the file is read on terminals too.
    return printable("\n".join(lines).rstrip("\n") + "\n", keep_newlines=True)
