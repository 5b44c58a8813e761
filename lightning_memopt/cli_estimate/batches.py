"""Batches of any micro-batch size: from ``--batch-shape`` specs or from a datamodule's training set."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

from lightning_memopt.cli_estimate.classes import build
from lightning_memopt.cli_estimate.common import INT64_MAX, NAME, EstimateInputError, squash

__all__ = [
    "batch_bytes",
    "batch_source",
    "describe_batch",
    "dtype_name",
    "loader_batch_fn",
    "parse_batch_shape",
    "parse_length_batch_shape",
]


def parse_batch_shape(specs: list[str]) -> Callable[[int], Any]:
    """``batch_fn(B)`` for ``--batch-shape`` specs such as ``"B,128,64:float32"``, ``"ids=B,512:int64"``.

    ``B`` is the micro-batch size; the dtype is optional (default ``float32``). One unnamed spec gives a tensor,
    several a tuple, named ones (``name=...``) a dict. The tensors are on the meta device: shapes and dtypes, no data
    and no memory for any size (the estimate runs them as fake tensors). A tensor of more than ``2**63 - 1`` bytes is
    refused with an :class:`EstimateInputError`.

    Examples:
        >>> fn = parse_batch_shape(["ids=B,16:int64", "mask=B,16:bool"])
        >>> {k: (tuple(v.shape), str(v.dtype), v.device.type) for k, v in fn(4).items()}
        {'ids': ((4, 16), 'torch.int64', 'meta'), 'mask': ((4, 16), 'torch.bool', 'meta')}
    """
    import torch

    specs = list(specs)
    parsed = [_parse_spec(spec) for spec in specs]
    names = _check_specs(parsed)
    if any(d is not None and d < 0 for _, dims, _ in parsed for d in dims):
        raise EstimateInputError(
            "--batch-shape: a length dimension (L, L0, ...) needs --lengths FILE (the dataset's lengths) and a budget"
            " (--gpu or --device-memory): the table of the largest batch per length bucket."
        )

    def make(b: int) -> Any:
        tensors = []
        for (name, dims, given), spec in zip(parsed, specs):
            dtype = torch.float32 if given is None else given
            shape = [b if d is None else d for d in dims]
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes > INT64_MAX:
                raise EstimateInputError(
                    f"--batch-shape {spec!r} at batch size {b}: {' x '.join(map(str, shape))} {dtype_name(dtype)}"
                    f" is {nbytes:.3g} bytes, more than any tensor can hold (2**63 - 1); lower --batch-size or the"
                    " dimensions."
                )
            tensors.append((name, torch.empty(shape, dtype=dtype, device="meta")))
        if names:
            return dict(tensors)
        if len(tensors) == 1:
            return tensors[0][1]
        return tuple(t for _, t in tensors)

    return make


_Spec = tuple[str | None, list[int | None], Any]


def _parse_spec(spec: str) -> _Spec:
    """``name=B,128:int64`` -> ``("name", [None, 128], torch.int64)``; the name is ``None`` without ``=``."""
    where = f"--batch-shape {spec!r}"
    name, sep, rest = spec.partition("=")
    if not sep:
        name, rest = "", spec
    name = name.strip()
    if sep and not NAME.match(name):
        raise EstimateInputError(f"{where}: {name!r} is not a name (letters, digits, _).")
    dims_text, colon, dtype_text = rest.partition(":")
    dtype = None
    if colon:
        dtype = _parse_dtype(dtype_text.strip(), where)
    return name or None, [_parse_dim(dim.strip(), where) for dim in dims_text.split(",")], dtype


def _parse_dtype(text: str, where: str) -> Any:
    import torch

    named = getattr(torch, text, None)
    if not isinstance(named, torch.dtype):
        raise EstimateInputError(
            f"{where}: {text!r} is not a torch dtype (float32, bfloat16, float16, int64, int32, bool, ...)."
        )
    return named


def _parse_dim(dim: str, where: str) -> int | None:
    """``B`` (the micro-batch) -> ``None``; a positive int -> itself; ``L`` or ``L0`` ... ``L9`` (a length axis of
    ``--lengths``) -> ``-1`` ... ``-10``."""
    if dim in ("B", "b"):
        return None
    if dim.isdigit() and int(dim) > 0:
        return int(dim)
    if dim in ("L", "l") or (len(dim) == 2 and dim[0] in "Ll" and dim[1].isdigit()):
        return -1 - (int(dim[1]) if len(dim) == 2 else 0)
    raise EstimateInputError(
        f"{where}: dimension {dim!r} is neither B (the micro-batch), L0..L9 (a length axis of --lengths) nor a"
        " positive int. Example: --batch-shape B,128,64:float32"
    )


def parse_length_batch_shape(specs: list[str], axes: int) -> Callable[[int, Any], Any]:
    """``batch_fn(B, lengths)`` for ``--batch-shape`` specs whose dimensions may be ``L`` / ``L0`` ... (the length of
    axis k of ``--lengths``, each sample's ``axes`` lengths), as :func:`parse_batch_shape` makes them.

    Examples:
        >>> fn = parse_length_batch_shape(["ids=B,L0:int64", "labels=B,L1:int64"], 2)
        >>> {k: tuple(v.shape) for k, v in fn(4, (128, 32)).items()}
        {'ids': (4, 128), 'labels': (4, 32)}
    """
    parsed = [_parse_spec(spec) for spec in specs]
    used = {-1 - d for _, dims, _ in parsed for d in dims if d is not None and d < 0}
    if not used:
        raise EstimateInputError(
            "--lengths: no --batch-shape dimension is a length; write L (or L0, L1, ... per length axis) where the"
            " sequence goes, e.g. --batch-shape ids=B,L:int64."
        )
    if max(used) >= axes:
        raise EstimateInputError(
            f"--batch-shape: L{max(used)} but --lengths has {axes} length(s) per sample (L0 to L{axes - 1})."
        )

    def make(b: int, lengths: Any) -> Any:
        values = (lengths,) if isinstance(lengths, int) else tuple(lengths)
        resolved = [_with_lengths(spec, dims, values) for spec, (_, dims, _) in zip(specs, parsed)]
        return parse_batch_shape(resolved)(b)

    return make


def _with_lengths(spec: str, dims: list[int | None], lengths: tuple[int, ...]) -> str:
    """``spec`` with its length dimensions replaced by ``lengths``."""
    name, sep, rest = spec.partition("=")
    head = f"{name}=" if sep else ""
    body = rest if sep else spec
    _, colon, dtype = body.partition(":")
    text = ",".join(_dim_text(d, lengths) for d in dims)
    return f"{head}{text}{colon}{dtype}"


def _dim_text(d: int | None, lengths: tuple[int, ...]) -> str:
    """One dimension of a spec: ``B`` for ``None``, the length a negative ``d`` stands for (-1: L0), else ``d``."""
    if d is None:
        return "B"
    if d < 0:
        return str(lengths[-1 - d])
    return str(d)


def _check_specs(parsed: list[_Spec]) -> list[str]:
    """The names of the specs, checked together: all named or none, each once, and B somewhere."""
    named = [p[0] is not None for p in parsed]
    if any(named) and not all(named):
        raise EstimateInputError("--batch-shape: name all tensors (name=B,...: a dict) or none (a tensor or tuple).")
    names = [p[0] for p in parsed if p[0] is not None]
    if len(set(names)) != len(names):
        raise EstimateInputError(f"--batch-shape: a name given twice ({', '.join(names)}).")
    if not any(None in dims for _, dims, _ in parsed):
        raise EstimateInputError(
            "--batch-shape: no tensor has the micro-batch dimension B; write it where the batch goes, e.g. B,128,64."
        )
    return names


def dtype_name(dtype: Any) -> str:
    """``torch.int64`` -> ``int64``."""
    return str(dtype).replace("torch.", "")


def batch_bytes(batch: Any) -> int:
    """The bytes of a batch's tensors (each storage once); meta tensors count what they would hold.

    Examples:
        >>> batch_bytes(parse_batch_shape(["ids=B,4096:int64", "mask=B,4096:bool"])(10**6))  # meta: nothing held
        36864000000
    """
    import torch
    from torch.utils._pytree import tree_flatten

    storages: dict[Any, int] = {}
    for t in tree_flatten(batch)[0]:
        if isinstance(t, torch.Tensor) and not t.is_sparse:
            storage = t.untyped_storage()  # a meta storage has no address: each tensor counts as its own
            if t.device.type == "meta":
                key: Any = id(t)
            else:
                key = (t.device, storage.data_ptr())
            storages[key] = storage.nbytes()
    return sum(storages.values())


def describe_batch(batch: Any) -> str:
    """The tensors of a batch in a few words: ``peaks float32[8, 101, 2], substructures float32[8, 32]``."""
    import torch

    parts: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            dtype = dtype_name(value.dtype)
            parts.append(f"{path + ' ' if path else ''}{dtype}[{', '.join(str(s) for s in value.shape)}]")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")

    walk(batch, "")
    text = ", ".join(parts[:8]) + (f", ... ({len(parts)} tensors)" if len(parts) > 8 else "")
    return text or f"no tensors ({type(batch).__name__})"


def loader_batch_fn(source: Any, where: str) -> tuple[Callable[[int], Any], int | None]:
    """``batch_fn(b)``: the first ``b`` samples of ``source.train_dataloader()``'s dataset, in order, collated.

    ``source`` is a datamodule (``prepare_data()`` and ``setup("fit")`` run first) or a LightningModule that defines
    its own ``train_dataloader``. Returns the function and the loader's own batch size (``None`` if it has none).
    """
    loader = _train_loader(source, where)
    return _LoaderBatches(loader, f"{where}: ", type(source).__name__), loader.batch_size


def _train_loader(source: Any, where: str) -> Any:
    """``source.train_dataloader()`` after ``prepare_data`` and ``setup("fit")``, checked to batch automatically."""
    from torch.utils.data import DataLoader

    name = type(source).__name__
    for hook, call in (
        ("prepare_data", lambda: source.prepare_data()),
        ("setup('fit')", lambda: source.setup("fit")),
        ("train_dataloader()", lambda: source.train_dataloader()),
    ):
        try:
            loader = call()
        except Exception as err:  # the user's hook, outside a Trainer: one line naming the flag
            raise EstimateInputError(
                f"{where}: {name}.{hook} failed outside a Trainer ({type(err).__name__}: {squash(err)})."
                " Fix its init args, or describe the batch with --batch-shape instead."
            ) from None
    if not isinstance(loader, DataLoader):
        raise EstimateInputError(
            f"{where}: {name}.train_dataloader() returned a {type(loader).__name__}, not one"
            " DataLoader; describe the batch with --batch-shape instead."
        )
    if loader.batch_size is None and loader.batch_sampler is None:
        raise EstimateInputError(
            f"{where}: {name}'s DataLoader has automatic batching off (its dataset yields whole"
            " batches), so batches of another size cannot be made; use --batch-shape instead."
        )
    return loader


class _LoaderBatches:
    """``batches(b)``: the first ``b`` samples of a loader's dataset, collated; the last batch is kept."""

    def __init__(self, loader: Any, where: str, name: str) -> None:
        self.dataset, self.collate = loader.dataset, loader.collate_fn
        self.where, self.name = where, name
        self.last: dict[int, Any] = {}
        self.per_sample: int | None = None  # the bytes of one sample, read once before a batch of many

    def __call__(self, b: int) -> Any:
        if b not in self.last:
            if b > 1:  # real data: read only what this machine can hold
                if self.per_sample is None:
                    self.per_sample = batch_bytes(self.read(1))
                _check_host_memory(b, self.per_sample, f"{self.where}{b} samples of {self.name}'s training set")
            batch = self.read(b)
            self.last.clear()  # keep one batch: the planner asks for each size once, or twice in a row
            self.last[b] = batch
        return self.last[b]

    def read(self, b: int) -> Any:
        try:
            return next(iter(self._loader(b)))
        except StopIteration:
            raise EstimateInputError(f"{self.where}{self.name}'s training set is empty.") from None
        except EstimateInputError:
            raise
        except Exception as err:  # the user's dataset or collate_fn: one line naming the flag
            raise EstimateInputError(
                f"{self.where}reading the first {b} samples of {self.name}'s training set failed"
                f" ({type(err).__name__}: {squash(err)})."
            ) from None

    def _loader(self, b: int) -> Any:
        from torch.utils.data import DataLoader, IterableDataset

        if isinstance(self.dataset, IterableDataset):
            return DataLoader(self.dataset, batch_size=b, collate_fn=self.collate)
        n = len(cast(Sized, self.dataset))  # a map-style dataset: its length (a TypeError where it has none)
        if n == 0:
            raise EstimateInputError(f"{self.where}{self.name}'s training set is empty.")
        # the first b samples in order; a set smaller than b is cycled so the batch has b samples
        return DataLoader(self.dataset, batch_size=b, sampler=_Cycled(b, n), collate_fn=self.collate)


class _Cycled:
    """The indices ``0, 1, ..., n - 1, 0, 1, ...``, ``size`` of them, without holding them (a sampler)."""

    def __init__(self, size: int, n: int) -> None:
        self.size, self.n = size, n

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        return (i % self.n for i in range(self.size))


def _check_host_memory(samples: int, sample_bytes: int, what: str) -> None:
    """One line where ``samples`` samples of real data would not fit this machine's memory (read, then faked)."""
    from lightning_memopt.utilities.formatting import format_bytes

    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): nothing to compare with
        return
    need = samples * sample_bytes
    if need > host:
        raise EstimateInputError(
            f"{what} would take {format_bytes(need)} of host memory to read ({format_bytes(sample_bytes)} a"
            f" sample), more than this machine has ({format_bytes(host)}). Lower the batch size, or describe the"
            " batch with --batch-shape, which holds no data."
        )


