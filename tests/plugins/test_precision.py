import logging
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from lightning_memopt import CacheCleaner, MemoryPrecision
from lightning_memopt.utilities.namespaces import is_instance
from tests.helpers.lightning import lightning_module, pl
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


class _Probe(pl.Callback):
    """Records the matmul precision, the output dtype of a forward and the scaler during training."""

    def __init__(self):
        self.matmul = None
        self.dtype = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.matmul = torch.get_float32_matmul_precision()
        with trainer.precision_plugin.forward_context():
            self.dtype = pl_module(trainer.precision_plugin.convert_input(batch)).dtype


def _fit(tmp_path, plugin, callbacks=(), **kw):
    probe = _Probe()
    trainer = make_trainer(tmp_path, plugins=[plugin], callbacks=[probe, *callbacks], **kw)
    model = TinyModel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return trainer, model, probe, [str(w.message) for w in caught]


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("MemoryPrecision(")]


def test_auto_on_cpu_trains_fp32_and_is_named_in_the_one_inactive_line(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    trainer, model, probe, messages = _fit(tmp_path, MemoryPrecision("auto"), callbacks=[CacheCleaner()])
    assert trainer.precision == "32-true"
    assert probe.dtype == torch.float32 and model.layer.weight.dtype == torch.float32
    assert _said(caplog) == []  # fp32 on a CPU: nothing of its own to say
    (line,) = [r.getMessage() for r in caplog.records if "inactive here" in r.getMessage()]
    assert "MemoryPrecision (auto is fp32 on cpu)" in " ".join(line.split())
    assert not [m for m in messages if "MemoryPrecision" in m]  # a choice is information, not a warning


def test_auto_on_a_gpu_says_what_it_chose_in_one_short_line(caplog):
    caplog.set_level(logging.INFO)
    plugin = MemoryPrecision("auto")
    choice = plugin.resolve(torch.device("cuda"), capability=(8, 0), device_name="NVIDIA A100")
    plugin._tell(choice, trainer=None, device=torch.device("cuda"))
    (said,) = _said(caplog)
    assert said.startswith("MemoryPrecision(precision='auto') chose 'bf16-mixed'") and len(said) <= 100


def test_verbose_says_the_whole_reason_within_100_columns(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    _fit(tmp_path, MemoryPrecision("auto", verbose=True))
    (said,) = _said(caplog)
    assert "trains in fp32. Set `MemoryPrecision(precision='bf16-mixed')`" in " ".join(said.split())
    assert len(said.splitlines()) > 1 and max(len(line) for line in said.splitlines()) <= 100


def test_an_explicit_precision_prints_nothing_unless_verbose(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    _fit(tmp_path, MemoryPrecision("bf16-mixed"))
    assert _said(caplog) == []
    _fit(tmp_path, MemoryPrecision("bf16-mixed", verbose=True))
    assert [" ".join(said.split()) for said in _said(caplog)] == [
        "MemoryPrecision(precision='bf16-mixed') chose 'bf16-mixed': `MemoryPrecision(precision="
        "'bf16-mixed')` was asked for explicitly on cpu."
    ]


def test_bf16_mixed_on_cpu_autocasts_and_keeps_fp32_weights(tmp_path):
    trainer, model, probe, _ = _fit(tmp_path, MemoryPrecision("bf16-mixed"))
    assert trainer.precision == "bf16-mixed"
    assert probe.dtype == torch.bfloat16
    assert model.layer.weight.dtype == torch.float32
    assert trainer.precision_plugin.scaler is None


def test_true_half_keeps_weights_in_bf16(tmp_path):
    plugin = MemoryPrecision("bf16-true")
    trainer = make_trainer(tmp_path, plugins=[plugin])
    with trainer.init_module():
        model = TinyModel()
    assert model.layer.weight.dtype == torch.bfloat16  # created in bf16, never materialised in fp32
    trainer.fit(model)
    assert model.layer.weight.dtype == torch.bfloat16
    assert trainer.precision == "bf16-true"


def test_fp16_mixed_has_a_scaler(tmp_path):
    trainer, _, _probe, _ = _fit(tmp_path, MemoryPrecision("16-mixed"))
    assert trainer.precision == "16-mixed"
    assert isinstance(trainer.precision_plugin.scaler, torch.amp.GradScaler)


def test_auto_resolution_from_capability_without_a_gpu():
    plugin = MemoryPrecision("auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA GradScaler on a CPU build warns that it is disabled
        choice = plugin.resolve(torch.device("cuda"), capability=(7, 0), device_name="Tesla V100-SXM2-16GB")
    assert choice.precision == "16-mixed" and plugin.precision == "16-mixed"
    assert plugin.scaler is not None
    choice = plugin.resolve(torch.device("cuda"), capability=(8, 0), device_name="NVIDIA A100")
    assert choice.precision == "bf16-mixed" and plugin.scaler is None


def test_bf16_on_old_gpu_raises_naming_the_gpu():
    with pytest.raises(
        ValueError, match=r"Tesla V100-SXM2-16GB \(compute capability 7.0\).*`MemoryPrecision\(precision='16-mixed'\)`"
    ):
        MemoryPrecision("bf16-mixed").resolve(
            torch.device("cuda"), capability=(7, 0), device_name="Tesla V100-SXM2-16GB"
        )


def test_tf32_set_through_one_api_and_restored(tmp_path):
    before = torch.get_float32_matmul_precision()
    _, _, probe, _ = _fit(tmp_path, MemoryPrecision("auto", float32_matmul_precision="high"))
    assert probe.matmul == "high"
    assert torch.get_float32_matmul_precision() == before


def test_tf32_restored_when_training_fails(tmp_path):
    class Boom(TinyModel):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    trainer = make_trainer(tmp_path, plugins=[MemoryPrecision("auto", float32_matmul_precision="medium")])
    with pytest.raises(RuntimeError, match="boom"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Boom())
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "fp16"}, "`precision` must be one of 'auto', '32-true'.*got 'fp16'"),
        ({"precision": True}, "`precision` must be one of 'auto', '32-true'.*got True"),
        ({"float32_matmul_precision": "tf32"}, "`float32_matmul_precision` must be one of 'highest', 'high', 'medium'"),
        ({"float32_matmul_precision": True}, "`float32_matmul_precision` must be one of .*, got True"),
        ({"allow_emulated_bf16": "yes"}, r"`allow_emulated_bf16` must be a bool \(True or False\), got 'yes'\."),
        ({"allow_emulated_bf16": 1}, r"`allow_emulated_bf16` must be a bool \(True or False\), got 1\."),
        ({"exact_accumulation": "no"}, r"`exact_accumulation` must be a bool \(True or False\), got 'no'\."),
        ({"exact_accumulation": None}, r"`exact_accumulation` must be a bool \(True or False\), got None\."),
        ({"scaler": "dynamic"}, r"`scaler` must be a `torch.amp.GradScaler` or None, got 'dynamic'\."),
        ({"verbose": "yes"}, r"`verbose` must be a bool \(True or False\), got 'yes'\."),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryPrecision(**kwargs)


def _backend_matmul():
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision


@pytest.mark.parametrize("end", ["normal", "crash"])
def test_tf32_restore_includes_the_per_backend_values(tmp_path, end):
    # `torch.set_float32_matmul_precision` also writes the per-backend values ("none" -> "tf32"/"ieee"); giving back
    # only the legacy value would leave "ieee" behind where "none" was.
    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            if end == "crash":
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    saved = _backend_matmul()
    # torch's state before any call to the setter, whatever earlier tests in this process did
    torch.backends.cuda.matmul.fp32_precision = torch.backends.mkldnn.matmul.fp32_precision = "none"
    try:
        before = (torch.get_float32_matmul_precision(), _backend_matmul(), torch.backends.cudnn.allow_tf32)
        assert before[1] == ("none", "none")
        trainer = make_trainer(tmp_path, plugins=[MemoryPrecision("32-true", float32_matmul_precision="high")])
        if end == "crash":
            with pytest.raises(RuntimeError, match="boom"):
                trainer.fit(Model())
        else:
            trainer.fit(Model())
        assert (torch.get_float32_matmul_precision(), _backend_matmul(), torch.backends.cudnn.allow_tf32) == before
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = saved


def test_tf32_set_through_the_new_api_by_the_app_is_left_alone(tmp_path):
    saved = torch.get_float32_matmul_precision(), _backend_matmul()
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # the application uses torch's per-backend API
    try:
        seen = _backend_matmul()
        with pytest.warns(
            UserWarning, match=r"left `float32_matmul_precision='medium'` unapplied: TF32 was already"
        ) as w:
            trainer = make_trainer(tmp_path, plugins=[MemoryPrecision("32-true", float32_matmul_precision="medium")])
            trainer.fit(TinyModel())
        (warned,) = [m for m in w if "unapplied" in str(m.message)]
        assert warned.filename.endswith(os.path.join("lightning_memopt", "plugins", "precision.py")), warned.filename
        assert _backend_matmul() == seen
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()  # still the application's state: the two APIs disagree
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = saved[1]
    assert (torch.get_float32_matmul_precision(), _backend_matmul()) == saved


@pytest.mark.parametrize("name", ["FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"])
def test_strategies_with_their_own_precision_are_refused(name):
    strategy = type(name, (), {})()
    module = torch.nn.Linear(2, 2)
    module._trainer = SimpleNamespace(strategy=strategy, global_rank=0)
    with pytest.raises(TypeError, match=f"cannot serve `strategy={name}`.*pass `precision='bf16-mixed'`"):
        MemoryPrecision().convert_module(module)


def test_real_fsdp_strategy_class_is_refused():
    FSDPStrategy = lightning_module("strategies").FSDPStrategy

    module = torch.nn.Linear(2, 2)
    module._trainer = SimpleNamespace(strategy=object.__new__(FSDPStrategy), global_rank=0)
    with pytest.raises(TypeError, match="cannot serve `strategy=FSDPStrategy`"):
        MemoryPrecision().convert_module(module)


def test_lightning_refuses_precision_and_plugin_together(tmp_path):
    # Pinned upstream behaviour; `MemoryPreset.trainer_kwargs` raises a clearer error (see test_presets.py).
    with pytest.raises(ValueError, match=r"Received both `precision=16-mixed` and `plugins=MemoryPrecision\("):
        make_trainer(tmp_path, precision="16-mixed", plugins=[MemoryPrecision()])


def test_scaler_state_survives_a_checkpoint_round_trip():
    plugin = MemoryPrecision("16-mixed")
    plugin.load_state_dict(
        {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 7, "_growth_tracker": 3}
    )
    plugin.resolve(torch.device("cpu"))
    assert plugin.state_dict()["growth_interval"] == 7


@pytest.mark.cuda
def test_cuda_auto_matches_the_real_card(tmp_path):
    major, minor = torch.cuda.get_device_capability()
    plugin = MemoryPrecision("auto")
    choice = plugin.resolve(torch.device("cuda", 0))
    assert choice.precision == ("bf16-mixed" if major >= 8 else "16-mixed")
    assert torch.cuda.get_device_name(0) in choice.reason
    print(f"\n{torch.cuda.get_device_name(0)} cc {major}.{minor}: {choice.precision} ({choice.reason})")


@pytest.mark.cuda
def test_cuda_fp16_scaler_path_trains(tmp_path):
    trainer = make_trainer(
        tmp_path, accelerator="cuda", plugins=[MemoryPrecision("16-mixed")], max_steps=8, limit_train_batches=8
    )
    model = TinyModel()
    before = model.layer.weight.detach().clone()
    trainer.fit(model)
    scaler = trainer.precision_plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert torch.isfinite(torch.tensor(scaler.get_scale()))
    assert not torch.equal(model.layer.weight.detach().cpu(), before)


@pytest.mark.cuda
def test_cuda_auto_fit_with_tf32(tmp_path):
    trainer = make_trainer(
        tmp_path, accelerator="cuda", plugins=[MemoryPrecision("auto", float32_matmul_precision="high")]
    )
    trainer.fit(TinyModel())
    major, _ = torch.cuda.get_device_capability()
    assert trainer.precision == ("bf16-mixed" if major >= 8 else "16-mixed")
    assert torch.get_float32_matmul_precision() == "highest"


# ---------------------------------------------------------------------------------------- mocked torch.cuda
GPUS = {  # name: (compute capability, what torch.cuda.is_bf16_supported() says: it counts emulation)
    "Tesla V100-SXM2-16GB": ((7, 0), True),
    "Tesla T4": ((7, 5), True),
    "NVIDIA A100-SXM4-80GB": ((8, 0), True),
    "NVIDIA H100 80GB HBM3": ((9, 0), True),
}


def fake_cuda(monkeypatch, name):
    """Make this CPU machine look like it has the GPU ``name`` (capability, name, bf16 claim, memory)."""
    capability, bf16_claim = GPUS[name]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_claim)
    return capability


def _setup_on_fake_gpu(plugin):
    """Run the plugin's setup as a Trainer on ``cuda:0`` would (convert_module with the trainer attached)."""
    module = torch.nn.Linear(2, 2)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), global_rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.convert_module(module)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("name", list(GPUS))
