"""Pure parts of the out-of-memory report: batch description, message numbers, environment, suggestions, Markdown."""

import dataclasses
import json
import sys
from collections import namedtuple

import pytest
import torch

from lightning_memopt.functional.oom import (
    REDACTED,
    REPORT_FORMAT,
    collect_environment,
    collect_versions,
    describe_batch,
    load_report,
    parse_oom_message,
    render_markdown,
    suggest_fixes,
)

GiB = 1024**3
MiB = 1024**2


# ---------------------------------------------------------------------------------------------------- batch


def test_describe_batch_nested_containers():
    Pair = namedtuple("Pair", ["ids", "mask"])

    @dataclasses.dataclass
    class Sample:
        image: torch.Tensor
        label: int

    batch = {
        "text": Pair(torch.zeros(6, 10, dtype=torch.long), torch.ones(6, 10, dtype=torch.bool)),
        "sample": Sample(torch.zeros(6, 3, 4, 4, dtype=torch.float16), 1),
        "names": ["a", "b"],
    }
    d = describe_batch(batch)
    paths = [t["path"] for t in d["tensors"]]
    assert paths == ["batch['text'].ids", "batch['text'].mask", "batch['sample'].image"]
    assert d["tensors"][0] == {
        "path": "batch['text'].ids",
        "shape": [6, 10],
        "dtype": "torch.int64",
        "device": "cpu",
        "bytes": 480,
    }
    assert d["tensors"][2]["dtype"] == "torch.float16" and d["tensors"][2]["bytes"] == 6 * 48 * 2
    assert d["micro_batch_size"] == 6 and d["num_tensors"] == 3 and not d["truncated"] and d["type"] == "dict"


def test_describe_batch_truncates_but_counts_everything():
    d = describe_batch([torch.zeros(1)] * 40)
    assert len(d["tensors"]) == 32 and d["num_tensors"] == 40 and d["truncated"]


def test_describe_batch_without_tensors_and_scalar_first():
    assert describe_batch("text")["micro_batch_size"] is None
    d = describe_batch((torch.tensor(3.0), torch.zeros(5, 2)))
    assert d["micro_batch_size"] == 5
    loop = []
    loop.append(loop)
    assert describe_batch(loop)["num_tensors"] == 0  # self-reference does not recurse forever


# ---------------------------------------------------------------------------------------------------- messages

CUDA_MESSAGE = (
    "CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total capacity of 79.10 GiB of which 120.50 MiB"
    " is free. Including non-PyTorch memory, this process has 78.97 GiB memory in use. Of the allocated memory"
    " 70.25 GiB is allocated by PyTorch, and 8.12 GiB is reserved by PyTorch but unallocated. If reserved but"
    " unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)


def test_parse_cuda_message():
    f = parse_oom_message(CUDA_MESSAGE)
    assert f["requested_bytes"] == 256 * MiB
    assert f["device_total_bytes"] == int(79.10 * GiB)
    assert f["device_free_bytes"] == int(120.5 * MiB)
    assert f["process_in_use_bytes"] == int(78.97 * GiB)
    assert f["pytorch_allocated_bytes"] == int(70.25 * GiB)
    assert f["reserved_unallocated_bytes"] == int(8.12 * GiB)


def test_parse_other_messages():
    mps = "MPS backend out of memory (MPS allocated: 17.00 GB). Tried to allocate 256.00 MB on private pool."
    assert parse_oom_message(mps)["requested_bytes"] == 256 * 1000**2
    assert parse_oom_message("Tried to allocate 512 bytes")["requested_bytes"] == 512
    assert set(parse_oom_message("nothing here").values()) == {None}
    assert parse_oom_message("")["requested_bytes"] is None


# ---------------------------------------------------------------------------------------------------- environment


def test_environment_allow_list_and_redaction():
    env = {
        "NCCL_DEBUG": "INFO",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_HUB_TOKEN": "tok-123",
        "NCCL_API_KEY": "k-456",
        "PL_SECRET": "s",
        "OMP_PASSWORD": "p",
        "HF_TOKEN": "hf-789",
        "AWS_SECRET_ACCESS_KEY": "aws",
        "HOME": "/root",
        "LOCAL_RANK": "1",
        "MY_PASSWORD": "pw",
    }
    kept = collect_environment(env)
    assert kept == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "LOCAL_RANK": "1",
        "NCCL_API_KEY": REDACTED,
        "NCCL_DEBUG": "INFO",
        "OMP_PASSWORD": REDACTED,
        "PL_SECRET": REDACTED,
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_HUB_TOKEN": REDACTED,
    }
    text = json.dumps(kept)
    for secret in ("tok-123", "k-456", "hf-789", "aws", "pw"):
        assert secret not in text


