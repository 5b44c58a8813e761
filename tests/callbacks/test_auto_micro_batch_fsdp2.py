"""AutoMicroBatch under FSDP2 (``fully_shard``): every rank abandons a failed micro-batch at the same collective.

The fast tests run the agreement and the reset of FSDP2's state in this process (FSDP2 on a one-process gloo group).
The slow one reads one 2-process run of ``tests/scripts/amb_fsdp2.py`` (Lightning's ModelParallelStrategy, rank 1 alone
out of memory in a middle block's forward, then in its backward, then inside FSDP's reduce-scatter) and compares it
with Lightning's accumulation at the micro-batch that fits.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from lightning_memopt.functional.micro_batch.ddp_sync import check_strategy_for_micro_batches
from lightning_memopt.functional.micro_batch.fsdp_sync import (
    AgreeingAllGather,
    AgreeingReduceScatter,
    PeerCollectiveOutOfMemoryError,
    check_fsdp_for_micro_batches,
    fsdp_modules,
    install_agreement,
    reset_fsdp_state,
)
from lightning_memopt.functional.micro_batch.retry import (
    Agreement,
    MicroBatchPart,
    PeerOutOfMemoryError,
    is_unrecoverable,
    run_micro_batches,
)
from tests.helpers.amb import BackwardBudget
from tests.helpers.lightning import lightning_module
from tests.helpers.subprocess_run import run_script_once

OK, RETRY, GIVE_UP = 0, 1, 2


class Scripted(Agreement):
    """An active agreement whose all-reduces answer from a script (the flag the other ranks sent; whether they have
    samples left is this rank's) and are counted: ``sent`` holds ``(flag, samples left)`` of each."""

    def __init__(self, answers=()):
        super().__init__(active=True)
        self.answers, self.sent = list(answers), []

    def agree(self, value, more=0):
        self.sent.append((value, more))
        return (max(value, self.answers.pop(0)) if self.answers else value), more


# ----------------------------------------------------------------------------------------------- the agreement


def test_an_agreement_point_agrees_only_while_a_micro_batch_runs_and_raises_the_peer_s_flag():
    comm = Scripted(answers=[OK, RETRY])
    comm.before_collective()  # outside a micro-batch (validation): nothing sent
    assert comm.sent == []
    with pytest.raises(PeerOutOfMemoryError) as caught, comm.step():
        comm.before_collective()
        comm.before_collective()  # another rank sent RETRY here
    assert caught.value.flag == RETRY and isinstance(caught.value, torch.OutOfMemoryError)
    assert comm.sent == [(OK, 0), (OK, 0)] and comm.points == 2 and not comm.in_step


def test_a_peer_s_flag_learned_inside_a_step_is_that_round_s_agreement():
    """Rank 0's view: rank 1 ran out of memory; rank 0 learns it at a collective, sends no end-of-round flag, and
    retries at half size with everyone."""
    comm = Scripted(answers=[RETRY])  # the first agreement point inside the step
    calls = []

    def step(start, stop):
        calls.append((start, stop))
        comm.before_collective()  # FSDP2's all-gather of the next unit
        return MicroBatchPart(stop - start, None, {})

    halvings = []
    parts, size = run_micro_batches(8, 8, 1, step, agreement=comm, on_halve=lambda *a: halvings.append(a))
    assert halvings == [(8, 4, False)] and size == 4 and [p.samples for p in parts] == [4, 4]
    # point (peer's RETRY: no end-of-round flag), then at 4: point, end (samples left), point, end (none left)
    assert comm.sent == [(OK, 0), (OK, 0), (OK, 1), (OK, 0), (OK, 0)]


def test_a_peer_giving_up_at_the_smallest_micro_batch_ends_this_rank_too():
    comm = Scripted(answers=[GIVE_UP])

    def step(start, stop):
        comm.before_collective()
        return MicroBatchPart(stop - start, None, {})

    with pytest.raises(torch.OutOfMemoryError, match="another process ran out of memory at a micro-batch of 1"):
        run_micro_batches(1, 1, 1, step, agreement=comm)
    assert comm.sent == [(OK, 0)]


def test_an_out_of_memory_error_inside_a_collective_ends_the_run_without_agreeing():
    comm = Scripted()

    def fails(**kwargs):
        raise torch.OutOfMemoryError("simulated: inside the all-gather")

    collective = AgreeingAllGather(comm)
    with pytest.raises(torch.OutOfMemoryError, match="inside FSDP's all-gather itself") as caught:
        run_micro_batches(8, 8, 1, lambda start, stop: collective._run(fails), agreement=comm)
    assert is_unrecoverable(caught.value)
    assert comm.sent == [(OK, 0)]  # the agreement point before the collective: no end-of-round


def test_fsdp1_deepspeed_and_tensor_parallel_are_refused_fsdp2_is_accepted():
    check_strategy_for_micro_batches("ModelParallelStrategy", 2, is_ddp=False, is_fsdp2=True)
    for name in ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"):
        with pytest.raises(ValueError, match=r"ModelParallelStrategy\(tensor_parallel_size=1\)"):
            check_strategy_for_micro_batches(name, 2, is_ddp=False)


class _Mesh:
    """A device mesh of Lightning's ModelParallelStrategy, as far as the check reads it."""

    mesh_dim_names = ("data_parallel", "tensor_parallel")

    def __init__(self, tensor_parallel):
        self.sizes = {"data_parallel": 1, "tensor_parallel": tensor_parallel}

    def __getitem__(self, name):
        return SimpleNamespace(size=lambda: self.sizes[name])

    def size(self, dim):
        return self.sizes[self.mesh_dim_names[dim]]


def test_tensor_parallel_model_parallel_strategy_is_refused_in_setup():
    strategy = lightning_module("strategies").ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    strategy._device_mesh = _Mesh(tensor_parallel=2)  # set up by the strategy before the callback's setup
    trainer = SimpleNamespace(strategy=strategy, world_size=2)
    with pytest.raises(ValueError, match=r"ModelParallelStrategy.*tensor_parallel_size=1") as caught:
        AutoMicroBatch().setup(trainer, SimpleNamespace(automatic_optimization=True), "fit")
    assert "under tensor parallelism (tensor_parallel_size=2 > 1)" in str(caught.value)


def test_a_model_not_sharded_by_fully_shard_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"fully_shard\(block, mesh=self.device_mesh\['data_parallel'\]\)"):
        check_fsdp_for_micro_batches(nn.Linear(2, 2))


