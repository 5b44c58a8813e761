"""The DreaMS-style example: data generator, model presets, and short runs of train.py and the LightningCLI config."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

h5py = pytest.importorskip("h5py")

from examples.dreams.data import (  # noqa: E402
    PRECURSOR_INTENSITY,
    SpectraDataset,
    collate_spectra,
    generate_spectra_h5,
    preprocess_spectrum,
    spectrum_statistics,
)
from examples.dreams.model import MODEL_PRESETS, SpectrumEncoder, model_config  # noqa: E402
from examples.dreams.module import SpectraFineTuner, load_backbone_state  # noqa: E402
from tests.helpers.subprocess_run import REPO_ROOT  # noqa: E402

TRAIN_PY = REPO_ROOT / "examples" / "dreams" / "train.py"


@pytest.fixture(scope="module")
def spectra_file(tmp_path_factory) -> Path:
    """6,000 spectra (about 4,800 in the train fold: 150 batches of 32), shared by the tests of this file."""
    return generate_spectra_h5(tmp_path_factory.mktemp("dreams") / "spectra.hdf5", num_spectra=6000, seed=0)


def _short_run_args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    return [
        "--output_dir",
        str(tmp_path / "run"),
        "--data_path",
        str(data),
        "--num_spectra",
        "6000",
        "--accelerator",
        "cpu",
        "--max_epochs",
        "1",
        "--limit_train_batches",
        "4",
        "--limit_val_batches",
        "2",
        "--num_sanity_val_steps",
        "0",
        "--no-progress_bar",
        "--memory_log_every_n_steps",
        "1",
        *extra,
    ]


# ------------------------------------------------------------------------------------------------ data


@pytest.mark.parametrize("seed", [0, 1])
def test_generator_statistics(tmp_path, seed):
    stats = spectrum_statistics(generate_spectra_h5(tmp_path / "s.hdf5", num_spectra=3000, seed=seed))
    q05, median, q95 = stats["peaks_q05_q50_q95"]
    assert 20 <= median <= 36, stats
    assert 5 <= q05 < median < q95 <= 80, stats
    mz05, _, mz95 = stats["precursor_mz_q05_q50_q95"]
    assert mz05 >= 200 and mz95 <= 650, stats
    assert 0.12 < stats["substructure_rate"] < 0.18, stats
    assert stats["folds"]["train"] > 0.75 * 3000 and min(stats["folds"]["val"], stats["folds"]["test"]) > 200


def test_hdf5_layout(spectra_file):
    with h5py.File(spectra_file, "r") as f:
        assert {"spectrum", "precursor_mz", "charge", "fold", "substructures", "properties"} <= set(f)
        n = f["precursor_mz"].shape[0]
        assert f["spectrum"].shape == (n, 2, 128) and f["spectrum"].dtype == np.float32
        assert f["precursor_mz"].shape == (n,) and f["precursor_mz"].dtype == np.float32
        assert f["substructures"].shape == (n, 32) and f["substructures"].dtype == np.uint8
        assert f["properties"].shape == (n, 4) and f["properties"].dtype == np.float32
        assert f["fold"].shape == (n,) and f["fold"].dtype.kind == "S"
        assert set(np.unique(f["fold"][:])) == {b"train", b"val", b"test"}
        spectra = f["spectrum"][:500]
    mz, intensity = spectra[:, 0], spectra[:, 1]
    real = mz > 0
    # m/z ascending over the real peaks, zero padding after them, base peak = 1
    assert all(np.all(np.diff(row[r]) > 0) for row, r in zip(mz, real))
    assert all(not r[np.argmin(r) :].any() for r in real if not r.all())
    assert np.allclose(intensity.max(axis=1), 1.0)
    assert np.all(intensity[~real] == 0)


def test_float64_layout(tmp_path):
    with h5py.File(generate_spectra_h5(tmp_path / "s.hdf5", num_spectra=10, dtype="float64"), "r") as f:
        assert f["spectrum"].dtype == np.float64 and f["precursor_mz"].dtype == np.float64


def test_preprocessing_keeps_top_peaks_and_prepends_the_precursor_token():
    spectrum = torch.tensor([[100.0, 150.0, 200.0, 250.0, 0.0], [2.0, 8.0, 1.0, 4.0, 0.0]])
    tokens = preprocess_spectrum(spectrum, 412.5, max_peaks_n=4)
    assert tokens.shape == (5, 2)
    assert tokens[0].tolist() == [412.5, pytest.approx(1.1)] and PRECURSOR_INTENSITY == 1.1
    assert tokens[1:, 0].tolist() == [100.0, 150.0, 200.0, 250.0]
    assert tokens[1:, 1].tolist() == [0.25, 1.0, 0.125, 0.5]  # base-peak normalised
    top2 = preprocess_spectrum(spectrum, 412.5, max_peaks_n=2)
    assert top2[1:].tolist() == [[150.0, 1.0], [250.0, 0.5]]  # the 2 most intense, back in m/z order
    padded = preprocess_spectrum(spectrum, 412.5, max_peaks_n=8)
    assert padded.shape == (9, 2) and padded[5:].abs().sum() == 0


def test_lazy_reading_in_two_workers_matches_in_memory(spectra_file):
    lazy = SpectraDataset(spectra_file, "val", max_peaks_n=60)
    in_mem = SpectraDataset(spectra_file, "val", max_peaks_n=60, in_mem=True)
    assert len(lazy) == len(in_mem) > 0
    loader = torch.utils.data.DataLoader(lazy, batch_size=16, num_workers=2, collate_fn=collate_spectra)
    batches = list(loader)
    assert lazy._file is None  # the handles were opened in the workers, not here
    got = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    want = collate_spectra([in_mem[i] for i in range(len(in_mem))])
    for key in ("peaks", "substructures", "properties"):
        assert torch.equal(got[key], want[key]), key
    # single items, batched reads with repeated and unordered indices, and a pickled (spawn-style) copy
    import pickle

    copy = pickle.loads(pickle.dumps(lazy))
    for ds in (lazy, copy):
        items = ds.__getitems__([5, 2, 5])
        for item, i in zip(items, [5, 2, 5]):
            assert all(torch.equal(item[k], in_mem[i][k]) for k in item)
    with pytest.raises(IndexError):
        lazy[len(lazy)]


def test_dynamic_padding_cuts_to_the_longest_spectrum(spectra_file):
    ds = SpectraDataset(spectra_file, "train", max_peaks_n=100, in_mem=True)
    items = [ds[i] for i in range(8)]
    fixed, dynamic = collate_spectra(items), collate_spectra(items, dynamic_padding=True)
    longest = max(int((it["peaks"][:, 0] > 0).sum()) for it in items)
    assert fixed["peaks"].shape == (8, 101, 2) and dynamic["peaks"].shape == (8, longest, 2)
    assert torch.equal(dynamic["peaks"], fixed["peaks"][:, :longest])


# ------------------------------------------------------------------------------------------------ model


def _count(preset: str) -> int:
    with torch.device("meta"):  # no memory, no initialisation: dreams-base is counted in milliseconds
        return sum(p.numel() for p in SpectrumEncoder(model_config(preset)).parameters())


def test_preset_parameter_counts():
    assert 0.15e6 < _count("tiny") < 0.3e6
    assert 2e6 < _count("small") < 6e6
    base = _count("dreams-base")
    assert 94e6 < base < 97e6, base  # DreaMS's backbone: ~95.5M
    cfg = MODEL_PRESETS["dreams-base"]
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_freq_low + cfg.n_freq_high) == (1024, 7, 8, 5997)


def test_model_forward_ignores_padding():
    torch.manual_seed(0)
    enc = SpectrumEncoder(model_config("tiny")).eval()
    peaks = torch.tensor([[[300.0, 1.1], [100.0, 1.0], [155.07, 0.4]]])
    padded = torch.cat([peaks, torch.zeros(1, 5, 2)], dim=1)
    with torch.no_grad():
        assert torch.allclose(enc(peaks)[:, 0], enc(padded)[:, 0], atol=1e-5)


def test_bad_sizes_say_how_to_fix_them():
    with pytest.raises(ValueError, match="`n_heads` must divide"):
        model_config("tiny", n_heads=5)
    with pytest.raises(ValueError, match="`unfreeze_backbone_at_epoch`"):
        SpectraFineTuner(unfreeze_backbone_at_epoch=-1)


# ------------------------------------------------------------------------------------------------ train.py


def test_memory_preset_decides_precision_and_accumulation():
    from lightning.pytorch.plugins import Precision

    from examples.dreams.train import preset_trainer_kwargs

    def resolve(**kw):
        kwargs, batch, name = preset_trainer_kwargs(accelerator="cpu", **kw)
        for cb in kwargs.get("callbacks", []):  # allocator settings are applied when built: give them back
            getattr(cb, "restore", lambda: None)()
        return kwargs, batch, name

    kwargs, batch, name = resolve(preset="max-savings", effective_batch_size=64)
    assert (batch, kwargs["accumulate_grad_batches"], name) == (16, 4, "max-savings")  # the preset's split
    assert any(type(p).__name__ == "MemoryPrecision" for p in kwargs["plugins"])
    assert "GradientCheckpointing" in [type(c).__name__ for c in kwargs["callbacks"]]
    kwargs, batch, name = resolve(preset="auto", batch_size=8, effective_batch_size=64)
    assert (batch, kwargs["accumulate_grad_batches"], name) == (8, 8, "balanced")  # no GPU: balanced
    kwargs, _, _ = resolve(preset="balanced", batch_size=32, train_precision="64")
    assert kwargs["precision"] == "64-true" and not any(isinstance(p, Precision) for p in kwargs["plugins"])
    kwargs, _, _ = resolve(preset="balanced", train_precision="bf16")
    assert (
        next(p for p in kwargs["plugins"] if type(p).__name__ == "MemoryPrecision").requested_precision == "bf16-mixed"
    )
    kwargs, batch, _ = resolve(preset="none", batch_size=16, effective_batch_size=64)
    assert (batch, kwargs["accumulate_grad_batches"], kwargs["precision"]) == (16, 4, "32-true")
    with pytest.raises(SystemExit, match="contradicts"):
        resolve(preset="balanced", batch_size=16, effective_batch_size=64, accumulate_grad_batches=2)
    with pytest.raises(SystemExit, match="train_precision"):
        resolve(preset="balanced", train_precision="fp8")


@pytest.mark.slow
def test_short_run_writes_memory_log_plot_and_checkpoint(tmp_path, spectra_file, capsys):
    from examples.dreams.train import main

    trainer = main(_short_run_args(tmp_path, spectra_file))
    out = capsys.readouterr().out
    run_dir = tmp_path / "run" / "version_0"
    log = run_dir / "memopt" / "memory_rank0.jsonl"
    plot = run_dir / "memopt" / "memory_timeline.png"
    checkpoints = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    assert log.stat().st_size > 0 and plot.stat().st_size > 0
    assert any(p.name == "last.ckpt" for p in checkpoints) and len(checkpoints) >= 2
    for path in (log, plot, run_dir / "checkpoints", run_dir / "metrics.csv"):
        assert str(path) in out, path
    assert "memory summary:" in out and "peak host RSS" in out
    assert "mean-prediction baseline" in out
    assert trainer.global_step == 4
    # the package's callbacks are all there by default
    names = {type(c).__name__ for c in trainer.callbacks}
    assert {"MemoryMonitor", "CacheCleaner", "GarbageCollector", "OOMReporter", "MemoryAudit"} <= names
    # a second run goes to its own directory (safe to run twice)
    main(_short_run_args(tmp_path, spectra_file, "--no_memory_callbacks"))
    assert (tmp_path / "run" / "version_1" / "checkpoints" / "last.ckpt").exists()
    assert not (tmp_path / "run" / "version_1" / "memopt").exists()


@pytest.mark.slow
def test_it_learns_half_the_mean_prediction_baseline(tmp_path, spectra_file):
    """A shortened version of the default run: 150 steps of 32 spectra, fixed seed."""
    import time

    from examples.dreams.train import main

    start = time.perf_counter()
    args = _short_run_args(tmp_path, spectra_file)
    args[args.index("--limit_train_batches") + 1] = "150"
    args[args.index("--limit_val_batches") + 1] = "8"
    trainer = main([*args, "--max_peaks_n", "40", "--memory_log_every_n_steps", "25"])
    seconds = time.perf_counter() - start
    assert trainer.global_step == 150
    # the baseline: always predicting the training fold's mean labels, computed here on the validation batches seen
    ds = SpectraDataset(spectra_file, "train", in_mem=True)
    bits = torch.as_tensor(ds._data["substructures"].mean(axis=0), dtype=torch.float32)
    props = torch.as_tensor(ds._data["properties"].mean(axis=0))
    val = collate_spectra(SpectraDataset(spectra_file, "val", in_mem=True).__getitems__(list(range(8 * 32))))
    baseline = float(
        torch.nn.functional.binary_cross_entropy(bits.expand_as(val["substructures"]), val["substructures"])
        + torch.nn.functional.mse_loss(props.expand_as(val["properties"]), val["properties"])
    )
    metrics = trainer.callback_metrics
    assert float(metrics["val_baseline_loss"]) == pytest.approx(baseline, rel=1e-4)
    assert float(metrics["val_loss"]) <= 0.5 * baseline, (float(metrics["val_loss"]), baseline)
    assert seconds < 120, seconds  # about 10 s on 2 shared cores: a hang guard


@pytest.mark.slow
def test_fine_tuning_loads_the_backbone_and_keeps_it_frozen(tmp_path, spectra_file):
    from examples.dreams.train import main

    first = main(_short_run_args(tmp_path, spectra_file, "--no_memory_callbacks"))
    ckpt = Path(first.checkpoint_callback.last_model_path)
    state = load_backbone_state(ckpt)
    assert state and not any(k.startswith(("backbone.", "head.")) for k in state)
    second = main(
        _short_run_args(
            tmp_path,
            spectra_file,
            "--no_memory_callbacks",
            "--pre_trained_pth",
            str(ckpt),
            "--unfreeze_backbone_at_epoch",
            "1",
        )
    )
    model = second.lightning_module
    for name, tensor in model.backbone.state_dict().items():  # frozen for the whole (single) epoch
        assert torch.equal(tensor, state[name]), name
    assert not torch.equal(model.head.weight, first.lightning_module.head.weight)
    with pytest.raises(ValueError, match="does not fit this backbone"):
        SpectraFineTuner(model_preset="tiny", d_fourier=32, pre_trained_pth=str(ckpt))


@pytest.mark.slow
def test_two_process_ddp_on_cpu(tmp_path, spectra_file):
    """``python examples/dreams/train.py --num_devices 2`` on CPU: Lightning starts rank 1 itself (gloo)."""
    import os
    import subprocess

    args = _short_run_args(tmp_path, spectra_file, "--num_devices", "2")
    args[args.index("--limit_train_batches") + 1] = "2"
    args[args.index("--limit_val_batches") + 1] = "1"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(
        [sys.executable, str(TRAIN_PY), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    memory = tmp_path / "run" / "version_0" / "memopt"
    for rank in (0, 1):
        assert (memory / f"memory_rank{rank}.jsonl").stat().st_size > 0, rank
    assert (memory / "memory_timeline.png").exists()
    assert "x 2 device(s)" in proc.stdout
    assert str(memory / "memory_rank1.jsonl") in proc.stdout


def test_command_line_has_the_dreams_flags():
    from examples.dreams.train import build_parser

    help_text = build_parser().format_help()
    for flag in (
        "--batch_size",
        "--max_peaks_n",
        "--train_precision",
        "--num_devices",
        "--lr",
        "--max_epochs",
        "--val_check_interval",
        "--save_top_k",
        "--num_workers_data",
        "--dropout",
        "--d_fourier",
        "--d_peak",
        "--n_layers",
        "--n_heads",
        "--pre_trained_pth",
        "--unfreeze_backbone_at_epoch",
        "--seed",
        "--no_wandb",
        "--preset",
        "--effective_batch_size",
        "--accumulate_grad_batches",
        "--auto_micro_batch",
        "--limit_val_batches",
        "--every_n_train_steps",
        "--gradient_checkpointing",
        "--dynamic_padding",
        "--model_preset",
        "--in_mem",
    ):
        assert flag in help_text, flag
    args = build_parser().parse_args(["--limit_val_batches", "1.0", "--val_check_interval", "50"])
    assert args.limit_val_batches == 1.0 and isinstance(args.limit_val_batches, float)  # all of it, not 1 batch
    assert args.val_check_interval == 50 and isinstance(args.val_check_interval, int)


# ------------------------------------------------------------------------------------------------ LightningCLI


@pytest.mark.slow
def test_lightning_cli_yaml_config_runs(tmp_path, spectra_file, capsys):
    from examples.dreams.cli import CONFIG, cli_main

    out_dir = tmp_path / "cli"
    cli = cli_main(
        [
            "fit",
            "--config",
            str(CONFIG),
            "--trainer.accelerator=cpu",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={out_dir}",
            f"--trainer.logger.init_args.save_dir={out_dir}",
            f"--data.data_path={spectra_file}",
            "--data.num_spectra=6000",
            "--memory.name=max-savings",
            "--memory.effective_batch_size=64",
        ]
    )
    trainer = cli.trainer
    assert trainer.global_step == 1  # 2 micro-batches of 32 per optimizer step
    assert trainer.accumulate_grad_batches == 2
    names = [type(c).__name__ for c in trainer.callbacks]
    for name in (
        "MemoryMonitor",
        "CacheCleaner",
        "GarbageCollector",
        "OOMReporter",
        "MemoryAudit",
        "GradientCheckpointing",
        "ModelCheckpoint",
    ):
        assert name in names, name
    assert type(trainer.precision_plugin).__name__ == "MemoryPrecision"
    run_dir = out_dir / "version_0"
    assert (run_dir / "memopt" / "memory_rank0.jsonl").exists() and (run_dir / "config.yaml").exists()
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    out = capsys.readouterr().out
    assert str(run_dir / "memopt" / "memory_timeline.png") in out and "memory summary:" in out
    assert not math.isnan(float(trainer.callback_metrics["val_loss"]))


# ------------------------------------------------------------------------------------------------ AutoMicroBatch


@pytest.mark.slow
def test_auto_micro_batch_survives_out_of_memory_with_the_same_steps_and_weights(
    tmp_path, spectra_file, monkeypatch, capsys
):
    """``--auto_micro_batch`` with a training forward that runs out of memory (simulated) above 8 spectra.

    The DataLoader yields the whole batch of 32; AutoMicroBatch halves 32 -> 16 -> 8 and the run takes its 4
    optimizer steps, ending with the weights of Lightning's accumulation of 4 micro-batches of 8 (no OOM there).
    """
    from examples.dreams.train import main

    seen: list[int] = []
    forward = SpectraFineTuner.forward

    def forward_with_budget(self, peaks):
        if self.training:
            seen.append(len(peaks))
            if len(peaks) > 8:
                raise torch.OutOfMemoryError(f"simulated: a forward of {len(peaks)} spectra, budget 8")
        return forward(self, peaks)

    monkeypatch.setattr(SpectraFineTuner, "forward", forward_with_budget)
    same = ("--no_memory_callbacks", "--dropout", "0", "--no-dynamic_padding", "--save_top_k", "0")
    trainer = main(
        _short_run_args(tmp_path / "auto", spectra_file, *same, "--effective_batch_size", "32", "--auto_micro_batch")
    )
    out = capsys.readouterr().out
    auto = next(c for c in trainer.callbacks if type(c).__name__ == "AutoMicroBatch")
    assert (auto.micro_batch_size, auto.retries) == (8, 2)
    assert seen[:3] == [32, 16, 8] and set(seen[3:]) == {8} and len(seen) == 2 + 4 * 4
    assert trainer.global_step == 4 and trainer.accumulate_grad_batches == 1
    assert "batch 32 per device x 1 accumulation x 1 device(s) = effective batch 32" in out
    assert "AutoMicroBatch splits it into micro-batches (from the whole batch), halving on out-of-memory" in out
    assert "micro-batch:   8 at the end (2 halving(s) after out-of-memory)" in out
    # the reference: micro-batches of 8 from the DataLoader, Lightning accumulates 4 of them per step
    seen.clear()
    args = _short_run_args(tmp_path / "ref", spectra_file, *same, "--batch_size", "8", "--accumulate_grad_batches", "4")
    args[args.index("--limit_train_batches") + 1] = "16"
    reference = main(args)
    assert set(seen) == {8} and reference.global_step == 4
    expected = reference.lightning_module.state_dict()
    for name, tensor in trainer.lightning_module.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_auto_micro_batch_flag_keeps_the_effective_batch_and_starts_at_the_micro_batch():
    from examples.dreams.train import build_parser, preset_trainer_kwargs

    def split(**kw):
        kwargs, batch, _ = preset_trainer_kwargs(accelerator="cpu", **kw)
        for cb in kwargs["callbacks"]:  # allocator settings are applied when built: give them back
            getattr(cb, "restore", lambda: None)()
        autos = [c for c in kwargs["callbacks"] if type(c).__name__ == "AutoMicroBatch"]
        return batch, kwargs["accumulate_grad_batches"], [c.start_micro_batch_size for c in autos]

    # the same effective batch as without the flag; the DataLoader yields all of it per device
    for preset in ("balanced", "none"):
        assert split(preset=preset, batch_size=8, accumulate_grad_batches=4) == (8, 4, [])
        assert split(preset=preset, batch_size=8, accumulate_grad_batches=4, auto_micro_batch=True) == (32, 1, [8])
    assert split(preset="max-speed", effective_batch_size=64, num_devices=2, auto_micro_batch=True) == (32, 1, ["auto"])
    assert split(preset="balanced", auto_micro_batch=True) == (32, 1, [32])  # the default batch, whole
    assert build_parser().parse_args(["--auto_micro_batch"]).auto_micro_batch is True
    assert build_parser().parse_args([]).auto_micro_batch is False


def test_lightning_cli_auto_micro_batch_gives_the_datamodule_the_per_device_batch(tmp_path):
    from examples.dreams.cli import CONFIG, cli_main

    out_dir = tmp_path / "cli"
    cli = cli_main(
        [
            "--config",
            str(CONFIG),
            "--trainer.accelerator=cpu",
            f"--trainer.default_root_dir={out_dir}",
            f"--trainer.logger.init_args.save_dir={out_dir}",
            "--memory.name=max-speed",
            "--memory.effective_batch_size=64",
            "--memory.auto_micro_batch=true",
        ],
        run=False,
    )
    assert cli.datamodule.hparams.batch_size == 64 and cli.trainer.accumulate_grad_batches == 1
    (auto,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "AutoMicroBatch"]
    assert auto.start_micro_batch_size == 32  # data.batch_size: where the micro-batches start


def test_a_peaks_budget_batches_spectra_of_similar_peak_counts_within_it(spectra_file):
    from examples.dreams.datamodule import SpectraDataModule

    dm = SpectraDataModule(data_path=str(spectra_file), max_peaks_n=100, peaks_budget=400, seed=3)
    dm.setup("fit")
    dataset = dm._sets["train"]
    counts = dataset.token_counts()
    items = [dataset[i] for i in range(5)]
    assert counts[:5] == [int((it["peaks"][:, 0] > 0).sum()) for it in items]  # what the collate cuts to
    loader = dm.train_dataloader()
    batches = list(loader.batch_sampler)  # sample indices: nothing read
    assert all(len(b) * max(counts[i] for i in b) <= 400 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(len(dataset)))  # every spectrum once
    assert len(batches) < len(dataset) // 4  # batches far larger than a few spectra where peaks are few
    first = next(iter(loader))  # read and collated: padded to its longest spectrum, within the budget
    assert first["peaks"].shape[0] * first["peaks"].shape[1] <= 400
