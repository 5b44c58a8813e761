import copy
import gc
import json

import pytest
import torch
from torch import nn

from lightning_memopt.functional.footprint import (
    CATEGORIES,
    Footprint,
    FootprintRow,
    find_duplicates,
    live_tensors,
    model_footprint,
    storage_key,
    tensor_names,
    unexplained_bytes,
)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_categories_bytes_and_rows_with_adam():
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    fp0 = model_footprint(net, [opt])
    assert fp0.bytes_by_category() == {
        "parameters": _param_bytes(net),
        "buffers": (16 + 16) * 4 + 8,  # running_mean, running_var (fp32), num_batches_tracked (int64)
        "gradients": 0,
        "optimizer_states": 0,  # Adam creates its states lazily
    }
    net(torch.randn(4, 8)).sum().backward()
    opt.step()
    fp = model_footprint(net, [opt])
    by_cat = fp.bytes_by_category()
    assert by_cat["gradients"] == _param_bytes(net)
    # exp_avg + exp_avg_sq per parameter, plus one 4-byte (or 8) scalar `step` tensor per parameter
    n_params = len(list(net.parameters()))
    steps = sum(s["step"].untyped_storage().nbytes() for s in opt.state.values())
    assert by_cat["optimizer_states"] == 2 * _param_bytes(net) + steps
    assert fp.total_bytes() == sum(by_cat.values())
    assert fp.total_bytes("cpu") == fp.total_bytes()
    assert fp.total_bytes("cuda") == fp.total_bytes("cuda:0") == 0
    grads = [r for r in fp.rows if r.category == "gradients"]
    assert grads == [FootprintRow("gradients", "torch.float32", "cpu", n_params, _param_bytes(net))]
    assert [r.category for r in fp.rows] == sorted((r.category for r in fp.rows), key=CATEGORIES.index)


def test_dtypes_are_separate_rows():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    fp = model_footprint(net)
    rows = {(r.category, r.dtype): r for r in fp.rows}
    assert rows["parameters", "torch.float32"].bytes == 20 * 4
    assert rows["parameters", "torch.bfloat16"].bytes == 20 * 2
    assert rows["parameters", "torch.bfloat16"].num_tensors == 2


def test_tied_weights_and_views_counted_once():
    emb = nn.Embedding(10, 6)
    head = nn.Linear(6, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    fp = model_footprint(model)
    assert fp.bytes_by_category()["parameters"] == 10 * 6 * 4
    assert fp.rows[0].num_tensors == 1
    names = tensor_names(model)
    assert names == {storage_key(emb.weight): "emb.weight"}
    # a parameter that is a view of another parameter's storage
    base = torch.zeros(4, 4)
    m = nn.Module()
    m.a = nn.Parameter(base[:2])
    m.b = nn.Parameter(base[2:])
    assert model_footprint(m).bytes_by_category()["parameters"] == 64


def test_storage_shared_across_categories_counted_in_first():
    lin = nn.Linear(3, 3, bias=False)
    lin.register_buffer("alias", lin.weight.detach())  # a buffer aliasing the weight: no extra bytes
    fp = model_footprint(lin)
    assert fp.bytes_by_category() == {"parameters": 36, "buffers": 0, "gradients": 0, "optimizer_states": 0}


def test_tensor_names_grads_buffers_and_optimizer_states():
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 8)).sum().backward()
    opt.step()
    names = tensor_names(net, [opt])
    values = set(names.values())
    assert {
        "0.weight",
        "0.weight.grad",
        "1.running_mean",
        "optimizer0.state[0.weight].exp_avg",
        "optimizer0.state[2.bias].exp_avg_sq",
    } <= values
    assert names[storage_key(net[0].weight.grad)] == "0.weight.grad"


def test_lightning_optimizer_wrapper_is_unwrapped():
    class Wrapper:
        def __init__(self, opt):
            self._optimizer = opt

    lin = nn.Linear(2, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.randn(1, 2)).sum().backward()
    opt.step()
    assert model_footprint(lin, [Wrapper(opt)]).bytes_by_category()["optimizer_states"] == 6 * 4


def test_as_dict_is_json_and_table_prints():
    fp = model_footprint(_net())
    d = json.loads(json.dumps(fp.as_dict()))
    assert d["total_bytes"] == fp.total_bytes()
    assert d["rows"][0]["category"] == "parameters"
    table = fp.table()
    assert "parameters" in table and "total" in table.splitlines()[-1]


def test_live_tensors_finds_dedups_and_names():
    net = _net()
    names = tensor_names(net)
    stray = copy.deepcopy(net[0].weight.detach())  # an unowned copy
    view = stray[:2]  # a view of the copy: same storage
    found = live_tensors("cpu", names=names)
    assert found == sorted(found, key=lambda t: t.bytes, reverse=True)
    keys_bytes = [t for t in found if t.shape == (16, 8)]
    named = {t.name for t in keys_bytes}
    assert "0.weight" in named and None in named
    unnamed = [t for t in keys_bytes if t.name is None and t.bytes == 16 * 8 * 4]
    assert len(unnamed) >= 1
    assert not any(t.shape == (2, 8) and t.bytes == stray.untyped_storage().nbytes() for t in found)
    assert live_tensors("cuda") == []
    del view, stray


