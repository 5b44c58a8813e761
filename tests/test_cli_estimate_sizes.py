"""``lightning-memopt estimate`` holds shapes, never data: batches and models of any size are built on the meta device,
absurd sizes are one line, and a plan over an effective batch of 10**12 takes seconds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memopt.cli import main
from lightning_memopt.planner import estimate_memory, plan_memory
from tests.helpers.subprocess_run import REPO_ROOT, run_script

ERROR = "lightning-memopt estimate: error: "
HERE = "tests.test_cli_estimate_sizes"
TINY = "tests.test_cli_estimate.Tiny"
HUGE_WIDTH = 65536  # nn.Linear(65536, 65536): 2**32 float32 weights, 16 GiB


class TokenModule(pl.LightningModule):
    """Token ids ``[B, L]`` (int64) through a small embedding: the batch is the large part."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 4)

    def training_step(self, batch, batch_idx):
        return self.embed(batch).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HugeLayerModule(pl.LightningModule):
    """One ``nn.Linear(width, width)``: 16 GiB of weights at the default width, allocated by ``__init__``."""

    def __init__(self, width: int = HUGE_WIDTH) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width, bias=False)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# One interpreter runs the estimates and reports each one's growth of the peak RSS. The data segment is capped at
# 8 GiB: an estimate that builds the 16 GiB layer fails there at once instead of taking the machine's memory.
_RSS_SCRIPT = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (8 * 2**30, 8 * 2**30))
from lightning_memopt.cli import main


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


runs = json.loads(sys.argv[1])
main(["estimate", *runs.pop("warm-up")])  # the imports and first-call costs, before measuring
results = {}
for name, argv in runs.items():
    before = peak_rss()
    code = main(["estimate", *argv])
    results[name] = {"code": code, "growth": peak_rss() - before}
