"""Fixed inputs of an out-of-memory report, for the golden-file tests of ``lightning_memopt.functional.oom``.

Everything a report is built from is fixed here: the clock, the memory reading, the trainer's position and
settings, the environment, the versions, the live tensors, and an exception raised from code compiled under the
file name ``model.py`` (so that the traceback's locations do not depend on where the repository lives).
The golden files in ``oom_golden/`` were rendered from these inputs by the code before
``functional/oom.py`` became a package; the tests compare today's output with them byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

GOLDEN_DIR = Path(__file__).resolve().parent / "oom_golden"

GiB = 1024**3
MiB = 1024**2

TIME = 1_700_000_000.25
RUN_ID = "0123456789ab"
SNAPSHOT_PATH = Path("reports") / "oom_snapshot_rank1.pickle"

CUDA_MESSAGE = (
    "CUDA out of memory. Tried to allocate 256.00 MiB. GPU 1 has a total capacity of 79.10 GiB of which 120.50 MiB"
    " is free. Including non-PyTorch memory, this process has 78.97 GiB memory in use. Of the allocated memory"
    " 70.25 GiB is allocated by PyTorch, and 8.12 GiB is reserved by PyTorch but unallocated. Token used:"
    " https://alice:hunter2@hub.example/x"
)

#: The source the exception is raised from; compiled as ``model.py``.
_SOURCE = """
import torch


def forward(x, message):
    raise torch.OutOfMemoryError(message)


def training_step(batch, batch_idx, message):
    return forward(batch["x"], message)


def validation_step(inputs, batch_idx, message):
    return forward(inputs, message)
"""
_NAMESPACE: dict = {}
exec(compile(_SOURCE, "model.py", "exec"), _NAMESPACE)


def training_oom() -> torch.OutOfMemoryError:
    """An OOM raised in ``forward`` under ``training_step(batch, batch_idx=3)``; its traceback holds the batch."""
    batch = {"x": torch.zeros(8, 16), "y": torch.zeros(8, dtype=torch.long), "ids": [torch.zeros(8, 4, 4)]}
    try:
        _NAMESPACE["training_step"](batch, 3, CUDA_MESSAGE)
    except torch.OutOfMemoryError as err:
        return err
    raise AssertionError("unreachable")


def validation_oom() -> RuntimeError:
    """An MPS-style OOM in ``validation_step``; no frame has a local called ``batch``."""
    try:
        _NAMESPACE["validation_step"](torch.zeros(3, 5), 1, "MPS backend out of memory. Tried to allocate 2.00 GB")
    except torch.OutOfMemoryError as err:
        return err
    raise AssertionError("unreachable")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.gradient_checkpointing = True  # the Hugging Face switch, as its blocks carry it


class FixedModel(nn.Module):
    """16 -> 16 -> 4 with a buffer, hyperparameters (one secret, one tensor, one tuple) and a switched-on block."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(16, 4, bias=False)
        self.register_buffer("scale", torch.ones(4))
        self.hparams = {
            "lr": 0.001,
            "layers": (16, 4),
            "temperature": torch.tensor(0.5),
            "wandb": {"api_key": "sk-secret-123", "url": "https://bob:pw12345@wandb.example/x"},
            "path": Path("data") / "train",
        }


def fixed_model_and_optimizer() -> tuple[FixedModel, torch.optim.Optimizer]:
    """The model and an Adam optimizer after one step (so it holds its two states per parameter)."""
    torch.manual_seed(0)
    model = FixedModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.head(model.block.inner(torch.ones(2, 16))).sum().backward()
    optimizer.step()
    return model, optimizer


