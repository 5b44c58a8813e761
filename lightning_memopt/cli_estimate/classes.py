"""Classes by their import paths, and objects built from class specs (as LightningCLI builds them)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from lightning_memopt.cli_estimate.common import NAME, EstimateInputError, squash
from lightning_memopt.cli_estimate.config import class_spec

__all__ = ["InitError", "build", "resolve_class"]


class InitError(EstimateInputError):
    """A class's own ``__init__`` failed while :func:`build` built it (not the import or the spec)."""


def _ensure_cwd_importable() -> None:
    # `python -m` puts the working directory on the path, the console script does not: make `examples.x.Y` work
    # from the repository root either way (as LightningCLI does for class paths).
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path and os.path.abspath(cwd) not in map(os.path.abspath, sys.path):
        sys.path.insert(0, cwd)


def resolve_class(path: Any, where: str, default_module: str | None = None) -> Any:
    """The object a dotted import path names (``package.module.Class``); errors name ``where``."""
    if not isinstance(path, str) or not path.strip():
        raise EstimateInputError(f"{where}: expected a class import path such as package.module.Class, got {path!r}.")
    path = path.strip()
    parts = path.split(".")
    if len(parts) == 1 or not all(NAME.match(p) for p in parts):
        return _short_name(path, where, default_module)
    _ensure_cwd_importable()
    for i in range(len(parts) - 1, 0, -1):
        module = _import_module(".".join(parts[:i]), path, where)
        if module is not None:
            return _attribute(module, parts[:i], parts[i:], path, where)
    raise EstimateInputError(
        f"{where}: cannot import {path!r}: there is no module named {parts[0]!r} (run from the"
        " directory that holds it, or install it)."
    )


def _short_name(path: str, where: str, default_module: str | None) -> Any:
    """A bare name, looked up in ``default_module`` (``torch.optim`` for an optimizer)."""
    if default_module is not None and NAME.match(path):
        module = importlib.import_module(default_module)
        if hasattr(module, path):
            return getattr(module, path)
    raise EstimateInputError(
        f"{where}: {path!r} is not a full import path; give package.module.Class (e.g."
        " examples.dreams.module.SpectraFineTuner)."
    )


def _import_module(module_name: str, path: str, where: str) -> Any:
    """The module, or ``None`` where there is no such module (the last part may be an attribute of a shorter one)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            return None
        raise EstimateInputError(f"{where}: importing {module_name} for {path!r} failed: {err}.") from None
    except Exception as err:  # the module itself raised while importing
        raise EstimateInputError(
            f"{where}: importing {module_name} for {path!r} failed ({type(err).__name__}: {err})."
        ) from None


def _attribute(module: Any, module_parts: list[str], attrs: list[str], path: str, where: str) -> Any:
    obj, owner = module, ".".join(module_parts)
    for attr in attrs:
        if not hasattr(obj, attr):
            raise EstimateInputError(f"{where}: cannot import {path!r}: {owner} has no attribute {attr!r}.")
        obj = getattr(obj, attr)
        owner = f"{owner}.{attr}"
    if not callable(obj):
        raise EstimateInputError(f"{where}: {path!r} is a {type(obj).__name__}, not a class.")
    return obj


def build(value: Any, where: str, default_module: str | None = None) -> Any:
    """Instantiate a class spec (and the class specs nested in its init args, in lists and dicts)."""
    if isinstance(value, dict) and "class_path" in value:
        spec = class_spec(value, where)
        assert spec is not None
        cls = resolve_class(spec["class_path"], where, default_module)
        kwargs = {k: build(v, f"{where}.init_args.{k}") for k, v in spec["init_args"].items()}
        try:
            return cls(**kwargs)
        except EstimateInputError:
            raise
        except Exception as err:  # the user's __init__: one line naming the flag
            raise InitError(f"{where}: {spec['class_path']}(...) failed: {type(err).__name__}: {squash(err)}") from None
    if isinstance(value, list):
        return [build(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: build(v, f"{where}.{k}") for k, v in value.items()}
    return value
