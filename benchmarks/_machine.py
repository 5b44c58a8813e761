"""What the benchmarks share: where numbers were taken (CPU model, cores, threads, GPU and library versions), the
timing of a callback's hooks and a quiet Trainer."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["machine_info", "quiet_trainer", "time_hooks"]


def machine_info(device: str = "cpu") -> dict:
    """The machine a benchmark ran on, for its JSON result (``device``: ``"cpu"`` or ``"cuda"``)."""
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    if str(device).startswith(("cuda", "gpu")) and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_capability"] = list(torch.cuda.get_device_capability())
    return info


def time_hooks(
    callback: Any, base: type, hooks: Iterable[str], record: Callable[[str, Any, float, float], None]
) -> None:
    """Wrap, in place, the hooks of ``callback`` that its class overrides (``base``'s own, Lightning's ``Callback``,
    are left alone): each call is passed on, then ``record(hook, trainer, seconds, cpu_seconds)`` gets its wall and
    thread CPU time.
    """
    for hook in hooks:
        if getattr(type(callback), hook) is getattr(base, hook):
            continue
        fn = getattr(callback, hook)

        def timed(trainer: Any, *args: Any, _fn: Callable[..., Any] = fn, _hook: str = hook, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return _fn(trainer, *args, **kwargs)
            finally:
                record(_hook, trainer, time.perf_counter() - start, time.thread_time() - start_cpu)

        setattr(callback, hook, timed)


def quiet_trainer(root: Any, callbacks: list, steps: int, accelerator: str = "cpu", **kwargs: Any) -> Any:
    """A Trainer on one device for ``steps`` optimizer steps; no logger, checkpoints, progress bar or model summary
    (``kwargs``: more Trainer arguments)."""
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        **kwargs,
    )
