"""Reading the memory log: load_memory_log, iter_memory_lines / iter_memory_records, and the records skipped."""

import json
import os
import warnings

import pytest

from lightning_memopt.analysis import (
    MemoryLogError,
    analyze_memory_logs,
    iter_memory_records,
    load_memory_log,
    summarize_memory_log,
)
from lightning_memopt.analysis.records import iter_memory_lines
from tests.helpers.analysis_logs import jsonl_text, rec, step_records, write
from tests.helpers.pipes import PipeWatchdog


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    path = write(
        tmp_path / "m.jsonl",
        [rec(1.0, "train", "step", 1, 10), rec(2.0, "train", "step", 2, 20)],
        tail='{"time": 3.0, "rank": 0, "pha',
    )
    with pytest.warns(UserWarning, match="line 3 is truncated"):
        records = load_memory_log(path)
    assert [r["global_step"] for r in records] == [1, 2]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "holds no memory records"),
        ("not json at all\n", "line 1 is not JSON"),
        ('{"a": 1}\n', "line 1 is not a memory record"),
        ("[1, 2]\n", "line 1 is not a memory record"),
        (
            '{"time": 1, "rank": 0, "phase": "train", "event": "step"}\ngarbage\n{"time": 1, "rank": 0, "phase": "t", '
            '"event": "s"}\n',
            "line 2 is not JSON",
        ),
    ],
)
def test_bad_files_raise_one_clear_error(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(MemoryLogError, match=match):
        load_memory_log(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(MemoryLogError, match="no such file"):
        load_memory_log(tmp_path / "nope.jsonl")
    with pytest.raises(MemoryLogError, match="is a directory"):
        load_memory_log(tmp_path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"time": 1, "rank": "zero", "phase": "train", "event": "step"}\n', "line 1 `rank` is 'zero', not an int"),
        (
            '{"time": 1, "rank": 0, "phase": "train", "event": "step", "allocated_bytes": "12"}\n',
            "line 1 `allocated_bytes` is '12'",
        ),
        ('{"time": NaN, "rank": 0, "phase": "train", "event": "step"}\n', "line 1 holds NaN"),
        (
            '{"time": 1, "rank": 0, "phase": "train", "event": "step"}\n'
            '{"time": 2, "rank": 0, "phase": "train", "event": "step", "global_step": ' + "9" * 5000 + "}\n",
            "bad.jsonl: line 2 holds an integer of more than 4300 digits",
        ),
    ],
)
def test_load_memory_log_names_the_line_of_a_wrong_type(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(MemoryLogError, match=match):
        load_memory_log(path)


BAD_RECORDS = [
    pytest.param('{"time": 9, "rank": "zero", "phase": "train", "event": "step"}', "`rank` is 'zero'", id="rank-str"),
    pytest.param('{"time": 9, "rank": null, "phase": "train", "event": "step"}', "`rank` is None", id="rank-null"),
    pytest.param('{"time": 9, "rank": -1, "phase": "train", "event": "step"}', "`rank` is -1", id="rank-negative"),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "allocated_bytes": "12"}',
        "`allocated_bytes` is '12'",
        id="bytes-str",
    ),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "host_rss_bytes": -5}',
        "`host_rss_bytes` is -5, not a number of bytes",
        id="bytes-negative",
    ),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "allocated_bytes": NaN}', "holds NaN", id="nan"
    ),
    pytest.param('{"time": Infinity, "rank": 0, "phase": "train", "event": "step"}', "holds Infinity", id="inf"),
    pytest.param('{"time": 1e999, "rank": 0, "phase": "train", "event": "step"}', "`time` is inf", id="overflow"),
    pytest.param('{"time": "x", "rank": 0, "phase": "train", "event": "step"}', "`time` is 'x'", id="time-str"),
    pytest.param('{"time": 9, "rank": 0, "phase": 3, "event": "step"}', "`phase` is 3", id="phase-int"),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "global_step": "7"}',
        "`global_step` is '7'",
        id="step-str",
    ),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "global_step": 1' + "0" * 400 + "}",
        "`global_step` is 1000",
        id="step-huge",
    ),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "run_id": 5}', "`run_id` is 5", id="run-id-int"
    ),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "allocated_bytes": 1' + "0" * 4999 + "}",
        "holds an integer of more than 4300 digits",
        id="integer-of-5000-digits",
    ),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "note": [' + "7" * 5000 + "]}",
        "holds an integer of more than 4300 digits",
        id="integer-of-5000-digits-in-any-field",
    ),
    pytest.param("[1, 2, 3]", "a JSON value that is an array, not an object", id="list"),
    pytest.param("42", "a JSON value that is a number, not an object", id="number"),
    pytest.param('{"time": 9, "rank": 0, "pha', "is not JSON", id="torn"),
    pytest.param("\x00\x01garbage", "is not JSON", id="binary"),
    pytest.param('{"pad": "' + "x" * 2**20 + '"}', "is longer than 1 MiB", id="overlong"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_RECORDS)