def test_versions_name_the_stack():
    v = collect_versions()
    assert v["torch"] == str(torch.__version__)
    assert v["lightning"] and v["lightning_memopt"] and v["python"]


# ---------------------------------------------------------------------------------------------------- suggestions


def _actions(tips):
    return [t["action"] for t in tips]


def test_activations_dominate_training():
    tips = suggest_fixes(
        stage="train",
        allocated_bytes=10 * GiB,
        reserved_bytes=10 * GiB,
        device_total_bytes=12 * GiB,
        device_free_bytes=2 * GiB,
        bytes_by_category={"parameters": GiB, "gradients": GiB, "optimizer_states": 0, "buffers": 0},
        unexplained_bytes=8 * GiB,
        micro_batch_size=32,
        accumulate_grad_batches=2,
        world_size=2,
        precision="32-true",
    )
    actions = _actions(tips)
    assert actions[0].startswith("Enable activation checkpointing")
    assert actions[1].startswith("Halve the micro-batch")
    assert "32 -> 16" in actions[1] and "2 -> 4" in actions[1] and "stays 128" in actions[1]
    assert any(a.startswith("Train in mixed precision") for a in actions)
    assert [t["rank"] for t in tips] == list(range(1, len(tips) + 1))
    assert tips[0]["saves_bytes"] == int(8 * GiB * 0.6)
    assert "8.00 GiB" in tips[0]["why"] and "80 %" in tips[0]["why"]
    assert not any("expandable_segments" in a for a in actions)  # no fragmentation here


def test_odd_micro_batch_says_effective_batch_changes():
    tips = suggest_fixes(stage="train", micro_batch_size=5, accumulate_grad_batches=1)
    halve = next(a for a in _actions(tips) if a.startswith("Halve"))
    assert "5 -> 2" in halve and "goes from 5 to 4" in halve


def test_optimizer_state_dominates():
    cats = {"parameters": 2 * GiB, "gradients": 2 * GiB, "optimizer_states": 4 * GiB, "buffers": 0}
    tips = suggest_fixes(
        stage="train",
        allocated_bytes=9 * GiB,
        reserved_bytes=9 * GiB,
        bytes_by_category=cats,
        unexplained_bytes=GiB,
        micro_batch_size=8,
        precision="bf16-mixed",
    )
    assert tips[0]["action"].startswith("Use an optimizer with less state")
    assert not any(a.startswith("Enable activation checkpointing") for a in _actions(tips))
    tips2 = suggest_fixes(
        stage="train",
        allocated_bytes=9 * GiB,
        reserved_bytes=9 * GiB,
        bytes_by_category=cats,
        unexplained_bytes=GiB,
        micro_batch_size=8,
        world_size=4,
    )
    assert tips2[0]["action"].startswith("Shard the optimizer state") and tips2[0]["saves_bytes"] == 3 * GiB


def test_fragmentation_suggests_expandable_segments_unless_set():
    kw = dict(
        stage="train",
        allocated_bytes=6 * GiB,
        reserved_bytes=10 * GiB,
        requested_bytes=GiB,
        bytes_by_category={"parameters": GiB},
        unexplained_bytes=5 * GiB,
        micro_batch_size=4,
    )
    tips = suggest_fixes(**kw)
    assert tips[0]["action"].startswith("Reduce fragmentation") and tips[0]["saves_bytes"] == 4 * GiB
    assert "expandable_segments:True" in tips[0]["action"]
    set_already = suggest_fixes(**kw, allocator_conf="max_split_size_mb:128,expandable_segments:True")
    assert not any("fragmentation" in a for a in _actions(set_already))


def test_single_huge_allocation_and_other_processes():
    tips = suggest_fixes(
        stage="train",
        allocated_bytes=GiB,
        reserved_bytes=GiB,
        device_total_bytes=16 * GiB,
        device_free_bytes=5 * GiB,
        requested_bytes=40 * GiB,
        unexplained_bytes=0,
        bytes_by_category={"parameters": GiB},
        micro_batch_size=4,
    )
    assert tips[0]["action"].startswith("Check the shape")
    assert any(a.startswith("Free the device of other users") for a in _actions(tips))


