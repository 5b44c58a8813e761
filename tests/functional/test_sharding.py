"""How a model is sharded (``footprint.model_sharding``), and what the out-of-memory report makes of it.

The sharded models are built in this process on torch's fake process group (``tests/helpers/fake_sharded.py``):
rank 0's shards of a 2- or 4-way FSDP2 sharding. The 2-process run under Lightning is ``tests/callbacks/test_fsdp2.py``.
"""

from __future__ import annotations

import gc
import math
import typing
import warnings

import pytest
import torch

from lightning_memopt.functional.footprint import model_sharding
from lightning_memopt.functional.oom import (
    ReportSources,
    build_oom_report,
    failure_memory,
    failure_position,
    render_markdown,
    schema,
    suggest_fixes,
)
from lightning_memopt.functional.readings.memory import MemoryReading
from tests.helpers import oom_fixtures as F
from tests.helpers.fake_sharded import blocks, fake_mesh, shard
from tests.helpers.oom_schema import check_against_schema

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _rank0_bytes(model: torch.nn.Module, world_size: int) -> int:
    """Rank 0's bytes of a dim-0 sharding (``torch.chunk``: the first ranks take ``ceil(rows / world_size)``)."""
    return sum(
        math.ceil(p.shape[0] / world_size) * math.prod(p.shape[1:]) * p.element_size() for p in model.parameters()
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_sharded_model_says_how_and_gives_local_and_whole_bytes(world_size):
    plain = blocks()
    whole = sum(p.numel() * p.element_size() for p in plain.parameters())
    expected_local = _rank0_bytes(plain, world_size)
    with fake_mesh(world_size) as mesh:
        facts = model_sharding(shard(blocks(), mesh))
    assert facts.sharded and facts.kind == "fsdp2"
    assert facts.data_parallel_size == world_size and facts.mesh_shape == [world_size]
    assert facts.num_parameters == facts.num_dtensor_parameters == 10
    assert facts.num_units == 3 and facts.unit_names == ["", "0", "1"]
    assert facts.unsharded_parameter_bytes == whole == 4 * (2 * (32 * 128 + 128 + 128 * 32 + 32) + 32 * 3 + 3)
    assert facts.local_parameter_bytes == expected_local < whole
    assert facts.reshard_after_forward is True and facts.kept_unsharded == []
    assert facts.cpu_offload is False and facts.param_dtype is None
    text = facts.text()
    assert f"over {world_size} ranks" in text and f"({expected_local} bytes) of" in text and f"({whole} bytes)" in text


def test_policies_of_the_units_are_read():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    with fake_mesh(2) as mesh:
        kept = model_sharding(shard(blocks(), mesh, reshard_after_forward=False))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        offload = model_sharding(
            shard(blocks(), mesh, offload_policy=CPUOffloadPolicy(pin_memory=False), mp_policy=policy)
        )
    assert kept.reshard_after_forward is False and kept.kept_unsharded == ["0", "1"]  # the root is not an inner unit
    assert offload.cpu_offload is True and offload.param_dtype == "torch.bfloat16" and offload.reshard_after_forward


def test_gathered_parameters_are_neither_duplicates_nor_lost_shards():
    # One rank: each shard has the shape and values of its whole parameter. A unit with reshard_after_forward=False
    # keeps the gathered whole after a no-grad forward (as in validation); the shards are then no module attribute.
    from lightning_memopt.functional.footprint import find_duplicates, live_tensors, model_footprint, tensor_names

    gc.collect()  # earlier tests' seeded models, left in reference cycles, hold the same values
    with fake_mesh(1, backend="gloo") as mesh:
        model = shard(blocks(), mesh, reshard_after_forward=False)
        before = model_footprint(model).bytes_by_category()["parameters"]
        with torch.no_grad():
            model(torch.randn(4, 32))
        gathered = [p for p in model.parameters() if not isinstance(p, torch.distributed.tensor.DTensor)]
        live = live_tensors("cpu", names=tensor_names(model))
        duplicates = find_duplicates(model, live)
        facts = model_sharding(model)
        after = model_footprint(model).bytes_by_category()["parameters"]
    assert len(gathered) == 10  # every unit (the root too) holds whole tensors now
    assert duplicates.num_tensors == 0, duplicates
    assert facts.num_dtensor_parameters == 10 and facts.local_parameter_bytes == before
    assert after == before + sum(p.numel() * p.element_size() for p in gathered)  # the shards and the gathered wholes


def test_a_whole_copy_of_sharded_weights_kept_on_a_rank_is_a_duplicate():
    # rank 0 of 2: a full state dict holds each whole parameter, whose first rows are this rank's shard
    from lightning_memopt.functional.footprint import find_duplicates, live_tensors, tensor_names
    from lightning_memopt.functional.footprint.sharding import shard_rows

    gc.collect()  # earlier tests' seeded models, left in reference cycles, hold the same values
    with fake_mesh(2) as mesh:
        model = shard(blocks(), mesh)
        whole = []
        for param in model.parameters():
            shape, rows = shard_rows(param)
            assert rows.start == 0 and rows.stop == param.to_local().shape[0]
            rest = torch.randn(shape[0] - rows.stop, *shape[1:])
            whole.append(torch.cat([param.to_local().detach(), rest]))
        unrelated = [torch.randn(t.shape) for t in whole]  # whole shapes, other values
        duplicates = find_duplicates(model, live_tensors("cpu", names=tensor_names(model)))
    assert duplicates.num_tensors == 10 and duplicates.num_same_shape_other_values >= 10  # the unrelated ones
    assert duplicates.bytes == sum(t.numel() * 4 for t in whole) and duplicates.fraction > 1.9  # whole vs shards
    assert duplicates.cause.startswith("a whole (unsharded) copy of the sharded weights")
    del whole, unrelated


def test_a_plain_model_is_not_sharded():
    facts = model_sharding(blocks())
    assert not facts.sharded and facts.kind is None and facts.num_units == 0 and facts.data_parallel_size is None
    assert facts.local_parameter_bytes == facts.unsharded_parameter_bytes
    assert facts.text().startswith("not sharded")


# ---------------------------------------------------------------------------------------------------- the report


def _report(model: torch.nn.Module, strategy: str = "ModelParallelStrategy", world_size: int = 2):
    exception = F.training_oom()
    settings = dict(F.SETTINGS, strategy=strategy, world_size=world_size)
    sources = ReportSources(
        settings=lambda: settings,
        live_tensors=lambda d, names=None: [],
        environment=dict,
        allocator=dict,
        versions=dict,
    )
    position = dict(F.POSITION, world_size=world_size)
    when = failure_position(
        lambda: position, device=torch.device("cpu"), traceback=exception.__traceback__, run_id=None
    )
    memory = failure_memory(lambda: MemoryReading(**F.CPU_MEMORY))
    return build_oom_report(
        exception, when=when, memory=memory, device=torch.device("cpu"), module=model, sources=sources
    )


def test_the_report_of_a_sharded_model_has_a_sharding_part():
    with fake_mesh(2) as mesh:
        model = shard(blocks(), mesh, reshard_after_forward=False)
        report = _report(model)
    check_against_schema(report)
    sharding = report["sharding"]
    assert sharding["sharded"] and sharding["strategy"] == "ModelParallelStrategy" and sharding["num_units"] == 3
    assert sharding["local_parameter_bytes"] == report["holders"]["bytes_by_category"]["parameters"]
    assert list(report).index("sharding") == list(report).index("config") + 1
    assert list(sharding) == list(typing.get_type_hints(schema.ShardingSection))  # every key, in the schema's order
    actions = " ".join(tip["action"] for tip in report["suggestions"])
    assert "reshard_after_forward=True" in actions and "`0`, `1`" in actions
    text = render_markdown(report)
    assert "## Sharding" in text and "over 2 ranks" in text and "unsharded" in text


def test_the_effective_batch_counts_data_parallel_ranks_only():
    # 4 ranks: 2-way FSDP on the mesh's data-parallel dimension, 2-way tensor parallel (ranks that share samples)
    with fake_mesh(4, shape=(2, 2), names=("data_parallel", "tensor_parallel")) as mesh:
        report = _report(shard(blocks(), mesh["data_parallel"]), world_size=4)
    micro, accumulate = report["config"]["micro_batch_size"], report["config"]["accumulate_grad_batches"]
    assert report["sharding"]["data_parallel_size"] == 2 and report["when"]["world_size"] == 4
    assert report["config"]["effective_batch_size"] == micro * 2 * accumulate  # not x 4
    halve = next(tip["action"] for tip in report["suggestions"] if tip["action"].startswith("Halve"))
    assert halve.endswith(f"the effective batch stays {micro * 2 * accumulate}")
    assert _report(blocks(), world_size=4)["config"]["effective_batch_size"] == micro * 4 * accumulate


def test_the_report_of_a_plain_model_has_no_sharding_part():
    report = _report(blocks(), strategy="DDPStrategy")
    assert "sharding" not in report and "## Sharding" not in render_markdown(report)


# ---------------------------------------------------------------------------------------------------- suggestions

_SHARDED = {
    "sharded": True,
    "kind": "fsdp2",
    "data_parallel_size": 2,
    "reshard_after_forward": True,
    "kept_unsharded": [],
    "cpu_offload": False,
    "param_dtype": None,
}
_HEAVY_STATES = dict(
    stage="train",
    allocated_bytes=10_000,
    reserved_bytes=10_000,
    bytes_by_category={"parameters": 2500, "gradients": 2500, "optimizer_states": 4000, "buffers": 0},
    unexplained_bytes=1000,
    micro_batch_size=8,
    world_size=2,
    precision="32-true",
)


def _actions(**kwargs) -> str:
    return "\n".join(tip["action"] for tip in suggest_fixes(**kwargs))


def test_sharded_tips_never_suggest_the_sharding_that_is_done():
    plain = _actions(**_HEAVY_STATES)
    sharded = _actions(**_HEAVY_STATES, sharding=_SHARDED)
    assert "strategy='fsdp'" in plain and "Shard parameters and gradients" in plain
    assert (
        "strategy='fsdp'" not in sharded and "Shard parameters" not in sharded and "Shard the optimizer" not in sharded
    )
    assert "sharded over 2 ranks already" in sharded and "CPUOffloadPolicy" in sharded
    offloaded = _actions(**_HEAVY_STATES, sharding=dict(_SHARDED, cpu_offload=True))
    assert "CPUOffloadPolicy" not in offloaded and "sharded over 2 ranks already" in offloaded


def test_sharded_tips_checkpoint_before_fully_shard_and_reshard_after_forward():
    busy = dict(_HEAVY_STATES, bytes_by_category={"parameters": 100, "gradients": 100}, unexplained_bytes=9000)
    sharded = _actions(**busy, sharding=dict(_SHARDED, reshard_after_forward=False, kept_unsharded=["model.0"]))
    assert "before `fully_shard`" in sharded and "reshard_after_forward=True` to `fully_shard` for `model.0`" in sharded
    assert "reshard_after_forward" not in _actions(**busy, sharding=_SHARDED)
    assert "before `fully_shard`" not in _actions(**busy)


def test_sharded_mixed_precision_tip_names_one_of_the_two_ways():
    busy = dict(_HEAVY_STATES, unexplained_bytes=9000, device_type="cuda")
    assert "MixedPrecisionPolicy" in _actions(**busy, sharding=_SHARDED)
    assert "mixed precision" not in _actions(**busy, sharding=dict(_SHARDED, param_dtype="torch.bfloat16"))


# ---------------------------------------------------------------------------------------------------- MemoryAudit


def test_the_audit_printout_says_the_model_is_sharded_and_gives_the_whole():
    from lightning_memopt.functional.audit.session import audit_model
    from lightning_memopt.functional.footprint import live_tensors, model_footprint, tensor_names

    with fake_mesh(2) as mesh:
        model = shard(blocks(), mesh)
        footprint = model_footprint(model)
        text = audit_model(model, footprint, live_tensors("cpu", tensor_names(model)), None, "cpu").text("fit_start")
    local, whole = footprint.bytes_by_category()["parameters"], 67212
    assert local == _rank0_bytes(blocks(), 2)
    assert text.splitlines()[0] == "MemoryAudit (fit start): model and optimizer footprint of this rank"
    assert "model sharded (fsdp2, 3 units, over 2 ranks): parameters" in text
    assert f"({local} bytes) of" in text and f"unsharded ({whole} bytes)" in text
    plain = blocks()
    plain_text = audit_model(plain, model_footprint(plain), [], None, "cpu").text("fit_start")
    assert "sharded" not in plain_text and "of this rank" not in plain_text


@pytest.mark.parametrize(("precision", "warned"), [("bf16-mixed", True), ("32-true", False), (None, False)])
def test_the_audit_warns_when_autocast_and_fsdp_mixed_precision_both_cast(precision, warned):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_memopt.functional.audit.leaks import LeakSampler
    from lightning_memopt.functional.audit.session import AuditSession
    from lightning_memopt.functional.readings.memory import DeviceMemory

    session = AuditSession(DeviceMemory("cpu"), LeakSampler(3, 1, None), 0.5, 5, collect_garbage=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with fake_mesh(2) as mesh, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session.audit(shard(blocks(), mesh, mp_policy=policy), [], "fit_start", lambda *a, **k: {}, precision=precision)
        session.audit(shard(blocks(), mesh), [], "fit_start", lambda *a, **k: {}, precision=precision)  # no policy
    found = [str(w.message) for w in caught if "both lower precision" in str(w.message)]
    assert len(found) == int(warned)
    if warned:
        assert "`Trainer(precision='bf16-mixed')`" in found[0] and "param_dtype=torch.bfloat16" in found[0]


# ---------------------------------------------------------------------------------------------------- checkpointing


@pytest.mark.parametrize("order", ["wrapped, then fully_shard", "fully_shard, then wrapped"])
def test_checkpointed_fsdp2_blocks_recompute_and_give_the_same_gradients(order):
    # One real rank (gloo): FSDP's hooks gather around the block's call; the wrapper replaces only its forward.
    from lightning_memopt.functional.checkpointing import wrap_modules

    def gradients(wrap: bool) -> tuple[list[torch.Tensor], int]:
        with fake_mesh(1, backend="gloo") as mesh:
            model, calls = blocks(), []
            for block in model[:-1]:
                block[0].register_forward_pre_hook(lambda module, args: calls.append(1))
            if wrap and order.startswith("wrapped"):
                wrap_modules(model, ["0", "1"])
            shard(model, mesh)
            if wrap and order.startswith("fully_shard"):
                wrap_modules(model, ["0", "1"])
            model(torch.randn(4, 32, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
            return [p.grad.full_tensor().clone() for p in model.parameters()], len(calls)

    (plain, plain_calls), (checkpointed, calls) = gradients(False), gradients(True)
    assert (plain_calls, calls) == (2, 4)  # each block again in backward
    for got, expected in zip(checkpointed, plain):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_a_model_sharded_as_one_unit_is_told_to_shard_per_block():
    from torch.distributed.fsdp import fully_shard

    with fake_mesh(1, backend="gloo") as mesh:
        model = blocks()
        fully_shard(model, mesh=mesh)
        model(torch.randn(2, 32)).sum().backward()  # FSDP2 keeps the root gathered after forward from now on
        facts = model_sharding(model)
        report = _report(model)
    assert facts.num_units == 1 and facts.reshard_after_forward is None and facts.kept_unsharded == []
    actions = " ".join(tip["action"] for tip in report["suggestions"])
    assert "Apply `fully_shard` to each block" in actions and "reshard_after_forward" not in actions
    with fake_mesh(2) as mesh:
        per_block = _report(shard(blocks(), mesh))
    assert not any("Apply `fully_shard` to each block" in tip["action"] for tip in per_block["suggestions"])


def test_fsdp1_tips_name_the_strategy_settings_not_fully_shard():
    busy = dict(_HEAVY_STATES, device_type="cuda")
    fsdp1 = _actions(**busy, sharding=dict(_SHARDED, kind="fsdp1"))
    assert "FSDPStrategy(cpu_offload=True)" in fsdp1 and "already" in fsdp1
    assert "fully_shard" not in fsdp1 and "MixedPrecisionPolicy" not in fsdp1 and "ModelParallelStrategy" not in fsdp1
    activations = dict(busy, unexplained_bytes=9000, bytes_by_category={"parameters": 100})
    assert "activation_checkpointing_policy" in _actions(**activations, sharding=dict(_SHARDED, kind="fsdp1"))


@pytest.mark.parametrize(
    ("shape", "placements"),
    [((2,), ("replicate",)), ((2,), ("shard1",)), ((2, 2), ("shard0", "replicate"))],
)
def test_shard_rows_reads_only_first_dimension_shards_on_a_one_dimensional_mesh(shape, placements):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from lightning_memopt.functional.footprint.sharding import shard_rows

    kinds = {"replicate": Replicate(), "shard0": Shard(0), "shard1": Shard(1)}
    names = ("data_parallel",) if len(shape) == 1 else ("replicate", "shard")
    with fake_mesh(math.prod(shape), shape=shape, names=names) as mesh:
        other = DTensor.from_local(torch.zeros(4, 6), mesh, [kinds[p] for p in placements], run_check=False)
        assert shard_rows(other) is None
        first_dimension = mesh if len(shape) == 1 else mesh["shard"]
        whole, rows = shard_rows(DTensor.from_local(torch.zeros(4, 6), first_dimension, [Shard(0)], run_check=False))
    assert whole == (8, 6) and (rows.start, rows.stop) == (0, 4)  # rank 0 holds the first half
