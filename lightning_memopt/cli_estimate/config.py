"""LightningCLI config files and dotted command-line overrides, read into class specs.

A class spec is ``{"class_path": "package.module.Class", "init_args": {...}}`` (``class_path`` absent where the
config gives a fixed class's init args only).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from typing import Any

from lightning_memopt.cli_estimate.common import EstimateInputError
from lightning_memopt.cli_estimate.memory import MEMORY_SECTION

__all__ = ["CLASS_SECTIONS", "class_spec", "load_config", "parse_overrides", "read_sections", "yaml_value"]

#: Config sections that name a class to build (``class_path`` + ``init_args``).
CLASS_SECTIONS = ("model", "data", "optimizer")
#: Sections the estimate reads or accepts on the command line besides the class sections (LightningCLI's).
_OTHER_SECTIONS = ("trainer", "lr_scheduler", MEMORY_SECTION)
#: YAML 1.1 (PyYAML) reads ``1e-4`` as a string; LightningCLI converts it by the parameter's type. Done here for all.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
_OVERRIDE = re.compile(r"^--(?P<section>[A-Za-z_][A-Za-z_0-9]*)\.(?P<keys>[^=\s]+?)(?:=(?P<value>.*))?$", re.S)


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as err:  # pragma: no cover - PyYAML comes with Lightning
        raise EstimateInputError(f"reading YAML needs PyYAML ({err}): pip install pyyaml") from None
    return yaml


#: The most values a config may hold with its YAML aliases written out (a file of a few lines can alias itself into
#: billions: "billion laughs").
MAX_CONFIG_VALUES = 1_000_000


def _fix_numbers(value: Any, done: dict[int, Any] | None = None) -> Any:
    """``"1e-4"`` -> ``1e-4`` everywhere in a loaded config (PyYAML reads exponents without a dot as strings); a list
    or mapping that YAML aliases stays one object (``done``: what was fixed already, by id)."""
    done = {} if done is None else done
    if isinstance(value, str) and _EXPONENT_FLOAT.match(value):
        return float(value)
    if not isinstance(value, (dict, list)):
        return value
    if id(value) not in done:
        if isinstance(value, dict):
            done[id(value)] = {k: _fix_numbers(v, done) for k, v in value.items()}
        else:
            done[id(value)] = [_fix_numbers(v, done) for v in value]
    return done[id(value)]


def _values(value: Any, sizes: dict[int, int]) -> int:
    """How many values ``value`` holds with its aliases written out (``sizes``: the lists and mappings counted)."""
    if not isinstance(value, (dict, list)):
        return 1
    if id(value) not in sizes:
        sizes[id(value)] = MAX_CONFIG_VALUES + 1  # a list holding itself expands without end
        items: Iterable[Any] = value
        if isinstance(value, dict):
            items = value.values()
        sizes[id(value)] = 1 + sum(_values(v, sizes) for v in items)
    return sizes[id(value)]


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
    if _values(config, {}) > MAX_CONFIG_VALUES:
        raise EstimateInputError(
            f"--config {path}: its YAML aliases expand to more than {MAX_CONFIG_VALUES:,} values (an alias bomb?)."
            " Write the values out, or alias fewer."
        )
    if "model" not in config and isinstance(config.get("fit"), dict):
        config = config["fit"]  # a config written for `cli.py --config FILE fit`
    return _fix_numbers(config)


def class_spec(value: Any, where: str) -> dict[str, Any] | None:
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
    for key, args in (("init_args", init_args), ("dict_kwargs", extra)):
        if not isinstance(args, dict):
            raise EstimateInputError(f"{where}.{key}: must be a mapping, got {args!r}.")
    rest = {k: v for k, v in value.items() if k not in ("class_path", "init_args", "dict_kwargs")}
    return {"class_path": value["class_path"], "init_args": {**rest, **init_args, **extra}}


def _merge_specs(base: dict[str, Any] | None, new: dict[str, Any] | None) -> dict[str, Any] | None:
    """A later class spec over an earlier one: its class (when it names one) and its init args over the old."""
    if base is None or new is None:
        return new if base is None else base
    merged = {"init_args": {**base.get("init_args", {}), **new.get("init_args", {})}}
    class_path = new.get("class_path", base.get("class_path"))
    if class_path is not None:
        merged["class_path"] = class_path
    return merged


def yaml_value(text: str) -> Any:
    """A command-line value read as YAML (``0.1``, ``true``, ``null``, ``[1, 2]``, ``{a: 1}``; else the string)."""
    if text == "":
        return ""
    yaml = _yaml()
    try:
        return _fix_numbers(yaml.safe_load(text))
    except yaml.YAMLError:
        return text


def _set_init_arg(spec: dict[str, Any], keys: list[str], value: Any) -> None:
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
        _set_init_arg(child, rest, value)
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
        out.append((match["section"], keys, yaml_value(text)))
        i += 1
    return out


def _read_configs(paths: list[str]) -> dict[str, Any]:
    """The ``--config`` files merged in order: class specs and mappings merge, other values are replaced."""
    config: dict[str, Any] = {}
    for path in paths:
        for key, value in load_config(path).items():
            if key in CLASS_SECTIONS:
                config[key] = _merge_specs(config.get(key), class_spec(value, f"--config {path}: {key}"))
            elif isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
    return config


def _memory_section(memory: Any) -> dict[str, Any] | None:
    if memory is None or isinstance(memory, dict):
        return None if memory is None else dict(memory)
    raise EstimateInputError(
        f"--config: the {MEMORY_SECTION}: section must be a mapping of MemoryPreset fields (e.g. {{name:"
        f" max-savings, effective_batch_size: 256, micro_batch_size: 16}}), got {type(memory).__name__}"
        f" {memory!r}."
    )


def read_sections(
    args: argparse.Namespace,
) -> tuple[dict[str, dict[str, Any] | None], dict[str, Any], dict[str, Any] | None]:
    """The class specs (``model``, ``data``, ``optimizer``), the ``trainer`` section and the ``memory`` section
    (``MemoryPresetCLI``'s preset; ``None`` without one), configs then command line."""
    config = _read_configs(args.config or [])
    specs: dict[str, dict[str, Any] | None] = {s: config.get(s) for s in CLASS_SECTIONS}
    for section in CLASS_SECTIONS:
        flag = getattr(args, section)
        if flag is None:
            continue
        text = flag.strip()
        if text.startswith("{"):  # an inline spec, as LightningCLI takes it: replaces the section
            specs[section] = class_spec(yaml_value(text), f"--{section}")
        else:
            specs[section] = _merge_specs(specs[section], {"class_path": text, "init_args": {}})
    trainer = dict(config["trainer"]) if isinstance(config.get("trainer"), dict) else {}
    memory = _memory_section(config.get(MEMORY_SECTION))
    sections = {*CLASS_SECTIONS, *_OTHER_SECTIONS, *(k for k, v in config.items() if isinstance(v, dict))}
    for section, keys, value in parse_overrides(list(getattr(args, "overrides", None) or []), sections):
        if section in CLASS_SECTIONS:
            spec = specs[section] = specs[section] or {"init_args": {}}
            _set_init_arg(spec, keys, value)
        elif section == "trainer":
            trainer[keys[0]] = value  # read: precision, devices, num_nodes, accumulate_grad_batches
        elif section == MEMORY_SECTION:
            memory = memory if memory is not None else {}
            memory[keys[0]] = value  # the preset's fields are flat
        # other sections (lr_scheduler, a LightningCLI subclass's own) are accepted and ignored
    return specs, trainer, memory
