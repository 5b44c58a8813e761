"""The per-rank planner: ``estimate_memory(..., world_size=N)`` predicts one rank's peak of an FSDP2-sharded training
step in one process, equal to real gloo runs of N processes (``tests/scripts/fsdp2_peak.py``) and to torch's
``FSDPMemTracker``, byte for byte on the CPU."""

from __future__ import annotations

import dataclasses
import functools
import json
import socket

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_memopt.functional.planning import LiveBytes
from lightning_memopt.functional.planning.sharding import default_shard_blocks, fake_process_group
from lightning_memopt.planner import MemoryEstimateError, estimate_memory
from tests.helpers.subprocess_run import SCRIPTS, run_file
from tests.helpers.zoo import ZOO
from tests.scripts.fsdp2_peak import BATCH, WIDTH, ResidualMLP, make_batch, tracker_peak

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _estimate(world_size=2, model=None, **kwargs):
    kwargs.setdefault("device", "cpu")
    return estimate_memory(model if model is not None else ResidualMLP(), make_batch(), world_size=world_size, **kwargs)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _gloo_peaks(tmp_path, world_size):
    proc = run_file(SCRIPTS / "fsdp2_peak.py", tmp_path, timeout=300, args=(_free_port(), str(world_size)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"peak_{rank}.json").read_text()) for rank in range(world_size)]


# ------------------------------------------------------------------------------------ the bar: real gloo runs


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4])  # 2 ranks: benchmarks/planner.py --quick (tests/test_planner_benchmark.py)
def test_the_estimate_equals_the_real_per_rank_peak_of_a_gloo_run(tmp_path, world_size):
    """Every rank holds the same shapes here (FSDP2 pads the shards), and the estimate is their peak to the byte.

    gloo's worker thread lets go of a collective's tensors a moment after the collective has returned; the worker
    waits for it before taking a new high (without that wait one rank measured up to one unit's buffer more in about
    1 of 5 four-process runs on 2 busy cores). The bound below keeps a thread that waits longer still from failing
    the run, while the lowest rank must show the estimate exactly."""
    peaks = _gloo_peaks(tmp_path, world_size)
    unit_bytes = 4 * sum(p.numel() for p in ResidualMLP().blocks[0].parameters())  # one unit, unsharded
    options = {
        "true": {"optimizer": ADAMW, "reshard_after_forward": True},
        "false": {"optimizer": ADAMW, "reshard_after_forward": False},
        # AdamW's multi-tensor step over DTensors (DTensor's metadata runs of it are fake tensors: counted by neither)
        "foreach": {"optimizer": functools.partial(ADAMW, foreach=True)},
    }
    for key, kwargs in options.items():
        est = _estimate(world_size, **kwargs)
        measured = [p[key] for p in peaks]
        assert min(measured) == est.peak_bytes, (key, measured)
        assert max(measured) - est.peak_bytes <= unit_bytes, (key, measured)


def test_the_estimate_equals_fsdp_mem_tracker_part_by_part():
    est = _estimate(2, optimizer=ADAMW)
    peak = _tracker_peak()
    assert est.peak_bytes == peak["Total"] == 6_124_880
    parts = est.at_peak
    assert parts["parameters"] == peak["Sharded Param"] == est.parameter_bytes
    assert parts["unsharded_parameters"] == peak["Unsharded Param"]
    assert parts["gradients"] == peak["Sharded Grad"]
    assert parts["optimizer_states"] == peak["OptState"]
    assert parts["communication"] == peak["All Gather"] + peak["Reduce Scatter"]
    assert parts["batch"] == peak["Inputs"]
    # the loss is an activation to one and a temporary to the other: together they agree
    assert parts["activations"] + parts["temporaries"] == peak["Activation"] + peak["Temp"]