def test_bad_records_are_skipped_with_one_warning_naming_the_lines(tmp_path, bad, reason):
    good = step_records(24, every=10)  # +10 bytes every 10 steps, over 230 steps
    content = jsonl_text([*good[:3], bad, *good[3:8], bad, bad, *good[8:]])
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summaries, _ = analyze_memory_logs([path])
    messages = [str(w.message) for w in caught if str(path) in str(w.message)]
    assert len(messages) == 1, messages
    assert f"{path}: skipped 3 of 27 records (lines 4, 10, 11): line 4 " in messages[0]
    assert reason in messages[0]
    (train,) = summaries
    assert train.num_readings == 24 and train.peak_allocated_bytes == 1240
    assert train.growth == "growing" and train.growth_bytes_per_1k_steps == pytest.approx(1000.0)


def test_many_bad_lines_are_listed_briefly(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        jsonl_text([*step_records(2), *["oops"] * 25, '{"time": 9, "rank": "zero", "phase": "t", "event": "s"}'])
    )
    with pytest.warns(UserWarning) as caught:
        analyze_memory_logs([path])
    (message,) = [str(w.message) for w in caught]
    assert "skipped 26 of 28 records (lines 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 and 16 more)" in message
    assert "line 3 is not JSON; line 28 `rank` is 'zero'" in message


def test_summarize_skips_records_of_the_wrong_type():
    records = [*step_records(4), {"time": 5.0, "rank": "zero", "phase": "train", "event": "step"}, [1], None]
    with pytest.warns(UserWarning, match=r"skipped 3 of 7 records \(index 4, 5, 6\): record 4 `rank` is 'zero'"):
        (summary,) = summarize_memory_log(records)
    assert summary.num_readings == 4


# ---------------------------------------------------------------------------------------------------- the reader


def test_iter_memory_records_streams_the_usable_records_in_order(tmp_path):
    good = step_records(3)
    path = tmp_path / "memory_rank0.jsonl"
    text = jsonl_text([good[0], "not json", "", good[1], '{"time": 9, "rank": "zero", "phase": "t", "event": "s"}'])
    path.write_bytes(b"\xef\xbb\xbf" + text.encode() + (json.dumps(good[2]) + '\n{"time": 4, "ra').encode())
    records = iter_memory_records(path)
    assert next(records) == good[0]  # one at a time: a generator, not a list
    assert list(records) == good[1:]


def test_iter_memory_lines_names_each_line_and_its_problem(tmp_path):
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(jsonl_text([*step_records(1), "[1]", "", '{"time": NaN}']) + '{"time": 4, "ra')
    lines = list(iter_memory_lines(path))
    assert [(line.number, line.record is not None, line.truncated) for line in lines] == [
        (1, True, False),
        (2, False, False),
        (4, False, False),
        (5, False, True),
    ]
    assert lines[1].problem == "is not a memory record (a JSON value that is an array, not an object)"
    assert lines[2].problem == "holds NaN, which is not JSON"
    assert lines[3].problem == "is truncated (the run stopped mid-write)"


def test_iter_memory_records_refuses_what_is_not_a_regular_file(tmp_path):
    with pytest.raises(MemoryLogError, match="no such file"):
        list(iter_memory_records(tmp_path / "memory_rank0.jsonl"))
    with pytest.raises(MemoryLogError, match="is a directory"):
        list(iter_memory_records(tmp_path))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_iter_memory_records_refuses_a_named_pipe_without_opening_it(tmp_path):
    fifo = tmp_path / "memory_rank0.jsonl"
    os.mkfifo(fifo)
    watchdog = PipeWatchdog(fifo)
    try:
        with pytest.raises(MemoryLogError, match="is a named pipe, not a regular file"):
            list(iter_memory_records(fifo))
    finally:
        watchdog.stop()
    assert not watchdog.fired, "the named pipe was opened"


def test_a_skipped_line_is_named_in_the_singular_and_several_in_the_plural(tmp_path):
    from lightning_memopt.analysis.memory_log import _FileReport

    one, two = _FileReport(tmp_path / "a.jsonl", usable=3), _FileReport(tmp_path / "b.jsonl", usable=3)
    one.skip(2, "is not JSON")
    two.skip(2, "is not JSON")
    two.skip(5, "is not JSON")
    assert "(line 2)" in one.warning()
    assert "(lines 2, 5)" in two.warning()


def test_a_log_path_of_none_is_refused_by_name():
    with pytest.raises((TypeError, ValueError), match="`path`"):
        load_memory_log(None)
