"""DreaMS-style reading of a spectra HDF5 file: per-spectrum preprocessing, a lazily reading dataset, collation.

The file layout and the synthetic spectra are described in :mod:`examples.dreams.synthetic` (whose names are
re-exported here).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from examples.dreams.synthetic import (
    NEUTRAL_LOSSES,
    NUM_PROPERTIES,
    Substructure,
    generate_spectra_h5,
    make_vocabulary,
    spectrum_statistics,
)

__all__ = [
    "NEUTRAL_LOSSES",
    "NUM_PROPERTIES",
    "PRECURSOR_INTENSITY",
    "SpectraDataset",
    "Substructure",
    "collate_spectra",
    "generate_spectra_h5",
    "make_vocabulary",
    "preprocess_spectrum",
    "spectrum_statistics",
]

PRECURSOR_INTENSITY = 1.1


def preprocess_spectrum(spectrum: torch.Tensor, precursor_mz: float, max_peaks_n: int) -> torch.Tensor:
    """DreaMS-style preprocessing of one ``[2, P]`` spectrum into ``[1 + max_peaks_n, 2]`` tokens.

    Keeps the ``max_peaks_n`` most intense peaks, restores m/z order, divides intensities by the base peak,
    zero-pads, and prepends the precursor token ``(precursor_mz, 1.1)``. Padding rows have m/z == 0.

    Example:
        >>> spec = torch.tensor([[100.0, 150.0, 200.0], [0.5, 2.0, 1.0]])
        >>> preprocess_spectrum(spec, 300.0, max_peaks_n=2).tolist()
        [[300.0, 1.100000023841858], [150.0, 1.0], [200.0, 0.5]]
    """
    mz, inten = spectrum[0], spectrum[1]
    real = mz > 0
    mz, inten = mz[real], inten[real]
    if len(mz) > max_peaks_n:
        keep = torch.topk(inten, max_peaks_n).indices.sort().values
        mz, inten = mz[keep], inten[keep]
    out = torch.zeros(1 + max_peaks_n, 2, dtype=torch.float32)
    out[0, 0] = float(precursor_mz)
    out[0, 1] = PRECURSOR_INTENSITY
    if len(mz):
        out[1 : 1 + len(mz), 0] = mz
        out[1 : 1 + len(mz), 1] = inten / inten.max()
    return out


class SpectraDataset(Dataset):
    """One fold of a spectra HDF5 file, read lazily inside each DataLoader worker (or fully, ``in_mem``).

    In lazy mode the file is opened on the first item a process reads, so every DataLoader worker (fork or
    spawn) gets its own handle; handles are never pickled. With ``in_mem=True`` the fold is read into RAM
    once (fast, but every worker and every DDP rank holds a copy).

    Args:
        path: HDF5 file written by :func:`generate_spectra_h5` (or a file with the same columns).
        fold: ``train``, ``val`` or ``test``.
        max_peaks_n: Peaks kept per spectrum by :func:`preprocess_spectrum`.
        in_mem: Read the whole fold into memory at construction.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     ds = SpectraDataset(generate_spectra_h5(f"{d}/s.hdf5", num_spectra=30), "train", max_peaks_n=60)
        ...     item = ds[0]
        >>> item["peaks"].shape, item["substructures"].shape
        (torch.Size([61, 2]), torch.Size([32]))
    """

    def __init__(self, path: str | os.PathLike[str], fold: str, max_peaks_n: int = 100, in_mem: bool = False) -> None:
        import h5py

        if fold not in ("train", "val", "test"):
            raise ValueError(f"`fold` must be one of 'train', 'val', 'test', got {fold!r}.")
        self.path = str(path)
        self.fold = fold
        self.max_peaks_n = int(max_peaks_n)
        self.in_mem = in_mem
        with h5py.File(self.path, "r") as f:
            self.indices = np.flatnonzero(f["fold"][:] == fold.encode())
            self._data = {k: f[k][:][self.indices] for k in self._columns()} if in_mem else None
        self._file: Any = None
        self._pid: int | None = None

    @staticmethod
    def _columns() -> tuple[str, ...]:
        return ("spectrum", "precursor_mz", "substructures", "properties")

    def __len__(self) -> int:
        return len(self.indices)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"] = None
        state["_pid"] = None
        return state

    def _handle(self) -> Any:
        if self._file is None or self._pid != os.getpid():
            import h5py

            self._file = h5py.File(self.path, "r")
            self._pid = os.getpid()
        return self._file

    def _rows(self, idx: list[int]) -> dict[str, np.ndarray]:
        """Columns of the items ``idx`` (positions in this fold), in the order given."""
        if self._data is not None:
            return {k: v[idx] for k, v in self._data.items()}
        f = self._handle()
        rows = self.indices[idx]
        # h5py reads a whole batch in one call per column when the rows are increasing and unique.
        unique, inverse = np.unique(rows, return_inverse=True)
        return {k: f[k][unique][inverse] for k in self._columns()}

    def _item(self, cols: dict[str, np.ndarray], i: int) -> dict[str, torch.Tensor]:
        spectrum = torch.as_tensor(np.asarray(cols["spectrum"][i], dtype=np.float32))
        return {
            "peaks": preprocess_spectrum(spectrum, float(cols["precursor_mz"][i]), self.max_peaks_n),
            "substructures": torch.as_tensor(np.asarray(cols["substructures"][i], dtype=np.float32)),
            "properties": torch.as_tensor(np.asarray(cols["properties"][i], dtype=np.float32)),
        }

    def token_counts(self) -> list[int]:
        """Each spectrum's tokens once preprocessed (the precursor and up to ``max_peaks_n`` peaks with an m/z): the
        lengths a ``TokenBudgetBatchSampler`` batches by. Reads the fold's spectra once."""
        cols = self._rows(list(range(len(self))))
        return [1 + min(self.max_peaks_n, int((np.asarray(spectrum)[0] > 0).sum())) for spectrum in cols["spectrum"]]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"index {idx} is out of range for a fold of {len(self)} spectra")
        return self._item(self._rows([int(idx)]), 0)

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """A whole batch at once (the DataLoader calls this when it exists): one HDF5 read per column, not per item."""
        cols = self._rows([int(i) for i in indices])
        return [self._item(cols, i) for i in range(len(indices))]


def collate_spectra(items: list[dict[str, torch.Tensor]], dynamic_padding: bool = False) -> dict[str, torch.Tensor]:
    """Stack items; with ``dynamic_padding`` cut the padding to the longest spectrum of the batch.

    Fixed padding to ``max_peaks_n`` makes attention cost grow with ``(1 + max_peaks_n)**2`` even when real
    spectra have far fewer peaks; dynamic padding keeps only ``1 + max(real peaks in the batch)`` tokens.

    Example:
        >>> a = {"peaks": torch.tensor([[300.0, 1.1], [100.0, 1.0], [0.0, 0.0]]), "y": torch.zeros(2)}
        >>> collate_spectra([a, a], dynamic_padding=True)["peaks"].shape
        torch.Size([2, 2, 2])
    """
    batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    if dynamic_padding:
        real = int((batch["peaks"][:, :, 0] > 0).sum(dim=1).max())
        batch["peaks"] = batch["peaks"][:, : max(real, 1)].contiguous()
    return batch