def _tracker_peak(policy=None) -> dict[str, int]:
    """torch's ``FSDPMemTracker`` over two steps of the residual MLP sharded per block and at the root over a fake
    group of 2, in Lightning's order: its peak by part (no package code)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import fully_shard

    options = {} if policy is None else {"mp_policy": policy}
    with fake_process_group(2) as mesh, FakeTensorMode():
        model = ResidualMLP()
        for unit in [*model.blocks, model]:
            fully_shard(unit, mesh=mesh["data_parallel"], **options)
        return tracker_peak(model, ADAMW(model.parameters()), make_batch())


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fsdp2_s_mixed_precision_policy_equals_fsdp_mem_tracker_and_beats_autocast(precision):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    est = _estimate(2, optimizer=ADAMW, precision=precision, mixed_precision_policy=True)
    peak = _tracker_peak(MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    assert est.peak_bytes == peak["Total"]
    assert est.at_peak["unsharded_parameters"] == peak["Unsharded Param"]  # all-gathered in 16 bits
    assert est.at_peak["parameters"] == peak["Sharded Param"] == est.parameter_bytes  # the shards stay float32
    assert est.peak_bytes < _estimate(2, optimizer=ADAMW, precision=precision).peak_bytes  # autocast holds more
    assert est.sharding.param_dtype == dtype and f"MixedPrecisionPolicy(param_dtype={dtype}" in str(est)
    assert any("no autocast (the Trainer at 32-true)" in a for a in est.assumptions)


def test_dtensor_s_metadata_runs_are_not_counted():
    """DTensor learns an operator's output shape by running it once per process and signature on global-shape fake
    tensors; those are no memory (counted, they put 917,504 bytes of temporaries into the first AdamW step of a
    process's first sharded estimate). Each run below has shapes no other run has, so its propagation is not cached."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_memopt.utilities._torch_private import uncounted_dtensor_metadata

    def counted(width: int, skip: bool) -> tuple[int, int]:
        with fake_process_group(2) as mesh, FakeTensorMode():
            x = distribute_tensor(torch.randn(26, width), mesh["data_parallel"], [Shard(0)])
            counter = LiveBytes()
            skipping = uncounted_dtensor_metadata(counter.pause, counter.resume) if skip else contextlib.nullcontext()
            with counter, skipping:
                y = torch.special.xlog1py(x, x)
            return counter.peak, y.to_local().untyped_storage().nbytes()

    peak, local = counted(15, skip=True)
    assert peak == local == 13 * 15 * 4  # the local result only
    peak, local = counted(17, skip=False)
    assert peak > local + 26 * 17 * 4  # without it, the global-shape fake tensors too


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 1, "precision": "bf16-mixed"}, r"needs `world_size` > 1"),
        ({"world_size": 2, "precision": "32-true"}, r"'bf16-mixed' or '16-mixed'"),
        ({"world_size": 2, "precision": "bf16-true"}, r"'bf16-mixed' or '16-mixed'"),
    ],
)
def test_the_mixed_precision_policy_needs_ranks_and_a_mixed_precision(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory(ResidualMLP(), make_batch(), device="cpu", mixed_precision_policy=True, **kwargs)


# ------------------------------------------------------------------------------------------------ the options


def test_keeping_parameters_unsharded_after_forward_raises_the_peak():
    resharded, kept = _estimate(reshard_after_forward=True), _estimate(reshard_after_forward=False)
    assert kept.peak_bytes > resharded.peak_bytes
    assert kept.at_peak["unsharded_parameters"] > resharded.at_peak["unsharded_parameters"]
    assert kept.parameter_bytes == resharded.parameter_bytes


def test_cpu_offload_lowers_the_device_peak_and_counts_the_host_bytes_apart():
    plain, offloaded = _estimate(), _estimate(cpu_offload=True)
    assert offloaded.peak_bytes < plain.peak_bytes
    assert offloaded.offloaded_bytes >= plain.parameter_bytes + plain.gradient_bytes + plain.optimizer_state_bytes
    assert plain.offloaded_bytes == 0
    for part in ("parameters", "gradients", "optimizer_states"):
        assert not offloaded.at_peak.get(part), part
    assert sum(offloaded.at_peak.values()) == offloaded.peak_bytes
    assert "CPU offload" in str(offloaded) and "on the host" in str(offloaded)


def test_more_ranks_hold_less_and_the_shards_add_up_to_the_model():
    from torch.distributed.tensor import DTensor

    model = ResidualMLP()
    one, two, four = (_estimate(n, model=model) for n in (1, 2, 4))
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # a twin was sharded, not the model
    assert one.peak_bytes > two.peak_bytes > four.peak_bytes
    assert two.unsharded_parameter_bytes == four.unsharded_parameter_bytes == one.parameter_bytes
    assert two.parameter_bytes == one.parameter_bytes // 2 and four.parameter_bytes == one.parameter_bytes // 4
    assert two.sharding.units == ("blocks.0", "blocks.1", "blocks.2", "blocks.3", "")
    assert (two.world_size, one.world_size, one.sharding) == (2, 1, None)


def test_shard_modules_choose_the_units():
    est = _estimate(shard_modules=["blocks.0", "head"])
    assert est.sharding.units == ("blocks.0", "head", "")
    assert default_shard_blocks(ResidualMLP(), [Block := type(ResidualMLP().blocks[0])]) == [
        f"blocks.{i}" for i in range(4)
    ]
    assert Block.__name__ == "Block"


def test_print_shows_the_ranks_the_sharding_and_the_unsharded_bytes():
    text = str(_estimate(reshard_after_forward=False))
    assert "peak memory per rank" in text
    assert "sharding: FSDP2 over 2 ranks, 5 units per block, then the root" in text
    assert "reshard_after_forward=False" in text
    assert "reshard_after_forward=True" in str(_estimate())  # FSDP2's default, said as applied
    assert "unsharded" in text and "all-gathered" in text and "totals per rank" in text
    assert "fake process group" in text


def test_a_real_cpu_step_on_the_fake_group_counts_the_same_bytes():
    """``fake=False`` (the fallback for steps fake tensors cannot run) allocates rank 0's real shards: same bytes."""
    assert _estimate(fake=False).peak_bytes == _estimate().peak_bytes == 6_124_880


def test_a_cuda_target_is_modelled_as_on_one_device():
    est = _estimate(device="cuda", gpu=(8, 0))
    cpu = _estimate()
    assert est.at_peak["workspace"] > 0 and est.peak_bytes > cpu.peak_bytes
    assert all(v % 512 == 0 for k, v in est.at_peak.items() if k != "workspace")
    assert any("NCCL" in a for a in est.assumptions)


# ------------------------------------------------------------------------------------------------ LightningModule


class _Lit(pl.LightningModule):
    def __init__(self, shard=True, reshard=True):
        super().__init__()
        self.model = ResidualMLP()
        self.shard, self.reshard = shard, reshard
        self.meshes = []

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        self.meshes.append((self.device_mesh["data_parallel"].size(), self.device_mesh["tensor_parallel"].size()))
        if self.shard:
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard)
            fully_shard(self, mesh=mesh, reshard_after_forward=self.reshard)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        return self(batch)

    def configure_optimizers(self):
        return ADAMW(self.parameters())