def batch_source(
    args: argparse.Namespace, specs: dict[str, Any], model: Any
) -> tuple[Callable[[int], Any], int | None, str]:
    """``(batch_fn, the datamodule's batch size or None, the source in words)``."""
    if args.batch_shape:
        return parse_batch_shape(args.batch_shape), None, f"--batch-shape {' '.join(args.batch_shape)}"
    data_spec = specs["data"]
    if data_spec is not None and not data_spec.get("class_path"):
        raise EstimateInputError(
            "--data: the config's data section has no class_path; pass --data CLASS_PATH (the"
            " LightningDataModule, e.g. examples.dreams.module.SpectraDataModule), or"
            " --batch-shape."
        )
    if data_spec is not None:
        holder = build(data_spec, "--data")
        if not callable(getattr(holder, "train_dataloader", None)):
            raise EstimateInputError(
                f"--data: {data_spec['class_path']} built a {type(holder).__name__}, which has no train_dataloader()."
            )
        where = "--data"
    elif _own_train_dataloader(model):
        holder, where = model, "--model"
    else:
        raise EstimateInputError(
            "no batch: pass --data CLASS_PATH (or --config with a data section) to take it from"
            " the datamodule, or --batch-shape B,128,64:float32 to describe it."
        )
    batch_fn, batch_size = loader_batch_fn(holder, where)
    return batch_fn, batch_size, f"the first samples of {type(holder).__name__}.train_dataloader()'s dataset, in order"


def _own_train_dataloader(model: Any) -> bool:
    """Whether a LightningModule defines its own ``train_dataloader`` (LightningCLI runs without a datamodule)."""
    from lightning_memopt.utilities.namespaces import classes

    method = getattr(type(model), "train_dataloader", None)
    hooks = classes("core.hooks.DataHooks")
    return method is not None and all(method is not getattr(base, "train_dataloader", None) for base in hooks)
