"""The one trainer factory the tests use: CPU, a few steps, nothing written that a test does not ask for."""

from __future__ import annotations

from typing import Any

from tests.helpers.lightning import pl


def make_trainer(tmp_path, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "default_root_dir": str(tmp_path),
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "limit_train_batches": 4,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "limit_predict_batches": 2,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "log_every_n_steps": 1,
    }
    defaults.update(kwargs)
    return pl.Trainer(**defaults)