def test_a_lightning_module_is_sharded_by_its_own_configure_model():
    lit = _Lit(reshard=False)
    est = _estimate(model=lit)
    plain = _estimate(optimizer=ADAMW, reshard_after_forward=False)
    assert est.sharding.source == "configure_model"
    assert est.sharding.units == ("model.blocks.0", "model.blocks.1", "model.blocks.2", "model.blocks.3", "")
    assert est.peak_bytes == plain.peak_bytes and est.at_peak == plain.at_peak
    assert lit.meshes == [] and lit.device_mesh is None  # the user's module is not touched: its twin is configured
    overridden = _estimate(model=_Lit(reshard=False), reshard_after_forward=True)
    assert overridden.peak_bytes == _estimate(optimizer=ADAMW).peak_bytes
    assert "by configure_model" in str(est)
    assert "reshard_after_forward=as configure_model set it" in str(_estimate(model=_Lit()))


def test_a_lightning_module_that_does_not_shard_gets_the_default_sharding_with_its_children_as_roots():
    est = _estimate(model=_Lit(shard=False))
    assert est.sharding.source == "default children"
    assert est.sharding.units == ("model.blocks.0", "model.blocks.1", "model.blocks.2", "model.blocks.3", "model")
    assert est.peak_bytes == _estimate(optimizer=ADAMW).peak_bytes
    assert "per block, then each child of the LightningModule" in str(est)
    with pytest.raises(ValueError, match="`shard_modules`=.*configure_model shards the model itself"):
        _estimate(model=_Lit(), shard_modules=["model.blocks.*"])
    with pytest.raises(ValueError, match="`mixed_precision_policy` shapes the default sharding, but FSDP_Lit"):
        _estimate(model=_Lit(), precision="bf16-mixed", mixed_precision_policy=True)