# ----------------------------------------------------------------------------------------------- FSDP2's state


@pytest.fixture
def one_process_mesh(one_process_group):
    """The mesh of a one-process gloo group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def _collective_failing_with(error):
    def collective(**kwargs):
        raise error

    return collective


def test_the_ranks_waiting_in_a_collective_end_with_the_error_of_the_rank_that_ran_out_of_memory_in_it(
    one_process_mesh,
):
    """Rank 0 plays both sides, each with an agreement of its own as two ranks have: it runs out of memory inside the
    reduce-scatter (its error goes to the store), then, as a waiting rank would at the same agreement point, gets the
    backend's error from the collective and ends with the first error instead."""
    comm = Scripted()
    oom = torch.OutOfMemoryError("simulated: inside the reduce-scatter")
    with pytest.raises(torch.OutOfMemoryError, match="inside the reduce-scatter"), comm.step():
        AgreeingReduceScatter(comm)._run(_collective_failing_with(oom))
    waiting = Scripted()
    collective = AgreeingReduceScatter(waiting)
    gloo = RuntimeError("[gloo] Connection closed by peer")
    with pytest.raises(PeerCollectiveOutOfMemoryError) as caught:
        run_micro_batches(
            8, 8, 1, lambda start, stop: collective._run(_collective_failing_with(gloo)), agreement=waiting
        )
    said = str(caught.value)
    assert "another process ran out of memory inside FSDP's reduce-scatter" in said
    assert "rank 0 (" in said and "OutOfMemoryError: simulated: inside the reduce-scatter" in said
    assert caught.value.__cause__ is gloo and is_unrecoverable(caught.value)  # the backend's error kept; no retry


