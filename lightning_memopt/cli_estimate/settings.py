"""The estimate's settings from the flags and the config's ``trainer`` section, checked before anything is built."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from lightning_memopt.cli_estimate.classes import build, resolve_class
from lightning_memopt.cli_estimate.common import INT64_MAX, NAME, EstimateInputError, squash

__all__ = [
    "budget_setting",
    "check_flags",
    "checkpointing_setting",
    "int_setting",
    "optimizer_setting",
    "precision_setting",
]

#: Lightning's short precision names and what they mean (``Trainer(precision=16)`` is ``"16-mixed"``).
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "half": "16-mixed"}


def precision_setting(value: Any, where: str) -> str:
    """``--precision`` or ``trainer.precision``: ``auto`` or a precision the estimate models (Lightning's short names
    ``32``, ``16``, ``bf16``, ``half`` are read as theirs); errors name ``where``."""
    from lightning_memopt.planner import ESTIMATE_PRECISIONS as choices

    text = str(value).strip()
    text = _PRECISION_ALIASES.get(text, text)
    if text != "auto" and text not in choices:
        raise EstimateInputError(
            f"{where}: {value!r} is not a precision the estimate models; one of auto,"
            f" {', '.join(choices)} (or Lightning's 32, 16, bf16)."
        )
    return text


def int_setting(value: Any) -> int | None:
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


def checkpointing_setting(text: str, planning: bool) -> Any:
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
        if len(parts) > 1 and all(NAME.match(p) for p in parts) and parts[-1][:1].isupper():
            blocks.append(resolve_class(item, "--checkpointing"))  # a class by its import path
        else:
            blocks.append(item)
    if not blocks:
        raise EstimateInputError(f"--checkpointing: {text!r}: give auto, on, off or block classes / name patterns.")
    return blocks


def check_flags(args: argparse.Namespace) -> None:
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
    if getattr(args, "length_buckets", None) is not None and getattr(args, "lengths", None) is None:
        raise EstimateInputError("--length-buckets: needs --lengths FILE (the dataset's lengths, one sample per line).")
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
        if value is not None and value > INT64_MAX:
            raise EstimateInputError(f"{flag}: must be at most 2**63 - 1 (the largest int64), got {value}.")


def budget_setting(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(budget for plan_memory, the flag that gave it)``, checked: known GPU, a size, memory left to use."""
    from lightning_memopt.planner import CUDA_CONTEXT_BYTES, GPU_MEMORY, parse_budget
    from lightning_memopt.utilities.formatting import format_bytes

    if args.gpu is not None:
        names = {name.upper().replace(" ", ""): name for name in GPU_MEMORY}
        key = args.gpu.strip().upper().replace(" ", "")
        if key not in names:
            raise EstimateInputError(
                f"--gpu: unknown GPU {args.gpu!r}; known: {', '.join(GPU_MEMORY)}. For"
                " another device pass --device-memory SIZE (e.g. 40GB, 24GiB)."
            )
        budget, flag = names[key], "--gpu"
    elif args.device_memory is not None:
        budget, flag = args.device_memory, "--device-memory"
    else:
        return None, None
    try:
        total = parse_budget(budget)[0]
    except (ValueError, OverflowError) as err:  # parse_budget("inf") overflows, "nan" fails in int()
        text = squash(err).replace("`budget`=", "")
        if "neither a size" not in text and "must be positive" not in text:
            text = f"{budget!r} is neither a size (e.g. 40GB, 24GiB, 8e9) nor a known GPU."
        raise EstimateInputError(f"{flag}: {text}") from None
    context = CUDA_CONTEXT_BYTES if args.device == "cuda" else 0
    if int((total - context) * (1 - args.margin)) <= 0:
        raise EstimateInputError(
            f"{flag}: {budget} ({format_bytes(total)}) leaves nothing once the CUDA context"
            f" ({format_bytes(context)}) and the {args.margin:.0%} margin are taken off; pass the"
            " device's whole memory."
        )
    return budget, flag


def optimizer_setting(specs: dict[str, Any]) -> Callable[[Any], Any] | None:
    """``optimizer(params)`` built from the ``optimizer`` class spec (a bare class name is looked up in
    ``torch.optim``); ``None`` without one (the model's ``configure_optimizers`` is used)."""
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