print("RESULTS " + json.dumps(results))
"""

_RUNS = {
    "warm-up": ["--model", f"{HERE}.TokenModule", "--batch-shape", "B,16:int64", "--batch-size", "2"],
    # 48000 x 4096 int64: 1.46 GiB of token ids
    "batch": ["--model", f"{HERE}.TokenModule", "--batch-shape", "B,4096:int64", "--batch-size", "48000"],
    "model": ["--model", f"{HERE}.HugeLayerModule", "--batch-shape", f"B,{HUGE_WIDTH}", "--batch-size", "2"],
    # real data from a datamodule: 10**12 samples of 128 bytes would not fit any host
    "data": ["--model", f"{TINY}Module", "--data", f"{TINY}DataModule", "--batch-size", str(10**12), "--device", "cpu"],
}


@pytest.fixture(scope="module")
def rss_runs(tmp_path_factory):
    proc = run_script(_RSS_SCRIPT, tmp_path_factory.mktemp("rss"), timeout=300, args=(json.dumps(_RUNS),))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS ") :]), proc


@pytest.mark.slow
def test_a_1_5_gib_batch_from_shapes_is_estimated_without_allocating_it(rss_runs):
    results, proc = rss_runs
    batch_bytes = 48000 * 4096 * 8
    assert results["batch"]["code"] == 0, proc.stderr[-3000:]
    assert "batch 1.46 GiB" in " ".join(proc.stdout.split())  # the estimate counts the batch it never held
    assert results["batch"]["growth"] < 200 * 2**20 < batch_bytes / 7, results


@pytest.mark.slow
def test_a_model_whose_init_builds_a_16_gib_layer_is_estimated_without_building_it(rss_runs):
    results, proc = rss_runs
    assert results["model"]["code"] == 0, proc.stderr[-3000:]
    assert "parameters 16.00 GiB (16.00 GiB trainable)" in proc.stdout
    assert results["model"]["growth"] < 200 * 2**20, results


@pytest.mark.slow
def test_a_batch_of_real_data_larger_than_the_host_is_one_line_before_reading_it(rss_runs):
    results, proc = rss_runs
    assert results["data"]["code"] == 2 and results["data"]["growth"] < 200 * 2**20, results
    words = "--data: 1000000000000 samples of TinyDataModule's training set would take 119209.29 GiB of host memory"
    assert words in proc.stderr and "more than this machine has" in proc.stderr


def test_the_model_built_on_meta_is_estimated_to_the_byte_like_the_real_one(capsys, monkeypatch):
    """The command builds the model on the meta device; the table equals :func:`estimate_memory` on a real model."""
    built: list[str] = []
    init = HugeLayerModule.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self.layer.weight.device.type)

    monkeypatch.setattr(HugeLayerModule, "__init__", recording_init)
    argv = ["--model", f"{HERE}.HugeLayerModule", "--model.width", "64", "--batch-shape", "B,64", "--batch-size", "3"]
    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert built == ["meta"]
    assert estimate_memory(HugeLayerModule(64), torch.randn(3, 64)).table() in out


def test_an_init_that_needs_data_is_built_on_the_cpu_with_a_note(capsys):
    code = main(["estimate", "--model", f"{HERE}.NeedsData", "--batch-shape", "B,8", "--batch-size", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    err = " ".join(err.split())  # a note wraps at 100 columns
    assert "failed: RuntimeError" in err and "built on the CPU instead, which allocates its weights" in err
    assert estimate_memory(NeedsData(), torch.randn(2, 8)).table() in out


class NeedsData(HugeLayerModule):
    """An ``__init__`` that reads a value (``.item()``): impossible on the meta device."""

    def __init__(self) -> None:
        super().__init__(8)
        self.scale = float(torch.ones(1).sum().item())


@pytest.mark.parametrize(
    ("shape", "size", "words"),
    [
        ("B,4096:int64", "1000000000", "is 30517.58 GiB by itself, more than the largest GPU known holds (H200"),
        ("B,4096,4096,4096:int64", "1000000000", "is 5.5e+20 bytes, more than any tensor can hold (2**63 - 1)"),
        ("B,4096:int64", str(2**63), "--batch-size: must be at most 2**63 - 1"),
    ],
    ids=["petabytes-of-activations", "overflows-int64", "batch-over-int64"],
)
def test_an_absurd_size_is_one_line_and_a_non_zero_exit(capsys, shape, size, words):
    started = time.perf_counter()
    code = main(["estimate", "--model", f"{HERE}.TokenModule", "--batch-shape", shape, "--batch-size", size])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(ERROR) and "Traceback" not in err, err
    assert words in err
    assert time.perf_counter() - started < 30


def test_estimate_memory_takes_a_meta_model_and_a_meta_batch_to_the_byte():
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    for device in ("cpu", "cuda"):
        expected = estimate_memory(real, torch.randn(16, 32), device=device)
        got = estimate_memory(meta, torch.empty(16, 32, device="meta"), device=device)
        assert (got.peak_bytes, got.at_peak, got.batch_bytes) == (
            expected.peak_bytes,
            expected.at_peak,
            expected.batch_bytes,
        )
    with pytest.raises(ValueError, match="the batch is on the meta device"):
        estimate_memory(real, torch.empty(16, 32, device="meta"), device="cpu", fake=False)


def test_plan_memory_on_meta_batches_equals_the_plan_on_real_ones():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    kwargs = {"effective_batch_size": 48, "budget": "400KB", "device": "cpu", "gradient_checkpointing": False}
    real = plan_memory(model, lambda b: torch.randn(b, 8, 64), **kwargs)
    meta = plan_memory(model, lambda b: torch.empty(b, 8, 64, device="meta"), **kwargs)
    assert real.feasible and 1 < real.micro_batch_size < 48
    assert [(t.micro_batch_size, t.needed_bytes) for t in meta.trials] == [
        (t.micro_batch_size, t.needed_bytes) for t in real.trials
    ]


@pytest.mark.slow
def test_a_plan_over_an_effective_batch_of_10_12_takes_seconds_with_a_line_per_estimate():
    argv = ["--model", "tests.test_cli_estimate.TinyModule", "--batch-shape", "B,16", "--batch-shape", "B,16"]
    argv += ["--effective-batch-size", str(10**12), "--gpu", "A100-80GB"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_memopt.cli", "estimate", *argv],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: the imports take most of it; listing 1..10**12 took hours
        cwd=REPO_ROOT,
        env=env,
    )
    seconds = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert seconds < 300  # far from the normal run (seconds), far below hours
    assert "Plan: micro-batch " in proc.stdout and "= 1000000000000, bf16-mixed" in proc.stdout
    assert (
        "per-device batch 1000000000000: 169 micro-batches to choose from (1, 2, 4, 5, ..., 1000000000000)"
        in proc.stderr
    )
    progress = [
        line for line in proc.stderr.splitlines() if re.match(r"lightning-memopt estimate: micro-batch +\d+, ", line)
    ]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"^ *\d+ +\d+ +bf16-mixed ", line)]
    assert len(progress) == len(rows) >= 3  # the whole batch, micro-batch 1, then the binary search
    assert len(progress) <= 2 + 8  # largest, smallest and a binary search over 169 divisors
    searched = re.search(r"estimate: (\d+) estimates in ([\d.]+) s", proc.stderr)
    assert searched and int(searched[1]) == len(rows) and float(searched[2]) < 30  # the search itself, imports aside


def test_plan_memory_refuses_an_effective_batch_over_int64_by_name():
    words = r"`effective_batch_size` must be at most 2\*\*63 - 1 .* got 9223372036854775808"
    with pytest.raises(ValueError, match=words):
        plan_memory(nn.Linear(4, 4), lambda b: torch.empty(b, 4, device="meta"), effective_batch_size=2**63)


def test_plan_memory_without_progress_logs_a_line_per_estimate(caplog):
    model = nn.Linear(64, 64)
    with caplog.at_level("INFO", logger="lightning_memopt.planner.plan"):
        plan = plan_memory(model, lambda b: torch.randn(b, 64), effective_batch_size=12, budget="1GB", device="cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_memopt.planner.plan"]
    assert lines[0] == (
        "per-device batch 12: 6 micro-batches to choose from (1, 2, 3, 4, 6, 12); at most 5 estimates per"
        " checkpointing setting"
    )
    assert len(lines) == 1 + len(plan.trials) and all(line.startswith("micro-batch ") for line in lines[1:])
