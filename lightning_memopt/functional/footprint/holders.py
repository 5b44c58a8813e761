"""Where tensors are held: the containers and attributes of an object, walked for tensors with their paths."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from lightning_memopt.functional.footprint.storage import INSPECTION_ERRORS, StorageKey, storage_key

__all__ = ["MODULE_INTERNALS", "find_storage_holders", "iter_held_tensors"]

#: What every ``nn.Module`` has in its ``__dict__`` (hook registries, parameter, buffer and submodule dicts, ...).
MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def _children(value: Any, where: str) -> list[tuple[str, Any]]:
    """``(path, item)`` of what a module (parameters, buffers, attributes), mapping or collection holds; ``[]`` for
    anything else."""
    if isinstance(value, torch.nn.Module):
        named = [*value.named_parameters(), *value.named_buffers()]
        named += [(k, v) for k, v in vars(value).items() if k not in MODULE_INTERNALS]
        return [(f"{where}.{k}", v) for k, v in named]
    if isinstance(value, Mapping):
        return [(f"{where}[{k!r}]", v) for k, v in list(value.items())]
    if isinstance(value, (list, tuple, set, frozenset)) or type(value).__name__ == "deque":
        return [(f"{where}[{i}]", v) for i, v in enumerate(list(value))]
    return []


def iter_held_tensors(
    obj: Any,
    path: str = "",
    max_depth: int = 4,
    max_items: int = 100_000,
    into_modules: bool = False,
    seen: set[int] | None = None,
) -> Iterator[tuple[str, str | None, torch.Tensor]]:
    """The tensors inside ``obj``: ``(path, owner, tensor)``, walking dicts, lists, tuples, sets and deques.

    With ``into_modules``, modules met on the way (stored without being registered) are walked too: their
    parameters, buffers and attributes; ``owner`` is then the path of the outermost such module, else ``None``.
    Each object is visited once (``seen`` may be shared between calls), at most ``max_items`` of them, to
    ``max_depth`` levels. A container that breaks while being walked is skipped; this never raises.

    Examples:
        >>> w = torch.ones(2)
        >>> [(p, o) for p, o, _ in iter_held_tensors({"a": [w, 3], "m": torch.nn.Linear(1, 1)}, "x",
        ...                                           into_modules=True)]
        [("x['a'][0]", None), ("x['m'].weight", "x['m']"), ("x['m'].bias", "x['m']")]
    """
    seen = set() if seen is None else seen
    budget = [max_items]

    def walk(value: Any, where: str, depth: int, owner: str | None) -> Iterator[tuple[str, str | None, Any]]:
        if budget[0] <= 0 or id(value) in seen:
            return
        budget[0] -= 1
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield where, owner, value
            return
        if depth >= max_depth or isinstance(value, (str, bytes, int, float, bool, type(None))):
            return
        if isinstance(value, torch.nn.Module):
            if not into_modules:
                return
            owner = owner or where
        try:
            items = _children(value, where)
        except INSPECTION_ERRORS:  # a container that breaks while being listed
            return
        for item_path, item in items:
            yield from walk(item, item_path, depth + 1, owner)

    try:
        yield from walk(obj, path, 0, None)
    except INSPECTION_ERRORS:  # e.g. a property that raises while being walked: stop with what was found
        return


def find_storage_holders(
    module: torch.nn.Module,
    keys: Iterable[StorageKey],
    prefix: str = "self",
    max_depth: int = 4,
    max_items: int = 100_000,
) -> dict[StorageKey, str]:
    """Where in ``module``'s attributes the storages ``keys`` are held: ``{key: "self._hparams_initial['x']"}``.

    Walks the instance attributes of ``module`` and its submodules (not their registered parameters, buffers and
    submodules) with :func:`iter_held_tensors`, into modules that are stored without being registered (a model
    kept in ``hparams`` by ``save_hyperparameters()``, a teacher in a dict); a storage inside such a module is
    reported at that module's path. Used to say where a stray copy of the weights lives. Keys that are not found
    are left out; this never raises.

    Examples:
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 2)
        ...         self.kept = {"backbone": torch.nn.Linear(2, 2)}  # not a registered submodule
        >>> net = Net()
        >>> key = storage_key(net.kept["backbone"].weight)
        >>> find_storage_holders(net, [key])[key]
        "self.kept['backbone']"
    """
    wanted = {k for k in keys if k is not None}
    found: dict[StorageKey, str] = {}
    if not wanted:
        return found
    with contextlib.suppress(*INSPECTION_ERRORS):
        modules = list(module.named_modules())
        seen = {id(mod) for _, mod in modules}  # registered submodules are the model, not a copy of it
        for mod_name, mod in modules:
            base = f"{prefix}.{mod_name}" if mod_name else prefix
            for attr, value in list(vars(mod).items()):
                if attr in MODULE_INTERNALS or attr == "_trainer":
                    continue
                for path, owner, tensor in iter_held_tensors(
                    value, f"{base}.{attr}", max_depth, max_items, into_modules=True, seen=seen
                ):
                    key = storage_key(tensor)
                    if key in wanted and key not in found:
                        found[key] = owner or path
                if len(found) == len(wanted):
                    return found
    return found
