"""``lightning-memopt estimate``: breakdown table and plan from the command line, exit codes, one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import ClassVar

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import MemoryPreset
from lightning_memopt.cli import main
from lightning_memopt.planner import ESTIMATE_PRECISIONS, estimate_memory, plan_memory
from lightning_memopt.utilities.formatting import format_bytes
from tests.helpers.subprocess_run import REPO_ROOT

ERROR = "lightning-memopt estimate: error: "
TINY = "tests.test_cli_estimate.TinyModule"
TINY_DATA = "tests.test_cli_estimate.TinyDataModule"


class TinyModule(pl.LightningModule):
    """An MLP regressor: ``batch = (x, y)``, both ``[B, width]``."""

    def __init__(self, width: int = 16, depth: int = 2, lr: float = 1e-3) -> None:
        super().__init__()
        if not isinstance(lr, float):  # LightningCLI gives floats for "1e-3"; so must the estimate command
            raise TypeError(f"lr must be a float, got {lr!r}")
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TinyDataModule(pl.LightningDataModule):
    """``num_samples`` random ``(x, y)`` pairs; counts its hooks so the test sees that they ran."""

    calls: ClassVar[list[str]] = []

    def __init__(self, width: int = 16, num_samples: int = 40, batch_size: int = 8) -> None:
        super().__init__()
        self.width, self.num_samples, self.batch_size = width, num_samples, batch_size

    def prepare_data(self):
        TinyDataModule.calls.append("prepare_data")

    def setup(self, stage):
        TinyDataModule.calls.append(f"setup:{stage}")
        g = torch.Generator().manual_seed(0)
        self.train_set = TensorDataset(
            torch.randn(self.num_samples, self.width, generator=g),
            torch.randn(self.num_samples, self.width, generator=g),
        )

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class TinyWithOwnLoader(TinyModule):
    """LightningCLI without a datamodule: the module's own ``train_dataloader``."""

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(6, 16), torch.zeros(6, 16)), batch_size=3)


def _tiny_batch_fn(width=16):
    return lambda b: (torch.empty(b, width), torch.empty(b, width))