def test_a_failing_configure_model_is_named_and_the_fake_group_is_gone():
    class Broken(_Lit):
        def configure_model(self):
            raise RuntimeError("no mesh for me")

    with pytest.raises(MemoryEstimateError, match=r"`Broken.configure_model\(\)` failed .*no mesh for me"):
        _estimate(model=Broken())
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "entry",
    [pytest.param(ZOO[name], id=name) for name in ("resnet", "lstm", "metrics", "manual")]
    + [pytest.param(ZOO[name], id=name, marks=pytest.mark.slow) for name in ("t5", "bert")],
)
def test_every_zoo_model_is_estimated_sharded(entry):
    """Hugging Face modules call ``self.model(**batch)``, never ``self``: their children are the roots."""
    one = estimate_memory(entry.build(), entry.batch(4), device="cpu")
    two = estimate_memory(entry.build(), entry.batch(4), device="cpu", world_size=2)
    assert two.parameter_bytes < two.unsharded_parameter_bytes == one.parameter_bytes
    assert two.optimizer_state_bytes < one.optimizer_state_bytes
    assert len(two.sharding.units) > 1


# ------------------------------------------------------------------------------------------------ one rank


@pytest.mark.parametrize(
    ("kwargs", "peak", "at_peak"),
    [
        # the numbers of the base commit (before sharding existed), for the same model and batch
        (
            {"device": "cpu"},
            9228360,
            {"parameters": 2173440, "buffers": 0, "batch": 8192, "gradients": 2173440,
             "optimizer_states": 4346952, "activations": 0, "temporaries": 526336},
        ),
        (
            {"device": "cuda"},
            27923968,
            {"parameters": 2173440, "buffers": 0, "batch": 8192, "gradients": 2173440,
             "optimizer_states": 4356096, "activations": 0, "temporaries": 2173440, "workspace": 17039360},
        ),
        (
            {"device": "cpu", "accumulate_grad_batches": 3},
            9228360,
            {"parameters": 2173440, "buffers": 0, "batch": 8192, "gradients": 2173440,
             "optimizer_states": 4346952, "activations": 0, "temporaries": 526336},
        ),
    ],
)  # fmt: skip
def test_world_size_one_is_the_single_device_estimate_byte_for_byte(kwargs, peak, at_peak):
    torch.manual_seed(0)
    est = estimate_memory(ResidualMLP(), torch.randn(BATCH, WIDTH), world_size=1, **kwargs)
    assert (est.peak_bytes, est.at_peak) == (peak, at_peak)
    default = estimate_memory(ResidualMLP(), torch.randn(BATCH, WIDTH), **kwargs)
    assert dataclasses.replace(default, seconds=est.seconds) == est
    assert est.sharding is None and est.unsharded_parameter_bytes == est.parameter_bytes
    assert "per rank" not in str(est) and "sharding" not in str(est)


