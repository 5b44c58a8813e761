"""benchmarks/planner.py --quick: every path runs, and the fake-tensor prediction equals the real step's peak."""

import json
import logging
import runpy
import sys
import warnings

import pytest

from tests.helpers.subprocess_run import REPO_ROOT, run_script


@pytest.mark.slow
def test_benchmark_quick_mode_runs(tmp_path):
    out = tmp_path / "planner.json"
    script = REPO_ROOT / "benchmarks" / "planner.py"
    # run_script: a session of its own, so a time-out also ends the benchmark's own worker process
    proc = run_script(
        f"""
        import runpy, sys
        sys.argv = ["planner.py", "--quick", "--out", {str(out)!r}]
        runpy.run_path({str(script)!r}, run_name="__main__")
        """,
        tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "planner" and report["quick"] is True

    cases = report["cases"]
    assert {"dreams", "clip", "encoder"} <= {c["model"] for c in cases}
    assert {(c["precision"], c["checkpointing"]) for c in cases} == {("32-true", False), ("bf16-mixed", True)}
    for case in cases:
        assert case["predicted_bytes"] > 0 and case["measured_bytes"] > 0
        assert case["ratio"] == pytest.approx(1.0, rel=0.01), case
    assert report["checks"]["accuracy"]["pass"] is True
    if not report["transformers"]["available"]:
        assert "skipped" in report["transformers"] and "t5" not in report["models"]

    # the zoo table (--quick: T5 and the manual-optimization entry), the estimate within 2 % of the measured CPU peak
    from tests.helpers.zoo import ZOO

    zoo = {row["model"]: row for row in report["zoo"]}
    assert set(zoo) == {"t5", "manual"} and set(zoo) <= set(ZOO)  # --quick: two; every entry in tests/zoo/
    for name, row in zoo.items():
        assert "error" not in row, row
        if "skipped" in row:  # manual optimization until the planner runs it; transformers missing
            assert name == "manual" or not report["transformers"]["available"], row
            continue
        assert row["ratio"] == pytest.approx(1.0, abs=0.02), row
        assert row["cuda_estimated_bytes"] > row["estimated_bytes"]
    if report["transformers"]["available"]:
        assert "memory-efficient" in zoo["t5"]["cuda_attention"]
    assert report["checks"]["zoo"]["pass"] is True and "PASS  zoo" in proc.stdout

    # the RSS cross-check ran in a fresh process (too small in --quick to be judged)
    (rss,) = report["rss"]
    assert rss["growth"] > 0 and rss["peak_reset"] in (True, False)
    assert report["checks"]["rss"]["pass"] is None

    # the large-model path ran for both targets
    (scale,) = report["scale"]
    assert set(scale["estimates"]) == {"cuda", "cpu"}
    assert scale["estimates"]["cuda"]["peak_bytes"] > 0 and report["checks"]["scale_seconds"]["pass"] is True
    assert "large-model estimate" in proc.stdout and "PASS  accuracy" in proc.stdout

    # the sharded cases: one 2-rank gloo run, each option predicted to the byte; torch's tracker beside it
    sharded = {(r["reshard_after_forward"], r["foreach"]): r for r in report["sharded"]}
    assert set(sharded) == {(True, False), (False, False), (True, True)}
    for row in sharded.values():
        assert row["world_size"] == 2 and len(row["measured_per_rank"]) == 2, row
        assert row["predicted_bytes"] == row["measured_bytes"] and row["ratio"] == 1.0, row
        assert row["estimate_seconds"] > 0 and row["tracker_bytes"] > 0
    assert sharded[(False, False)]["predicted_bytes"] > sharded[(True, False)]["predicted_bytes"]
    assert sharded[(True, False)]["tracker_bytes"] == sharded[(True, False)]["predicted_bytes"]
    assert report["checks"]["sharded"]["pass"] is True and "PASS  sharded" in proc.stdout


@pytest.mark.slow
def test_sharded_table_on_tiny_configs(tmp_path, monkeypatch):
    """benchmarks/sharded_table.py --tiny: the Markdown table (model x GPUs, fits on 24/40/80 GB) and its JSON."""
    out = tmp_path / "table.md"
    script = REPO_ROOT / "benchmarks" / "sharded_table.py"
    argv = ["sharded_table.py", "--tiny", "--models", "decoder", "--out", str(out)]
    # in this process (seconds of imports saved); the script puts benchmarks/ on sys.path and silences warnings
    with monkeypatch.context() as patched:
        patched.setattr(sys, "argv", argv)
        patched.setattr(sys, "path", list(sys.path))
        patched.setattr(logging.getLogger("transformers"), "level", logging.getLogger("transformers").level)
        with warnings.catch_warnings(), pytest.raises(SystemExit) as ended:
            runpy.run_path(str(script), run_name="__main__")
    assert ended.value.code == 0
    lines = out.read_text().splitlines()
    head = "| model | GPUs | per-rank peak, AdamW | fits 24 GB | fits 40 GB | fits 80 GB | estimate s |"
    assert lines[0].startswith(head)
    assert [line.split(" | ")[1] for line in lines[2:4]] == ["1", "2"]
    assert all(line.count("| yes ") == 3 for line in lines[2:4]), lines  # a tiny model fits every card
    assert "Made by `python benchmarks/sharded_table.py --tiny" in out.read_text()

    report = json.loads(out.with_suffix(".json").read_text())
    one, two = report["rows"]
    for name in ("AdamW",):
        assert one[name]["sharding"].startswith("none") and two[name]["sharding"].startswith("FSDP2 over 2 ranks")
        # the shards of 2 ranks hold half the parameters (FSDP2 pads uneven shards: a few bytes more)
        assert 0 <= 2 * two[name]["parameter_bytes"] - one[name]["parameter_bytes"] < one[name]["parameter_bytes"] / 100
        assert one[name]["call_seconds"] > 0 and set(one[name]["fits"]) == {"24 GB", "40 GB", "80 GB"}
    # the planner's usable-memory rule: the card less the CUDA context, less plan_memory's 10 % margin
    assert report["usable_bytes"]["40 GB"] == int((int(39.4 * 1024**3) - 512 * 1024**2) * 0.9)