def test_evaluation_stage_suggestions():
    tips = suggest_fixes(
        stage="validate",
        allocated_bytes=4 * GiB,
        reserved_bytes=4 * GiB,
        bytes_by_category={"parameters": GiB, "gradients": GiB},
        unexplained_bytes=2 * GiB,
        micro_batch_size=64,
    )
    actions = _actions(tips)
    assert actions[0].startswith("Lower the validate batch size")
    assert any("zero_grad(set_to_none=True)" in a for a in actions)
    assert not any(a.startswith("Halve the micro-batch") for a in actions)


def test_unknown_numbers_still_give_ordered_generic_suggestions():
    tips = suggest_fixes(stage="train", micro_batch_size=8, precision="32-true", device_type="cpu")
    assert [t["saves_bytes"] for t in tips] == [None] * len(tips)
    assert _actions(tips)[0].startswith("Enable activation checkpointing")
    assert suggest_fixes(stage=None) == []


# ---------------------------------------------------------------------------------------------------- Markdown


def _full_report():
    return {
        "format": REPORT_FORMAT,
        "when": {
            "time": 0.0,
            "rank": 1,
            "world_size": 2,
            "fn": "fit",
            "stage": "train",
            "epoch": 3,
            "global_step": 7320,
            "batch_idx": 12,
            "device": "cuda:1",
        },
        "error": {"type": "torch.OutOfMemoryError", "message": CUDA_MESSAGE, "location": "forward (model.py:10)"},
        "batch": {
            "found_in": "training_step (model.py:20)",
            "micro_batch_size": 8,
            "num_tensors": 1,
            "truncated": False,
            "tensors": [
                {"path": "batch", "shape": [8, 512], "dtype": "torch.int64", "device": "cuda:1", "bytes": 32768}
            ],
        },
        "memory": {"allocated_bytes": 70 * GiB, "reserved_bytes": 78 * GiB, "summary": "|  PyTorch CUDA memory |"},
        "holders": {
            "device": "cuda:1",
            "bytes_by_category": {"parameters": GiB},
            "unexplained_bytes": 69 * GiB,
            "rows": [
                {"category": "parameters", "dtype": "torch.float32", "device": "cuda:1", "num_tensors": 3, "bytes": GiB}
            ],
            "top_tensors": [
                {
                    "name": "encoder.weight",
                    "shape": [1024, 1024],
                    "dtype": "torch.float32",
                    "bytes": 4 * MiB,
                    "requires_grad": True,
                    "has_grad_fn": False,
                }
            ],
        },
        "config": {
            "precision": "bf16-mixed",
            "accumulate_grad_batches": 4,
            "allocator": {"PYTORCH_ALLOC_CONF": None},
            "versions": {"torch": "2.11"},
        },
        "suggestions": [{"rank": 1, "action": "Do X", "why": "Because Y.", "saves_bytes": GiB}],
        "snapshot": {"path": "oom_snapshot_rank1.pickle", "how_to_open": "Open it."},
        "environment": {"NCCL_DEBUG": "INFO"},
        "report_errors": ["who holds memory: boom"],
    }


def test_render_markdown_has_every_section():
    text = render_markdown(_full_report())
    assert text.startswith("# Out-of-memory report: rank 1 of 2, train, global step 7320\n")
    for heading in (
        "## When and where",
        "## Error",
        "## Suggestions (try in this order)",
        "## Failing batch",
        "## Memory at failure",
        "## Who holds memory",
        "## Configuration",
        "## Allocator snapshot",
        "## Environment",
        "## Allocator summary",
        "## Parts of this report that could not be gathered",
    ):
        assert heading in text, heading
    assert "1. **Do X** (frees about 1.00 GiB). Because Y." in text
    assert "| batch | (8, 512) | torch.int64 | cuda:1 | 32.00 KiB |" in text
    assert "encoder.weight" in text and "69.00 GiB" in text and "oom_snapshot_rank1.pickle" in text
    assert "| 1970-01-01T00:00:00+00:00 |" in text.replace("| time (UTC) ", "")


def test_render_markdown_partial_report_and_pipes_escaped():
    text = render_markdown({"error": {"type": "RuntimeError", "message": "a | b"}, "config": {"x": "a|b"}})
    assert "## Error" in text and "a\\|b" in text and "## Memory" not in text


def test_load_report_roundtrip_and_errors(tmp_path):
    good = tmp_path / "oom_report_rank0.json"
    good.write_text(json.dumps(_full_report()))
    assert load_report(good)["when"]["global_step"] == 7320
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_report(bad)
    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an out-of-memory report"):
        load_report(other)
    with pytest.raises(ValueError, match="is a directory"):
        load_report(tmp_path)