def test_auto_on_mocked_gpus_uses_capability_not_is_bf16_supported(monkeypatch, name, caplog):
    caplog.set_level(logging.INFO)
    capability = fake_cuda(monkeypatch, name)
    assert torch.cuda.is_bf16_supported()  # every card claims bf16 ...
    plugin = MemoryPrecision("auto")
    _setup_on_fake_gpu(plugin)
    native = capability >= (8, 0)  # ... but only compute capability >= 8.0 has it in hardware
    expected = "bf16-mixed" if native else "16-mixed"
    assert plugin.precision == expected and plugin.choice.precision == expected
    assert is_instance(plugin, "plugins.precision.MixedPrecision")  # Lightning's own, in the first namespace here
    assert plugin.device == "cuda"
    assert isinstance(plugin.scaler, torch.amp.GradScaler) is (not native)
    (said,) = _said(caplog)
    assert said.startswith(f"MemoryPrecision(precision='auto') chose {expected!r} on {name} (") and len(said) <= 100
    assert f"{name} (compute capability {capability[0]}.{capability[1]})" in plugin.choice.reason


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_on_mocked_v100_raises_naming_the_gpu_and_suggesting_fp16(monkeypatch, precision):
    fake_cuda(monkeypatch, "Tesla V100-SXM2-16GB")
    fp16 = precision.replace("bf16", "16")
    expected = rf"Tesla V100-SXM2-16GB \(compute capability 7.0\).*`MemoryPrecision\(precision='{fp16}'\)`"
    with pytest.raises(ValueError, match=expected):
        _setup_on_fake_gpu(MemoryPrecision(precision))
    plugin = MemoryPrecision(precision, allow_emulated_bf16=True)
    _setup_on_fake_gpu(plugin)
    assert plugin.precision == precision  # the explicit opt-in is honoured


