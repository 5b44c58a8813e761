"""build_oom_report and the report's format: golden files, the TypedDict schema, readers that fail.

The golden files (``tests/helpers/oom_golden/``) were rendered from ``tests/helpers/oom_fixtures.py`` by the code
before ``functional/oom.py`` became a package (then assembled by ``OOMReporter`` itself); the JSON and the
Markdown must stay byte-identical.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from pathlib import Path

import pytest
import torch

from lightning_memopt.functional.oom import (
    OOMReport,
    ReportSources,
    SectionGuard,
    build_oom_report,
    failure_memory,
    failure_position,
    render_markdown,
    report_json,
    schema,
    suggest_fixes,
    take_snapshot,
)
from lightning_memopt.functional.oom.message import MESSAGE_FIELDS
from lightning_memopt.functional.readings.memory import MemoryReading
from tests.helpers import oom_fixtures as F
from tests.helpers.oom_schema import check_against_schema

GOLDEN = F.GOLDEN_DIR


class _FailingParts(SectionGuard):
    """Catches RuntimeError; the parts named in ``labels`` fail as if their reader broke."""

    def __init__(self, labels=()):
        super().__init__(catch=(RuntimeError,))
        self.labels = set(labels)

    def __call__(self, label, read, fallback):
        if label in self.labels:
            read = _broken
        return super().__call__(label, read, fallback)


def _broken(*args, **kwargs):
    raise RuntimeError("reader broke")


def _build(variant: str, guard: SectionGuard | None = None) -> OOMReport:
    """The report of a golden variant, from the fixed inputs."""
    guard = SectionGuard(catch=(RuntimeError,)) if guard is None else guard
    model, optimizer = F.fixed_model_and_optimizer()
    cuda = variant == "train_cuda"
    if variant == "validate_cpu":
        device, memory, position, exception = torch.device("cpu"), F.CPU_MEMORY, F.VALIDATE_POSITION, F.validation_oom()
        settings = dict(
            F.SETTINGS,
            precision="bf16-mixed",
            accumulate_grad_batches=1,
            world_size=1,
            strategy="SingleDeviceStrategy",
            accelerator="CPUAccelerator",
            num_devices=1,
            device_ids="[0]",
        )
    else:
        device = torch.device("cuda:1" if cuda else "cpu")
        memory, position, exception, settings = F.MEMORY, F.POSITION, F.training_oom(), F.SETTINGS
    failing = variant == "train_failures"
    recorded = variant != "validate_cpu"
    sources = ReportSources(
        settings=lambda: settings,
        optimizers=lambda: [optimizer],
        is_checkpointed=lambda module: False,
        snapshot=functools.partial(
            take_snapshot,
            F.SNAPSHOT_PATH,
            device.type,
            requested=recorded,
            recording=recorded,
            dump=_broken if failing else (lambda path: True),
        ),
        memory_summary=lambda d: F.SUMMARY if recorded else None,
        environment=lambda: dict(F.ENVIRONMENT) if recorded else {},
        allocator=lambda: dict(F.ALLOCATOR),
        versions=_broken if failing else (lambda: dict(F.VERSIONS)),
        live_tensors=_broken if failing else (lambda d, names=None: list(F.LIVE_TENSORS)),
    )
    reading = failure_memory(lambda: MemoryReading(**memory), guard)
    when = failure_position(
        lambda: position, device=device, traceback=exception.__traceback__, run_id=F.RUN_ID, clock=lambda: F.TIME
    )
    return build_oom_report(
        exception,
        when=when,
        memory=reading,
        device=device,
        module=model,
        sources=sources,
        max_listed=2,
        guard=guard,
    )


# ---------------------------------------------------------------------------------------------------- golden


@pytest.mark.parametrize("variant", ["train_cuda", "validate_cpu", "train_failures"])
def test_report_json_and_markdown_match_the_golden_files(variant):
    guard = None
    if variant == "train_failures":
        guard = _FailingParts({"failing batch", "hyperparameters", "suggestions"})
    report = _build(variant, guard)
    assert report_json(report) == (GOLDEN / f"{variant}.json").read_text(encoding="utf-8")
    assert render_markdown(report) == (GOLDEN / f"{variant}.md").read_text(encoding="utf-8")


def test_markdown_of_hand_made_reports_matches_the_golden_file():
    golden = json.loads((GOLDEN / "markdown.json").read_text(encoding="utf-8"))
    cases = F.markdown_cases()
    assert sorted(cases) == sorted(golden)
    for name, report in cases.items():
        assert render_markdown(report) == golden[name], name


def test_suggestions_match_the_golden_file():
    golden = json.loads((GOLDEN / "suggestions.json").read_text(encoding="utf-8"))
    for name, kwargs in F.suggestion_cases().items():
        assert json.loads(json.dumps(suggest_fixes(**kwargs))) == golden["cases"][name], name
    grid = [suggest_fixes(**kwargs) for kwargs in F.suggestion_grid(golden["grid_size"])]
    assert hashlib.sha256(json.dumps(grid, sort_keys=True).encode()).hexdigest() == golden["grid_sha256"]


# ---------------------------------------------------------------------------------------------------- schema


@pytest.mark.parametrize("variant", ["train_cuda", "validate_cpu", "train_failures"])
def test_golden_reports_use_only_the_keys_of_the_schema(variant):
    report = json.loads((GOLDEN / f"{variant}.json").read_text(encoding="utf-8"))
    check_against_schema(report)
    assert list(report) == [k for k in typing.get_type_hints(schema.OOMReport) if k in report]  # in schema order


def test_memory_section_is_the_reading_the_summary_and_the_message_numbers():
    reading = [f.name for f in dataclasses.fields(MemoryReading)]
    expected = [*reading, "summary", *(f"message_{name}" for name in MESSAGE_FIELDS)]
    assert list(typing.get_type_hints(schema.MemorySection)) == expected


def test_docs_describe_every_key_of_the_schema():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "oom-report.md").read_text(encoding="utf-8")
    for name in schema.__all__:
        typed = getattr(schema, name)
        if name == "REPORT_FORMAT":
            assert typed in docs
            continue
        for key in typing.get_type_hints(typed):
            assert f"`{key}`" in docs, (name, key)


# ---------------------------------------------------------------------------------------------------- readers


def test_without_a_catching_guard_a_failing_reader_raises():
    with pytest.raises(RuntimeError, match="reader broke"):
        failure_memory(_broken)
    with pytest.raises(RuntimeError, match="reader broke"):
        failure_position(_broken, device=torch.device("cpu"), traceback=None, run_id=None)
    exception = F.training_oom()
    sources = ReportSources(settings=_broken)
    with pytest.raises(RuntimeError, match="reader broke"):
        build_oom_report(exception, when={}, memory={}, device=torch.device("cpu"), module=torch.nn.Linear(1, 1),
                         sources=sources)  # fmt: skip


def test_failing_readers_are_listed_and_the_rest_is_reported():
    guard = SectionGuard(catch=(RuntimeError,))
    memory = failure_memory(_broken, guard)
    when = failure_position(
        _broken, device=torch.device("cpu"), traceback=None, run_id="r", clock=lambda: 5.0, guard=guard
    )
    assert memory == {} and when == {"time": 5.0, "rank": 0, "world_size": 1, "run_id": "r"}
    sources = ReportSources(
        settings=_broken,
        memory_summary=_broken,
        environment=_broken,
        snapshot=_broken,
        versions=lambda: {"torch": "x"},
        allocator=lambda: {},
    )
    report = build_oom_report(
        RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB"),
        when=when,
        memory=memory,
        device=torch.device("cpu"),
        module=torch.nn.Linear(2, 2),
        sources=sources,
        max_listed=0,
        guard=guard,
    )
    assert report["report_errors"] == [
        "memory reading: RuntimeError('reader broke')",
        "training position: RuntimeError('reader broke')",
        "memory summary: RuntimeError('reader broke')",
        "configuration: RuntimeError('reader broke')",
        "environment: RuntimeError('reader broke')",
        "allocator snapshot: RuntimeError('reader broke')",
    ]
    assert report["memory"] == {"message_" + k: None for k in MESSAGE_FIELDS} | {"message_requested_bytes": 2**30}
    assert report["config"]["versions"] == {"torch": "x"} and "precision" not in report["config"]
    assert report["snapshot"] == {"path": None, "reason": "writing it failed: RuntimeError('reader broke')"}
    assert "environment" not in report and report["hparams"] == {} and report["suggestions"] == []  # no stage
    assert report["holders"]["bytes_by_category"]["parameters"] == 24 and "top_tensors" not in report["holders"]
    check_against_schema(report)


def test_checkpointing_seen_at_train_start_is_reported_when_given_back_before_the_failure():
    on = {"on": True, "wrapped": ["block"], "model_switch": [], "num_wrapped": 1, "num_model_switch": 0}
    kwargs = dict(
        memory={},
        device=torch.device("cpu"),
        module=torch.nn.Linear(2, 2),
        sources=ReportSources(settings=lambda: F.SETTINGS),
        checkpointing_at_start=on,
    )
    train = build_oom_report(RuntimeError("oom"), when={"stage": "train"}, **kwargs)
    assert train["config"]["activation_checkpointing"] == {**on, "seen": "at train start"}
    validate = build_oom_report(RuntimeError("oom"), when={"stage": "validate"}, **kwargs)
    assert validate["config"]["activation_checkpointing"]["on"] is False


def test_secrets_are_redacted_in_the_built_report():
    report = _build("train_cuda")
    text = report_json(report)
    for secret in ("hunter2", "sk-secret-123", "pw12345", "tok-999"):
        assert secret not in text, secret
    assert report["hparams"]["wandb"]["api_key"] == "<redacted>" and report["hparams"]["temperature"] == 0.5


# ---------------------------------------------------------------------------------------------------- chained


def _throw(exception, cause):
    if cause is ...:
        raise exception
    raise exception from cause


def _raised(exception, cause=..., context=None):
    """``exception`` raised (with a traceback) from ``cause`` (``...``: no ``from``) while handling ``context``."""
    try:
        if context is None:
            _throw(exception, cause)
        try:
            raise context
        except BaseException:
            _throw(exception, cause)
    except BaseException as err:
        return err


def _report(exception, guard=None):
    return build_oom_report(
        exception,
        when=failure_position(lambda: F.POSITION, device=torch.device("cpu"), traceback=None, run_id="r"),
        memory={},
        device=torch.device("cpu"),
        module=torch.nn.Linear(2, 2),
        sources=ReportSources(settings=lambda: F.SETTINGS),
        guard=guard,
    )


def test_chained_exceptions_are_in_the_report_nearest_first_and_redacted():
    oom = _raised(torch.OutOfMemoryError(F.CUDA_MESSAGE))
    wrapped = _raised(RuntimeError("data worker died: --password hunter2"), cause=oom)
    # raised while handling `wrapped` (an implicit context), from nothing
    outer = _raised(ValueError("step 3 failed, see https://bob:pw12345@logs.example/run"), context=wrapped)
    report = _report(outer)
    error = report["error"]
    assert (
        error["type"] == "ValueError"
        and error["message"] == "step 3 failed, see https://bob:<redacted>@logs.example/run"
    )
    chain = error["chain"]
    assert [(e["relation"], e["type"]) for e in chain] == [
        ("context", "RuntimeError"),
        ("cause", "torch.OutOfMemoryError"),
    ]
    assert chain[0]["message"] == "data worker died: --password <redacted>"
    assert chain[1]["message"].startswith("CUDA out of memory. Tried to allocate 256.00 MiB.")
    assert "hunter2" not in report_json(report) and "pw12345" not in report_json(report)
    assert all(e["location"].startswith("_throw (") for e in chain)
    # the numbers of the wrapped out-of-memory error's message are read from the chain
    assert report["memory"]["message_requested_bytes"] == 256 * 2**20
    assert report["memory"]["message_device_total_bytes"] is not None and report["report_errors"] == []
    check_against_schema(report)


def test_the_chain_shows_in_the_markdown():
    oom = _raised(torch.OutOfMemoryError("CUDA out of memory. token=abc123"))
    text = render_markdown(_report(_raised(RuntimeError("step failed"), cause=oom)))
    error = text[text.index("## Error") : text.index("## Memory at failure")]
    assert "`RuntimeError` raised at _throw (" in error
    assert "Its direct cause: `torch.OutOfMemoryError` raised at _throw (" in error
    assert "```\nCUDA out of memory. token=<redacted>\n```" in error and "abc123" not in text
    context = render_markdown(_report(_raised(RuntimeError("cleanup failed"), context=oom)))
    assert "Raised while handling: `torch.OutOfMemoryError`" in context


def test_a_lone_exception_has_no_chain_and_old_reports_render_as_before():
    report = _report(_raised(RuntimeError("CUDA out of memory.")))
    assert "chain" not in report["error"]
    old = {"error": {"type": "RuntimeError", "message": "boom", "location": None}}
    assert render_markdown(old).split("## Error\n\n", 1)[1] == "`RuntimeError` raised at n/a\n\n```\nboom\n```\n"


def test_a_hand_edited_chain_of_the_wrong_shape_is_listed_not_fatal():
    report = {
        "error": {
            "type": "RuntimeError",
            "message": "boom",
            "chain": [{"relation": ["odd"], "type": "X", "message": "inner"}, "not an object"],
        }
    }
    text = render_markdown(report)
    assert "['odd']: `X` raised at n/a" in text and "```\ninner\n```" in text
    assert '`error.chain[1]` (expected an object, got a string): "not an object"' in text
    assert "`error.chain` (expected a list, got a string)" in render_markdown({"error": {"type": "E", "chain": "x"}})


def test_a_suppressed_context_a_cycle_and_a_long_chain():
    oom = _raised(torch.OutOfMemoryError("CUDA out of memory."))
    hidden = _raised(RuntimeError("retry failed"), cause=None, context=oom)  # raise ... from None
    assert hidden.__suppress_context__
    assert [e["type"] for e in _report(hidden)["error"]["chain"]] == ["torch.OutOfMemoryError"]
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert [e["message"] for e in _report(a)["error"]["chain"]] == ["b"]  # the cycle ends it
    deepest = RuntimeError("0")
    for i in range(1, 12):
        deepest = _raised(RuntimeError(str(i)), cause=deepest)
    chain = _report(deepest)["error"]["chain"]
    assert [e["message"] for e in chain] == [str(i) for i in range(10, 2, -1)]  # the nearest 8


def test_a_chained_exception_whose_message_fails_costs_the_chain_only():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    report = _report(_raised(RuntimeError("outer"), cause=Unprintable()), guard=SectionGuard(catch=(RuntimeError,)))
    assert "chain" not in report["error"] and report["error"]["message"] == "outer"
    assert report["report_errors"] == ["chained exceptions: RuntimeError('no str')"]