@pytest.mark.skipif(getattr(sys, "get_int_max_str_digits", lambda: 0)() != 4300, reason="Python's default digit limit")
def test_a_report_with_an_integer_of_5000_digits_is_refused_naming_the_file_and_the_line(tmp_path, capsys):
    text = json.dumps(_full_report(), indent=2)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if '"global_step"' in line)
    lines[at] = lines[at].split(":")[0] + ": " + "7" * 5000 + ","
    path = tmp_path / "oom_report_rank0.json"
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError) as info:
        load_report(path)
    message = str(info.value)
    assert (
        message.startswith(f"{path}: ")
        and f"more than 4300 digits (Python reads at most 4300) at line {at + 1}" in message
    )
    from lightning_memopt.cli import main

    # `report` reads with limits: the number is shown cut with a marker, the rest of the report is printed
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "global step 77777777777777777777... (a number of more than 1000 characters, not shown)" in out


# ---------------------------------------------------------------------------------------------------- secrets in values


@pytest.mark.parametrize(
    ("name", "value", "secret", "expected"),
    [
        (
            "LIGHTNING_CLOUD_URL",
            "https://alice:hunter2@lightning.example/api",
            "hunter2",
            "https://alice:<redacted>@lightning.example/api",
        ),
        (
            "PL_LOGGER_URI",
            "https://mlflow.example/api?token=abc123&run=7",
            "abc123",
            "https://mlflow.example/api?token=<redacted>&run=7",
        ),
        (
            "PL_LOGGER_URI",
            "https://mlflow.example/api?key=xyz789",
            "xyz789",
            "https://mlflow.example/api?key=<redacted>",
        ),
        ("LIGHTNING_HEADERS", "Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0", "9f8e7d6c5b4a", "Bearer <redacted>"),
    ],
)
def test_environment_redacts_credentials_inside_allowed_values(name, value, secret, expected):
    kept = collect_environment({name: value, "NCCL_DEBUG": "INFO"})
    assert kept == {name: expected, "NCCL_DEBUG": "INFO"}
    assert secret not in json.dumps(kept)


def test_environment_leaves_harmless_values_alone():
    env = {
        "NCCL_DEBUG": "INFO",
        "PL_LOGGER_URI": "https://host/path?x=1",
        "TORCH_HOME": "/data/torch cache/hub",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128",
        "CUDA_VISIBLE_DEVICES": "0,1",
    }
    assert collect_environment(env) == env


def test_secret_name_rule_lives_in_one_place():
    from lightning_memopt.functional import oom
    from lightning_memopt.utilities import redaction

    assert oom.is_secret_name is redaction.is_secret_name and not hasattr(redaction, "SECRET_FRAGMENTS")
    assert oom.REDACTED == redaction.REDACTED == "<redacted>"


def test_render_markdown_redacts_every_section():
    report = _full_report()
    report["environment"] = {"LIGHTNING_CLOUD_URL": "https://bob:s3cr3t@cloud.example/x"}
    report["config"] = dict(report["config"], logger_uri="https://host/x?access_token=tok42&x=1")
    report["hparams"] = {
        "lr": 0.001,
        "num_key_value_heads": 8,
        "api_key": "sk-live-123",
        "data": {"root": "/data/train", "url": "https://u:pw@data.example/set?sig=s1g"},
    }
    report["error"] = dict(report["error"], message="fetch failed: Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.x1")
    text = render_markdown(report)
    for secret in ("s3cr3t", "tok42", "sk-live-123", ":pw@", "s1g", "eyJhbGciOiJIUzI1NiJ9"):
        assert secret not in text, secret
    assert "| data.root | /data/train |" in text and "| num_key_value_heads | 8 |" in text
    assert "https://bob:<redacted>@cloud.example/x" in text and "access_token=<redacted>&x=1" in text
    assert report["hparams"]["api_key"] == "sk-live-123"  # the caller's dict is not changed


@pytest.mark.parametrize(
    ("overrides", "unexpected"),
    [
        ({"when": "x"}, '`when` (expected an object, got a string): "x"'),
        ({"error": "x"}, '`error` (expected an object, got a string): "x"'),
        ({"suggestions": "x"}, '`suggestions` (expected a list, got a string): "x"'),
        ({"suggestions": [{"rank": 1, "action": "A"}, 5]}, "`suggestions[1]` (expected an object, got a number): 5"),
        ({"memory": [1, 2]}, "`memory` (expected an object, got a list): [1, 2]"),
        ({"holders": 5}, "`holders` (expected an object, got a number): 5"),
        ({"batch": {"tensors": ["x"]}}, '`batch.tensors[0]` (expected an object, got a string): "x"'),
        ({"config": {"versions": "2.0"}}, '`config.versions` (expected an object, got a string): "2.0"'),
        ({"report_errors": "boom"}, '`report_errors` (expected a list, got a string): "boom"'),
    ],
)
def test_render_markdown_lists_parts_of_the_wrong_type_and_renders_the_rest(overrides, unexpected):
    text = render_markdown({**_full_report(), **overrides})
    assert "## Parts of this report with an unexpected shape" in text
    assert unexpected in text
    assert "## Allocator snapshot" in text and "## Environment" in text  # untouched sections still render