def test_preset_precision_string_for_fsdp_on_mocked_gpus(monkeypatch):
    from lightning_memopt import MemoryPreset

    fake_cuda(monkeypatch, "Tesla V100-SXM2-16GB")
    assert MemoryPreset.from_name("max-speed").trainer_kwargs(strategy="fsdp")["precision"] == "16-mixed"
    with pytest.raises(ValueError, match="Tesla V100-SXM2-16GB"):
        MemoryPreset.from_name("max-speed", precision="bf16-mixed").trainer_kwargs(strategy="fsdp")
    fake_cuda(monkeypatch, "NVIDIA A100-SXM4-80GB")
    assert MemoryPreset.from_name("max-speed").trainer_kwargs(strategy="fsdp")["precision"] == "bf16-mixed"


@pytest.mark.cuda
def test_cuda_native_bf16_agrees_with_torch_without_emulation():
    # An independent reference: torch's own answer when emulation is not counted.
    reference = torch.cuda.is_bf16_supported(including_emulation=False)
    choice = MemoryPrecision("auto").resolve(torch.device("cuda", 0))
    assert (choice.precision == "bf16-mixed") is reference


def test_model_parallel_strategy_refusal_names_fsdp_mixed_precision_as_the_other_way():
    if not hasattr(lightning_module("strategies"), "ModelParallelStrategy"):
        pytest.skip("ModelParallelStrategy came with Lightning 2.3")
    strategy = object.__new__(lightning_module("strategies").ModelParallelStrategy)
    module = torch.nn.Linear(2, 2)
    module._trainer = SimpleNamespace(strategy=strategy, global_rank=0)
    with pytest.raises(TypeError, match=r"keep `precision='32-true'` and pass `mp_policy=MixedPrecisionPolicy\("):
        MemoryPrecision().convert_module(module)
    module._trainer = SimpleNamespace(strategy=type("DeepSpeedStrategy", (), {})(), global_rank=0)
    with pytest.raises(TypeError) as refused:
        MemoryPrecision().convert_module(module)
    assert "MixedPrecisionPolicy" not in str(refused.value)