#: A CUDA reading at the failure (``MemoryReading.as_dict()`` shape).
MEMORY = {
    "time": TIME,
    "device": "cuda:1",
    "allocated_bytes": 70 * GiB + 256 * MiB,
    "reserved_bytes": 78 * GiB,
    "active_bytes": 70 * GiB + 300 * MiB,
    "peak_allocated_bytes": 71 * GiB,
    "peak_reserved_bytes": 78 * GiB,
    "device_total_bytes": 80 * GiB,
    "device_free_bytes": 120 * MiB,
    "host_rss_bytes": 9 * GiB,
    "num_alloc_retries": 3,
    "num_ooms": 1,
}
#: A reading on the CPU (no device figures).
CPU_MEMORY = {
    "time": TIME,
    "device": "cpu",
    "allocated_bytes": None,
    "reserved_bytes": None,
    "active_bytes": None,
    "peak_allocated_bytes": None,
    "peak_reserved_bytes": None,
    "device_total_bytes": None,
    "device_free_bytes": None,
    "host_rss_bytes": 2 * GiB,
    "num_alloc_retries": None,
    "num_ooms": None,
}
SUMMARY = "|===========|\n|  PyTorch CUDA memory summary | a | b |\n|===========|"

#: What the trainer says about where it is (rank 1 of 4, training).
POSITION = {
    "rank": 1,
    "local_rank": 1,
    "node_rank": 0,
    "world_size": 4,
    "fn": "fit",
    "stage": "train",
    "epoch": 2,
    "global_step": 1234,
}
VALIDATE_POSITION = dict(POSITION, rank=0, local_rank=0, world_size=1, stage="validate")

#: The trainer's settings.
SETTINGS = {
    "precision": "32-true",
    "accumulate_grad_batches": 2,
    "world_size": 4,
    "strategy": "DDPStrategy",
    "accelerator": "CUDAAccelerator",
    "num_devices": 4,
    "num_nodes": 1,
    "device_ids": "[0, 1, 2, 3]",
}

ENVIRONMENT = {
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    "NCCL_DEBUG": "INFO",
    "PL_LOGGER_URI": "https://logs.example/run?token=tok-999&x=1",
    "TORCH_HUB_TOKEN": "<redacted>",
}
ALLOCATOR = {
    "PYTORCH_ALLOC_CONF": None,
    "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128",
    "PYTORCH_HIP_ALLOC_CONF": None,
}
VERSIONS = {
    "python": "3.11.9",
    "platform": "Linux-x86_64",
    "torch": "2.5.0",
    "cuda": "12.4",
    "hip": None,
    "lightning": "2.4.0",
    "torchmetrics": "1.5.0",
    "lightning_memopt": "0.9.0",
}


