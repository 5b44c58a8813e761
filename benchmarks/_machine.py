"""Where benchmark numbers were taken: CPU model, cores, threads, GPU and library versions."""

from __future__ import annotations

import os
import platform

__all__ = ["machine_info"]


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