def test_live_tensors_grad_fn_and_requires_grad():
    w = torch.randn(3, 3, requires_grad=True)
    kept = (w * 2).sum()
    detached = kept.detach().clone()
    by_key = {t.key: t for t in live_tensors("cpu")}
    entry, leaf, plain = by_key[storage_key(kept)], by_key[storage_key(w)], by_key[storage_key(detached)]
    assert entry.shape == () and entry.requires_grad and entry.has_grad_fn  # the tensor it means, not any scalar
    assert leaf.shape == (3, 3) and leaf.requires_grad and not leaf.has_grad_fn
    assert not plain.requires_grad and not plain.has_grad_fn
    del kept, w, detached, entry, leaf, plain, by_key


class _Exploding:
    """An object whose class checks and attribute access raise."""

    @property
    def __class__(self):
        raise RuntimeError("boom")

    def __getattr__(self, name):
        raise RuntimeError("boom")


class _BadTensor(torch.Tensor):
    @property
    def device(self):
        raise RuntimeError("broken device")


def test_live_tensors_never_raises_on_misbehaving_objects():
    bad = [_Exploding() for _ in range(3)]
    gc.collect()
    bad_tensor = torch.zeros(3).as_subclass(_BadTensor)
    ok = torch.zeros(7, 7, dtype=torch.float64)
    found = live_tensors()
    assert any(t.key == storage_key(ok) and t.shape == (7, 7) and t.dtype == "torch.float64" for t in found)
    del bad, bad_tensor, ok


def test_unexplained_bytes():
    fp = Footprint(
        rows=(
            FootprintRow("parameters", "torch.bfloat16", "cuda:0", 3, 600),
            FootprintRow("gradients", "torch.bfloat16", "cuda:0", 3, 600),
            FootprintRow("buffers", "torch.float32", "cpu", 1, 50),
        )
    )
    assert unexplained_bytes(2000, fp, "cuda:0") == 800
    assert unexplained_bytes(2000, fp, "cuda") == 800
    assert unexplained_bytes(None, fp, "cpu") is None
    assert fp.bytes_by_category("cpu") == {"parameters": 0, "buffers": 50, "gradients": 0, "optimizer_states": 0}


def test_meta_module_has_no_storage_keys():
    with torch.device("meta"):
        lin = nn.Linear(4, 4)
    assert tensor_names(lin) == {}
    fp = model_footprint(lin)
    assert fp.rows[0].device == "meta" and fp.rows[0].num_tensors == 2


@pytest.mark.cuda
def test_cuda_footprint_matches_allocator():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    net = nn.Linear(1024, 1024).cuda()
    fp = model_footprint(net)
    delta = torch.cuda.memory_allocated() - before
    assert fp.total_bytes("cuda") == _param_bytes(net)
    assert abs(delta - fp.total_bytes("cuda")) <= 2 * 512
    assert unexplained_bytes(torch.cuda.memory_allocated(), fp, "cuda:0") == torch.cuda.memory_allocated() - (
        fp.total_bytes("cuda:0")
    )
    assert any(t.shape == (1024, 1024) and t.device == "cuda:0" for t in live_tensors("cuda:0"))


def _dup_for(model):
    return find_duplicates(model, live_tensors("cpu", names=tensor_names(model)))


def test_fp32_duplicate_of_bf16_model_detected_with_exact_bytes():
    model = nn.Sequential(nn.Linear(96, 80), nn.Linear(80, 72)).to(torch.bfloat16)
    baseline = _dup_for(model)
    stray = [p.detach().float().clone() for p in model.parameters()]  # a leftover fp32 copy
    dup = _dup_for(model)
    expected = sum(p.numel() * 4 for p in model.parameters())
    assert dup.bytes - baseline.bytes == expected
    assert dup.num_tensors - baseline.num_tensors == 4
    assert dup.fraction >= 1.0
    assert dup.dtypes[0] == "torch.float32"
    assert "another dtype" in dup.cause
    assert {t.shape for t in dup.largest} >= {(80, 96), (72, 80)}
    json.dumps(dup.as_dict())
    del stray


def test_deepcopy_and_state_dict_causes():
    model = nn.Linear(123, 77)
    twin = copy.deepcopy(model)
    dup = _dup_for(model)
    assert dup.bytes >= (123 * 77 + 77) * 4 and "second model object" in dup.cause
    del twin
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    dup = _dup_for(model)
    assert "state dict" in dup.cause
    del sd


def test_tied_weights_views_and_grads_are_not_duplicates():
    emb = nn.Embedding(211, 13)
    head = nn.Linear(13, 211, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    view = emb.weight[:10]
    opt = torch.optim.Adam(model.parameters())
    model["head"](model["emb"](torch.tensor([1, 2]))).sum().backward()
    opt.step()
    dup = find_duplicates(model, live_tensors("cpu", names=tensor_names(model, [opt])))
    assert not any(t.shape in ((211, 13), (10, 13)) for t in dup.largest)
    del view


def test_same_shape_other_values_is_not_a_copy():
    model = nn.Linear(117, 59)
    batch = torch.randn(59, 117)  # a weight's shape, other values: a batch, a dataset tensor, another model
    dup = _dup_for(model)
    assert (59, 117) not in {t.shape for t in dup.largest}
    assert dup.num_same_shape_other_values >= 1
    by_shape = find_duplicates(model, live_tensors("cpu", names=tensor_names(model)), match_values=False)
    assert (59, 117) in {t.shape for t in by_shape.largest}  # shape alone would have counted it
    stray = model.weight.detach().to(torch.bfloat16)  # the same values, rounded to bf16: a mirror
    dup = _dup_for(model)
    assert any(t.shape == (59, 117) and t.dtype == "torch.bfloat16" for t in dup.largest)
    del batch, stray
