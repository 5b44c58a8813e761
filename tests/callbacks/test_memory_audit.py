import copy
import gc
import json
import logging
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback
from torch import nn

import lightning_memopt
from lightning_memopt import MemoryAudit, MemoryMonitor
from lightning_memopt.callbacks import memory_audit
from lightning_memopt.utilities import quiet
from lightning_memopt.utilities.formatting import WIDTH
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

#: Kept at module level on purpose: "held elsewhere", outside the model and the optimizer.
_STRAY: list[torch.Tensor] = []


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


PACKAGE = Path(lightning_memopt.__file__).parent


def _audit_warnings(caught, word):
    """The texts of MemoryAudit's warnings that contain ``word``; each must point at a module of this package (so
    ``filterwarnings(module="lightning_memopt...")`` reaches it), never at Lightning's hook caller."""
    found = [w for w in caught if "MemoryAudit" in str(w.message) and word in str(w.message)]
    assert [w.filename for w in found if not Path(w.filename).is_relative_to(PACKAGE)] == []
    return [str(w.message) for w in found]


def _printed(monkeypatch):
    """What MemoryAudit prints to the console (Lightning's ``rank_zero_info``), and the one inactive line."""
    lines = []
    record = lambda message, *args, **kwargs: lines.append(message)  # noqa: E731
    monkeypatch.setattr(memory_audit, "rank_zero_info", record)
    monkeypatch.setattr(quiet, "rank_zero_info", record)
    return lines


class HiddenModel(TinyModel):
    """Linear -> ReLU -> Linear: its graph keeps a (batch, hidden) activation alive."""

    def __init__(self, hidden: int = 512, batch_size: int = 16, dtype: torch.dtype = torch.float32, out: int = 2):
        super().__init__(batch_size=batch_size)
        self.layer = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, out)).to(dtype)

    def forward(self, x):
        return self.layer(x.to(self.layer[0].weight.dtype)).float()


class LeakyModel(HiddenModel):
    def __init__(self):
        super().__init__()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss)  # the bug: keeps every step's graph alive
        return loss