def test_without_a_store_the_waiting_rank_ends_with_the_backend_s_error_and_a_note():
    comm = Scripted()
    gloo = RuntimeError("[gloo] Connection closed by peer")
    with pytest.raises(RuntimeError) as caught, comm.step():
        AgreeingAllGather(comm)._run(_collective_failing_with(gloo))
    assert caught.value is gloo and "another process stopped inside FSDP's all-gather" in str(gloo)


class _Block(nn.Module):
    def __init__(self, budget=None):
        super().__init__()
        self.linear, self.budget = nn.Linear(8, 8), budget

    def forward(self, x):
        return x + torch.tanh(BackwardBudget.apply(self.linear(x), self.budget))


def _sharded(mesh, budget=None):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _Block(), _Block(budget), _Block(), nn.Linear(8, 1))
    for block in list(model)[1:4]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_after_a_backward_abandoned_mid_way_the_retry_s_gradients_are_a_fresh_run_s(one_process_mesh):
    """The root stays unsharded after forward: backward wrote its head's gradient into the unsharded parameter, which
    the next all-gather reuses. The reset drops it (without: the retry's head gradient is off by the failed one)."""
    x = torch.randn(6, 4)
    reference = _sharded(one_process_mesh)
    reference(x[:2]).sum().backward()
    model = _sharded(one_process_mesh, budget=2)
    check_fsdp_for_micro_batches(model)
    modules = fsdp_modules(model)
    assert modules[0] is model and len(modules) == 4
    install_agreement(modules, Agreement())  # one process: the agreement sends nothing
    params = list(model.parameters())  # sharded, as the callback keeps them at a batch's start
    with pytest.raises(torch.OutOfMemoryError):
        model(x).sum().backward()
    for p in params:  # what restore_grads does for a window's first batch
        p.grad = None
    reset_fsdp_state(modules)
    model(x[:2]).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), name


@pytest.fixture
def fake_two_rank_mesh():
    """Rank 0 of a fake process group of 2 (torch's test backend: collectives do nothing), and its mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_fsdp2_s_collectives_agree_inside_a_micro_batch_only_and_a_peer_s_flag_stops_the_forward(fake_two_rank_mesh):
    model = _sharded(fake_two_rank_mesh)
    comm = Scripted()
    install_agreement(fsdp_modules(model), comm)
    x = torch.randn(4, 4)
    model(x).sum().backward()  # outside a micro-batch (validation, another callback's forward): FSDP2's defaults
    assert comm.sent == []
    with comm.step():
        model(x).sum().backward()
    # all-gathers: the root and three blocks in forward, the three blocks again in backward; four reduce-scatters
    assert comm.points == len(comm.sent) == 11
    comm.answers = [OK, RETRY]  # another rank ran out of memory in the root's forward, before block 1's all-gather
    with pytest.raises(PeerOutOfMemoryError), comm.step():
        model(x)
    reset_fsdp_state(fsdp_modules(model))
    model(x).sum().backward()  # FSDP2 runs again after the reset


# ----------------------------------------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    return run_script_once(tmp_path_factory, "amb_fsdp2.py")


def _load(directory, name):
    return [torch.load(directory / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_only_rank_1_runs_out_of_memory_and_both_ranks_halve_to_lightning_accumulation_s_weights(fsdp2_run, where):
    reference = _load(fsdp2_run, "reference")
    ranks = _load(fsdp2_run, where)
    for r in ranks:  # both ranks halved together (8 -> 4 -> 2), the same three optimizer steps
        assert (r["micro"], r["retries"], r["step"]) == (2, 2, 3)
        assert r["sizes"][:3] == [8, 4, 2] and r["sizes"][3:] == [2] * 11  # every sample once after the halvings
    assert reference[0]["step"] == 3
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][name]), (where, name)
        assert torch.allclose(value, reference[0]["weights"][name], rtol=0, atol=1e-6), (where, name)


@pytest.mark.slow
def test_ranks_out_of_memory_at_different_points_halve_together(fsdp2_run):
    """8: rank 0 runs out of memory in block 1's forward, rank 1 learns it at block 2's all-gather; 4: rank 1 runs out
    of memory in block 2's backward, rank 0 learns it at a collective of backward; 2 fits."""
    reference, ranks = _load(fsdp2_run, "reference"), _load(fsdp2_run, "both")
    for r in ranks:
        assert (r["micro"], r["retries"], r["step"]) == (2, 2, 3)
    assert ranks[0]["sizes"][:3] == [8, 4, 2] and ranks[1]["sizes"][:3] == [8, 4, 2]
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][name]), name
        assert torch.allclose(value, reference[0]["weights"][name], rtol=0, atol=1e-6), name


