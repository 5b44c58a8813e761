"""A DreaMS-style spectrum transformer: Fourier m/z features + a peak MLP -> pre-norm encoder.

Each of the ``1 + max_peaks_n`` tokens (precursor first) becomes ``concat(fourier(m/z), peak_mlp(m/z, intensity))``,
so ``d_model = d_fourier + d_peak``. There is no positional encoding: order comes from m/z. Padding tokens
(m/z == 0) are masked out of attention. The encoder is a stack of pre-norm ``nn.TransformerEncoderLayer``
(bias-free, FF 4x); the fine-tuning head reads the precursor token's final embedding.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["MODEL_PRESETS", "FourierFeatures", "SpectrumEncoder", "SpectrumEncoderConfig", "model_config"]


@dataclass(frozen=True)
class SpectrumEncoderConfig:
    """Sizes of the spectrum encoder.

    Args:
        d_fourier: Width of the Fourier branch's output.
        d_peak: Width of the (m/z, intensity) MLP's output. ``d_fourier + d_peak`` is ``d_model``.
        n_layers: Encoder layers.
        n_heads: Attention heads (must divide ``d_model``).
        n_freq_low: Fourier frequencies with periods log-spaced in [2e-4, 1] Da (mass defect).
        n_freq_high: Fourier frequencies evenly spaced between periods of 999 and 2 Da (integer mass).
        fourier_mlp_layers: Layers of the MLP over the ``2 * (n_freq_low + n_freq_high)`` sin/cos features.
        fourier_mlp_width: Hidden width of that MLP.
        dropout: Dropout in the encoder layers.
    """

    d_fourier: int = 48
    d_peak: int = 16
    n_layers: int = 3
    n_heads: int = 4
    n_freq_low: int = 32
    n_freq_high: int = 224
    fourier_mlp_layers: int = 2
    fourier_mlp_width: int = 128
    dropout: float = 0.0

    @property
    def d_model(self) -> int:
        return self.d_fourier + self.d_peak


#: ``tiny`` trains on a laptop CPU in a minute (~0.2M parameters); ``small`` (~3.5M) is for a small GPU;
#: ``dreams-base`` has DreaMS's published sizes (1024-d, 7 layers, 8 heads, 5,997 frequencies; ~95M).
MODEL_PRESETS: dict[str, SpectrumEncoderConfig] = {
    "tiny": SpectrumEncoderConfig(),
    "small": SpectrumEncoderConfig(
        d_fourier=224,
        d_peak=32,
        n_layers=4,
        n_heads=8,
        n_freq_low=256,
        n_freq_high=256,
        fourier_mlp_layers=3,
        fourier_mlp_width=256,
        dropout=0.05,
    ),
    "dreams-base": SpectrumEncoderConfig(
        d_fourier=980,
        d_peak=44,
        n_layers=7,
        n_heads=8,
        n_freq_low=4999,
        n_freq_high=998,
        fourier_mlp_layers=5,
        fourier_mlp_width=512,
        dropout=0.1,
    ),
}


def model_config(preset: str = "tiny", **overrides: Any) -> SpectrumEncoderConfig:
    """A preset's config with ``None``-free overrides applied, checked.

    Example:
        >>> model_config("tiny", n_layers=2).n_layers
        2
        >>> model_config("huge")
        Traceback (most recent call last):
        ...
        ValueError: `model_preset` must be one of 'tiny', 'small', 'dreams-base', got 'huge'.
    """
    if preset not in MODEL_PRESETS:
        allowed = ", ".join(repr(k) for k in MODEL_PRESETS)
        raise ValueError(f"`model_preset` must be one of {allowed}, got {preset!r}.")
    cfg = replace(MODEL_PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    if cfg.d_model % cfg.n_heads:
        raise ValueError(
            f"`n_heads` must divide d_model = d_fourier + d_peak = {cfg.d_model}, got n_heads={cfg.n_heads}."
            " Change `d_fourier`, `d_peak` or `n_heads`."
        )
    return cfg


class FourierFeatures(nn.Module):
    """Fixed sin/cos features of raw m/z followed by a trainable MLP.

    Periods: ``n_low`` log-spaced in [2e-4, 1] Da (they resolve the mass defect) and ``n_high`` over [2, 999] Da,
    evenly spaced in frequency (the integer part). The ``2 * (n_low + n_high)``-wide feature tensor is the widest
    activation of the model at ``dreams-base`` size, and it is saved for backward.
    """

    def __init__(self, n_low: int, n_high: int, layers: int, width: int, d_out: int) -> None:
        super().__init__()
        low = torch.logspace(math.log10(2e-4), 0.0, n_low, dtype=torch.float64) if n_low else torch.empty(0)
        # Evenly spaced in frequency between periods of 999 and 2 Da: a Fourier basis of the integer-mass range.
        high = 1.0 / torch.linspace(1.0 / 999.0, 0.5, n_high, dtype=torch.float64) if n_high else torch.empty(0)
        freqs = 2 * math.pi / torch.cat([low.double(), high.double()])
        self.register_buffer("freqs", freqs.float(), persistent=False)
        dims = [2 * len(freqs)] + [width] * (layers - 1) + [d_out]
        mods: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(dims)):
            mods.append(nn.Linear(a, b))
            if i < len(dims) - 2:
                mods.append(nn.ReLU())
        self.mlp = nn.Sequential(*mods)

    def forward(self, mz: torch.Tensor) -> torch.Tensor:
        # The phase is computed in float64 so the mass-defect periods (2e-4 Da at m/z ~1000) keep their meaning.
        phase = (mz.double().unsqueeze(-1) * self.freqs.double()).remainder(2 * math.pi)
        feats = torch.cat([phase.sin(), phase.cos()], dim=-1).to(self.mlp[0].weight.dtype)
        return self.mlp(feats)


class SpectrumEncoder(nn.Module):
    """The backbone: peaks ``[B, 1 + n, 2]`` (m/z, intensity; m/z == 0 is padding) -> embeddings ``[B, 1 + n, d]``.

    Args:
        config: Sizes.

    Example:
        >>> enc = SpectrumEncoder(model_config("tiny"))
        >>> peaks = torch.tensor([[[300.0, 1.1], [100.0, 1.0], [0.0, 0.0]]])
        >>> enc(peaks).shape
        torch.Size([1, 3, 64])
    """

    def __init__(self, config: SpectrumEncoderConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.fourier = FourierFeatures(
            config.n_freq_low, config.n_freq_high, config.fourier_mlp_layers, config.fourier_mlp_width, config.d_fourier
        )
        self.peak_mlp = nn.Sequential(nn.Linear(2, config.d_peak), nn.ReLU(), nn.Linear(config.d_peak, config.d_peak))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d,
                config.n_heads,
                dim_feedforward=4 * d,
                dropout=config.dropout,
                activation="gelu",
                batch_first=True,
                norm_first=True,
                bias=False,
            )
            for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(d)
        self.gradient_checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each encoder layer's activations in backward instead of keeping them (less memory)."""
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    def forward(self, peaks: torch.Tensor) -> torch.Tensor:
        mz, inten = peaks[..., 0], peaks[..., 1]
        padding = mz == 0
        peak_in = torch.stack([mz / 1000.0, inten], dim=-1).to(self.peak_mlp[0].weight.dtype)
        x = torch.cat([self.fourier(mz), self.peak_mlp(peak_in)], dim=-1)
        x = x.masked_fill(padding.unsqueeze(-1), 0.0)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, None, padding, use_reentrant=False)
            else:
                x = layer(x, src_key_padding_mask=padding)
        return self.norm(x)

    def describe(self) -> dict[str, Any]:
        return {
            **asdict(self.config),
            "d_model": self.config.d_model,
            "parameters": sum(p.numel() for p in self.parameters()),
        }
