import json
import warnings

import pytest
import torch
from torch import nn

from lightning_memopt import to_device_and_dtype
from lightning_memopt.functional.conversion import ConversionResult
from lightning_memopt.utilities.formatting import format_bytes


def _net():
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))


def test_cast_in_place_reports_bytes_and_keeps_parameter_objects():
    net = _net()
    params = list(net.parameters())
    res = to_device_and_dtype(net, dtype=torch.bfloat16)
    assert isinstance(res, ConversionResult) and res.converted
    assert [id(p) for p in net.parameters()] == [id(p) for p in params]  # in place: same Parameter objects
    # params 72 + bn weight/bias 16, running stats 16 (float) + num_batches_tracked 1 (int64, untouched)
    assert res.num_converted == 6 and res.num_skipped == 1
    assert res.bytes_before == {"cpu": (72 + 16 + 16) * 4 + 8}
    assert res.bytes_after == {"cpu": (72 + 16 + 16) * 2 + 8}
    assert net[1].num_batches_tracked.dtype == torch.int64
    assert res.allocated_before is None and res.allocated_after is None  # no allocator readings on CPU
    json.dumps(res.as_dict())


def test_noop_conversions_are_skipped_without_calling_to(monkeypatch):
    net = _net().to(torch.float16)
    calls = []
    monkeypatch.setattr(nn.Module, "to", lambda self, *a, **k: calls.append((a, k)) or self)
    for kwargs in (
        {},
        {"device": "cpu"},
        {"dtype": torch.float16},
        {"device": torch.device("cpu"), "dtype": torch.float16},
    ):
        res = to_device_and_dtype(net, **kwargs)
        assert not res.converted and res.num_converted == 0
        assert res.bytes_before == res.bytes_after
    assert calls == []


def test_only_mismatching_tensors_counted():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    res = to_device_and_dtype(net, dtype=torch.bfloat16)
    assert (res.num_converted, res.num_skipped) == (2, 2)
    assert res.total_bytes_before == 20 * 4 + 20 * 2 and res.total_bytes_after == 40 * 2


@pytest.mark.parametrize("bad", [torch.int8, "bfloat16", torch.bool])
def test_bad_dtype_names_argument(bad):
    with pytest.raises(ValueError, match=r"`dtype` must be a floating-point torch.dtype.*got"):
        to_device_and_dtype(nn.Linear(2, 2), dtype=bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "model"}, r"`model` must be a torch.nn.Module \(a LightningModule too\), got 'model' \(str\)"),
        ({"model": {"weight": torch.zeros(1)}}, r"`model` must be a torch.nn.Module .* \(dict\)"),
        ({"device": 3.5}, r"`device` must be a torch.device, .* got 3.5 \(float\)"),
        ({"device": True}, r"`device` must be .* got True \(bool\). A bool is not a device index"),
        ({"device": "gpu"}, r"`device` must be .* got 'gpu' \(str\)"),
    ],
)
def test_bad_model_or_device_names_argument(kwargs, match):
    args = {"model": nn.Linear(2, 2), **kwargs}
    with pytest.raises(ValueError, match=match):
        to_device_and_dtype(**args)


@pytest.mark.cuda
def test_cuda_move_and_cast_once_reports_allocator_delta():
    net = nn.Linear(1024, 1024)
    res = to_device_and_dtype(net, device="cuda", dtype=torch.bfloat16)
    assert res.converted and res.bytes_after == {"cuda:0": (1024 * 1024 + 1024) * 2}
    assert res.allocated_after - res.allocated_before >= (1024 * 1024 + 1024) * 2
    assert not to_device_and_dtype(net, device="cuda:0", dtype=torch.bfloat16).converted
    stray = net.state_dict()  # references to the bf16 storages, kept elsewhere
    res = to_device_and_dtype(net, dtype=torch.float32)
    # the old bf16 weights stay alive in `stray`: allocated grows by the full fp32 size, nothing is freed
    assert res.allocated_after - res.allocated_before >= (1024 * 1024 + 1024) * 4
    del stray


def _model():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))


def test_old_weights_kept_alive_by_a_state_dict_are_counted_and_warned():
    model = _model()
    kept = model.state_dict()  # the user's reference: the fp32 storages cannot be freed
    fp32 = sum(t.numel() * 4 for t in kept.values() if t.is_floating_point())
    size = format_bytes(fp32)
    with pytest.warns(UserWarning, match=rf"to_device_and_dtype: {size} of the model's old tensors \(6 storages\)"):
        result = to_device_and_dtype(model, dtype=torch.bfloat16)
    assert result.num_kept_alive == 6 and result.bytes_kept_alive == fp32
    assert result.total_bytes_after < result.total_bytes_before
    assert f"{size} of the old tensors (6) is still held by other references" in str(result)
    del kept


def test_a_conversion_that_frees_everything_warns_nothing_and_prints_readably():
    model = _model()
    before = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = to_device_and_dtype(model, dtype=torch.bfloat16)
    after = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert result.num_kept_alive == 0 and result.bytes_kept_alive == 0
    assert str(result) == (
        f"converted 6 tensors (1 already matched): parameters and buffers {format_bytes(before)} on cpu ->"
        f" {format_bytes(after)} on cpu"
    )
    assert "KiB" in str(result)
    assert str(to_device_and_dtype(model, dtype=torch.bfloat16)).startswith("nothing converted: all 7 tensors")
