"""A valid OOM report of a given size, written in pieces (never held in memory whole): a huge allocator summary,
a huge hparams vocabulary, a huge list of live tensors and a deeply nested value, a third of the size each."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_memopt.functional.oom import REPORT_FORMAT

_PIECE = 1 << 20


def write_big_report(path: Path, size: int) -> Path:
    third = size // 3
    head = {
        "format": REPORT_FORMAT,
        "when": {"time": 1735732800.0, "rank": 0, "world_size": 1, "stage": "train", "global_step": 7},
        "error": {"type": "torch.OutOfMemoryError", "message": "CUDA out of memory.", "location": "f (x.py:1)"},
    }
    tensor = json.dumps(
        {
            "name": "layer.weight",
            "shape": [4096, 4096],
            "dtype": "torch.float32",
            "device": "cuda:0",
            "bytes": 67108864,
            "requires_grad": True,
            "has_grad_fn": False,
        }
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(head)[:-1])
        f.write(', "memory": {"allocated_bytes": 1073741824, "summary": "')
        line = "|  Allocated memory  |  1024 MiB  |  2048 MiB  |\\n"
        for _ in range(third // _PIECE):
            f.write(line * (_PIECE // len(line)))
        f.write('"}, "holders": {"device": "cuda:0", "top_tensors": [')
        f.write(",".join([tensor] * 1000))
        for _ in range(third // _PIECE):
            f.write(("," + tensor) * (_PIECE // (len(tensor) + 1)))
        f.write('], "bytes_by_category": {"parameters": 1}}, "hparams": {"deep": ')
        f.write("[" * 60 + "]" * 60)
        f.write(', "vocab": ["token"')
        word = ', "w\\u00e9rd\\n"'
        for _ in range(third // _PIECE):
            f.write(word * (_PIECE // len(word)))
        f.write("]}}\n")
    return path
