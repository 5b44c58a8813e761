"""Synthetic MS/MS spectra in a DreaMS-style HDF5 layout, and a lazily reading dataset.

File layout (one dataset per column, same first dimension ``N``):

* ``spectrum`` float32 ``[N, 2, P]``: row 0 m/z (ascending), row 1 intensity (base peak = 1), zero-padded;
  only the ``P`` most intense peaks are kept.
* ``precursor_mz`` float32 ``[N]``, ``charge`` int8 ``[N]``, ``fold`` bytes ``[N]`` (``train``/``val``/``test``).
* Labels: ``substructures`` uint8 ``[N, K]`` (which hidden substructures the molecule has) and
  ``properties`` float32 ``[N, 4]`` (standardised substructure bits times a fixed matrix, plus a little noise).

How a spectrum is built: a fixed vocabulary of ``K`` hidden substructures, each with 1-3 diagnostic fragment
ions (nominal m/z 55-399 plus a mass defect of about 0.00048 x m), sometimes (p = 0.3) a characteristic neutral
loss, and a mass contribution of 20-80 Da. A molecule switches each substructure on with probability 0.15 (at least
one); its precursor m/z is 90 + the contributions + U(0, 120) (capped at 990). The spectrum holds the diagnostic
peaks below the precursor (jittered m/z, intensity U(0.2, 1)), the neutral-loss peaks at precursor - loss, about 16
background peaks (log-normal count, 40 % of them weak) and, half of the time, the precursor ion; intensities get
5 % multiplicative noise. Statistics (5/50/95 % quantiles): peaks per spectrum about 12/27/55, precursor m/z about
220/395/610.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "NEUTRAL_LOSSES",
    "NUM_PROPERTIES",
    "Substructure",
    "generate_spectra_h5",
    "make_vocabulary",
    "spectrum_statistics",
]

NEUTRAL_LOSSES = (18.0106, 17.0265, 27.9949, 43.9898, 46.0055, 32.0262, 60.0211, 162.0528)
NUM_PROPERTIES = 4


@dataclass(frozen=True)
class Substructure:
    """One hidden substructure: its fragment ions, optional neutral loss and mass contribution."""

    fragments: tuple[float, ...]
    neutral_loss: float | None
    mass: float


def make_vocabulary(num_substructures: int = 32, seed: int = 0) -> list[Substructure]:
    """The fixed vocabulary of hidden substructures (the same for a given seed).

    Example:
        >>> vocab = make_vocabulary(4, seed=0)
        >>> len(vocab), all(55 <= f < 400.3 for s in vocab for f in s.fragments)
        (4, True)
    """
    rng = np.random.default_rng(seed)
    vocab = []
    for _ in range(num_substructures):
        n = int(rng.integers(1, 4))
        nominal = rng.integers(55, 400, size=n).astype(np.float64)
        fragments = nominal + 0.00048 * nominal + rng.normal(0.0, 0.002, size=n)
        loss = float(rng.choice(NEUTRAL_LOSSES)) if rng.random() < 0.3 else None
        vocab.append(Substructure(tuple(float(f) for f in fragments), loss, float(rng.uniform(20, 80))))
    return vocab


def _property_matrix(num_substructures: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    return rng.normal(0.0, 1.0, size=(num_substructures, NUM_PROPERTIES)) / np.sqrt(num_substructures)


def _one_spectrum(rng: np.random.Generator, vocab: list[Substructure], p_on: float) -> tuple[np.ndarray, ...]:
    k = len(vocab)
    bits = rng.random(k) < p_on
    if not bits.any():
        bits[rng.integers(k)] = True
    on = np.flatnonzero(bits)
    precursor = min(90.0 + sum(vocab[i].mass for i in on) + rng.uniform(0, 120), 990.0)
    mz: list[float] = []
    inten: list[float] = []
    for i in on:
        for frag in vocab[i].fragments:
            if frag < precursor - 1:
                mz.append(frag + rng.normal(0.0, 0.001))
                inten.append(rng.uniform(0.2, 1.0))
        loss = vocab[i].neutral_loss
        if loss is not None and precursor - loss > 40:
            mz.append(precursor - loss + rng.normal(0.0, 0.001))
            inten.append(rng.uniform(0.1, 0.7))
    n_background = int(np.clip(rng.lognormal(np.log(16.0), 0.62), 1, 200))
    bg_mz = rng.uniform(40.0, max(precursor - 1, 41.0), size=n_background)
    bg_mz = np.floor(bg_mz) + 0.00048 * np.floor(bg_mz) + rng.uniform(-0.05, 0.15, size=n_background)
    weak = rng.random(n_background) < 0.4
    bg_int = np.where(weak, rng.uniform(0.005, 0.03, size=n_background), rng.uniform(0.03, 0.5, size=n_background))
    mz.extend(bg_mz.tolist())
    inten.extend(bg_int.tolist())
    if rng.random() < 0.5:
        mz.append(precursor)
        inten.append(rng.uniform(0.05, 0.6))
    mz_arr = np.asarray(mz)
    int_arr = np.asarray(inten) * (1.0 + rng.normal(0.0, 0.05, size=len(inten))).clip(0.5)
    return mz_arr, int_arr, float(precursor), bits


def generate_spectra_h5(
    path: str | os.PathLike[str],
    num_spectra: int = 4000,
    num_substructures: int = 32,
    max_peaks: int = 128,
    p_on: float = 0.15,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write ``num_spectra`` synthetic spectra and their labels to an HDF5 file (see the module docstring).

    Args:
        path: Output file (``.hdf5``); written atomically (a temporary file renamed at the end).
        num_spectra: Number of spectra ``N``.
        num_substructures: Size ``K`` of the hidden substructure vocabulary (the fingerprint length).
        max_peaks: ``P``, the peaks kept per spectrum (the most intense ones).
        p_on: Probability that a molecule has a given substructure.
        val_fraction: Fraction of spectra in the ``val`` fold.
        test_fraction: Fraction of spectra in the ``test`` fold.
        seed: Seed of the vocabulary and of the spectra.
        dtype: ``float32`` (default) or ``float64`` (the published files' dtype; twice the RAM).

    Returns:
        The path written.

    Example:
        >>> import tempfile, h5py
        >>> with tempfile.TemporaryDirectory() as d:
        ...     p = generate_spectra_h5(f"{d}/s.hdf5", num_spectra=20)
        ...     with h5py.File(p) as f:
        ...         print(f["spectrum"].shape, f["substructures"].shape, f["properties"].shape)
        (20, 2, 128) (20, 32) (20, 4)
    """
    import h5py

    if num_spectra < 1:
        raise ValueError(f"`num_spectra` must be a positive int, got {num_spectra!r}.")
    if dtype not in ("float32", "float64"):
        raise ValueError(f"`dtype` must be one of 'float32', 'float64', got {dtype!r}.")
    vocab = make_vocabulary(num_substructures, seed)
    weights = _property_matrix(num_substructures, seed)
    rng = np.random.default_rng(seed + 2)
    spectra = np.zeros((num_spectra, 2, max_peaks), dtype=dtype)
    precursors = np.zeros(num_spectra, dtype=dtype)
    bits = np.zeros((num_spectra, num_substructures), dtype=np.uint8)
    for n in range(num_spectra):
        mz, inten, precursor, on = _one_spectrum(rng, vocab, p_on)
        keep = np.argsort(-inten, kind="stable")[:max_peaks]
        mz, inten = mz[keep], inten[keep]
        order = np.argsort(mz, kind="stable")
        spectra[n, 0, : len(order)] = mz[order]
        spectra[n, 1, : len(order)] = inten[order] / inten.max()
        precursors[n] = precursor
        bits[n] = on
    standardised = (bits - p_on) / np.sqrt(p_on * (1 - p_on))
    properties = standardised @ weights + rng.normal(0.0, 0.1, size=(num_spectra, NUM_PROPERTIES))
    u = rng.random(num_spectra)
    fold = np.where(u < val_fraction, b"val", np.where(u < val_fraction + test_fraction, b"test", b"train"))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with h5py.File(tmp, "w") as f:
        f.create_dataset("spectrum", data=spectra)
        f.create_dataset("precursor_mz", data=precursors)
        f.create_dataset("charge", data=np.ones(num_spectra, dtype=np.int8))
        f.create_dataset("fold", data=fold.astype("S5"))
        f.create_dataset("substructures", data=bits)
        f.create_dataset("properties", data=properties.astype(np.float32))
        f.attrs.update({"num_substructures": num_substructures, "seed": seed, "p_on": p_on})
    os.replace(tmp, path)
    return path


def spectrum_statistics(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Peak-count and precursor m/z quantiles (5/50/95 %) of a spectra file, and its label means."""
    import h5py

    with h5py.File(path, "r") as f:
        spectra = f["spectrum"][:]
        precursors = f["precursor_mz"][:]
        bits = f["substructures"][:]
        folds = f["fold"][:]
    peaks = (spectra[:, 0, :] > 0).sum(axis=1)
    return {
        "num_spectra": len(spectra),
        "peaks_q05_q50_q95": [float(q) for q in np.quantile(peaks, [0.05, 0.5, 0.95])],
        "precursor_mz_q05_q50_q95": [float(q) for q in np.quantile(precursors, [0.05, 0.5, 0.95])],
        "substructure_rate": float(bits.mean()),
        "folds": {k.decode(): int((folds == k).sum()) for k in np.unique(folds)},
    }
