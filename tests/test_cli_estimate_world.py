"""``lightning-memopt estimate --devices N``: the plan chooses DDP or FSDP2 over the world and says which; an estimate
over several ranks says whose bytes it gives."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt.cli import main
from lightning_memopt.planner import estimate_memory
from lightning_memopt.utilities.formatting import format_bytes
from tests.scripts.fsdp2_peak import ResidualMLP

BIG = "tests.test_cli_estimate_world.BlocksModule"


class BlocksModule(pl.LightningModule):
    """Residual MLP blocks; ``width=4096, blocks=8`` is 1.07 B parameters (built on the meta device by the command)."""

    def __init__(self, width: int = 128, blocks: int = 4) -> None:
        super().__init__()
        self.model = ResidualMLP(width=width, blocks=blocks)

    def training_step(self, batch, batch_idx):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.model(x)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _run(capsys, *argv):
    code = main(["estimate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_devices_4_plans_fsdp2_for_a_model_too_big_for_one_24gb_card(capsys):
    big = ["--model", BIG, "--model.width", "4096", "--model.blocks", "8", "--batch-shape", "B,512,4096"]
    code, out, err = _run(capsys, *big, "--device-memory", "24GB", "--effective-batch-size", "32", "--devices", "4")
    assert code == 0, err
    text = " ".join(out.split())
    assert "Plan: FSDP2 over 4 ranks (reshard_after_forward=True), micro-batch" in text
    assert "Why: DDP does not fit even the smallest micro-batch" in text
    assert "strategy: fsdp2" in out and "shard_roots: [model]" in out  # the memory: snippet
    assert "def configure_model(self):" in out and "ModelParallelStrategy(data_parallel_size=4" in out
    assert "for i in range(0, 8)" in out
    assert "fsdp2, micro-batch" in err and "ddp, micro-batch" in err  # one progress line per estimate, named
    # on one card the advice plans the GPUs instead of guessing
    code, out, err = _run(capsys, *big, "--device-memory", "24GB", "--effective-batch-size", "32")
    assert code == 1
    assert "Needs sharding: FSDP2 over 2 GPUs fits micro-batch 1 (planned:" in " ".join(out.split())


def _config(tmp_path, memory: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"model:\n  class_path: {BIG}\nmemory: {memory}\n")
    return str(path)


def test_an_estimate_over_several_ranks_is_fsdp2_where_the_config_shards_else_ddp(capsys, tmp_path):
    args = ["--batch-shape", "B,128", "--batch-size", "16", "--device", "cpu", "--devices", "2"]
    config = _config(tmp_path, "{strategy: fsdp2, reshard_after_forward: false}")
    code, out, err = _run(capsys, "--config", config, *args)
    assert code == 0, err
    assert "Strategy: FSDP2 over 2 ranks (the config shards): the bytes below are one rank's." in out
    expected = estimate_memory(
        BlocksModule(), torch.empty(16, 128), device="cpu", world_size=2, reshard_after_forward=False
    )
    assert f"per rank of a training step on cpu at 32-true: {format_bytes(expected.peak_bytes)}" in out
    code, out, err = _run(capsys, "--model", BIG, *args)
    assert code == 0, err
    assert "Strategy: DDP over 2 ranks (every rank holds the whole model)" in " ".join(out.split())


@pytest.mark.parametrize(("flag", "value"), [("--devices", "0"), ("--num-nodes", "-1")])
def test_a_world_below_one_is_named(capsys, flag, value):
    code, _, err = _run(capsys, "--model", BIG, "--batch-shape", "B,128", "--batch-size", "2", flag, value)
    assert code != 0 and f"{flag}: must be a positive int, got {value}" in err