class TiedModel(TinyModel):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.layer(self.head(self.emb(x)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"leak_window": 2}, "`leak_window` must be at least 3"),
        ({"leak_window": 0}, "`leak_window` must be a positive int, got 0"),
        ({"leak_every_n_train_steps": 0}, "`leak_every_n_train_steps` must be a positive int, got 0"),
        ({"leak_every_n_train_steps": 2.5}, "`leak_every_n_train_steps` must be a positive int, got 2.5"),
        ({"duplicate_fraction": 50}, r"`duplicate_fraction` must be a fraction in \(0, 1\], got 50"),
        ({"duplicate_fraction": 0}, "`duplicate_fraction`"),
        ({"leak_min_bytes_per_step": 0}, "`leak_min_bytes_per_step` must be a positive int"),
        ({"leak_min_bytes_per_step": True}, "`leak_min_bytes_per_step`"),
        ({"max_listed": -1}, "`max_listed`"),
        ({"leak_max_overhead": 2}, "`leak_max_overhead` must be a fraction"),
    ],
)
def test_bad_arguments_raise_in_init(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryAudit(**kwargs)


def test_the_leak_interval_counts_optimizer_steps_and_dirpath_is_kept_as_a_str(tmp_path):
    audit = MemoryAudit(dirpath=tmp_path / "audit", leak_every_n_train_steps=3)
    assert audit.leak_every_n_train_steps == 3
    assert isinstance(audit.dirpath, str) and audit.dirpath == str(tmp_path / "audit")  # as ModelCheckpoint keeps it
    assert MemoryAudit().dirpath is None  # the default is resolved in `setup`
    with pytest.raises(TypeError, match="leak_every_n_steps"):  # renamed, no alias
        MemoryAudit(leak_every_n_steps=3)
    with pytest.raises(ValueError, match="`verbose` must be a bool"):
        MemoryAudit(verbose="yes")


@pytest.mark.slow  # 2 s: two fits with every audit
def test_footprint_at_fit_start_written_logged_and_printed_only_when_verbose(tmp_path, caplog, monkeypatch):
    printed = _printed(monkeypatch)
    audit = MemoryAudit(detect_leaks=False)
    monitor = MemoryMonitor(log_every_n_steps=1)
    trainer = make_trainer(tmp_path, callbacks=[audit, monitor], max_steps=2)
    model = TinyModel(in_features=27)  # shapes no other test's leftovers share
    with caplog.at_level(logging.INFO, logger="lightning_memopt"):
        trainer.fit(model)
    # a clean audit is silent on the console (its text goes to the package logger); the monitor's line on a CPU
    assert [line for line in printed if "inactive here" not in line] == []
    path = monitor.path  # the MemoryMonitor's file, shared, in the one default directory
    assert audit.path == path == tmp_path / "memopt" / "memory_rank0.jsonl"
    records = _records(path)
    audits = [r for r in records if r["event"] == "audit"]
    assert [r["audit"] for r in audits] == ["fit_start", "first_step"]
    assert any(r["event"] == "step" for r in records)  # the monitor's records share the file
    start, first = audits
    param_bytes = (27 * 2 + 2) * 4
    assert start["footprint"]["bytes_by_category"] == {
        "parameters": param_bytes,
        "buffers": 0,
        "gradients": 0,
        "optimizer_states": 0,
    }
    assert first["footprint"]["bytes_by_category"]["gradients"] == param_bytes
    assert start["unexplained_bytes"] is None  # CPU: no allocator readings
    assert start["host_rss_bytes"] > 0 and start["phase"] == "train" and start["rank"] == 0
    assert first["num_unowned_tensors"] >= 1 and first["unowned_tensor_bytes"] >= 64 * 27 * 4  # the dataset
    assert start["duplicates"] is None
    assert "parameters" in caplog.text and "footprint" in caplog.text
    json.dumps(audit.last_audit)
    make_trainer(tmp_path, callbacks=[MemoryAudit(detect_leaks=False, verbose=True)], max_steps=2).fit(model)
    text = "\n".join(printed)
    assert "MemoryAudit (fit start): model and optimizer footprint" in text and "(first step)" in text
    assert "MemoryAudit: DataLoader train: batch_size=4," in text  # one long line, wrapped
    assert max(len(line) for line in text.splitlines()) <= WIDTH


def test_with_every_check_off_it_is_named_in_the_one_inactive_line_and_writes_nothing(tmp_path, monkeypatch):
    printed = _printed(monkeypatch)
    flags = ("audit_fit_start", "detect_leaks", "check_grad_tracking", "audit_dataloaders")
    audit = MemoryAudit(**dict.fromkeys(flags, False))
    make_trainer(tmp_path, callbacks=[audit], max_steps=2).fit(TinyModel())
    assert printed == [quiet.inactive_line({"MemoryAudit": "every check is off"})]
    assert audit.path is None and list(tmp_path.rglob("*.jsonl")) == []
    printed.clear()
    make_trainer(tmp_path, callbacks=[MemoryAudit(**dict.fromkeys(flags[1:], False))], max_steps=1).fit(TinyModel())
    assert printed == []  # one check on: active, and quiet


def test_fp32_duplicate_of_bf16_model_detected_with_byte_count(tmp_path):
    model = HiddenModel(hidden=251, dtype=torch.bfloat16, out=3)
    _STRAY[:] = [p.detach().float().clone() for p in model.parameters()]  # leftover fp32 copy
    expected = sum(p.numel() * 4 for p in model.parameters())
    audit = MemoryAudit(dirpath=tmp_path / "audit", detect_leaks=False)
    trainer = make_trainer(tmp_path, callbacks=[audit], max_steps=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model)
    finally:
        _STRAY.clear()
    messages = _audit_warnings(caught, "not owned")
    assert len(messages) == 1  # once, although both audits see the copy
    assert f"({expected} bytes" not in messages[0]  # the figure is printed as "<human> = <n> bytes"
    assert f"= {expected} bytes" in messages[0] and "4 tensors" in messages[0]
    assert "another dtype" in messages[0] and "torch.float32" in messages[0]
    start = next(r for r in _records(tmp_path / "audit" / "memory_rank0.jsonl") if r.get("audit") == "fit_start")
    assert start["duplicates"]["bytes"] == expected
    warning = next(r for r in _records(tmp_path / "audit" / "memory_rank0.jsonl") if r["event"] == "warning")
    assert warning["check"] == "duplicates" and warning["duplicate_bytes"] == expected


@pytest.mark.cuda
def test_cuda_stray_fp32_copy_of_bf16_model_matches_the_allocator(tmp_path):
    """The FLAN-T5 case on a real GPU: a bf16 model on the device and a stray fp32 copy of its weights."""
    model = HiddenModel(hidden=4093, dtype=torch.bfloat16, out=7).cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    _STRAY[:] = [p.detach().float() for p in model.parameters()]  # e.g. kept from before `.to(bfloat16)`
    stray_allocated = torch.cuda.memory_allocated() - before
    exact = sum(p.numel() * 4 for p in model.parameters())
    audit = MemoryAudit(dirpath=tmp_path / "audit", detect_leaks=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(tmp_path, callbacks=[audit], max_steps=1, accelerator="cuda").fit(model)
    finally:
        _STRAY.clear()
    start = next(r for r in _records(tmp_path / "audit" / "memory_rank0.jsonl") if r.get("audit") == "fit_start")
    assert start["device"].startswith("cuda") and start["unexplained_bytes"] is not None
    assert start["duplicates"]["bytes"] == exact
    assert 0 <= stray_allocated - exact <= 512 * 4  # the caching allocator rounds each block up to 512 bytes
    (message,) = _audit_warnings(caught, "not owned")
    assert f"= {exact} bytes" in message and "cuda" in message
    print(message)  # kept in the GPU log by benchmarks/gpu/issue6.sh


def test_small_copy_below_fraction_is_not_reported(tmp_path):
    model = HiddenModel(hidden=249, out=3)
    _STRAY[:] = [model.layer[2].weight.detach().clone()]  # 747 of ~9k elements: under half a copy
    audit = MemoryAudit(detect_leaks=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(tmp_path, callbacks=[audit], max_steps=1).fit(model)
    finally:
        _STRAY.clear()
    assert _audit_warnings(caught, "not owned") == []
    start = next(r for r in _records(audit.path) if r.get("audit") == "fit_start")
    assert start["duplicates"]["num_tensors"] == 1  # seen and recorded, below the fraction that warns
    assert start["duplicates"]["bytes"] == 3 * 249 * 4


def test_tied_weights_are_not_duplicates(tmp_path):
    audit = MemoryAudit(detect_leaks=False, duplicate_fraction=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[audit], max_steps=2).fit(TiedModel())
    assert _audit_warnings(caught, "not owned") == []
    assert audit.last_audit["duplicates"] is None
    params = audit.last_audit["footprint"]["bytes_by_category"]["parameters"]
    assert params == (32 * 32 + 32 * 2 + 2) * 4  # the tied matrix once


def test_leak_warning_names_growth_step_and_attribute(tmp_path):
    audit = MemoryAudit(leak_every_n_train_steps=2, leak_window=5, audit_fit_start=False, leak_max_overhead=None)
    model = LeakyModel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[audit], max_steps=20).fit(model)
    messages = _audit_warnings(caught, "autograd history")
    assert len(messages) == 1
    assert "self.losses holds more tensors with autograd history" in messages[0]
    assert "self.losses (10 tensors with grad_fn)" in messages[0] and "per optimizer step" in messages[0]
    assert audit.leak is not None and audit.leak.first_step == 4  # the first sample above the one before
    # backward frees what the graph saved: what stays is the float32 loss itself, 4 bytes per step
    assert 4 <= audit.leak.bytes_per_step < 64
    warning = next(r for r in _records(audit.path) if r["event"] == "warning")
    assert warning["check"] == "leak" and warning["global_step"] == 10  # within the first window
    assert warning["grad_fn_holders"][0]["path"] == "self.losses"
    assert warning["grad_fn_holders"][0]["num_tensors"] == 10


@pytest.mark.slow
def test_clean_model_no_warning_over_200_steps(tmp_path):
    audit = MemoryAudit(leak_max_overhead=None)  # a fixed interval: 20 samples over the 200 steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(
            tmp_path,
            callbacks=[audit],
            max_steps=200,
            limit_train_batches=100,
            limit_val_batches=2,
            val_check_interval=50,
        )
        model = HiddenModel(hidden=64)
        model.length = 16 * 100
        model.configure_optimizers = lambda: torch.optim.Adam(model.parameters())
        trainer.fit(model)
    assert trainer.global_step == 200
    assert [str(w.message) for w in caught if "MemoryAudit" in str(w.message)] == []
    assert audit.leak is None and len(audit._session.sampler.samples) == 10


def test_leak_samples_only_on_interval(tmp_path):
    calls = []
    audit = MemoryAudit(
        leak_every_n_train_steps=5, audit_fit_start=False, check_grad_tracking=False, leak_max_overhead=None
    )
    real = audit._session.sampler.walk
    audit._session.sampler.walk = lambda *a, **k: calls.append(1) or real(*a, **k)  # the object walk, counted
    make_trainer(tmp_path, callbacks=[audit], max_steps=20, accumulate_grad_batches=2, limit_train_batches=40).fit(
        TinyModel()
    )
    assert len(calls) == 4  # steps 5, 10, 15, 20: one gc walk each, none in between
    assert [s for s, _ in audit._session.sampler.samples] == [5, 10, 15, 20]


def test_cpu_samples_wait_until_training_time_pays_for_the_walk(tmp_path):
    now = [0.0]  # a fake clock: each training batch takes 0.125 s, each object walk 1 s (exact in binary)
    audit = MemoryAudit(
        leak_every_n_train_steps=1, audit_fit_start=False, check_grad_tracking=False, leak_max_overhead=0.5
    )
    sampler = audit._session.sampler
    real_walk = sampler.walk

    def slow_walk(*args, **kwargs):
        now[0] += 1.0
        return real_walk(*args, **kwargs)

    sampler.clock, sampler.walk = (lambda: now[0]), slow_walk

    class Clock(Callback):
        def on_train_batch_start(self, *args):
            now[0] += 0.125

    make_trainer(tmp_path, callbacks=[Clock(), audit], max_steps=60, limit_train_batches=60).fit(TinyModel())
    steps = [s for s, _ in audit._session.sampler.samples]
    # the first walk is free to measure; after it a 1 s walk needs 1 / 0.5 = 2 s = 16 batches of training
    assert steps == [1, 17, 33, 49]
    walk_time, train_time = len(steps) * 1.0, 60 * 0.125
    assert walk_time - 1.0 <= 0.5 * train_time  # beyond the first walk, at most the budget


class GradInValidation(TinyModel):
    def validation_step(self, batch, batch_idx):
        with torch.enable_grad():
            out = self(batch)
        return {"out": out}


class MetricWithGrad(TinyModel):
    def __init__(self):
        super().__init__()
        self.preds = torchmetrics.CatMetric()

    def training_step(self, batch, batch_idx):
        out = self(batch)
        self.preds.update(out.sum(-1))  # not detached: every update keeps its graph
        return out.pow(2).mean()


def test_grad_tracking_checks(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(
            tmp_path,
            callbacks=[MemoryAudit(audit_fit_start=False, leak_every_n_train_steps=1)],
            max_steps=4,
            limit_val_batches=2,
            inference_mode=False,
        ).fit(GradInValidation())
    assert len(_audit_warnings(caught, "validation_step (batch 0) returned 1 tensors with autograd")) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(
            tmp_path, callbacks=[MemoryAudit(audit_fit_start=False, leak_every_n_train_steps=1)], max_steps=2
        ).fit(MetricWithGrad())
    assert _audit_warnings(caught, "metric states hold tensors that require grad: self.preds.value")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(
            tmp_path, callbacks=[MemoryAudit(audit_fit_start=False, leak_every_n_train_steps=1)], max_steps=2
        ).fit(TinyModel())
    assert [str(w.message) for w in caught if "MemoryAudit" in str(w.message)] == []


def test_audit_failure_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    def broken():
        raise RuntimeError("gc walk broke")

    monkeypatch.setattr(gc, "get_objects", broken)
    audit = MemoryAudit(leak_every_n_train_steps=1, leak_window=3, leak_max_overhead=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, callbacks=[audit], max_steps=6)
        trainer.fit(TinyModel())
    assert trainer.global_step == 6
    failed = _audit_warnings(caught, "failed")
    assert len([m for m in failed if "audit check" in m]) == 1
    assert len([m for m in failed if "leak check" in m]) == 1
    assert all("training goes on" in m for m in failed)


def test_misbehaving_object_in_gc_is_skipped(tmp_path):
    class Exploding:
        @property
        def __class__(self):
            raise RuntimeError("boom")

    keep = [Exploding() for _ in range(3)]  # noqa: F841 - alive during the audit
    audit = MemoryAudit(detect_leaks=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[audit], max_steps=1).fit(TinyModel())
    assert [str(w.message) for w in caught if "MemoryAudit" in str(w.message)] == []
    assert audit.last_audit is not None


def test_state_dict_keeps_leak_window_and_pickles(tmp_path):
    audit = MemoryAudit(leak_every_n_train_steps=1, audit_fit_start=False, leak_max_overhead=None)
    make_trainer(tmp_path, callbacks=[audit], max_steps=4).fit(TinyModel())
    state = audit.state_dict()
    assert [s for s, _ in state["leak_samples"]] == [1, 2, 3, 4] and state["leak_reported"] is False
    fresh = MemoryAudit(leak_every_n_train_steps=1)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.state_dict() == state
    assert pickle.loads(pickle.dumps(audit)).state_dict() == state


@pytest.mark.slow
def test_every_fit_in_one_process_reports_its_own_findings(tmp_path):
    """Notebooks, sweeps, cross-validation: a second fit (same callback or a new one) warns again."""
    model = HiddenModel(hidden=64, dtype=torch.bfloat16, out=3)
    audit = MemoryAudit(dirpath=tmp_path / "audit", detect_leaks=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # Python's default: a repeated message from one place is hidden
            for callback in (audit, audit, MemoryAudit(dirpath=tmp_path / "audit", detect_leaks=False)):
                _STRAY[:] = [p.detach().float().clone() for p in model.parameters()]  # the same finding each fit
                make_trainer(tmp_path, callbacks=[callback], max_steps=1).fit(model)
    finally:
        _STRAY.clear()
    messages = _audit_warnings(caught, "not owned")
    assert len(messages) == 3 and len(set(messages)) == 1, messages
    warnings_written = [r for r in _records(tmp_path / "audit" / "memory_rank0.jsonl") if r["event"] == "warning"]
    assert [r["check"] for r in warnings_written] == ["duplicates"] * 3


def test_findings_respect_the_users_filters(tmp_path):
    model = HiddenModel(hidden=64, dtype=torch.bfloat16, out=3)
    _STRAY[:] = [p.detach().float().clone() for p in model.parameters()]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            warnings.filterwarnings("ignore", message="MemoryAudit")
            make_trainer(tmp_path, callbacks=[MemoryAudit(detect_leaks=False)], max_steps=1).fit(model)
    finally:
        _STRAY.clear()
    assert not _audit_warnings(caught, "not owned")


class HistoryModel(TinyModel):
    """The textbook leak: every step keeps a tensor with autograd history in a module attribute."""

    def __init__(self, leak=True):
        super().__init__()
        self.leak = leak
        self.history = []

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        kept = out["loss"] * torch.ones(2048)
        if self.leak:
            self.history.append(kept)
        else:
            self.history = [kept]  # the latest only: one tensor with a graph, replaced every step
        return out


@pytest.mark.slow  # 1.5 s each: the default window of leak samples
@pytest.mark.parametrize("leak", [True, False], ids=["leaky", "clean"])
def test_textbook_leak_is_found_on_a_short_cpu_run_at_defaults(tmp_path, leak):
    audit = MemoryAudit(audit_fit_start=False)  # defaults for everything that decides leaks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(
            tmp_path, callbacks=[audit], max_steps=200, limit_train_batches=None, limit_val_batches=0, max_epochs=-1
        ).fit(HistoryModel(leak))
    messages = _audit_warnings(caught, "autograd history at every sample")
    if leak:
        assert len(messages) == 1 and "self.history holds more tensors" in messages[0], messages
        assert audit.leak is not None
    else:
        assert messages == [] and audit.leak is None


class KeepsBackboneInHparams(TinyModel):
    """As in DreaMS: the backbone is an __init__ argument, so save_hyperparameters() keeps the object passed in."""

    def __init__(self, backbone):
        super().__init__()
        self.save_hyperparameters()
        self.backbone = copy.deepcopy(backbone)  # the model trains this copy; hparams keep the original

    def forward(self, x):
        return self.layer(self.backbone(x))


def test_duplicate_warning_says_where_the_copy_is_held(tmp_path):
    model = KeepsBackboneInHparams(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 32)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[MemoryAudit(detect_leaks=False)], max_steps=1).fit(model)
    messages = _audit_warnings(caught, "not owned")
    assert messages, "the copy in hparams was not reported"
    assert "Held at self._hparams['backbone'], self._hparams_initial['backbone']." in messages[0], messages[0]
    assert 'self.save_hyperparameters(ignore=["backbone"])' in messages[0]


def test_duplicate_warning_says_when_the_holder_is_not_an_attribute(tmp_path):
    model = HiddenModel(hidden=64, dtype=torch.bfloat16, out=3)
    _STRAY[:] = [p.detach().float().clone() for p in model.parameters()]  # a module-level variable
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(tmp_path, callbacks=[MemoryAudit(detect_leaks=False)], max_steps=1).fit(model)
    finally:
        _STRAY.clear()
    (message,) = _audit_warnings(caught, "not owned")
    assert "not in an attribute of the LightningModule" in message


class FastMovingBf16(HiddenModel):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=50.0)  # one step moves every weight far from its copy


def test_the_first_step_audit_does_not_shrink_a_copy_because_the_weights_moved(tmp_path):
    model = FastMovingBf16(hidden=64, dtype=torch.bfloat16, out=3)
    _STRAY[:] = [p.detach().float().clone() for p in model.parameters()]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer(
                tmp_path, callbacks=[MemoryAudit(dirpath=tmp_path / "a", detect_leaks=False)], max_steps=2
            ).fit(model)
        moved = [
            not torch.allclose(p.detach().float(), s, rtol=1e-2, atol=1e-3) for p, s in zip(model.parameters(), _STRAY)
        ]
    finally:
        _STRAY.clear()
    assert all(moved)  # the copies no longer hold the weights' values
    audits = {r["audit"]: r for r in _records(tmp_path / "a" / "memory_rank0.jsonl") if r["event"] == "audit"}
    assert audits["fit_start"]["duplicates"]["num_tensors"] == 4
    assert audits["first_step"]["duplicates"]["num_tensors"] == 4
    assert audits["first_step"]["duplicates"]["bytes"] == audits["fit_start"]["duplicates"]["bytes"]
