"""Quiet by default: what a CPU fit with the package's callbacks prints, compared with the same fit without them.

A callback with nothing to do on a CPU says so in the one line per fit that lists the inactive callbacks, instead
of a line of its own; routine summaries wait for ``verbose=True``; every line fits 100 columns; every warning is
located in the package module that raised it (or the test's line), so ``filterwarnings(module=...)`` can target it.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import lightning_memopt
from lightning_memopt import MemoryPreset
from lightning_memopt.callbacks import (
    AllocatorSettings,
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryAudit,
    OOMReporter,
)
from lightning_memopt.utilities.formatting import WIDTH
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

PACKAGE_DIR = os.path.dirname(lightning_memopt.__file__)
TESTS_DIR = os.path.dirname(__file__)
INACTIVE = "lightning-memopt: inactive here:"


class EncoderModel(TinyModel):
    """TinyModel behind one transformer layer: GradientCheckpointing has a block to wrap."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__(batch_size=batch_size)
        self.encoder = nn.TransformerEncoderLayer(32, 2, 16, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.encoder(x.unsqueeze(1)).squeeze(1))


@dataclass
class Output:
    lines: list[str]  # stdout and stderr
    records: list[str]  # log records, formatted
    warnings: list[warnings.WarningMessage]


def _fit(tmp_path, capfd, caplog, fits: int = 1, batch_size: int = 4, **trainer_kwargs: Any) -> Output:
    capfd.readouterr()
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, max_steps=2, limit_val_batches=1, **trainer_kwargs)
        model = EncoderModel(batch_size=batch_size)
        for _ in range(fits):
            trainer.fit(model)
            trainer.fit_loop.epoch_loop.max_steps += 2  # the same Trainer fits again
    out, err = capfd.readouterr()
    return Output((out + err).splitlines(), [r.getMessage() for r in caplog.records if _shown(r)], list(caught))


def _shown(record: logging.LogRecord) -> bool:
    """Whether a record reaches the console without logging set up by the user: the package's own logger has no
    handler (below WARNING its records print only once the user configures logging), Lightning's has one."""
    return record.levelno >= logging.WARNING or not record.name.startswith("lightning_memopt")


def _package_part(run: Output, baseline: Output) -> Output:
    """What the package added to the baseline fit's output: its lines, its log records, its warnings."""
    known = {(w.category, str(w.message)) for w in baseline.warnings}
    return Output(
        [line for line in run.lines if line not in baseline.lines],
        [record for record in run.records if record not in baseline.records],
        [w for w in run.warnings if (w.category, str(w.message)) not in known],
    )


def _check_quiet(ours: Output, fits: int = 1) -> None:
    inactive = [record for record in ours.records if record.startswith(INACTIVE)]
    assert len(inactive) <= fits, inactive  # at most one per fit
    assert ours.records == inactive, f"the package printed more than the inactive line: {ours.records}"
    logged = [line for text in ours.records for line in text.splitlines()]
    assert [line for line in logged + ours.lines if len(line) > WIDTH] == []
    said = {line.strip() for line in logged}
    assert [line for line in ours.lines if line.strip() not in said] == []  # no print() beside the logging
    located = [(w.filename, str(w.message)) for w in ours.warnings]
    assert [(f, m) for f, m in located if not f.startswith((PACKAGE_DIR, TESTS_DIR))] == []


@pytest.mark.slow
def test_the_callbacks_of_this_area_print_one_inactive_line_per_fit_on_cpu(tmp_path, capfd, caplog):
    def callbacks():
        return [
            CacheCleaner(every_n_train_steps=1),
            GarbageCollector(every_n_train_steps=1),
            GradientCheckpointing(),
            AllocatorSettings("expandable_segments:True", memory_fraction=0.5),
        ]

    baseline = _fit(tmp_path / "baseline", capfd, caplog, fits=2)
    ours = _package_part(_fit(tmp_path / "ours", capfd, caplog, fits=2, callbacks=callbacks()), baseline)
    _check_quiet(ours, fits=2)
    assert ours.warnings == []
    line = f"{INACTIVE} CacheCleaner (no cache on cpu), AllocatorSettings (CUDA only)."
    assert [" ".join(record.split()) for record in ours.records] == [line, line]  # one per fit, nothing else


@pytest.mark.slow
def test_a_cpu_fit_with_every_callback_of_the_package_is_quiet(tmp_path, capfd, caplog):
    preset = MemoryPreset.from_name(
        "max-savings", effective_batch_size=8, micro_batch_size=4, auto_micro_batch=True, memory_fraction=0.5
    )
    kwargs = preset.trainer_kwargs(callbacks=[MemoryAudit(), OOMReporter()])
    assert {type(c).__name__ for c in kwargs["callbacks"]} == set(lightning_memopt.callbacks.__all__)
    assert [type(p).__name__ for p in kwargs["plugins"]] == ["MemoryPrecision"]
    kwargs.pop("devices", None)
    baseline = _fit(tmp_path / "baseline", capfd, caplog, batch_size=preset.batch_size)
    ours = _package_part(_fit(tmp_path / "ours", capfd, caplog, batch_size=preset.batch_size, **kwargs), baseline)
    _check_quiet(ours)
    (inactive,) = ours.records
    assert "CacheCleaner (" in inactive and "AllocatorSettings (" in inactive