@pytest.mark.slow
def test_a_backward_out_of_memory_mid_window_keeps_the_window_s_sharded_gradients(fsdp2_run):
    """accumulate_grad_batches=2: the first batch of the window went through at 8; rank 1 runs out of memory in the
    second's backward after some units reduce-scattered their gradients into the sharded ones: back to the first
    batch's, and the window ends equal to Lightning's accumulation at 2 (the first batch at 8 rounds differently)."""
    reference, ranks = _load(fsdp2_run, "window_reference"), _load(fsdp2_run, "window")
    for r in ranks:
        assert (r["micro"], r["retries"], r["step"]) == (2, 2, 3)
        assert r["sizes"][:4] == [8, 8, 4, 2]
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][name]), name
        assert torch.allclose(value, reference[0]["weights"][name], rtol=0, atol=1e-6), name


@pytest.mark.slow
def test_an_out_of_memory_error_inside_a_collective_ends_every_rank_within_seconds(fsdp2_run):
    failing, waiting = _load(fsdp2_run, "collective")[::-1]
    assert failing["error"].startswith("OutOfMemoryError: simulated: inside the reduce-scatter")
    assert "cannot be retried" in failing["error"]
    assert waiting["error"].startswith("PeerCollectiveOutOfMemoryError: AutoMicroBatch: another process ran out of")
    assert "rank 1 (" in waiting["error"] and "Error: simulated: inside the reduce-scatter" in waiting["error"]
    assert waiting["seconds"] < 300  # a hang guard: the process group's time-out is 30 minutes
    # each rank wrote its report (the documented name links to the newest)
    reports = [json.loads((fsdp2_run / "collective_reports" / f"oom_report_rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[1]["error"]["type"] == "torch.OutOfMemoryError" and reports[1]["when"]["rank"] == 1
    assert reports[0]["error"]["type"].endswith("PeerCollectiveOutOfMemoryError") and reports[0]["when"]["rank"] == 0
    for report in reports:
        assert "inside the reduce-scatter" in report["error"]["message"]
        assert report["sharding"]["kind"] == "fsdp2" and report["sharding"]["data_parallel_size"] == 2


def test_hsdp_s_two_dimensional_mesh_is_refused(fake_two_rank_mesh):
    """HSDP all-reduces the reduce-scattered gradients over the replicas: no agreement point before that collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
    with pytest.raises(ValueError, match="one-dimensional data-parallel mesh"):
        check_fsdp_for_micro_batches(model)
    check_fsdp_for_micro_batches(fully_shard(nn.Linear(4, 4), mesh=fake_two_rank_mesh))  # FSDP: accepted


@pytest.mark.slow
def test_an_evaluation_out_of_memory_on_one_rank_under_fsdp2_halves_both_ranks_in_fit_and_alone(fsdp2_run):
    runs = [torch.load(fsdp2_run / f"eval_rank{r}.pt", weights_only=False) for r in (0, 1)]
    # the same run without the callback, validated at 2 per batch (the synced epoch mean: equal up to rounding)
    reference = torch.load(fsdp2_run / "eval_reference_rank0.pt", weights_only=False)
    for run in runs:  # rank 0 had memory to spare and followed rank 1 at the same all-gathers: 8 -> 4 -> 2
        assert run["micro"] == 2
        assert run["sizes"] == [8, 4, 2, 2, 2, 2, 2, 2, 2, 2]  # the validate after fit, learning again from 8
        assert run["in_fit"] == pytest.approx(reference["in_fit"], rel=1e-6)
        assert run["alone"] == pytest.approx(reference["alone"], rel=1e-6)