def test_render_markdown_odd_values_inside_sections():
    report = _full_report()
    report["memory"] = {"allocated_bytes": "lots", "reserved_bytes": float("nan"), "summary": 5}
    report["holders"]["top_tensors"] = [{"name": "w", "shape": 7, "bytes": None}]
    report["batch"]["tensors"] = [{"path": "x"}]
    report["suggestions"] = [{"rank": 1, "action": "A", "why": "B", "saves_bytes": "many"}]
    text = render_markdown(report)
    assert "| allocated_bytes | lots |" in text and "| 1 | w | 7 |" in text and "1. **A**. B" in text
    assert "`memory.summary` (expected a string, got a number): 5" in text
    assert render_markdown([1, 2]).startswith("# Out-of-memory report\n\nNot a report: expected an object")


def test_load_report_refuses_what_is_not_a_regular_file(tmp_path):
    import os

    if not hasattr(os, "mkfifo"):
        pytest.skip("needs named pipes")
    from tests.helpers.pipes import PipeWatchdog

    fifo = tmp_path / "oom_report_rank0.json"
    os.mkfifo(fifo)
    watchdog = PipeWatchdog(fifo)
    try:
        with pytest.raises(ValueError, match="not a regular file"):
            load_report(fifo)
    finally:
        watchdog.stop()
    assert not watchdog.fired, "the named pipe was opened"


def test_parameters_and_gradients_dominate_sharding_saves_all_but_one_share():
    cats = {"parameters": 3 * GiB, "gradients": 3 * GiB, "optimizer_states": 0, "buffers": 0}
    common = dict(
        stage="train",
        allocated_bytes=8 * GiB,
        reserved_bytes=8 * GiB,
        bytes_by_category=cats,
        unexplained_bytes=2 * GiB,
        micro_batch_size=8,
    )
    sharded = {t["action"]: t for t in suggest_fixes(**common, world_size=4)}
    fsdp = next(t for a, t in sharded.items() if a.startswith("Shard parameters and gradients"))
    assert fsdp["saves_bytes"] == 6 * GiB * 3 // 4  # each of 4 processes keeps a quarter
    two = next(t for t in suggest_fixes(**common, world_size=2) if t["action"].startswith("Shard parameters"))
    assert two["saves_bytes"] == 3 * GiB
    alone = [t for t in suggest_fixes(**common) if "parameters" in t["action"].lower()]
    assert [t["saves_bytes"] for t in alone if t["action"].startswith("Train fewer parameters")] == [None]


def test_under_auto_micro_batch_the_tip_lowers_its_smallest_micro_batch_and_keeps_the_real_effective_batch():
    # AutoMicroBatch gave up at micro-batches of 2 of a batch of 16 (no accumulation): effective 16, not 2
    common = {
        "stage": "train",
        "allocated_bytes": 10_000,
        "reserved_bytes": 10_500,
        "bytes_by_category": {"parameters": 500, "gradients": 500, "optimizer_states": 1000, "buffers": 0},
        "unexplained_bytes": 8000,
        "micro_batch_size": 2,
        "accumulate_grad_batches": 1,
        "precision": "bf16-mixed",
        "activation_checkpointing": True,
    }
    split = [t["action"] for t in suggest_fixes(**common, effective_batch_size=16)]
    tip = next(a for a in split if "micro" in a)
    assert "`min_micro_batch_size` 2 -> 1" in tip and tip.endswith("the effective batch stays 16")
    assert not any("double `accumulate_grad_batches`" in a for a in split)
    plain = [t["action"] for t in suggest_fixes(**common, effective_batch_size=2)]
    assert any(a.startswith("Halve the micro-batch and double `accumulate_grad_batches`") for a in plain)


def test_a_raw_value_in_the_markdown_is_cut_to_exactly_200_characters_with_its_marker():
    from lightning_memopt.functional.oom.markdown import _raw

    assert _raw("x" * 198) == json.dumps("x" * 198)  # 200 characters with its quotes: whole
    cut = _raw("x" * 199)
    assert len(cut) == 200 and cut.endswith("...") and cut.startswith('"xxx')