def _run(capsys, *argv):
    code = main(["estimate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _progress_lines(err):
    return [line for line in err.splitlines() if re.match(r"lightning-memopt estimate: micro-batch +\d+, ", line)]


# ------------------------------------------------------------------------------------------------ estimates


def test_shape_spec_estimate_prints_the_same_breakdown_as_estimate_memory(capsys):
    code, out, err = _run(
        capsys,
        "--model",
        TINY,
        "--model.width",
        "32",
        "--batch-shape",
        "B,32",
        "--batch-shape",
        "B,32:float32",
        "--batch-size",
        "8",
        "--device",
        "cpu",
    )
    assert code == 0, err
    expected = estimate_memory(TinyModule(width=32), (torch.empty(8, 32), torch.empty(8, 32)), device="cpu")
    assert expected.table() in out
    assert f"on cpu at 32-true: {format_bytes(expected.peak_bytes)} (fake tensors, " in out
    lines = out.splitlines()
    assert lines[0] == f"Model: {TINY} (2,112 parameters, 2,112 trainable)"  # 2 x (32 x 32 + 32)
    assert lines[1] == "Batch 8: --batch-shape B,32 B,32:float32: [0] float32[8, 32], [1] float32[8, 32]"
    assert "Budget" not in out and _progress_lines(err) == []


def test_named_shape_specs_make_a_dict_of_meta_tensors():
    from lightning_memopt.cli_estimate import EstimateInputError, parse_batch_shape

    batch = parse_batch_shape(["ids=B,7:int64", "mask = B,7:bool", "x=B,3,2"])(5)
    assert list(batch) == ["ids", "mask", "x"]
    assert all(t.device.type == "meta" for t in batch.values())  # shapes and dtypes, no data
    assert batch["ids"].shape == (5, 7) and batch["ids"].dtype == torch.int64
    assert batch["mask"].dtype == torch.bool and batch["x"].shape == (5, 3, 2) and batch["x"].dtype == torch.float32
    assert isinstance(parse_batch_shape(["B,4"])(2), torch.Tensor)
    for specs, words in (
        (["a=B,3", "B,3"], "name all tensors"),
        (["3,4"], "no tensor has the micro-batch"),
        (["B,x"], "dimension 'x'"),
        (["B:float33"], "'float33' is not a torch dtype"),
        (["a=B", "a=B,2"], "a name given twice"),
        (["B,-2"], "dimension '-2'"),
    ):
        with pytest.raises(EstimateInputError, match=re.escape(words)):
            parse_batch_shape(specs)


def test_datamodule_from_a_config_with_overrides_and_the_trainer_precision(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(
        "seed_everything: 0\n"
        "memory: {preset: auto}\n"  # a LightningCLI subclass's own section: ignored
        "trainer:\n  precision: bf16-mixed\n  max_epochs: 3\n"
        f"model:\n  class_path: {TINY}\n  init_args: {{width: 24, lr: 1e-3}}\n"
        f"data:\n  class_path: {TINY_DATA}\n  init_args: {{width: 24, batch_size: 8}}\n"
    )
    TinyDataModule.calls.clear()
    code, out, err = _run(
        capsys,
        "--config",
        str(config),
        "--model.init_args.depth",
        "3",
        "--data.batch_size=4",
        "--memory.preset",
        "none",
        "--device",
        "cpu",
    )
    assert code == 0, err
    assert TinyDataModule.calls == ["prepare_data", "setup:fit"]
    lines = out.splitlines()
    assert lines[0] == f"Model: {TINY} (1,800 parameters, 1,800 trainable)"  # depth 3: 3 x (24 x 24 + 24)
    assert lines[1].startswith("Batch 4: the first samples of TinyDataModule.train_dataloader()'s dataset, in")
    assert all(len(line) <= 100 for line in lines) and lines[2].startswith("  ")  # the batch line wraps under itself
    assert " ".join(" ".join(lines[1:3]).split()).endswith(": [0] float32[4, 24], [1] float32[4, 24]")
    assert "on cpu at bf16-mixed:" in lines[3]
    expected = estimate_memory(
        TinyModule(width=24, depth=3), (torch.empty(4, 24), torch.empty(4, 24)), precision="bf16-mixed", device="cpu"
    )
    assert expected.table() in out
    # --precision wins over the config's trainer.precision
    code, out, _ = _run(capsys, "--config", str(config), "--precision", "32", "--device", "cpu")
    assert code == 0 and "on cpu at 32-true:" in out


def test_an_optimizer_section_replaces_configure_optimizers(capsys):
    args = ["--model", TINY, "--batch-shape", "B,16", "--batch-shape", "B,16", "--batch-size", "2", "--device", "cpu"]
    code, out, err = _run(capsys, *args, "--optimizer", "SGD", "--optimizer.lr", "0.1")
    assert code == 0, err
    # 2 x (16 x 16 + 16) float32 parameters = 2.12 KiB; plain SGD keeps no state
    assert "totals: parameters 2.12 KiB (2.12 KiB trainable), gradients 2.12 KiB, optimizer states 0 B," in out
    code, out, err = _run(capsys, *args, "--optimizer", "torch.optim.SGD", "--optimizer.init_args.momentum", "0.9")
    assert code == 0, err
    assert "optimizer states 2.12 KiB," in out  # one momentum buffer per parameter


def test_a_module_with_its_own_train_dataloader_needs_no_datamodule(capsys):
    code, out, err = _run(capsys, "--model", "tests.test_cli_estimate.TinyWithOwnLoader", "--device", "cpu")
    assert code == 0, err
    assert "Batch 3: the first samples of TinyWithOwnLoader.train_dataloader()'s dataset" in out


# ------------------------------------------------------------------------------------------------ plans


def test_a_plan_from_shape_specs_matches_plan_memory_and_reports_progress_on_stderr(capsys):
    code, out, err = _run(
        capsys,
        "--model",
        TINY,
        "--model.width",
        "64",
        "--batch-shape",
        "B,64",
        "--batch-shape",
        "B,64",
        "--device-memory",
        "200KB",
        "--effective-batch-size",
        "64",
        "--device",
        "cpu",
    )
    plan = plan_memory(TinyModule(width=64), _tiny_batch_fn(64), effective_batch_size=64, budget="200KB", device="cpu")
    assert code == 0, err
    assert plan.feasible and 1 < plan.micro_batch_size < 64  # the search had something to do
    assert str(plan) in out
    assert plan.estimate.table() in out
    assert f"Batch {plan.micro_batch_size} (the micro-batch): " in out
    assert f"Plan: micro-batch {plan.micro_batch_size} x accumulate {plan.accumulate_grad_batches} = 64," in out
    progress = _progress_lines(err)
    assert len(progress) == len(plan.trials) >= 3
    for line, trial in zip(progress, plan.trials):
        assert f"micro-batch {trial.micro_batch_size:>5}, 32-true" in line
        assert line.rstrip().split("(")[0].strip().endswith("fits" if trial.fits else "too much")
    assert "lightning-memopt estimate: planning TinyModule for 200KB, effective batch 64" in err


def test_a_budget_too_small_exits_1_with_the_advice(capsys):
    code, out, err = _run(
        capsys,
        "--model",
        TINY,
        "--model.width",
        "64",
        "--batch-shape",
        "B,64",
        "--batch-shape",
        "B,64",
        "--device-memory",
        "60KB",
        "--effective-batch-size",
        "8",
        "--device",
        "cpu",
        "--checkpointing",
        "off",
    )
    plan = plan_memory(
        TinyModule(width=64),
        _tiny_batch_fn(64),
        effective_batch_size=8,
        budget="60KB",
        device="cpu",
        gradient_checkpointing=False,
    )
    assert not plan.feasible and "Needs sharding" in plan.advice
    assert code == 1, err
    assert f"Nothing fits: {plan.advice}" in " ".join(out.split())  # wrapped at 100 columns
    assert "The smallest setting tried (micro-batch 1, activation checkpointing off) does not fit" in out
    assert plan.estimate.table() in out
    assert len(_progress_lines(err)) == len(plan.trials) == 2  # the whole batch, then micro-batch 1


def test_a_budget_without_an_effective_batch_plans_the_datamodule_s_batch(capsys):
    code, out, err = _run(
        capsys,
        "--model",
        TINY,
        "--data",
        TINY_DATA,
        "--data.num_samples",
        "10",
        "--data.batch_size",
        "32",
        "--device-memory",
        "1GB",
        "--devices",
        "2",
        "--device",
        "cpu",
    )
    assert code == 0, err
    assert "Effective batch: 64 (batch size 32 x 2 devices; --effective-batch-size sets it)" in out
    # 10 samples, cycled to fill the micro-batch of 32
    assert "Batch 32 (the micro-batch): " in out and "[0] float32[32, 16]" in out
    assert "Plan: DDP, micro-batch 32 x accumulate 1 x 2 ranks = 64, 32-true" in out


# ------------------------------------------------------------------------------------------------ DreaMS example


@pytest.mark.slow
@pytest.mark.parametrize("budget", [["--gpu", "A100-40GB"], ["--device-memory", "600MB"]], ids=["a100", "600MB"])
def test_the_dreams_example_from_its_lightningcli_config(tmp_path, capsys, monkeypatch, budget):
    pytest.importorskip("h5py")
    from examples.dreams.module import SpectraDataModule, SpectraFineTuner

    monkeypatch.chdir(REPO_ROOT)
    data = tmp_path / "spectra.hdf5"
    code, out, err = _run(
        capsys,
        "--config",
        "examples/dreams/config.yaml",
        "--model",
        "examples.dreams.module.SpectraFineTuner",
        "--data",
        "examples.dreams.module.SpectraDataModule",
        "--data.data_path",
        str(data),
        "--data.num_spectra",
        "300",
        *budget,
        "--effective-batch-size",
        "64",
    )
    assert data.exists()
    # the same module and datamodule as the config (model_preset tiny, dynamic_padding), planned directly
    module = SpectraFineTuner(model_preset="tiny", lr=0.003, head_lr_scale=10.0)
    datamodule = SpectraDataModule(data_path=str(data), num_spectra=300, batch_size=32, dynamic_padding=True)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()

    def batch_fn(b):
        return next(iter(DataLoader(loader.dataset, batch_size=b, collate_fn=loader.collate_fn, shuffle=False)))

    plan = plan_memory(module, batch_fn, effective_batch_size=64, budget=budget[1])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "Model: examples.dreams.module.SpectraFineTuner (222,484 parameters, 222,484 trainable)"
    assert plan.feasible and str(plan) in out and plan.estimate.table() in out
    verdict = f"Plan: micro-batch {plan.micro_batch_size} x accumulate {plan.accumulate_grad_batches} = 64, bf16-mixed"
    assert verdict in out
    assert "at the peak" in out and "activations (forward, kept for backward)" in out
    assert len(_progress_lines(err)) == len(plan.trials)
    if budget[0] == "--gpu":
        assert plan.micro_batch_size == 64 and "Budget A100-40GB: 39.40 GiB, usable 35.01 GiB" in out
    else:
        assert plan.micro_batch_size < 64  # 54 MiB usable: accumulation needed


# ------------------------------------------------------------------------------------ MemoryPresetCLI's memory:


def _preset_config(tmp_path, memory: str, data_batch: int = 8):
    path = tmp_path / "config.yaml"
    path.write_text(
        f"model:\n  class_path: {TINY}\n"
        f"data:\n  class_path: {TINY_DATA}\n  init_args: {{batch_size: {data_batch}}}\n"
        f"memory: {memory}\n"
    )
    return str(path)


def _pair(b, width=16):
    return (torch.empty(b, width), torch.empty(b, width))


def test_the_memory_section_is_what_the_estimate_models_unless_a_flag_says_otherwise(tmp_path, capsys):
    """The preset's micro-batch (not the datamodule's batch_size, which MemoryPresetCLI overrides), its accumulation
    (24 / 3 = 8: gradients kept across the micro-batches), its precision and its checkpointing; --batch-size,
    --precision and --checkpointing override them."""
    config = _preset_config(
        tmp_path, "{name: balanced, effective_batch_size: 24, micro_batch_size: 3, precision: bf16}"
    )
    code, out, err = _run(capsys, "--config", config, "--device", "cpu")
    assert code == 0, err
    assert out.splitlines()[1].startswith("Batch 3: ")
    expected = estimate_memory(TinyModule(), _pair(3), precision="bf16-mixed", device="cpu", accumulate_grad_batches=8)
    assert f"on cpu at bf16-mixed: {format_bytes(expected.peak_bytes)}" in out and expected.table() in out
    assert "gradient accumulation over 8 micro-batches" in out
    code, out, err = _run(capsys, "--config", config, "--device", "cpu", "--batch-size", "5", "--precision", "32")
    assert code == 0, err
    assert out.splitlines()[1].startswith("Batch 5: ")
    assert estimate_memory(TinyModule(), _pair(5), device="cpu", accumulate_grad_batches=8).table() in out

    auto = _preset_config(
        tmp_path, "{name: balanced, effective_batch_size: 16, auto_micro_batch: true, micro_batch_size: 4}"
    )
    code, out, err = _run(capsys, "--config", auto, "--device", "cpu")
    assert code == 0, err  # AutoMicroBatch starts at 4 of the batch of 16: its micro-batches accumulate into one batch
    assert estimate_memory(TinyModule(), _pair(4), device="cpu", accumulate_grad_batches=4).table() in out
    assert "gradient accumulation over 4 micro-batches" in out

    checkpointed = _preset_config(tmp_path, "{name: max-savings, micro_batch_size: 128, checkpoint_modules: ['net.*']}")
    code, out, err = _run(capsys, "--config", checkpointed, "--device", "cpu")
    assert code == 0, err
    with_blocks = estimate_memory(
        TinyModule(), _pair(128), device="cpu", gradient_checkpointing=True, checkpoint_modules=["net.*"]
    )
    without = estimate_memory(TinyModule(), _pair(128), device="cpu")
    assert with_blocks.table() != without.table()
    assert with_blocks.table() in out
    code, out, err = _run(capsys, "--config", checkpointed, "--device", "cpu", "--checkpointing", "off")
    assert code == 0 and without.table() in out


def test_a_plan_fills_what_the_memory_section_leaves_open_and_prints_the_section_to_paste(tmp_path, capsys):
    config = _preset_config(
        tmp_path, "{name: max-speed, effective_batch_size: 24, monitor: true, gc_every_n_train_steps: null}"
    )
    budget = str(estimate_memory(TinyModule(), _pair(6), device="cpu").peak_bytes)
    argv = ["--config", config, "--device", "cpu", "--device-memory", budget, "--margin", "0"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    plan = plan_memory(TinyModule(), _pair, effective_batch_size=24, budget=budget, margin=0, device="cpu")
    assert plan.feasible and plan.micro_batch_size < 24  # the budget makes the plan choose
    assert "Effective batch: 24 (memory.effective_batch_size" in out and str(plan) in out
    snippet = yaml.safe_load(out.split("to paste into the config:\n", 1)[1])
    assert snippet == {
        "memory": {
            "name": "max-speed",
            "effective_batch_size": 24,
            "micro_batch_size": plan.micro_batch_size,
            "precision": "32-true",
            "gradient_checkpointing": plan.gradient_checkpointing,
            "monitor": True,
        }
    }
    pasted = MemoryPreset(**snippet["memory"])
    assert (pasted.batch_size, pasted.accumulate_grad_batches) == (plan.micro_batch_size, plan.accumulate_grad_batches)
    # a precision written in the section (here from the command line) is kept, not chosen
    code, out, err = _run(capsys, *argv, "--memory.precision", "bf16-mixed")
    assert code == 0, err
    fixed = plan_memory(
        TinyModule(),
        _pair,
        effective_batch_size=24,
        budget=budget,
        margin=0,
        device="cpu",
        precision="bf16-mixed",
    )
    assert str(fixed) in out and "precision: bf16-mixed" in out


def test_a_memory_section_of_another_cli_is_ignored_with_a_note(tmp_path, capsys):
    config = _preset_config(tmp_path, "{snapshot_every: 100}")
    code, out, err = _run(capsys, "--config", config, "--device", "cpu")
    assert code == 0 and out.splitlines()[1].startswith("Batch 8: ")  # the datamodule's batch
    assert "memory: section holds no MemoryPreset field" in err


def test_an_unexpected_error_is_one_line_too(capsys, monkeypatch):
    from lightning_memopt.cli_estimate import run

    def broken(args):
        raise KeyError("a bug\nover two lines")

    monkeypatch.setattr(run, "_run", broken)
    code, out, err = _run(capsys, "--model", TINY, "--batch-shape", "B,16", "--device", "cpu")
    assert code == 2 and out == ""
    assert err == f"{ERROR}the estimate stopped unexpectedly (KeyError: 'a bug\\nover two lines'); please report this\n"


def test_torch_logs_nothing_while_a_shape_fails_on_fake_tensors(capsys):
    """torch logged a 20-line traceback (torch._subclasses.fake_tensor) before the command's one-line error."""
    import logging

    import torch._subclasses.fake_tensor as fake_tensor

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    fake_tensor.log.addHandler(handler)
    try:
        code, _, err = _run(
            capsys, "--model", TINY, "--batch-shape", "B,5", "--batch-shape", "B,16", "--batch-size", "2"
        )
    finally:
        fake_tensor.log.removeHandler(handler)
    assert code == 2 and err.count("\n") == 1 and err.startswith(ERROR) and "[2, 5]" in err
    assert records == []
    # the logger works again afterwards
    fake_tensor.log.addHandler(handler)
    try:
        fake_tensor.log.error("after")
    finally:
        fake_tensor.log.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["after"]


_TWO_SHAPES = ["--batch-shape", "B,16", "--batch-shape", "B,16"]
FAILURES = {
    "bad config": ("config", "model:\n  class_path: [unclosed\n", [], "not valid YAML"),
    "unimportable class_path": ("config", "model: {class_path: no_such_package.Model}\n", _TWO_SHAPES, "cannot import"),
    "forward raises": ("argv", None, ["--model", "tests.test_cli_estimate.Raises", *_TWO_SHAPES], "ZeroDivisionError"),
    "shape that cannot run": (
        "argv",
        None,
        ["--model", TINY, "--batch-shape", "B,5", *["--batch-shape", "B,16"]],
        "[2, 5]",
    ),
    "bad --batch-shape": ("argv", None, ["--model", TINY, "--batch-shape", "B,x"], "dimension 'x'"),
    "bad memory section": (
        "config",
        f"model: {{class_path: {TINY}}}\nmemory: {{name: balanced, micro_batch_sise: 2}}\n",
        _TWO_SHAPES,
        "unknown key(s) micro_batch_sise",
    ),
}

_DRIVER = """
import json, os, sys
from lightning_memopt import MemoryPreset
from lightning_memopt.cli import main
out = []
for i, argv in enumerate(json.loads(sys.argv[1])):
    path = os.path.join(sys.argv[2], f"stderr{i}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        code = main(["estimate", *argv])
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(fd)
    out.append([code, open(path).read()])
print(json.dumps(out))
"""


class Raises(TinyModule):
    def training_step(self, batch, batch_idx):
        return 1 / 0


@pytest.mark.slow
def test_every_failure_is_one_line_on_stderr_without_a_traceback_or_a_torch_log(tmp_path):
    runs = []
    for name, (kind, text, argv, _) in FAILURES.items():
        if kind == "config":
            path = tmp_path / f"{name.replace(' ', '_')}.yaml"
            path.write_text(text)
            argv = ["--config", str(path), *argv]
        runs.append([*argv, "--batch-size", "2", "--device", "cuda"])
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(runs), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    for (name, (*_, words)), (code, err) in zip(FAILURES.items(), json.loads(proc.stdout.splitlines()[-1])):
        assert code == 2, (name, err)
        assert err.count("\n") == 1 and err.startswith(ERROR), (name, err)
        assert words in err, (name, err)


# ------------------------------------------------------------------------------------------------ bad input


def _bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  class_path: [unclosed\n")
    return ["--config", str(path)]


def _list_yaml(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- data\n")
    return ["--config", str(path)]


def _fixed_class_config(tmp_path):
    path = tmp_path / "fixed.yaml"
    path.write_text("model:\n  width: 8\n")
    return ["--config", str(path), "--batch-shape", "B,8"]


SHAPES = ["--batch-shape", "B,16", "--batch-shape", "B,16"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            lambda tmp: ["--model", "tests.test_cli_estimate.Nope", *SHAPES],
            "--model: cannot import 'tests.test_cli_estimate.Nope': tests.test_cli_estimate has no attribute 'Nope'",
        ),
        (lambda tmp: ["--model", "no_such_package.Model", *SHAPES], "--model: cannot import 'no_such_package.Model'"),
        (lambda tmp: ["--model", "TinyModule", *SHAPES], "--model: 'TinyModule' is not a full import path"),
        (lambda tmp: ["--model", "json.dumps", *SHAPES, "--batch-size", "2"], "--model: json.dumps(...) failed"),
        (lambda tmp: ["--model", "json.JSONDecoder", *SHAPES, "--batch-size", "2"], "not a LightningModule"),
        (lambda tmp: ["--model", TINY, "--model.widht", "3", *SHAPES], "unexpected keyword argument 'widht'"),
        (
            lambda tmp: ["--model", TINY, *SHAPES, "--device-memory", "40XB", "--effective-batch-size", "8"],
            "--device-memory: '40XB' is neither a size",
        ),
        (
            lambda tmp: ["--model", TINY, *SHAPES, "--device-memory", "nan", "--effective-batch-size", "8"],
            "--device-memory: 'nan' is neither a size",
        ),
        (
            lambda tmp: ["--model", TINY, *SHAPES, "--device-memory", "inf", "--effective-batch-size", "8"],
            "--device-memory: 'inf' is neither a size",
        ),
        (
            lambda tmp: ["--model", TINY, *SHAPES, "--device-memory", "300MB", "--effective-batch-size", "8"],
            "--device-memory: 300MB (286.10 MiB) leaves nothing once the CUDA context",
        ),
        (
            lambda tmp: ["--model", TINY, *SHAPES, "--gpu", "A100-41GB", "--effective-batch-size", "8"],
            "--gpu: unknown GPU 'A100-41GB'; known: T4,",
        ),
        (
            lambda tmp: ["--model", TINY, *SHAPES, "--gpu", "A100-40GB", "--device-memory", "40GB"],
            "--gpu and --device-memory: give one of them",
        ),
        (
            lambda tmp: ["--model", TINY, *SHAPES, "--effective-batch-size", "8"],
            "--effective-batch-size: planning needs a memory budget; "
            "pass --gpu NAME (e.g. A100-40GB) or --device-memory",
        ),
        (
            lambda tmp: ["--model", TINY, *SHAPES, "--gpu", "T4", "--effective-batch-size", "9", "--devices", "2"],
            "--effective-batch-size: 9 must divide by devices x num nodes = 2",
        ),
        (lambda tmp: ["--model", TINY, *SHAPES], "--batch-size: needed for the estimate"),
        (lambda tmp: ["--model", TINY, *SHAPES, "--batch-size", "0"], "--batch-size: must be a positive int, got 0"),
        (
            lambda tmp: ["--model", TINY, *SHAPES, "--batch-size", "2", "--margin", "1.5"],
            "--margin: must be a fraction",
        ),
        (
            lambda tmp: ["--model", TINY, *SHAPES, "--batch-size", "2", "--precision", "64-true"],
            "--precision: '64-true' is not a precision the estimate models",
        ),
        (
            lambda tmp: ["--model", TINY, "--batch-shape", "B,7", "--batch-size", "3"],
            "the training step of TinyModule failed on the batch from --batch-shape B,7 (ValueError: too many values",
        ),
        (lambda tmp: ["--model", TINY, "--batch-size", "2"], "no batch: pass --data CLASS_PATH"),
        (lambda tmp: ["--model", TINY, "--data", TINY_DATA, *SHAPES], "--batch-shape and --data: give one"),
        (
            lambda tmp: ["--model", TINY, "--data", TINY_DATA, "--data.num_samples", "0"],
            "--data: TinyDataModule.train_dataloader() failed outside a Trainer (ValueError: num_samples",
        ),
        (
            lambda tmp: ["--model", TINY, "--data", "tests.test_cli_estimate.TinyModule", "--batch-size", "2"],
            "--data: TinyModule.train_dataloader() failed outside a Trainer",
        ),
        (lambda tmp: ["--model", TINY, *SHAPES, "--bogus", "1"], "unrecognized argument '--bogus'"),
        (lambda tmp: ["--model", TINY, *SHAPES, "--model.width"], "--model.width: expected a value after it"),
        (lambda tmp: [*SHAPES, "--batch-size", "2"], "--model: pass --model CLASS_PATH"),
        (_fixed_class_config, "--model: the config's model section has no class_path; pass --model CLASS_PATH"),
        (
            lambda tmp: [
                "--config",
                _preset_config(tmp, "{name: max-savings, effective_batch_size: 100, micro_batch_size: 16}"),
            ],
            "--config: memory: `memory.effective_batch_size`=100 is not divisible by `memory.micro_batch_size`",
        ),
        (
            lambda tmp: ["--config", _preset_config(tmp, "{name: max-sped}")],
            "--config: memory: Unknown preset `memory.name`='max-sped'",
        ),
        (
            lambda tmp: ["--config", _preset_config(tmp, "{name: balanced, micro_batch_sise: 4}")],
            "--config: memory: unknown key(s) micro_batch_sise; MemoryPreset's fields are",
        ),
        (lambda tmp: ["--config", _preset_config(tmp, "[max-savings]")], "the memory: section must be a mapping"),
        (
            lambda tmp: ["--config", _preset_config(tmp, "{effective_batch_size: 9}"), "--devices", "2"],
            "`memory.effective_batch_size`=9 is not divisible by the world size 2 (`devices`=2",
        ),
        (_bad_yaml, "bad.yaml: not valid YAML"),
        (_list_yaml, "list.yaml: holds a list, not a mapping of sections"),
        (lambda tmp: ["--config", str(tmp / "missing.yaml")], "missing.yaml: no such file"),
        (lambda tmp: ["--config", str(tmp)], ": is a directory"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_argument(tmp_path, capsys, argv, words):
    code, out, err = _run(capsys, *argv(tmp_path), "--device", "cuda")
    assert code == 2, (out, err)
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(ERROR), err
    assert words in err and "Traceback" not in err


def test_a_training_step_that_cannot_run_on_fake_tensors_is_one_line(capsys):
    code, out, err = _run(
        capsys,
        "--model",
        "tests.test_cli_estimate.DataDependent",
        "--batch-shape",
        "B,4",
        "--batch-size",
        "2",
        "--device",
        "cpu",
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(ERROR) and "cannot be estimated on fake tensors" in err


class TinyWithValidation(TinyModule):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))


def test_an_evaluation_stage_is_estimated_and_planned_beside_the_training_micro_batch(capsys):
    shapes = ["--batch-shape", "B,16", "--batch-shape", "B,16", "--device", "cpu"]
    model = "tests.test_cli_estimate.TinyWithValidation"
    code, out, err = _run(capsys, "--model", model, *shapes, "--batch-size", "4", "--stage", "validate")
    assert code == 0, err
    est = estimate_memory(
        TinyWithValidation(), (torch.zeros(4, 16), torch.zeros(4, 16)), device="cpu", stage="validate"
    )
    assert f"Estimated peak memory of a validation step on cpu at 32-true: {format_bytes(est.peak_bytes)}" in out
    budget = ["--effective-batch-size", "64", "--device-memory", "20KB"]
    code, out, err = _run(capsys, "--model", model, *shapes, *budget, "--stage", "validate")
    assert code == 0, err
    plan = plan_memory(
        TinyWithValidation(), lambda b: (torch.zeros(b, 16), torch.zeros(b, 16)), effective_batch_size=64,
        budget="20KB", device="cpu", evaluation="validate", precision="32-true",
    )  # fmt: skip
    assert plan.eval_batch_size > plan.micro_batch_size
    assert f"Evaluation (trainer.validate): batch {plan.eval_batch_size} per device" in out
    assert f"eval_batch_size: {plan.eval_batch_size}" in out  # in the memory: section to paste
    assert "validate batch" in err  # a progress line per evaluation estimate
    code, out, err = _run(capsys, "--model", TINY, *shapes, "--batch-size", "4", "--stage", "test")
    assert code == 2 and err.strip() == (
        f"{ERROR}--stage='test', but TinyModule has no `test_step`: Lightning would not run the stage. Define"
        " `test_step`."
    )


class NeedsTheTrainersData(TinyModule):
    def configure_optimizers(self):  # the stand-in Trainer of an estimate has no dataloaders
        return torch.optim.AdamW(self.parameters(), lr=self.lr / len(self.trainer.train_dataloader))


def test_a_configure_optimizers_that_fails_names_the_optimizer_flag(capsys):
    code, out, err = _run(
        capsys, "--model", "tests.test_cli_estimate.NeedsTheTrainersData", "--batch-shape", "B,16", "--batch-shape",
        "B,16", "--batch-size", "2", "--device", "cpu",
    )  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "no `train_dataloader`" in err
    assert "Pass --optimizer (e.g. `--optimizer AdamW --optimizer.lr 1e-4`)" in err and "functools" not in err
    assert "fake=False" not in err


def test_a_step_that_needs_a_real_run_names_the_python_fallback(capsys):
    code, _, err = _run(
        capsys, "--model", "tests.test_cli_estimate.DataDependent", "--batch-shape", "B,4", "--batch-size", "2",
        "--device", "cpu",
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1
    assert "test_cli_estimate.py:" in err and "in forward: `return y[y > 0].sum()" in err
    assert "`estimate_memory(model, batch, fake=False, device='cpu')` in Python" in err


def _yaml_alias_bomb(path, depth: int = 9) -> None:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, depth)]
    path.write_text("\n".join([f"model: {{class_path: {TINY}}}", *lines]) + "\n")


def test_a_yaml_alias_bomb_is_refused_in_one_line_without_expanding_it(tmp_path, capsys):
    """9 ** 9 values written out (the old reader never ended: 852 MB at 100 s); shared aliases stay shared."""
    import time

    from lightning_memopt.cli_estimate.config import load_config

    bomb = tmp_path / "bomb.yaml"
    _yaml_alias_bomb(bomb)
    started = time.perf_counter()
    code, out, err = _run(capsys, "--config", str(bomb), "--batch-shape", "B,16", "--batch-shape", "B,16")
    assert time.perf_counter() - started < 60  # a hang guard far from the normal run (well under a second)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "bomb.yaml: its YAML aliases expand to more than 1,000,000 values" in err
    small = tmp_path / "small.yaml"
    _yaml_alias_bomb(small, depth=3)  # 9 ** 3 values written out: read, its aliases still one object
    config = load_config(str(small))
    assert config["l2"][0] is config["l2"][8] is config["l1"] and len(config["l1"]) == 9
    loops = tmp_path / "loops.yaml"
    loops.write_text("model: &m\n  class_path: x\n  init_args: {me: *m}\n")
    code, _, err = _run(capsys, "--config", str(loops), "--batch-shape", "B,16")
    assert code == 2 and "loops.yaml: its YAML aliases expand to more than" in err


def test_numbers_are_read_once_per_aliased_value(tmp_path):
    from lightning_memopt.cli_estimate.config import load_config

    path = tmp_path / "lr.yaml"
    path.write_text("model:\n  init_args: &args {lr: 1e-4, width: 8}\nshadow:\n  init_args: *args\n")
    config = load_config(str(path))
    assert config["model"]["init_args"] == {"lr": 1e-4, "width": 8}
    assert config["shadow"]["init_args"] is config["model"]["init_args"]


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y[y > 0].sum()  # a data-dependent shape


# ------------------------------------------------------------------------------------------------ help, imports


def test_help_lists_estimate_and_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert re.search(r"^ +estimate +predict a training step's peak memory", capsys.readouterr().out, re.M)
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in (
        "--gpu NAME",
        "--device-memory SIZE",
        "--effective-batch-size N",
        "--batch-shape SPEC",
        "--config FILE.yaml",
        "--model.NAME VALUE",
        "1 nothing fits the budget",
        "2 bad input",
        "a progress line per estimate goes to stderr",
        *ESTIMATE_PRECISIONS,
    ):
        assert words.lower() in text.lower(), words


def test_other_subcommands_still_refuse_unknown_arguments(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path / "r.json"), "--model.width", "3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --model.width 3" in capsys.readouterr().err


def test_analyze_report_and_estimate_help_start_without_importing_torch(tmp_path):
    log = tmp_path / "memory_rank0.jsonl"
    record = {
        "time": 1.0,
        "rank": 0,
        "phase": "train",
        "event": "step",
        "epoch": 0,
        "global_step": 1,
        "batch_idx": 0,
        "device": "cpu",
        "allocated_bytes": None,
        "host_rss_bytes": 1000,
    }
    log.write_text(json.dumps(record) + "\n")
    code = (
        "import sys\n"
        "from lightning_memopt.cli import main\n"
        "assert main(['analyze', sys.argv[1]]) == 0\n"
        "try:\n    main(['estimate', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'pytorch_lightning', 'yaml') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
