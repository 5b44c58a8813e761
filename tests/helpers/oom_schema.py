"""Checks a report dict against the TypedDicts of ``lightning_memopt.functional.oom.schema``."""

from __future__ import annotations

import typing

from lightning_memopt.functional.oom import schema


def _keys(typed_dict) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def check_against_schema(report) -> None:
    """Every key of ``report`` (and of its typed parts) is in the TypedDicts; every required key is there."""
    assert schema.OOMReport.__required_keys__ >= {"format", "when", "report_errors"}  # Required is seen at runtime
    assert set(report) <= _keys(schema.OOMReport) and schema.OOMReport.__required_keys__ <= set(report)
    for key, typed in (
        ("when", schema.WhenSection),
        ("error", schema.ErrorSection),
        ("batch", schema.BatchSection),
        ("memory", schema.MemorySection),
        ("holders", schema.HoldersSection),
        ("config", schema.ConfigSection),
        ("snapshot", schema.SnapshotSection),
    ):
        assert set(report[key]) <= _keys(typed), (key, set(report[key]) - _keys(typed))
        if report[key]:
            assert typed.__required_keys__ <= set(report[key]), key
    for tensor in report["batch"].get("tensors", []):
        assert set(tensor) == _keys(schema.BatchTensor)
    for row in report["holders"].get("rows", []):
        assert set(row) == _keys(schema.FootprintRowDict)
    for tensor in report["holders"].get("top_tensors", []):
        assert set(tensor) == _keys(schema.LiveTensorDict)
    if "activation_checkpointing" in report["config"]:
        state = set(report["config"]["activation_checkpointing"])
        assert schema.CheckpointingState.__required_keys__ <= state <= _keys(schema.CheckpointingState)
    if "sharding" in report:
        sharding = set(report["sharding"])
        assert schema.ShardingSection.__required_keys__ <= sharding <= _keys(schema.ShardingSection), sharding
    for tip in report.get("suggestions", []):
        assert set(tip) == _keys(schema.Suggestion)
