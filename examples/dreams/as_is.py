"""DreaMS as it is: its ``pytorch_lightning`` structure, with the memory fixes its users write by hand and the same
fixes with this package.

The real repository (pluskal-lab/DreaMS) imports the standalone ``pytorch_lightning``; its fine-tuning module takes
the pre-trained backbone as an ``__init__`` argument and calls ``self.save_hyperparameters()``, which deep-copies
that backbone into ``_hparams_initial`` (a second copy of every weight); it trains with
``DDPStrategy(find_unused_parameters=True)``, an integer ``precision`` and ``trainer.validate`` before
``trainer.fit``. This script mirrors that structure on the example's synthetic spectra and tiny encoder, and runs it
two ways:

* ``--variant hand``: the fixes users wrote: batch 1 with ``accumulate_grad_batches=2``, ``torch.cuda.empty_cache()``
  after every batch, ``gc.collect()`` every 25 steps, ``precision=16``, ``limit_val_batches``;
* ``--variant package`` (default): the same training with :class:`~lightning_memopt.MemoryPreset` and
  :class:`~lightning_memopt.MemoryAudit`. The preset keeps the effective batch (1 x 2 devices x 2), takes Lightning's
  ``16``, collects garbage on all ranks at the same step, empties the CUDA cache only between phases (after every
  batch it costs time and frees nothing a next batch would not take again; expandable segments fight
  fragmentation instead) and turns on the backbone's own gradient checkpointing. The audit names the stray copy
  (``_hparams_initial['backbone']``) and its fix (``self.save_hyperparameters(ignore=["backbone"])``).

Run it: ``.venv/bin/python examples/dreams/as_is.py --devices 2`` (2 DDP processes on the CPU, about 20 s).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from examples.dreams.data import NUM_PROPERTIES, SpectraDataset, collate_spectra, generate_spectra_h5
from examples.dreams.model import SpectrumEncoder, model_config

__all__ = ["FineTuningHead", "hand_written_trainer", "main", "package_trainer"]


class FineTuningHead(pl.LightningModule):
    """DreaMS's fine-tuning module, as structured there: a head on the pre-trained backbone's precursor token."""

    def __init__(self, backbone: nn.Module, num_substructures: int = 32, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()  # as in DreaMS: keeps a deep copy of `backbone` in `_hparams_initial`
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.d_model, num_substructures + NUM_PROPERTIES)
        self.num_substructures = num_substructures

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.head(self.backbone(batch["peaks"])[:, 0]).float()
        bits, props = out[:, : self.num_substructures], out[:, self.num_substructures :]
        return F.binary_cross_entropy_with_logits(bits, batch["substructures"]) + F.mse_loss(props, batch["properties"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, batch_size=len(batch["peaks"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), batch_size=len(batch["peaks"]), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


# ------------------------------------------------------------------------------------- the fixes, written by hand
class EmptyCacheEveryBatch(pl.Callback):
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class CollectGarbage(pl.Callback):
    def __init__(self, every_n_steps: int = 25) -> None:
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            gc.collect()


def hand_written_trainer(devices: int, **trainer_kwargs: Any) -> tuple[pl.Trainer, int]:
    """The Trainer and the DataLoader batch size of the hand-written fixes."""
    trainer = pl.Trainer(
        devices=devices,
        strategy=DDPStrategy(find_unused_parameters=True),
        precision=16,
        accumulate_grad_batches=2,
        limit_val_batches=4,
        callbacks=[EmptyCacheEveryBatch(), CollectGarbage(every_n_steps=25)],
        **trainer_kwargs,
    )
    return trainer, 1


# ------------------------------------------------------------------------------------- the same, with the package
def package_trainer(devices: int, **trainer_kwargs: Any) -> tuple[pl.Trainer, int]:
    """The Trainer and the DataLoader batch size with ``MemoryPreset`` and ``MemoryAudit``."""
    from lightning_memopt import MemoryAudit, MemoryPreset

    preset = MemoryPreset(
        "max-savings",
        effective_batch_size=2 * devices,
        micro_batch_size=1,
        devices=devices,
        precision=16,
        gc_every_n_train_steps=25,
    )
    trainer = pl.Trainer(
        strategy=DDPStrategy(find_unused_parameters=True),
        limit_val_batches=4,
        **preset.trainer_kwargs(callbacks=[MemoryAudit()], **trainer_kwargs),
    )
    return trainer, preset.batch_size


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=("package", "hand"), default="package")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--data_path", default=None, help="HDF5 file (generated when missing)")
    parser.add_argument("--root_dir", default=None, help="where logs go (default: a temporary directory)")
    parser.add_argument("--result", default=None, help="write this rank's summary as JSON (RANK is appended)")
    args = parser.parse_args(argv)
    root = Path(args.root_dir or tempfile.mkdtemp(prefix="dreams-as-is-"))
    data_path = Path(args.data_path or root / "spectra.hdf5")
    if not data_path.exists():
        generate_spectra_h5(data_path, num_spectra=200, seed=0)
    torch.manual_seed(0)
    model = FineTuningHead(SpectrumEncoder(model_config("tiny", dropout=0.0)))
    build = package_trainer if args.variant == "package" else hand_written_trainer
    common = dict(
        accelerator="cpu",
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, batch_size = build(args.devices, **common)
        loader = {
            fold: DataLoader(
                SpectraDataset(data_path, fold, max_peaks_n=32),
                batch_size=batch_size,
                shuffle=False,
                collate_fn=collate_spectra,
            )
            for fold in ("train", "val")
        }
        trainer.validate(model, loader["val"], verbose=False)  # as DreaMS: a validation before training
        trainer.fit(model, loader["train"], loader["val"])
    summary = {
        "variant": args.variant,
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "batch_size": batch_size,
        "precision": trainer.precision,
        "callbacks": sorted(type(c).__name__ for c in trainer.callbacks),
        "warnings": sorted(
            {
                str(w.message)
                for w in caught
                if "lightning_memopt" in (w.filename or "") or str(w.message).startswith("MemoryAudit")
            }
        ),
        "weights": {k: v.double().sum().item() for k, v in model.state_dict().items()},
    }
    if args.result:
        Path(f"{args.result}{trainer.global_rank}.json").write_text(json.dumps(summary))
    if trainer.is_global_zero:
        print(
            f"{args.variant}: {trainer.global_step} optimizer steps, accumulate {trainer.accumulate_grad_batches}"
            f" x batch {batch_size} x {args.devices} devices, precision {trainer.precision}"
        )
        for message in summary["warnings"]:
            print(f"  {message}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
