"""The work behind ``lightning-memopt estimate``: a model, a batch and a budget from the command line.

Private to :mod:`lightning_memopt.cli`. Importing this module imports neither torch nor Lightning (``build_parser``
never imports it; ``_run_estimate`` does, and torch and the planner are imported inside :func:`run_estimate`).

What it does, in the order :func:`run_estimate` does it:

* read the LightningCLI config files (``--config``: sections ``model``, ``data``, ``optimizer`` and ``trainer``;
  any other section is ignored) and apply the command line's ``--model CLASS``, ``--data CLASS``,
  ``--optimizer CLASS`` and dotted overrides (``--model.init_args.lr 0.1`` or ``--model.lr 0.1``);
* build the classes with :mod:`importlib` (nested ``class_path``/``init_args`` dicts are built too);
* make ``batch_fn(micro_batch_size)``: from the datamodule's training set (the first samples in order, collated by
  its ``train_dataloader``'s ``collate_fn``) or from ``--batch-shape`` specs;
* run :func:`~lightning_memopt.planner.estimate_memory` (no budget) or
  :func:`~lightning_memopt.planner.plan_memory` (a budget) and print the result.

Every error a user can cause is an :class:`EstimateInputError` whose message is one line naming the argument.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["CLASS_SECTIONS", "EstimateInputError", "parse_batch_shape", "run_estimate"]

#: Config sections that name a class to build (``class_path`` + ``init_args``).
CLASS_SECTIONS = ("model", "data", "optimizer")
#: Sections the estimate reads or accepts on the command line besides the class sections (LightningCLI's).
_OTHER_SECTIONS = ("trainer", "lr_scheduler")
#: Lightning's short precision names and what they mean (``Trainer(precision=16)`` is ``"16-mixed"``).
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "half": "16-mixed"}
#: YAML 1.1 (PyYAML) reads ``1e-4`` as a string; LightningCLI converts it by the parameter's type. Done here for all.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")
_OVERRIDE = re.compile(r"^--(?P<section>[A-Za-z_][A-Za-z_0-9]*)\.(?P<keys>[^=\s]+?)(?:=(?P<value>.*))?$", re.S)


class EstimateInputError(ValueError):
    """Bad input to ``lightning-memopt estimate``; the message is one line and names the argument."""


# ------------------------------------------------------------------------------------------------------ config


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as err:  # pragma: no cover - PyYAML comes with Lightning
        raise EstimateInputError(f"reading YAML needs PyYAML ({err}): pip install pyyaml") from None
    return yaml


def _fix_numbers(value: Any) -> Any:
    """``"1e-4"`` -> ``1e-4`` everywhere in a loaded config (PyYAML reads exponents without a dot as strings)."""
    if isinstance(value, str) and _EXPONENT_FLOAT.match(value):
        return float(value)
    if isinstance(value, dict):
        return {k: _fix_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fix_numbers(v) for v in value]
    return value


def load_config(path: str) -> dict[str, Any]:
    """A LightningCLI config file as a dict (the ``fit:`` section when the file holds subcommands)."""
    from lightning_memopt.utilities.files import regular_file_problem

    hint = "Pass a LightningCLI YAML config (sections model:, data:, trainer:)."
    problem = regular_file_problem(path)  # a named pipe is refused without opening it
    if problem is not None:
        raise EstimateInputError(f"--config {path}: {problem}. {hint}")
    yaml = _yaml()
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as err:
        raise EstimateInputError(f"--config {path}: cannot be read ({err}).") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(err, "problem", None) or type(err).__name__
        raise EstimateInputError(f"--config {path}: not valid YAML ({what}{where}).") from None
    except RecursionError:
        raise EstimateInputError(f"--config {path}: not valid YAML (nested too deeply to read).") from None
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise EstimateInputError(f"--config {path}: holds a {type(config).__name__}, not a mapping of sections. {hint}")
    if "model" not in config and isinstance(config.get("fit"), dict):
        config = config["fit"]  # a config written for `cli.py --config FILE fit`
    return _fix_numbers(config)


def _class_spec(value: Any, where: str) -> dict[str, Any] | None:
    """A section as ``{"class_path": ... (absent for a fixed class), "init_args": {...}}``; ``None`` if unset."""
    if value is None:
        return None
    if isinstance(value, str):
        return {"class_path": value.strip(), "init_args": {}}
    if not isinstance(value, dict):
        raise EstimateInputError(
            f"{where}: must be a mapping (class_path and init_args, or the init args) or a"
            f" class path, got {type(value).__name__} {value!r}."
        )
    if "class_path" not in value:
        return {"init_args": dict(value)}  # LightningCLI with a fixed class: the section holds the init args
    init_args = value.get("init_args") or {}
    extra = value.get("dict_kwargs") or {}
    if not isinstance(init_args, dict) or not isinstance(extra, dict):
        raise EstimateInputError(f"{where}.init_args: must be a mapping, got {init_args!r}.")
    rest = {k: v for k, v in value.items() if k not in ("class_path", "init_args", "dict_kwargs")}
    return {"class_path": value["class_path"], "init_args": {**rest, **init_args, **extra}}


def _merge(base: dict[str, Any] | None, new: dict[str, Any] | None) -> dict[str, Any] | None:
    """A later class spec over an earlier one: its class (when it names one) and its init args over the old."""
    if base is None or new is None:
        return new if base is None else base
    merged = {"init_args": {**base.get("init_args", {}), **new.get("init_args", {})}}
    class_path = new.get("class_path", base.get("class_path"))
    if class_path is not None:
        merged["class_path"] = class_path
    return merged


def _scalar(text: str) -> Any:
    """A command-line value read as YAML (``0.1``, ``true``, ``null``, ``[1, 2]``, ``{a: 1}``; else the string)."""
    if text == "":
        return ""
    yaml = _yaml()
    try:
        return _fix_numbers(yaml.safe_load(text))
    except yaml.YAMLError:
        return text


def _set(spec: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set ``init_args.a.b`` (or ``a.b``) of a class spec; nested class specs are entered through their init args."""
    key, rest = keys[0], keys[1:]
    if key == "class_path" and not rest:
        spec["class_path"] = value
        return
    if key in ("init_args", "dict_kwargs"):
        if not rest:
            if not isinstance(value, dict):
                raise EstimateInputError(f"init_args must be a mapping, got {value!r}.")
            spec.setdefault("init_args", {}).update(value)
            return
        key, rest = rest[0], rest[1:]
    args = spec.setdefault("init_args", {})
    if not rest:
        args[key] = value
        return
    child = args.get(key)
    if not isinstance(child, dict):
        child = args[key] = {}
    if "class_path" in child:
        child.setdefault("init_args", {})
        _set(child, rest, value)
    else:
        node = child
        for k in rest[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[rest[-1]] = value


def parse_overrides(tokens: list[str], sections: set[str]) -> list[tuple[str, list[str], Any]]:
    """``--model.lr 0.1`` / ``--data.init_args.batch_size=8`` tokens -> ``(section, keys, value)``, in order."""
    out = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        match = _OVERRIDE.match(token)
        if match is None or match["section"] not in sections:
            known = ", ".join(f"--{s}.NAME" for s in sorted(sections))
            raise EstimateInputError(
                f"unrecognized argument {token!r}. Overrides are {known} VALUE; see lightning-memopt estimate --help."
            )
        text = match["value"]
        if text is None:
            if i + 1 >= len(tokens):
                raise EstimateInputError(f"{token}: expected a value after it.")
            text = tokens[i + 1]
            i += 1
        keys = match["keys"].split(".")
        if any(not k for k in keys):
            raise EstimateInputError(f"{token}: an empty name between the dots.")
        out.append((match["section"], keys, _scalar(text)))
        i += 1
    return out


# ------------------------------------------------------------------------------------------------------ classes


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
    if len(parts) == 1 or not all(_NAME.match(p) for p in parts):
        if default_module is not None and _NAME.match(path):
            module = importlib.import_module(default_module)
            if hasattr(module, path):
                return getattr(module, path)
        raise EstimateInputError(
            f"{where}: {path!r} is not a full import path; give package.module.Class (e.g."
            " examples.dreams.module.SpectraFineTuner)."
        )
    _ensure_cwd_importable()
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
                continue  # no such module: maybe the last part is an attribute of a shorter one
            raise EstimateInputError(f"{where}: importing {module_name} for {path!r} failed: {err}.") from None
        except Exception as err:  # the module itself raised while importing
            raise EstimateInputError(
                f"{where}: importing {module_name} for {path!r} failed ({type(err).__name__}: {err})."
            ) from None
        owner = module_name
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                raise EstimateInputError(f"{where}: cannot import {path!r}: {owner} has no attribute {attr!r}.")
            obj = getattr(obj, attr)
            owner = f"{owner}.{attr}"
        if not callable(obj):
            raise EstimateInputError(f"{where}: {path!r} is a {type(obj).__name__}, not a class.")
        return obj
    raise EstimateInputError(
        f"{where}: cannot import {path!r}: there is no module named {parts[0]!r} (run from the"
        " directory that holds it, or install it)."
    )


def build(value: Any, where: str, default_module: str | None = None) -> Any:
    """Instantiate a class spec (and the class specs nested in its init args, in lists and dicts)."""
    if isinstance(value, dict) and "class_path" in value:
        spec = _class_spec(value, where)
        assert spec is not None
        cls = resolve_class(spec["class_path"], where, default_module)
        kwargs = {k: build(v, f"{where}.init_args.{k}") for k, v in spec["init_args"].items()}
        try:
            return cls(**kwargs)
        except EstimateInputError:
            raise
        except Exception as err:
            text = " ".join(str(err).split())
            raise EstimateInputError(
                f"{where}: {spec['class_path']}(...) failed: {type(err).__name__}: {text}"
            ) from None
    if isinstance(value, list):
        return [build(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: build(v, f"{where}.{k}") for k, v in value.items()}
    return value


# ------------------------------------------------------------------------------------------------------ batches


def parse_batch_shape(specs: list[str]) -> Callable[[int], Any]:
    """``batch_fn(B)`` for ``--batch-shape`` specs such as ``"B,128,64:float32"``, ``"ids=B,512:int64"``.

    ``B`` is the micro-batch size; the dtype is optional (default ``float32``). One unnamed spec gives a tensor,
    several a tuple, named ones (``name=...``) a dict. Floating tensors are left uninitialised (their values are
    never read: the estimate runs on fake tensors), the others are zeros (valid indices for embeddings).

    Example:
        >>> fn = parse_batch_shape(["ids=B,16:int64", "mask=B,16:bool"])
        >>> {k: (tuple(v.shape), str(v.dtype)) for k, v in fn(4).items()}
        {'ids': ((4, 16), 'torch.int64'), 'mask': ((4, 16), 'torch.bool')}
    """
    import torch

    parsed: list[tuple[str | None, list[int | None], Any]] = []
    for spec in specs:
        where = f"--batch-shape {spec!r}"
        name, sep, rest = spec.partition("=")
        if not sep:
            name, rest = "", spec
        name = name.strip()
        if sep and not _NAME.match(name):
            raise EstimateInputError(f"{where}: {name!r} is not a name (letters, digits, _).")
        dims_text, colon, dtype_text = rest.partition(":")
        dtype = torch.float32
        if colon:
            dtype = getattr(torch, dtype_text.strip(), None)
            if not isinstance(dtype, torch.dtype):
                raise EstimateInputError(
                    f"{where}: {dtype_text.strip()!r} is not a torch dtype (float32, bfloat16,"
                    " float16, int64, int32, bool, ...)."
                )
        dims: list[int | None] = []
        for dim in dims_text.split(","):
            dim = dim.strip()
            if dim in ("B", "b"):
                dims.append(None)
            elif dim.isdigit() and int(dim) > 0:
                dims.append(int(dim))
            else:
                raise EstimateInputError(
                    f"{where}: dimension {dim!r} is neither B (the micro-batch) nor a positive"
                    " int. Example: --batch-shape B,128,64:float32"
                )
        parsed.append((name or None, dims, dtype))
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

    def make(b: int) -> Any:
        tensors = []
        for name, dims, dtype in parsed:
            shape = [b if d is None else d for d in dims]
            tensor = torch.empty(shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
            tensors.append((name, tensor))
        if names:
            return dict(tensors)
        return tensors[0][1] if len(tensors) == 1 else tuple(t for _, t in tensors)

    return make


def describe_batch(batch: Any) -> str:
    """The tensors of a batch in a few words: ``peaks float32[8, 101, 2], substructures float32[8, 32]``."""
    import torch

    parts: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).replace("torch.", "")
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
    from torch.utils.data import DataLoader, IterableDataset

    name = type(source).__name__
    for hook, call in (
        ("prepare_data", lambda: source.prepare_data()),
        ("setup('fit')", lambda: source.setup("fit")),
        ("train_dataloader()", lambda: source.train_dataloader()),
    ):
        try:
            loader = call()
        except Exception as err:
            text = " ".join(str(err).split())
            raise EstimateInputError(
                f"{where}: {name}.{hook} failed outside a Trainer ({type(err).__name__}: {text}). Fix its init args,"
                " or describe the batch with --batch-shape instead."
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
    dataset, collate = loader.dataset, loader.collate_fn
    iterable = isinstance(dataset, IterableDataset)
    last: dict[int, Any] = {}

    def batch_fn(b: int) -> Any:
        if b not in last:
            if iterable:
                new = DataLoader(dataset, batch_size=b, collate_fn=collate)
            else:
                n = len(dataset)
                if n == 0:
                    raise EstimateInputError(f"{where}: {name}'s training set is empty.")
                # the first b samples in order; a set smaller than b is cycled so the batch has b samples
                new = DataLoader(
                    dataset, batch_size=b, sampler=range(b) if b <= n else [i % n for i in range(b)], collate_fn=collate
                )
            try:
                batch = next(iter(new))
            except StopIteration:
                raise EstimateInputError(f"{where}: {name}'s training set is empty.") from None
            except Exception as err:
                text = " ".join(str(err).split())
                raise EstimateInputError(
                    f"{where}: reading the first {b} samples of {name}'s training set failed"
                    f" ({type(err).__name__}: {text})."
                ) from None
            last.clear()  # keep one batch: the planner asks for each size once, or twice in a row
            last[b] = batch
        return last[b]

    return batch_fn, loader.batch_size


# ------------------------------------------------------------------------------------------------------ running


def _precision(value: Any, where: str, choices: tuple[str, ...]) -> str:
    text = str(value).strip()
    text = _PRECISION_ALIASES.get(text, text)
    if text != "auto" and text not in choices:
        raise EstimateInputError(
            f"{where}: {value!r} is not a precision the estimate models; one of auto,"
            f" {', '.join(choices)} (or Lightning's 32, 16, bf16)."
        )
    return text


def _int_setting(value: Any) -> int | None:
    """``trainer.devices``/``num_nodes`` from a config: an int, a list of devices, ``"0,1"``; else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, (list, tuple)):
        return len(value) or None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip()) or None
    if isinstance(value, str) and "," in value:
        return len([v for v in value.split(",") if v.strip()]) or None
    return None


def _checkpointing(text: str, planning: bool) -> Any:
    """``--checkpointing``: ``auto`` (the plan tries without and with), ``on``, ``off`` or the blocks to checkpoint.

    Blocks are comma-separated class names (``TransformerEncoderLayer``), class import paths
    (``torch.nn.TransformerEncoderLayer``) or patterns of submodule names (``backbone.layers.*``), as
    :class:`~lightning_memopt.GradientCheckpointing` takes them.
    """
    value = text.strip()
    if value == "auto":
        return "auto" if planning else None
    if value in ("on", "true", "yes"):
        return True
    if value in ("off", "false", "no"):
        return False if planning else None
    blocks: list[Any] = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        parts = item.split(".")
        if len(parts) > 1 and all(_NAME.match(p) for p in parts) and parts[-1][:1].isupper():
            blocks.append(resolve_class(item, "--checkpointing"))  # a class by its import path
        else:
            blocks.append(item)
    if not blocks:
        raise EstimateInputError(f"--checkpointing: {text!r}: give auto, on, off or block classes / name patterns.")
    return blocks


def _say(line: str) -> None:
    print(f"lightning-memopt estimate: {line}", file=sys.stderr, flush=True)


def run_estimate(args: argparse.Namespace) -> int:
    """The ``estimate`` subcommand; returns the exit code (0 fits or estimated, 1 nothing fits)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _run(args)
        finally:
            seen = set()
            for warning in caught:
                if issubclass(warning.category, DeprecationWarning):
                    continue
                message = " ".join(str(warning.message).split())
                if message not in seen:
                    seen.add(message)
                    _say(f"warning: {message}")


def _sections(args: argparse.Namespace) -> tuple[dict[str, dict[str, Any] | None], dict[str, Any]]:
    """The class specs (``model``, ``data``, ``optimizer``) and the ``trainer`` section, configs then command line."""
    config: dict[str, Any] = {}
    for path in args.config or []:
        for key, value in load_config(path).items():
            if key in CLASS_SECTIONS:
                config[key] = _merge(config.get(key), _class_spec(value, f"--config {path}: {key}"))
            elif isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
    specs: dict[str, dict[str, Any] | None] = {s: config.get(s) for s in CLASS_SECTIONS}
    for section in CLASS_SECTIONS:
        flag = getattr(args, section)
        if flag is None:
            continue
        text = flag.strip()
        if text.startswith("{"):  # an inline spec, as LightningCLI takes it: replaces the section
            specs[section] = _class_spec(_scalar(text), f"--{section}")
        else:
            specs[section] = _merge(specs[section], {"class_path": text, "init_args": {}})
    trainer = dict(config["trainer"]) if isinstance(config.get("trainer"), dict) else {}
    sections = {*CLASS_SECTIONS, *_OTHER_SECTIONS, *(k for k, v in config.items() if isinstance(v, dict))}
    for section, keys, value in parse_overrides(list(getattr(args, "overrides", None) or []), sections):
        if section in CLASS_SECTIONS:
            spec = specs[section] = specs[section] or {"init_args": {}}
            _set(spec, keys, value)
        elif section == "trainer":
            trainer[keys[0]] = value  # read: precision, devices, num_nodes, accumulate_grad_batches
        # other sections (lr_scheduler, a LightningCLI subclass's own such as `memory:`) are accepted and ignored
    return specs, trainer


def _check_flags(args: argparse.Namespace) -> None:
    """The checks that need no import."""
    if args.gpu is not None and args.device_memory is not None:
        raise EstimateInputError("--gpu and --device-memory: give one of them (a GPU name or a size), not both.")
    if args.gpu is None and args.device_memory is None and args.effective_batch_size is not None:
        raise EstimateInputError(
            "--effective-batch-size: planning needs a memory budget; pass --gpu NAME (e.g."
            " A100-40GB) or --device-memory SIZE (e.g. 40GB)."
        )
    if args.gpu is not None and args.device == "cpu":
        raise EstimateInputError("--gpu with --device cpu: a GPU budget models CUDA; pass --device-memory for a CPU.")
    if args.batch_shape and args.data is not None:
        raise EstimateInputError("--batch-shape and --data: give one batch source (shapes, or a datamodule).")
    if math.isnan(args.margin) or not 0 <= args.margin < 1:
        raise EstimateInputError(f"--margin: must be a fraction in [0, 1), got {args.margin}; 0.1 keeps 10 % free.")
    for flag, value in (
        ("--batch-size", args.batch_size),
        ("--effective-batch-size", args.effective_batch_size),
        ("--devices", args.devices),
        ("--num-nodes", args.num_nodes),
    ):
        if value is not None and value < 1:
            raise EstimateInputError(f"{flag}: must be a positive int, got {value}.")


def _budget(args: argparse.Namespace, planner: Any) -> tuple[str | None, str | None]:
    """``(budget for plan_memory, the flag that gave it)``, checked: known GPU, a size, memory left to use."""
    if args.gpu is not None:
        names = {name.upper().replace(" ", ""): name for name in planner.GPU_MEMORY}
        key = args.gpu.strip().upper().replace(" ", "")
        if key not in names:
            raise EstimateInputError(
                f"--gpu: unknown GPU {args.gpu!r}; known: {', '.join(planner.GPU_MEMORY)}. For"
                " another device pass --device-memory SIZE (e.g. 40GB, 24GiB)."
            )
        budget, flag = names[key], "--gpu"
    elif args.device_memory is not None:
        budget, flag = args.device_memory, "--device-memory"
    else:
        return None, None
    try:
        total = planner.parse_budget(budget)[0]
    except (ValueError, OverflowError) as err:  # parse_budget("inf") overflows, "nan" fails in int()
        text = " ".join(str(err).split()).replace("`budget_bytes`=", "")
        if "neither a size" not in text and "must be positive" not in text:
            text = f"{budget!r} is neither a size (e.g. 40GB, 24GiB, 8e9) nor a known GPU."
        raise EstimateInputError(f"{flag}: {text}") from None
    from lightning_memopt.utilities.formatting import format_bytes

    context = planner.CUDA_CONTEXT_BYTES if args.device == "cuda" else 0
    if int((total - context) * (1 - args.margin)) <= 0:
        raise EstimateInputError(
            f"{flag}: {budget} ({format_bytes(total)}) leaves nothing once the CUDA context"
            f" ({format_bytes(context)}) and the {args.margin:.0%} margin are taken off; pass the"
            " device's whole memory."
        )
    return budget, flag


def _batch_source(
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


def _optimizer(specs: dict[str, Any]) -> Callable[[Any], Any] | None:
    spec = specs["optimizer"]
    if spec is None:
        return None
    if not spec.get("class_path"):
        raise EstimateInputError(
            "--optimizer: the optimizer section has no class_path; pass --optimizer CLASS_PATH"
            " (e.g. torch.optim.AdamW)."
        )
    cls = resolve_class(spec["class_path"], "--optimizer", default_module="torch.optim")
    kwargs = {k: build(v, f"--optimizer.init_args.{k}") for k, v in spec["init_args"].items()}

    def optimizer(params: Any) -> Any:
        return cls(params, **kwargs)

    return optimizer


_PLANNER_NAMES = {
    "`effective_batch_size`": "--effective-batch-size",
    "`margin`": "--margin",
    "`devices`": "--devices",
    "`num_nodes`": "--num-nodes",
    "`precision`": "--precision",
    "`checkpointing`": "--checkpointing",
    "`optimizer`": "--optimizer",
}


def _one_line(err: BaseException, budget_flag: str | None = None) -> str:
    text = " ".join(str(err).split())
    for name, flag in {**_PLANNER_NAMES, "`budget_bytes`": budget_flag or "the budget"}.items():
        text = text.replace(name, flag)
    return text


def _run(args: argparse.Namespace) -> int:
    specs, trainer = _sections(args)
    _check_flags(args)
    model_spec = specs["model"]
    if model_spec is None or not model_spec.get("class_path"):
        where = "the config's model section has no class_path; " if model_spec is not None else ""
        raise EstimateInputError(
            f"--model: {where}pass --model CLASS_PATH (the LightningModule, e.g."
            " examples.dreams.module.SpectraFineTuner), or --config FILE with model.class_path."
        )

    # ---- torch from here on
    from torch import nn

    from lightning_memopt import planner
    from lightning_memopt.utilities.formatting import format_bytes

    where = "--precision" if args.precision is not None else "trainer.precision (config)"
    precision = _precision(
        args.precision if args.precision is not None else trainer.get("precision") or "auto",
        where,
        planner.ESTIMATE_PRECISIONS,
    )
    devices = args.devices or _int_setting(trainer.get("devices")) or 1
    num_nodes = args.num_nodes or _int_setting(trainer.get("num_nodes")) or 1
    world = devices * num_nodes
    accumulate = trainer.get("accumulate_grad_batches")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        accumulate = 1
    budget, budget_flag = _budget(args, planner)
    checkpointing = _checkpointing(args.checkpointing, planning=budget is not None)

    model = build(model_spec, "--model")
    if not isinstance(model, nn.Module):
        raise EstimateInputError(
            f"--model: {model_spec['class_path']} built a {type(model).__name__}, not a"
            " LightningModule or torch.nn.Module."
        )
    optimizer = _optimizer(specs)
    batch_fn, own_batch_size, source = _batch_source(args, specs, model)
    batch_size = args.batch_size or own_batch_size
    params = list(model.parameters())
    out = [
        f"Model: {model_spec['class_path']} ({sum(p.numel() for p in params):,} parameters,"
        f" {sum(p.numel() for p in params if p.requires_grad):,} trainable)"
    ]

    if budget is None:
        if batch_size is None:
            raise EstimateInputError(
                "--batch-size: needed for the estimate (B of --batch-shape); or pass --gpu /"
                " --device-memory and --effective-batch-size to plan the micro-batch."
            )
        batch = batch_fn(batch_size)
        estimate = _guarded(
            lambda: planner.estimate_memory(
                model,
                batch,
                precision="32-true" if precision == "auto" else precision,
                optimizer=optimizer,
                device=args.device,
                checkpointing=checkpointing,
            ),
            planner,
            model,
            source,
            budget_flag,
        )
        print("\n".join([*out, f"Batch {batch_size}: {source}: {describe_batch(batch)}", str(estimate)]))
        return 0

    effective = args.effective_batch_size
    if effective is None:
        if batch_size is None:
            raise EstimateInputError(
                "--effective-batch-size: needed to plan (samples per optimizer step over all"
                " devices); there is no batch size to take it from."
            )
        effective = batch_size * accumulate * world
        how = f"batch size {batch_size}" + (f" x accumulate {accumulate}" if accumulate > 1 else "")
        how += f" x {world} devices" if world > 1 else ""
        out.append(f"Effective batch: {effective} ({how}; --effective-batch-size sets it)")
    elif args.batch_size is not None:
        _say("note: --batch-size is not used when planning; the plan chooses the micro-batch.")
    if effective % world:
        raise EstimateInputError(
            f"--effective-batch-size: {effective} must divide by devices x num nodes = {world}"
            f" (every device gets the same batch); use a multiple of {world}."
        )
    _say(f"planning {type(model).__name__} for {budget}, effective batch {effective}: one line per estimate")
    started = time.perf_counter()
    plan = _guarded(
        lambda: planner.plan_memory(
            model,
            batch_fn,
            effective_batch_size=effective,
            budget_bytes=budget,
            devices=devices,
            num_nodes=num_nodes,
            margin=args.margin,
            precision=precision,
            checkpointing=checkpointing,
            optimizer=optimizer,
            device=args.device,
            progress=_say,
        ),
        planner,
        model,
        source,
        budget_flag,
    )
    count = len(plan.trials)
    _say(f"{count} estimate{'s' if count != 1 else ''} in {time.perf_counter() - started:.1f} s")
    size = plan.micro_batch_size or 1
    role = "the micro-batch" if plan.feasible else "the smallest tried"
    out.append(f"Batch {size} ({role}): {source}: {describe_batch(batch_fn(size))}")
    if plan.estimate is not None:
        if not plan.feasible:
            out.append(
                f"The smallest setting tried (micro-batch {size}, activation checkpointing"
                f" {'on' if plan.gradient_checkpointing else 'off'}) does not fit"
                f" {format_bytes(plan.usable_bytes)}:"
            )
        out += [str(plan.estimate), ""]
    out.append(str(plan))
    print("\n".join(out))
    return 0 if plan.feasible else 1


def _guarded(call: Callable[[], Any], planner: Any, model: Any, source: str, budget_flag: str | None) -> Any:
    """Run the estimate or the plan; what goes wrong in them becomes one line."""
    try:
        return call()
    except EstimateInputError:
        raise
    except planner.MemoryEstimateError as err:
        raise EstimateInputError(_one_line(err, budget_flag)) from None
    except Exception as err:  # the user's training step failed on the batch (the planner's arguments are checked)
        raise EstimateInputError(
            f"the training step of {type(model).__name__} failed on the batch from {source} ({type(err).__name__}:"
            f" {_one_line(err)}). Check the batch (--batch-shape) or the model's init args."
        ) from None


def _own_train_dataloader(model: Any) -> bool:
    """Whether a LightningModule defines its own ``train_dataloader`` (LightningCLI runs without a datamodule)."""
    from lightning_memopt.utilities.namespaces import classes

    method = getattr(type(model), "train_dataloader", None)
    return method is not None and all(method is not hooks.train_dataloader for hooks in classes("core.hooks.DataHooks"))