# ------------------------------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize("world_size", [0, -2, 1.5, True, "2", None])
def test_world_size_must_be_a_positive_int(world_size):
    with pytest.raises(ValueError, match=r"`world_size` must be a positive int, got"):
        _estimate(world_size)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"reshard_after_forward": False}, "reshard_after_forward"),
        ({"cpu_offload": True}, "cpu_offload"),
        ({"shard_modules": ["blocks.*"]}, "shard_modules"),
    ],
)
def test_sharding_options_need_more_than_one_rank(kwargs, name):
    with pytest.raises(ValueError, match=rf"`{name}` shapes a sharded estimate, but `world_size`=1 does not shard"):
        _estimate(1, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reshard_after_forward": "yes"}, "`reshard_after_forward` must be"),
        ({"cpu_offload": 1}, "`cpu_offload` must be"),
        ({"shard_modules": []}, "`shard_modules` must be a non-empty list"),
        ({"shard_modules": [3]}, "`shard_modules` must be a non-empty list"),
    ],
)
def test_sharding_options_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _estimate(2, **kwargs)


def test_a_real_process_group_already_running_is_refused_and_left_alone(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"`world_size`=2: a process group is initialised already \(backend"):
            _estimate(2)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert _estimate(1).sharding is None  # one rank needs no group
    finally:
        dist.destroy_process_group()


def test_the_fake_group_is_gone_after_an_estimate_and_after_a_failing_one():
    _estimate(2)
    assert not dist.is_initialized()
    with pytest.raises(MemoryEstimateError, match="cannot be estimated on fake tensors"):
        estimate_memory(_ItemModel(), make_batch(), device="cpu", world_size=2)
    assert not dist.is_initialized()


class _ItemModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.lin(x).sum() * float(x.sum().item())


# ------------------------------------------------------------------------------------------------ the counter


def test_the_counter_follows_storages_resized_in_place_and_gives_resize_back():
    original = torch.UntypedStorage.resize_
    x = torch.ones(256)  # 1024 bytes
    with LiveBytes() as counter:
        counter.track(x, "unsharded_parameters")
        x.untyped_storage().resize_(0)
        assert counter.now == 0
        x.untyped_storage().resize_(2048)
        assert (counter.now, counter.peak, counter.totals) == (2048, 2048, {"unsharded_parameters": 2048})
    assert torch.UntypedStorage.resize_ is original
    x.untyped_storage().resize_(0)  # outside the counter: nothing is counted
    assert counter.now == 2048


def test_the_counter_sees_what_a_dtensor_operator_does_inside():
    """A DTensor operator that must redistribute an operand all-gathers it inside the DTensor's dispatch: the counter
    lets the DTensor run and counts those buffers (it would see only the output otherwise)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    with fake_process_group(4) as mesh:
        a = distribute_tensor(torch.ones(64, 64), mesh["data_parallel"], [Shard(0)])
        b = distribute_tensor(torch.ones(64, 64), mesh["data_parallel"], [Shard(1)])
        with LiveBytes() as counter:
            out = a + b
        assert counter.now == counter.storage_bytes(out) == 64 * 64 * 4 // 4
        assert counter.peak >= 64 * 64 * 4  # a whole operand gathered on the way


def test_the_counter_counts_a_dtensor_as_its_local_shard():
    from torch.distributed.tensor import Shard, distribute_tensor

    with fake_process_group(4) as mesh:
        dtensor = distribute_tensor(torch.ones(64, 8), mesh["data_parallel"], [Shard(0)])
        counter = LiveBytes()
        counter.track(dtensor, "parameters")
        assert counter.now == counter.storage_bytes(dtensor) == 64 * 8 * 4 // 4
        with counter:
            doubled = dtensor * 2
        assert counter.now == 2 * 64 * 8 * 4 // 4
        del doubled
