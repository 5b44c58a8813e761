"""Both Lightning namespaces: ``lightning.pytorch`` (the ``lightning`` package) and ``pytorch_lightning``.

A ``pytorch_lightning.Trainer`` accepts only ``pytorch_lightning`` callbacks and plugins (and checks it for plugins),
a ``lightning.pytorch.Trainer`` only its own. The classes this package hands to a Trainer therefore derive from the
base class of every namespace that is installed (:data:`Callback`, :data:`Precision`), and code that needs a Lightning
class for a particular Trainer looks it up in that Trainer's namespace (:func:`namespace_of`, :func:`lookup`).

A namespace counts as installed when its distribution is at version :data:`MIN_VERSION` or later; one that is not
installed is never imported (:func:`installed_namespaces` reads package metadata only).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from types import ModuleType
from typing import Any

from lightning_memopt.utilities.formatting import printable

__all__ = [
    "MIN_VERSION",
    "NAMESPACES",
    "Callback",
    "Precision",
    "classes",
    "installed_namespaces",
    "is_instance",
    "lookup",
    "namespace_of",
]

#: The oldest Lightning release served (``lightning`` or ``pytorch-lightning``); CI runs the contract test on it.
MIN_VERSION = (2, 1)

#: Each namespace and the distribution that installs it.
_DISTRIBUTIONS = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch-lightning"}


def _version(distribution: str) -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def installed_namespaces() -> tuple[str, ...]:
    """The Lightning namespaces installed at :data:`MIN_VERSION` or later, ``lightning.pytorch`` first.

    Nothing is imported: a namespace counts when its distribution's metadata has a recent enough version and its
    top-level package can be found.

    Examples:
        >>> set(installed_namespaces()) <= {"lightning.pytorch", "pytorch_lightning"}
        True
    """
    found = []
    for namespace, distribution in _DISTRIBUTIONS.items():
        version = _version(distribution)
        top = namespace.split(".")[0]
        if version is not None and version >= MIN_VERSION and importlib.util.find_spec(top) is not None:
            found.append(namespace)
    return tuple(found)


NAMESPACES = installed_namespaces()
if not NAMESPACES:
    raise ImportError(
        "lightning-memopt needs Lightning 2.1 or later: `pip install lightning` (or `pip install pytorch-lightning`"
        " for code that imports `pytorch_lightning`)."
    )


def _import(namespace: str, module: str = "") -> ModuleType:
    return importlib.import_module(f"{namespace}.{module}" if module else namespace)


def classes(path: str) -> tuple[type, ...]:
    """The class at ``path`` (e.g. ``"callbacks.Callback"``) in every installed namespace, in :data:`NAMESPACES` order.

    A namespace whose release has no such class (``ModelParallelStrategy`` came with Lightning 2.3) is left out.

    Examples:
        >>> [c.__name__ for c in classes("callbacks.Callback")] == ["Callback"] * len(NAMESPACES)
        True
        >>> classes("callbacks.NoSuchCallback")
        ()
    """
    module, _, name = path.rpartition(".")
    found = (getattr(_import(namespace, module), name, None) for namespace in NAMESPACES)
    return tuple(cls for cls in found if cls is not None)


def _namespace_name(obj: Any) -> str | None:
    for cls in type(obj).__mro__:
        owner = cls.__module__ or ""
        for namespace in NAMESPACES:
            if owner == namespace or owner.startswith(namespace + "."):
                return namespace
    return None


def namespace_of(obj: Any) -> ModuleType:
    """The Lightning namespace ``obj`` (a Trainer, a LightningModule, a strategy) belongs to, imported.

    Objects of neither namespace (test doubles, this package's own classes, which derive from both) get the first
    installed one.

    Examples:
        >>> namespace_of(object()).__name__ == NAMESPACES[0]
        True
    """
    return _import(_namespace_name(obj) or NAMESPACES[0])


def lookup(obj: Any, path: str) -> Any:
    """The attribute at ``path`` (e.g. ``"strategies.DDPStrategy"``) in the namespace of ``obj``.

    Examples:
        >>> lookup(object(), "callbacks.Callback") is classes("callbacks.Callback")[0]
        True
    """
    module, _, name = path.rpartition(".")
    return getattr(_import(_namespace_name(obj) or NAMESPACES[0], module), name)


def is_instance(obj: Any, path: str) -> bool:
    """Whether ``obj`` is an instance of the class at ``path`` in any installed namespace.

    Examples:
        >>> is_instance(object(), "LightningModule")
        False
    """
    return isinstance(obj, classes(path))


class Callback(*classes("callbacks.Callback")):  # type: ignore[misc]
    """Lightning's ``Callback`` of every installed namespace: a Trainer of either accepts the subclasses."""


class Precision(*classes("plugins.precision.Precision")):  # type: ignore[misc]
    """Lightning's ``Precision`` plugin base of every installed namespace: a Trainer of either accepts subclasses."""


#: Lightning's rank-zero helpers (one shared implementation: ``rank_zero_only.rank`` is set by either Trainer).
_rank_zero_info = _import(NAMESPACES[0], "utilities").rank_zero_info
rank_zero_only = _import(NAMESPACES[0], "utilities").rank_zero_only


def rank_zero_info(message: str, *args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """Lightning's ``rank_zero_info`` with ``message`` escaped for the terminal (newlines kept; see
    :func:`~lightning_memopt.utilities.formatting.printable`)."""
    _rank_zero_info(printable(message, keep_newlines=True), *args, stacklevel=stacklevel + 1, **kwargs)
