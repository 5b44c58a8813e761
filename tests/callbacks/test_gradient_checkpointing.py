"""GradientCheckpointing: same gradients as the plain model, less activation memory.

Activation memory on CPU is measured as peak RSS (``resource.getrusage(...).ru_maxrss``) of a fresh subprocess per
configuration, over one forward + backward of a transformer whose activations dwarf its weights.
"""

import copy
import json
import pickle
import warnings
from concurrent.futures import ThreadPoolExecutor

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memopt import GradientCheckpointing
from lightning_memopt.functional.checkpointing import _CheckpointedForward
from tests.helpers.subprocess_run import run_script
from tests.helpers.trainer import make_trainer


class Blocks(pl.LightningModule):
    def __init__(self, d=16, layers=3, dropout=0.1):
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.encoder(x))

    def training_step(self, batch, batch_idx):
        return self(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.randn(8, 5, 16, generator=g), batch_size=4)


def _grads(model, x):
    model.zero_grad()
    torch.manual_seed(123)  # same dropout masks
    model(x).pow(2).mean().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "modules", [None, [nn.TransformerEncoderLayer], ["TransformerEncoderLayer"], ["encoder.layers.*"]]
)
def test_gradients_identical_to_the_plain_model(modules):
    x = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(1))
    plain = Blocks().train()
    wrapped = copy.deepcopy(plain)
    cb = GradientCheckpointing(checkpoint_modules=modules)
    assert cb.wrap(wrapped) == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    ref, got = _grads(plain, x), _grads(wrapped, x)
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=0, msg=name)
    assert wrapped.state_dict().keys() == plain.state_dict().keys()


def test_checkpointing_really_recomputes():
    calls = []
    model = Blocks(layers=1, dropout=0.0).train()
    model.encoder.layers[0].linear1.register_forward_pre_hook(lambda m, a: calls.append(1))
    GradientCheckpointing().wrap(model)
    model(torch.randn(2, 5, 16)).sum().backward()
    assert len(calls) == 2  # forward + recomputation in backward
    calls.clear()
    with torch.no_grad():
        model(torch.randn(2, 5, 16))
    assert len(calls) == 1  # no checkpointing without grad


