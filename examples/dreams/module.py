"""The LightningModule of the DreaMS-style fine-tuning example; its LightningDataModule is re-exported here."""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from examples.dreams.data import NUM_PROPERTIES
from examples.dreams.datamodule import SpectraDataModule  # the module and its data, importable together
from examples.dreams.model import SpectrumEncoder, model_config

__all__ = ["SpectraDataModule", "SpectraFineTuner", "load_backbone_state"]


def load_backbone_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Backbone weights from a Lightning checkpoint of this example or from a plain backbone ``state_dict``.

    Loaded onto the CPU (``map_location="cpu"``): loading a GPU checkpoint onto the GPU keeps a second copy of
    the weights alive next to the model's own until the dict is dropped.
    """
    obj = torch.load(path, map_location="cpu", weights_only=True)
    state = obj.get("state_dict", obj)
    if any(k.startswith("backbone.") for k in state):
        state = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
    if not state:
        raise ValueError(f"`pre_trained_pth` {str(path)!r} holds no backbone weights (no `backbone.*` keys).")
    return state


class SpectraFineTuner(pl.LightningModule):
    """Fine-tunes a spectrum transformer to predict substructure bits (BCE) and 4 properties (MSE).

    The loss is ``BCE(substructures) + MSE(properties)``; validation also logs each part and
    ``val_baseline_loss``, the loss of always predicting the training set's mean (the bar to beat).

    Args:
        model_preset: ``tiny``, ``small`` or ``dreams-base`` (see ``examples.dreams.model.MODEL_PRESETS``).
        d_fourier: Override of the preset's Fourier width.
        d_peak: Override of the preset's peak-MLP width.
        n_layers: Override of the preset's layer count.
        n_heads: Override of the preset's head count.
        dropout: Override of the preset's dropout.
        num_substructures: Length of the substructure fingerprint.
        lr: AdamW learning rate of the backbone (linear warm-up over ``warmup_steps``).
        head_lr_scale: The head (and the backbone's final norm) learn at ``lr * head_lr_scale``: a freshly
            initialised head on top of a trained backbone needs larger steps than the backbone, whose weights should
            move little. Adam moves each weight by about ``lr`` per step, so with a small ``lr`` the head's logits
            would grow too slowly to become confident.
        weight_decay: AdamW weight decay.
        warmup_steps: Optimizer steps of linear learning-rate warm-up.
        pre_trained_pth: Checkpoint to load the backbone from (a Lightning checkpoint of this example or a backbone
            ``state_dict``).
        unfreeze_backbone_at_epoch: Keep the backbone frozen (only the head trains) until this epoch; 0 = never frozen.
        gradient_checkpointing: Recompute encoder-layer activations in backward.
    """

    def __init__(
        self,
        model_preset: str = "tiny",
        d_fourier: int | None = None,
        d_peak: int | None = None,
        n_layers: int | None = None,
        n_heads: int | None = None,
        dropout: float | None = None,
        num_substructures: int = 32,
        lr: float = 3e-3,
        head_lr_scale: float = 10.0,
        weight_decay: float = 0.01,
        warmup_steps: int = 20,
        pre_trained_pth: str | None = None,
        unfreeze_backbone_at_epoch: int = 0,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        cfg = model_config(
            model_preset, d_fourier=d_fourier, d_peak=d_peak, n_layers=n_layers, n_heads=n_heads, dropout=dropout
        )
        self.backbone = SpectrumEncoder(cfg)
        self.head = nn.Linear(cfg.d_model, num_substructures + NUM_PROPERTIES)
        with torch.no_grad():  # start from the usual substructure rate instead of p = 0.5
            self.head.bias[:num_substructures] = math.log(0.15 / 0.85)
        self.num_substructures = num_substructures
        if not head_lr_scale > 0:
            raise ValueError(f"`head_lr_scale` must be a positive number, got {head_lr_scale!r}.")
        if unfreeze_backbone_at_epoch < 0:
            raise ValueError(
                f"`unfreeze_backbone_at_epoch` must be >= 0 (0 = never frozen), got {unfreeze_backbone_at_epoch}."
            )
        if gradient_checkpointing:
            self.backbone.gradient_checkpointing_enable()
        if pre_trained_pth:
            self.load_backbone(pre_trained_pth)
        elif unfreeze_backbone_at_epoch > 0:
            rank_zero_warn(
                "`unfreeze_backbone_at_epoch` > 0 without `pre_trained_pth`: the frozen backbone is"
                " randomly initialised, so only the head learns until it is unfrozen."
            )
        self.register_buffer("prior_bits", torch.full((num_substructures,), 0.15), persistent=False)
        self.register_buffer("prior_properties", torch.zeros(NUM_PROPERTIES), persistent=False)

    def load_backbone(self, path: str | os.PathLike[str]) -> None:
        """Load the backbone's weights from ``path`` (see :func:`load_backbone_state`); the head stays as it is."""
        state = load_backbone_state(path)
        try:
            missing, unexpected = self.backbone.load_state_dict(state, strict=False)
        except RuntimeError as err:  # shape mismatches raise even with strict=False
            raise ValueError(
                f"`pre_trained_pth` {str(path)!r} does not fit this backbone ({self.backbone.config}). Pass the"
                f" `model_preset` and size overrides it was trained with. Details: {err}"
            ) from err
        if missing:
            raise ValueError(
                f"`pre_trained_pth` {str(path)!r} lacks {len(missing)} backbone weights, e.g. "
                f"{missing[:3]}. Pass the `model_preset` and size overrides it was trained with."
            )
        rank_zero_info(
            f"Loaded the backbone from {path} ({len(state)} tensors"
            + (f"; ignored {len(unexpected)} unexpected keys)" if unexpected else ")")
        )

    def gradient_checkpointing_enable(self) -> None:
        """Hugging Face-style switch, so ``GradientCheckpointing`` callbacks can turn it on."""
        self.backbone.gradient_checkpointing_enable()

    def gradient_checkpointing_disable(self) -> None:
        """Turn activation recomputation off again (``GradientCheckpointing`` calls it at teardown)."""
        self.backbone.gradient_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.backbone.gradient_checkpointing

    @property
    def backbone_frozen(self) -> bool:
        """Whether the backbone is frozen in the current epoch (``current_epoch < unfreeze_backbone_at_epoch``)."""
        return self.current_epoch < self.hparams.unfreeze_backbone_at_epoch

    def forward(self, peaks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.backbone(peaks)[:, 0])
        return out[:, : self.num_substructures], out[:, self.num_substructures :]

    def _losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits, props = self(batch["peaks"])
        bce = F.binary_cross_entropy_with_logits(logits.float(), batch["substructures"])
        mse = F.mse_loss(props.float(), batch["properties"])
        return {"loss": bce + mse, "bce": bce, "mse": mse}

    @override
    def on_fit_start(self) -> None:
        dm = self.trainer.datamodule
        if isinstance(dm, SpectraDataModule):
            bits, props = dm.train_label_means()
            self.prior_bits.copy_(bits)
            self.prior_properties.copy_(props)

    @override
    def on_train_epoch_start(self) -> None:
        # Lightning does not switch modules back to training mode between epochs: set both ways explicitly.
        frozen = self.backbone_frozen
        changed = any(p.requires_grad == frozen for p in self.backbone.parameters())
        for p in self.backbone.parameters():
            p.requires_grad_(not frozen)
        self.backbone.train(not frozen)
        if changed and (frozen or self.current_epoch > 0):
            state = "frozen (only the head trains)" if frozen else "unfrozen"
            rank_zero_info(f"Epoch {self.current_epoch}: backbone {state}.")

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        losses = self._losses(batch)
        self.log_dict({f"train_{k}": v for k, v in losses.items()}, prog_bar=False, batch_size=len(batch["peaks"]))
        return losses["loss"]

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        losses = self._losses(batch)
        n = len(batch["peaks"])
        p = self.prior_bits.clamp(1e-6, 1 - 1e-6).expand_as(batch["substructures"])
        baseline = F.binary_cross_entropy(p, batch["substructures"]) + F.mse_loss(
            self.prior_properties.expand_as(batch["properties"]), batch["properties"]
        )
        self.log_dict({f"val_{k}": v for k, v in losses.items()}, prog_bar=True, batch_size=n, sync_dist=True)
        self.log("val_baseline_loss", baseline, batch_size=n, sync_dist=True)

    @override
    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        fast = [*self.head.parameters(), *self.backbone.norm.parameters()]
        fast_ids = {id(p) for p in fast}
        groups = [
            {"params": [p for p in self.parameters() if id(p) not in fast_ids], "lr": lr},
            {"params": fast, "lr": lr * self.hparams.head_lr_scale},
        ]
        opt = torch.optim.AdamW(groups, lr=lr, weight_decay=self.hparams.weight_decay)
        warmup = max(1, int(self.hparams.warmup_steps))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
