"""Every memory callback under FSDP2: Lightning's ``ModelParallelStrategy`` with ``fully_shard`` in
``configure_model``, two CPU processes over gloo (``tests/scripts/fsdp2_callbacks.py``).

One run checks them all: the fit runs with MemoryMonitor (cross-rank exchange included), CacheCleaner,
GarbageCollector, MemoryAudit, GradientCheckpointing and OOMReporter, then rank 1 alone runs out of memory inside an
FSDP unit's forward. FSDP1 (``FSDPStrategy``) and NCCL need a GPU and are not run here.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers.subprocess_run import SCRIPTS, run_file

#: The script's model: 4 blocks of Linear(32, 128) + Linear(128, 32), a Linear(32, 2) head; float32.
WHOLE_PARAMETER_BYTES = 4 * (4 * (32 * 128 + 128 + 128 * 32 + 32) + 32 * 2 + 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fsdp2")
    start = time.monotonic()
    result = run_file(SCRIPTS / "fsdp2_callbacks.py", directory, timeout=420)
    return directory, result, time.monotonic() - start


def _read(directory, name):
    return json.loads((directory / name).read_text())


@pytest.mark.slow
def test_the_sharded_fit_runs_every_callback_and_ends_on_the_oom(run):
    directory, result, elapsed = run
    output = result.stdout[-2000:] + result.stderr[-4000:]
    assert elapsed < 300, f"the run took {elapsed:.0f} s\n{output}"
    assert result.returncode != 0, output  # rank 1's out-of-memory error ends the run
    caught = _read(directory, "caught_rank1.json")
    assert caught == {"type": "OutOfMemoryError", "is_oom": True, "gc_enabled": True}, output  # gc given back
    assert "training goes on" not in result.stderr, output  # no callback failed and warned
    for rank in (0, 1):
        seen = _read(directory, f"seen_rank{rank}.json")
        assert seen["strategy"] == "ModelParallelStrategy" and seen["world_size"] == 2
        assert seen["all_dtensor"], "fully_shard did not run"
        assert seen["gc_enabled"] is False  # GarbageCollector took over collection during the fit
        records = [json.loads(line) for line in (directory / "memopt" / f"memory_rank{rank}.jsonl").open()]
        assert {r["rank"] for r in records} == {rank}
        assert sum(r["event"] == "step" for r in records) >= 2 and sum(r["event"] == "audit" for r in records) == 2
        assert {"train", "validate"} <= {r["phase"] for r in records}  # the validation after step 2 was monitored
    logged = _read(directory, "seen_rank0.json")["logged_keys"]
    assert {"memory/train/host_rss_bytes_max", "memory/audit/parameters_bytes"} <= set(logged)  # the all_gather ran


@pytest.mark.slow
def test_gradient_checkpointing_wraps_the_blocks_before_fully_shard_and_recomputes(run):
    directory, _result, _ = run
    for rank in (0, 1):
        seen = _read(directory, f"seen_rank{rank}.json")
        # blocks built in __init__ are wrapped at setup, before fully_shard; those configure_model builds, after it
        assert seen["wrapped_at_shard"] == [True, True, False, False]
        assert seen["checkpointed"] == [True] * 4
        assert seen["block_calls"] == [4] * 4  # 2 steps: each block's forward, and again in backward, in both orders


@pytest.mark.slow
def test_memory_audit_gives_shards_with_the_unsharded_total_and_no_false_duplicates(run):
    directory, _result, _ = run
    for rank in (0, 1):
        audit = _read(directory, f"seen_rank{rank}.json")["last_audit"]
        by_category = audit["footprint"]["bytes_by_category"]
        assert by_category["parameters"] == by_category["gradients"] == WHOLE_PARAMETER_BYTES // 2  # shards
        assert audit["duplicates"] is None
        log = (directory / f"log_rank{rank}.txt").read_text()
        assert "footprint of this rank" in log and "model sharded (fsdp2, 5 units, over 2 ranks)" in log
        assert f"({WHOLE_PARAMETER_BYTES // 2} bytes) of" in log and f"unsharded ({WHOLE_PARAMETER_BYTES} bytes)" in log
        assert "duplicate" not in log.lower()


@pytest.mark.slow
def test_the_oom_report_says_how_the_model_is_sharded(run):
    directory, _result, _ = run
    memopt = directory / "memopt"
    assert sorted(p.name for p in memopt.glob("oom_report_rank*") if "-" not in p.name) == [
        "oom_report_rank1.json",
        "oom_report_rank1.md",
    ]
    report = _read(memopt, "oom_report_rank1.json")
    assert report["when"]["rank"] == 1 and report["error"]["type"] == "torch.OutOfMemoryError"
    sharding = report["sharding"]
    assert sharding["strategy"] == "ModelParallelStrategy" and sharding["kind"] == "fsdp2"
    assert sharding["data_parallel_size"] == 2 and sharding["num_units"] == 5
    assert sharding["unit_names"] == ["model", "model.0", "model.1", "model.2", "model.3"]
    assert sharding["num_parameters"] == sharding["num_dtensor_parameters"] == 18
    assert sharding["reshard_after_forward"] is True and sharding["cpu_offload"] is False
    assert sharding["local_parameter_bytes"] == WHOLE_PARAMETER_BYTES // 2
    assert sharding["unsharded_parameter_bytes"] == WHOLE_PARAMETER_BYTES
    actions = " ".join(tip["action"] for tip in report["suggestions"])
    assert "sharded over 2 ranks already" in actions and "strategy='fsdp'" not in actions
    assert report["config"]["activation_checkpointing"]["num_wrapped"] == 4
    markdown = (memopt / "oom_report_rank1.md").read_text()
    assert "## Sharding" in markdown and "over 2 ranks" in markdown