def test_fit_wraps_at_setup_and_restores_at_teardown(tmp_path):
    model = Blocks()
    cb = GradientCheckpointing()
    seen = {}

    class Peek(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["wrapped"] = isinstance(pl_module.encoder.layers[0].__dict__.get("forward"), _CheckpointedForward)

    trainer = make_trainer(tmp_path, callbacks=[cb, Peek()], max_steps=2)
    trainer.fit(model)
    assert seen["wrapped"]
    assert "forward" not in model.encoder.layers[0].__dict__
    trainer = make_trainer(tmp_path, callbacks=[cb, Peek()], max_steps=2)
    trainer.fit(model)  # fit twice
    assert seen["wrapped"] and not cb.wrapped_names


def test_wrapped_model_deepcopies_and_pickles():
    model = Blocks(dropout=0.0)
    GradientCheckpointing().wrap(model)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        fwd = clone.encoder.layers[0].forward
        assert isinstance(fwd, _CheckpointedForward) and fwd.module is clone.encoder.layers[0]
        x = torch.randn(2, 5, 16)
        torch.testing.assert_close(clone(x), model(x))


class FakeHF(nn.Module):
    """Stands in for a Hugging Face PreTrainedModel."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16)
        self.enabled_with = None
        self.disabled = False

    @property
    def is_gradient_checkpointing(self):
        return self.enabled_with is not None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.enabled_with = gradient_checkpointing_kwargs

    def gradient_checkpointing_disable(self):
        self.disabled = True


class HFModule(Blocks):
    def __init__(self):
        super().__init__()
        self.backbone = FakeHF()


def test_model_switch_is_preferred(tmp_path):
    model = HFModule()
    cb = GradientCheckpointing()
    trainer = make_trainer(tmp_path, callbacks=[cb], max_steps=1)
    trainer.fit(model)
    assert model.backbone.enabled_with == {"use_reentrant": False}
    assert model.backbone.disabled  # turned off again at teardown
    assert not cb.wrapped_names  # nothing else wrapped


def test_model_switch_is_skipped_when_the_model_does_not_support_it():
    class NoSupport(FakeHF):
        supports_gradient_checkpointing = False  # Hugging Face's enable() would raise ValueError here

    model = HFModule()
    model.backbone = NoSupport()
    cb = GradientCheckpointing()
    cb.setup(None, model, "fit")
    assert model.backbone.enabled_with is None
    assert cb.wrapped_names == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2", "backbone.layer"]
    cb.teardown(None, model, "fit")
    assert not model.backbone.disabled and "forward" not in model.backbone.layer.__dict__


def test_no_match_warns(tmp_path):
    cb = GradientCheckpointing(checkpoint_modules=["NoSuchLayer"])
    with pytest.warns(UserWarning, match=r"found no submodule matching \['NoSuchLayer'\].*Pass `checkpoint_modules=`"):
        make_trainer(tmp_path, callbacks=[cb], max_steps=1).fit(Blocks())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"checkpoint_modules": [3]},
            "`checkpoint_modules` entries must be nn.Module classes, class names or name patterns, got 3",
        ),
        ({"checkpoint_modules": [""]}, "`checkpoint_modules` entries must be .* got ''"),
        ({"checkpoint_modules": []}, r"`checkpoint_modules` must name at least one .* got \[\]"),
        ({"checkpoint_modules": 3}, r"`checkpoint_modules` must be a list of nn.Module classes, .* or None, got 3\."),
        ({"use_model_switch": "no"}, r"`use_model_switch` must be a bool \(True or False\), got 'no'\."),
        ({"use_model_switch": 0}, r"`use_model_switch` must be a bool \(True or False\), got 0\."),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientCheckpointing(**kwargs)


def test_modules_accepts_any_iterable_once():
    cb = GradientCheckpointing(checkpoint_modules=(m for m in ["TransformerEncoderLayer"]))
    assert cb.checkpoint_modules == ["TransformerEncoderLayer"]
    assert cb.wrap(Blocks()) == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    cb.unwrap()


class _CrashAfterOneStep(Blocks):
    crash = True

    def training_step(self, batch, batch_idx):
        if self.crash and batch_idx == 1:
            raise RuntimeError("crash in training_step")
        return super().training_step(batch, batch_idx)


class _CountRecomputation(pl.Callback):
    """Counts forward calls of the first block's first linear layer and whether the block is wrapped, per batch."""

    def __init__(self):
        self.calls = 0
        self.wrapped = []

    def setup(self, trainer, pl_module, stage):
        pl_module.encoder.layers[0].linear1.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.wrapped.append(isinstance(pl_module.encoder.layers[0].__dict__.get("forward"), _CheckpointedForward))


@pytest.mark.parametrize("second", ["same callback", "fresh callback"])
def test_a_crash_gives_the_forwards_back_and_a_retry_checkpoints_again(tmp_path, second):
    model = _CrashAfterOneStep(layers=2, dropout=0.0)
    cb = GradientCheckpointing()
    with pytest.raises(RuntimeError, match="crash in training_step"):
        make_trainer(tmp_path, callbacks=[cb], max_steps=4).fit(model)
    assert all("forward" not in m.__dict__ for m in model.modules())  # given back on exception
    assert not cb.wrapped_names

    model.crash = False
    retry = cb if second == "same callback" else GradientCheckpointing()
    counter = _CountRecomputation()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*nothing is checkpointed")
        make_trainer(tmp_path, callbacks=[retry, counter], max_steps=2).fit(model)
    assert counter.wrapped == [True, True]
    assert counter.calls == 2 * 2  # forward + recomputation in backward, for each of the 2 steps
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert type(model.encoder.layers[0]).forward is nn.TransformerEncoderLayer.forward
    assert not retry.wrapped_names


def test_blocks_wrapped_by_someone_else_are_left_to_them(tmp_path):
    model = Blocks()
    owner = GradientCheckpointing()
    owner.wrap(model)
    cb = GradientCheckpointing()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*nothing is checkpointed")
        make_trainer(tmp_path, callbacks=[cb], max_steps=1).fit(model)
    assert cb.already_wrapped_names == [] and not cb.wrapped_names  # cleared at teardown
    assert isinstance(model.encoder.layers[0].__dict__.get("forward"), _CheckpointedForward)  # still the owner's
    owner.unwrap()
    assert all("forward" not in m.__dict__ for m in model.modules())


class _SwitchModel(Blocks):
    def __init__(self, on):
        super().__init__()
        self.backbone = _RealSwitch(on)


class _RealSwitch(nn.Module):
    def __init__(self, on):
        super().__init__()
        self.on = on

    @property
    def is_gradient_checkpointing(self):
        return self.on

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.on = True

    def gradient_checkpointing_disable(self):
        self.on = False


@pytest.mark.parametrize("on_before", [False, True])
@pytest.mark.parametrize("end", ["normal", "crash"])
def test_model_switch_is_given_back_as_found(tmp_path, on_before, end):
    model = _SwitchModel(on_before)
    seen = []

    class Peek(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(pl_module.backbone.on)
            if end == "crash" and batch_idx == 1:
                raise RuntimeError("crash in training")

    trainer = make_trainer(tmp_path, callbacks=[GradientCheckpointing(), Peek()], max_steps=2)
    if end == "crash":
        with pytest.raises(RuntimeError, match="crash in training"):
            trainer.fit(model)
    else:
        trainer.fit(model)
    assert seen == [True, True]
    assert model.backbone.on is on_before


RSS_SCRIPT = """
import json, re, sys
import psutil
import torch
from torch import nn
from lightning_memopt import GradientCheckpointing  # imported in both modes: same baseline
torch.manual_seed(0)
torch.set_num_threads(1)
layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
model = nn.TransformerEncoder(layer, 8, enable_nested_tensor=False).train()
x = torch.randn(16, 512, 64)
if sys.argv[1] == "checkpointed":
    GradientCheckpointing().wrap(model)
with open("/proc/self/clear_refs", "w") as f:  # the peak so far (imports' transients) reset to the current RSS
    f.write("5")
before = psutil.Process().memory_info().rss // 1024
model(x).pow(2).mean().backward()
with open("/proc/self/status") as f:
    after = int(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1))  # the peak since the reset
print("RESULT" + json.dumps({"delta_kib": after - before}))
"""


@pytest.mark.slow
def test_activation_memory_is_lower_peak_rss_in_subprocesses(tmp_path, monkeypatch):
    # Measurement: peak RSS (VmHWM, KiB) of a fresh process over forward + backward, reset just before them
    # (/proc/self/clear_refs), minus the RSS then: an import's transient peak never counts.
    # A fixed glibc mmap threshold makes every large tensor its own mapping, returned to the OS when freed, so
    # peak RSS follows the peak of live tensors instead of heap reuse (measured: ~225 MB plain vs ~70 MB).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    modes = ("plain", "checkpointed")
    for mode in modes:
        (tmp_path / mode).mkdir()
    # One process per configuration, both at once: each process's peak RSS is its own.
    with ThreadPoolExecutor(len(modes)) as pool:
        procs = dict(zip(modes, pool.map(lambda m: run_script(RSS_SCRIPT, tmp_path / m, args=(m,)), modes)))
    deltas = {}
    for mode, proc in procs.items():
        assert proc.returncode == 0, proc.stderr[-2000:]
        line = next(row for row in proc.stdout.splitlines() if row.startswith("RESULT"))
        deltas[mode] = json.loads(line[len("RESULT") :])["delta_kib"]
    # Plain keeps every layer's activations (~25 MiB each); checkpointing keeps only the 8 layer inputs
    # (2 MiB each) plus one layer's activations during its recomputation.
    assert deltas["checkpointed"] < 0.5 * deltas["plain"], deltas


@pytest.mark.cuda
def test_cuda_activation_memory_is_lower_peak_allocated():
    # On a GPU the measure is torch.cuda.max_memory_allocated over one forward + backward, minus what was
    # allocated before it (weights, input).
    def peak(checkpointed):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, 8, enable_nested_tensor=False).cuda().train()
        if checkpointed:
            GradientCheckpointing().wrap(model)
        x = torch.randn(16, 512, 256, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model(x).pow(2).mean().backward()
        torch.cuda.synchronize()
        grads = [p.grad.clone() for p in model.parameters()]
        return torch.cuda.max_memory_allocated() - before, grads

    plain, ref = peak(False)
    checkpointed, got = peak(True)
    print(f"\nactivation peak: plain {plain / 2**20:.1f} MiB, checkpointed {checkpointed / 2**20:.1f} MiB")
    assert checkpointed < 0.5 * plain
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_real_hugging_face_model_uses_its_own_switch():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    plain = transformers.BertModel(config).train()
    model = copy.deepcopy(plain)
    holder = nn.Module()
    holder.backbone = model
    cb = GradientCheckpointing()
    cb.setup(None, holder, "fit")
    assert model.is_gradient_checkpointing and not cb.wrapped_names
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (plain, model):
        m.zero_grad()
        torch.manual_seed(123)
        m(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=0, msg=name)
    cb.teardown(None, holder, "fit")
    assert not model.is_gradient_checkpointing


CHECKPOINT_OPTION_NAMES = [
    "debug",
    "determinism_check",
    "context_fn",
    "early_stop",
    "preserve_rng_state",
    "use_reentrant",
]


class OptionNamedBlock(nn.Module):
    """A block whose forward takes keyword arguments named like ``torch.utils.checkpoint.checkpoint``'s options."""

    def __init__(self, name):
        super().__init__()
        self.name = name
        self.linear = nn.Linear(4, 4)

    def forward(self, x, **kwargs):
        assert list(kwargs) == [self.name], kwargs  # the block gets its own argument, untouched
        return self.linear(x) * kwargs[self.name]


class HoldsOptionNamedBlock(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.block = OptionNamedBlock(name)

    def forward(self, x, **kwargs):
        return self.block(x, **kwargs)


@pytest.mark.parametrize("name", CHECKPOINT_OPTION_NAMES)
def test_the_blocks_own_keyword_arguments_reach_it(name):
    torch.manual_seed(0)
    plain = HoldsOptionNamedBlock(name)
    wrapped = copy.deepcopy(plain)
    assert GradientCheckpointing(checkpoint_modules=[OptionNamedBlock]).wrap(wrapped) == ["block"]
    x = torch.randn(3, 4)
    losses, grads = [], []
    for model in (plain, wrapped):
        loss = model(x, **{name: 100.0}).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append(model.block.linear.weight.grad.clone())
    assert losses[0] == losses[1] and torch.equal(grads[0], grads[1])


class _BuiltInConfigureModel(Blocks):
    """Builds its encoder in ``configure_model``, as sharded training does: nothing to match at setup."""

    def __init__(self):
        pl.LightningModule.__init__(self)
        self.encoder = None
        self.head = nn.Linear(16, 1)
        self.calls = 0

    def configure_model(self):
        if self.encoder is None:
            torch.manual_seed(0)
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.encoder.layers[0].linear1.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


def test_blocks_built_in_configure_model_are_wrapped_at_fit_start(tmp_path):
    model = _BuiltInConfigureModel()
    cb = GradientCheckpointing()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*nothing is checkpointed")
        make_trainer(tmp_path, callbacks=[cb], max_steps=2).fit(model)
    assert model.calls == 2 * 2  # forward + recomputation in backward, for each of the 2 steps
    assert all("forward" not in m.__dict__ for m in model.modules()) and not cb._pending  # given back at teardown


def test_no_match_after_configure_model_warns_once_at_fit_start(tmp_path):
    cb = GradientCheckpointing(checkpoint_modules=["NoSuchLayer"])
    with pytest.warns(UserWarning, match="found no submodule matching") as caught:
        make_trainer(tmp_path, callbacks=[cb], max_steps=1).fit(_BuiltInConfigureModel())
    assert sum("found no submodule" in str(w.message) for w in caught) == 1
