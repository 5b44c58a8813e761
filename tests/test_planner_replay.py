"""The second training step is replayed from the first's counts, not run: the same estimate as running it, in half
the operators; a step that keeps a tensor for the next one has its second step run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_memopt.functional.planning import count_training_steps
from lightning_memopt.functional.planning import steps as steps_module
from lightning_memopt.planner import estimate_memory
from tests.scripts.fsdp2_peak import ResidualMLP, make_batch


def _run_every_step(monkeypatch):
    monkeypatch.setattr(steps_module._StepLoop, "_replayed", lambda self, first: False)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))

    def forward(self, x):
        return self.net(x).pow(2).mean()


class _KeepsAnOutput(_Tiny):
    """Keeps a tensor from one step to the next (replaced there): the second step must run."""

    def forward(self, x):
        hidden = self.net[0](x)
        self.kept = hidden.detach() * 2  # alive until the next step's forward replaces it
        return self.net[1:](hidden).pow(2).mean()


CASES = {
    "cpu fp32": (lambda: _Tiny(), lambda: torch.randn(16, 32), {"device": "cpu"}),
    "cuda bf16-mixed": (lambda: _Tiny(), lambda: torch.randn(16, 32), {"precision": "bf16-mixed"}),
    "accumulate 3, SGD momentum": (
        lambda: _Tiny(),
        lambda: torch.randn(16, 32),
        {"device": "cpu", "accumulate_grad_batches": 3, "optimizer": lambda p: torch.optim.SGD(p, 0.1, momentum=0.9)},
    ),
    "cuda, foreach SGD momentum": (
        lambda: _Tiny(),
        lambda: torch.randn(16, 32),
        {"optimizer": lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, nesterov=True)},
    ),
    "Adam, amsgrad, weight decay": (
        lambda: _Tiny(),
        lambda: torch.randn(4, 32),
        {"device": "cpu", "optimizer": lambda p: torch.optim.Adam(p, amsgrad=True, weight_decay=0.1)},
    ),
    "cpu, SGD nesterov: states made as it goes": (
        lambda: _Tiny(),
        lambda: torch.randn(2, 32),
        {"device": "cpu", "optimizer": lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, nesterov=True)},
    ),
    "checkpointing": (
        lambda: _Tiny(),
        lambda: torch.randn(16, 32),
        {"gradient_checkpointing": True, "checkpoint_modules": [nn.Linear]},
    ),
    "fsdp2 with MixedPrecisionPolicy": (
        lambda: ResidualMLP(),
        make_batch,
        {"world_size": 2, "precision": "bf16-mixed", "mixed_precision_policy": True},
    ),
    "fsdp2, accumulate 2": (lambda: ResidualMLP(), make_batch, {"world_size": 2, "accumulate_grad_batches": 2}),
}


def _fields(estimate):
    skip = {"seconds", "assumptions"}
    return {f.name: getattr(estimate, f.name) for f in dataclasses.fields(estimate) if f.name not in skip}


@pytest.mark.parametrize("case", list(CASES))
def test_a_replayed_second_step_equals_running_it(case, monkeypatch):
    build, batch, kwargs = CASES[case]
    torch.manual_seed(0)
    replayed = estimate_memory(build(), batch(), **kwargs)
    first_only = estimate_memory(build(), batch(), steps=1, **kwargs)
    _run_every_step(monkeypatch)
    run = estimate_memory(build(), batch(), **kwargs)
    # the replayed forward holds the first step's gradients and optimizer states
    assert replayed.phase_peaks["forward"] > first_only.phase_peaks["forward"]
    assert _fields(replayed) == _fields(run)


def _calls(module, replay):
    """The count, and what ran: the training step's indices, then ``"optimizer step"`` per optimizer step."""
    calls = []

    class AdamW(torch.optim.AdamW):
        def step(self, closure=None):
            calls.append("optimizer step")
            return super().step(closure)

    def step(model, batch, index):
        calls.append(index)
        return model(batch)

    count = count_training_steps(module, torch.randn(16, 32), step, lambda m: [AdamW(m.parameters())], replay=replay)
    return count, calls


def test_the_replay_runs_the_training_step_once_and_counts_what_running_it_twice_counts():
    replayed, calls = _calls(_Tiny(), replay=True)
    run, all_calls = _calls(_Tiny(), replay=False)
    assert calls == [0, "optimizer step"] and all_calls == [0, "optimizer step", 1, "optimizer step"]
    assert replayed == run
    first_only = count_training_steps(
        _Tiny(), torch.randn(16, 32), lambda m, b, i: m(b), lambda m: [torch.optim.AdamW(m.parameters())], steps=1
    )
    assert replayed.phase_peaks["forward"] > first_only.phase_peaks["forward"]  # the first step's states and grads


def test_a_step_that_keeps_a_tensor_for_the_next_one_has_its_second_step_run():
    kept, calls = _calls(_KeepsAnOutput(), replay=True)
    run, _ = _calls(_KeepsAnOutput(), replay=False)
    assert calls == [0, "optimizer step", 1, "optimizer step"]  # run: the kept tensor is alive in the next forward
    assert kept == run
    plain, _ = _calls(_Tiny(), replay=True)
    assert kept.peak_bytes > plain.peak_bytes