@dataclass(frozen=True)
class FakeLiveTensor:
    """What ``footprint.live_tensors`` returns, with fixed values."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int
    requires_grad: bool
    has_grad_fn: bool
    name: str | None


LIVE_TENSORS = [
    FakeLiveTensor((8, 1024, 50257), "torch.float32", "cuda:1", 8 * 1024 * 50257 * 4, False, True, None),
    FakeLiveTensor((16, 16), "torch.float32", "cuda:1", 1024, True, False, "block.inner.weight"),
    FakeLiveTensor((16, 16), "torch.float32", "cuda:1", 1024, False, False, "block.inner.weight (exp_avg)"),
]


# ---------------------------------------------------------------------------------------------------- Markdown


def full_report() -> dict:
    """A complete report as ``OOMReporter`` writes it (hand-made values)."""
    return {
        "format": "lightning-memopt/oom-report/1",
        "when": {
            "time": 0.0,
            "rank": 1,
            "world_size": 2,
            "fn": "fit",
            "stage": "train",
            "epoch": 3,
            "global_step": 7320,
            "batch_idx": 12,
            "device": "cuda:1",
        },
        "error": {"type": "torch.OutOfMemoryError", "message": CUDA_MESSAGE, "location": "forward (model.py:10)"},
        "batch": {
            "found_in": "training_step (model.py:20)",
            "micro_batch_size": 8,
            "num_tensors": 40,
            "truncated": True,
            "tensors": [
                {"path": "batch", "shape": [8, 512], "dtype": "torch.int64", "device": "cuda:1", "bytes": 32768}
            ],
        },
        "memory": {"allocated_bytes": 70 * GiB, "reserved_bytes": 78 * GiB, "summary": "|  PyTorch CUDA memory |"},
        "holders": {
            "device": "cuda:1",
            "bytes_by_category": {"parameters": GiB},
            "unexplained_bytes": 69 * GiB,
            "rows": [
                {"category": "parameters", "dtype": "torch.float32", "device": "cuda:1", "num_tensors": 3, "bytes": GiB}
            ],
            "top_tensors": [
                {
                    "name": "encoder.weight",
                    "shape": [1024, 1024],
                    "dtype": "torch.float32",
                    "bytes": 4 * MiB,
                    "requires_grad": True,
                    "has_grad_fn": False,
                },
                {"name": None, "shape": [3], "dtype": "torch.int64", "bytes": 24},
            ],
        },
        "config": {
            "precision": "bf16-mixed",
            "accumulate_grad_batches": 4,
            "logger": "a|b\nc",
            "allocator": {"PYTORCH_ALLOC_CONF": None},
            "versions": {"torch": "2.11"},
        },
        "hparams": {"lr": 0.1, "model": {"depth": {"a": {"b": {"c": {"d": 1}}}}, "sizes": [1, 2]}, "empty": {}},
        "suggestions": [
            {"rank": 1, "action": "Do X", "why": "Because Y.", "saves_bytes": GiB},
            {"rank": 2, "action": "Do Z", "why": "Because W.", "saves_bytes": 0},
        ],
        "snapshot": {"path": "oom_snapshot_rank1.pickle", "how_to_open": "Open it."},
        "environment": {"NCCL_DEBUG": "INFO"},
        "report_errors": ["who holds memory: boom"],
    }


def markdown_cases() -> dict[str, object]:
    """Named inputs of ``render_markdown``: complete, partial, odd and wrongly shaped reports."""
    odd = full_report()
    odd["memory"] = {"allocated_bytes": "lots", "reserved_bytes": float("nan"), "summary": 5, "x": [1]}
    odd["holders"]["top_tensors"] = [{"name": "w", "shape": 7, "bytes": None}]
    odd["batch"] = {"found_in": None, "tensors": [{"path": "x"}, 3]}
    odd["suggestions"] = [{"rank": 1, "action": "A", "why": "B", "saves_bytes": "many"}, "tip"]
    odd["when"] = dict(odd["when"], time="yesterday")
    odd["snapshot"] = {"path": None}
    no_snapshot = dict(full_report(), snapshot={"path": None, "reason": "not recorded."})
    return {
        "full": full_report(),
        "odd": odd,
        "no_snapshot": no_snapshot,
        "partial": {"error": {"type": "RuntimeError", "message": "a | b"}, "config": {"x": "a|b"}},
        "empty": {},
        "not_a_report": [1, 2],
        "wrong_shapes": {
            **full_report(),
            "when": "x",
            "memory": [1, 2],
            "holders": 5,
            "config": {"versions": "2.0", "allocator": [1]},
            "report_errors": "boom",
            "hparams": 3,
            "environment": ["NCCL_DEBUG=INFO"],
        },
    }


# ---------------------------------------------------------------------------------------------------- suggestions


def suggestion_cases() -> dict[str, dict]:
    """Named keyword arguments of ``suggest_fixes`` that reach every rule."""
    cats = {"parameters": GiB, "gradients": GiB, "optimizer_states": 0, "buffers": 0}
    return {
        "activations_train": dict(
            stage="train",
            allocated_bytes=10 * GiB,
            reserved_bytes=10 * GiB,
            device_total_bytes=12 * GiB,
            device_free_bytes=2 * GiB,
            bytes_by_category=cats,
            unexplained_bytes=8 * GiB,
            micro_batch_size=32,
            accumulate_grad_batches=2,
            world_size=2,
            precision="32-true",
        ),
        "odd_micro_batch": dict(stage="train", micro_batch_size=5, accumulate_grad_batches=1),
        "micro_batch_one": dict(stage="train", micro_batch_size=1, precision="64-true", device_type="mps"),
        "checkpointing_on": dict(
            stage="train",
            allocated_bytes=10 * GiB,
            bytes_by_category=cats,
            unexplained_bytes=8 * GiB,
            micro_batch_size=4,
            activation_checkpointing=True,
        ),
        "optimizer_single": dict(
            stage="train",
            allocated_bytes=9 * GiB,
            reserved_bytes=9 * GiB,
            bytes_by_category={"parameters": 2 * GiB, "gradients": 2 * GiB, "optimizer_states": 4 * GiB},
            unexplained_bytes=GiB,
            micro_batch_size=8,
            precision="bf16-mixed",
        ),
        "optimizer_sharded": dict(
            stage="train",
            allocated_bytes=9 * GiB,
            reserved_bytes=9 * GiB,
            bytes_by_category={"parameters": 2 * GiB, "gradients": 2 * GiB, "optimizer_states": 4 * GiB},
            unexplained_bytes=GiB,
            micro_batch_size=8,
            world_size=4,
        ),
        "params_dominate": dict(
            stage="train",
            bytes_by_category={"parameters": 6 * GiB, "gradients": 6 * GiB},
            unexplained_bytes=GiB,
            world_size=1,
        ),
        "params_dominate_ddp": dict(
            stage="train",
            bytes_by_category={"parameters": 6 * GiB, "gradients": 6 * GiB},
            unexplained_bytes=GiB,
            world_size=8,
        ),
        "fragmentation": dict(
            stage="train",
            allocated_bytes=6 * GiB,
            reserved_bytes=10 * GiB,
            requested_bytes=GiB,
            bytes_by_category={"parameters": GiB},
            unexplained_bytes=5 * GiB,
            micro_batch_size=4,
        ),
        "fragmentation_set": dict(
            stage="train",
            allocated_bytes=6 * GiB,
            reserved_bytes=10 * GiB,
            requested_bytes=GiB,
            allocator_conf="max_split_size_mb:128, expandable_segments: True",
        ),
        "huge_and_others": dict(
            stage="train",
            allocated_bytes=GiB,
            reserved_bytes=GiB,
            device_total_bytes=16 * GiB,
            device_free_bytes=5 * GiB,
            requested_bytes=40 * GiB,
            unexplained_bytes=0,
            bytes_by_category={"parameters": GiB},
            micro_batch_size=4,
        ),
        "validate": dict(
            stage="validate",
            allocated_bytes=4 * GiB,
            reserved_bytes=4 * GiB,
            bytes_by_category={"parameters": GiB, "gradients": GiB},
            unexplained_bytes=2 * GiB,
            micro_batch_size=64,
            precision="32-true",
        ),
        "unknown_cpu": dict(stage="train", micro_batch_size=8, precision="32-true", device_type="cpu"),
        "no_stage": dict(stage=None),
        "sanity_check": dict(stage="sanity_check", precision="16-mixed"),
    }


def suggestion_grid(size: int = 3000) -> list[dict]:
    """``size`` combinations of the inputs of ``suggest_fixes``: a fixed sample (seed 0) of every combination.

    The golden file keeps a digest of their output.
    """
    import random

    options: dict[str, tuple] = {
        "stage": ("train", "validate", None),
        "allocated_bytes": (None, 0, 6 * GiB),
        "reserved_bytes": (None, 10 * GiB),
        "device_total_bytes": (None, 16 * GiB),
        "device_free_bytes": (None, GiB),
        "requested_bytes": (None, 9 * GiB),
        "bytes_by_category": (
            None,
            {"parameters": 3 * GiB, "gradients": 2 * GiB, "optimizer_states": GiB},
            {"optimizer_states": 4 * GiB},
        ),
        "unexplained_bytes": (None, 0, 4 * GiB),
        "micro_batch_size": (None, 1, 7),
        "accumulate_grad_batches": (None, 3),
        "world_size": (1, 4),
        "precision": (None, "32-true", "bf16-mixed"),
        "allocator_conf": (None, "expandable_segments:True"),
        "device_type": ("cuda", "cpu"),
        "activation_checkpointing": (None, True),
    }
    total = 1
    for values in options.values():
        total *= len(values)
    grid = []
    for index in random.Random(0).sample(range(total), size):
        kwargs = {}
        for name, values in options.items():
            index, digit = divmod(index, len(values))
            kwargs[name] = values[digit]
        grid.append(kwargs)
    return grid
