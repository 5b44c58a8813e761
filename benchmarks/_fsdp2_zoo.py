"""The zoo's T5 behind the interface of ``tests/scripts/fsdp2_peak.py``, and that script's gloo worker run on it.

``fsdp2_peak.py`` measures the real per-rank peak of a model that has ``blocks`` (each ``fully_shard``-ed, then the
root) and returns its loss from ``model(batch)``, ``batch`` one tensor. :class:`ZooT5` gives the test suite's Hugging
Face T5 (``tests/helpers/zoo.py``) that shape: its encoder and decoder blocks in ``blocks`` (the same modules,
registered first so the planner's default sharding picks the same units), the zoo's batch (input ids, attention mask,
labels) packed side by side in one tensor and split again in ``forward`` (contiguous copies: the same in every run),
the output ``.loss``. Run as a script, it
puts :class:`ZooT5` and its batch in place of the script's model and batch and starts the script's own workers (the
processes are forked: they see the replacement), so the counter is the test suite's, not a copy.

    python benchmarks/_fsdp2_zoo.py PORT WORLD_SIZE        # writes peak_{rank}.json in the working directory
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.scripts import fsdp2_peak  # noqa: E402

__all__ = ["BATCH", "ZooT5", "make_batch"]

BATCH = 8


class ZooT5(nn.Module):
    """The zoo's ``T5ForConditionalGeneration`` (seeded by the zoo): ``blocks`` (encoder, then decoder) and the loss."""

    def __init__(self) -> None:
        super().__init__()
        from tests.helpers.zoo import T5Module

        t5 = T5Module().model
        self.blocks = nn.ModuleList([*t5.encoder.block, *t5.decoder.block])
        self.t5 = t5

    def forward(self, packed: torch.Tensor) -> Any:
        from tests.helpers.zoo import T5Module

        source = T5Module.SOURCE
        ids, mask, labels = packed.split([source, source, T5Module.TARGET], dim=1)
        return self.t5(input_ids=ids.contiguous(), attention_mask=mask.contiguous(), labels=labels.contiguous()).loss


def make_batch() -> torch.Tensor:
    """The zoo's T5 batch of :data:`BATCH` samples, packed: input ids, attention mask and labels side by side."""
    from tests.helpers.zoo import T5Module

    batch = T5Module.make_batch(BATCH)
    return torch.cat([batch["input_ids"], batch["attention_mask"], batch["labels"]], dim=1)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    fsdp2_peak.ResidualMLP = ZooT5  # type: ignore[misc,assignment]
    fsdp2_peak.make_batch = make_batch  # type: ignore[assignment]
    torch.set_num_threads(1)
    world = int(sys.argv[2])
    mp.start_processes(fsdp2_peak.run, args=(world, sys.argv[1]), nprocs=world, start_method="fork")
