"""What `lightning-memopt analyze` and `report` print carries no control or bidi character from the files."""

import json
import re

import pytest
import torch

from lightning_memopt import OOMReporter
from lightning_memopt.cli import main
from lightning_memopt.functional.oom import REPORT_FORMAT
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

HOSTILE = "\x1b[2J\x1b]0;pwned\x07\rFORGED\nFORGED line\u202etxt.exe\x9b31m"
#: Anything a terminal acts on; only the newlines the CLI writes itself may remain.
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _step(step, run_id, **extra):
    return {"time": float(step), "rank": 0, "phase": "train", "event": "step", "epoch": 0, "global_step": step,
            "batch_idx": 0, "device": "cpu", "allocated_bytes": None, "host_rss_bytes": 2**20 * (1 + step),
            "run_id": run_id, **extra}  # fmt: skip


def _assert_clean(text):
    assert not CONTROL.search(text), repr(CONTROL.search(text))
    outside_code_blocks = re.sub(r"```\n.*?\n```", "", text, flags=re.S)  # a multi-line error message keeps its lines
    assert not any(line.startswith("FORGED") for line in outside_code_blocks.splitlines()), text


def test_analyze_escapes_log_fields(tmp_path, capsys):
    records = [_step(s, "run-a") for s in range(3)] + [_step(s, f"run-b{HOSTILE}") for s in range(3)]
    records.append(dict(_step(2, f"run-b{HOSTILE}"), event="warning", check=f"leak{HOSTILE}", message=HOSTILE))
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["analyze", str(path)]) == 0
    captured = capsys.readouterr()
    _assert_clean(captured.out)
    _assert_clean(captured.err)
    assert "\\x1b[2J" in captured.out and "\\u202etxt.exe" in captured.out  # shown, as escapes


def test_report_escapes_report_values_and_file_names(tmp_path, capsys):
    report = {
        "format": REPORT_FORMAT,
        "when": {"time": 0.0, "rank": 0, "world_size": 1, "stage": f"train{HOSTILE}", "global_step": 3},
        "error": {"type": f"T{HOSTILE}", "message": f"CUDA out of memory.\n{HOSTILE}", "location": HOSTILE},
        "holders": {"device": HOSTILE, "bytes_by_category": {HOSTILE: 512}},
        "suggestions": [{"rank": 1, "action": HOSTILE, "why": HOSTILE, "saves_bytes": 10}],
        "hparams": {HOSTILE: HOSTILE},
        "snapshot": {"path": None, "reason": HOSTILE},
        "report_errors": [HOSTILE],
    }
    path = tmp_path / "oom_report_rank0.json"
    path.write_text(json.dumps(report))
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    _assert_clean(out)
    assert out.count("\\x1b[2J") >= 8
    # an error naming a file whose name holds control characters: one clean line
    bad = tmp_path / f"x{HOSTILE.replace('/', '')}.json"
    bad.write_text("{not json")
    assert main(["report", str(bad)]) == 2
    err = capsys.readouterr().err
    _assert_clean(err)
    assert err.count("\n") == 1


def test_a_newline_in_dirpath_forges_no_console_line(tmp_path, caplog):
    directory = tmp_path / "oom\nlightning_memopt: WARNING all is fine \x1b[32mOK"

    class Failing(TinyModel):
        def training_step(self, batch, batch_idx):
            raise torch.OutOfMemoryError("CUDA out of memory.")

    trainer = make_trainer(tmp_path, callbacks=[OOMReporter(dirpath=directory, max_listed=0)])
    with caplog.at_level("INFO", logger="lightning_memopt"), pytest.raises(torch.OutOfMemoryError):
        trainer.fit(Failing())
    ours = [r.getMessage() for r in caplog.records if r.name == "lightning_memopt"]
    assert any("report written to" in m for m in ours), ours
    for message in ours:
        _assert_clean(message)
        # the summary puts the path on a line of its own (100 columns); the path itself stays on that one line
        assert message.count("\n") == (1 if "report written to" in message else 0)
    assert (directory / "oom_report_rank0.md").exists()  # the report itself went where it was asked
    _assert_clean((directory / "oom_report_rank0.md").read_text())
