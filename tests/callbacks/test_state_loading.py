"""Every stateful callback checks the state a checkpoint gives it: a clear error naming the callback, the key and the
value, or one warning naming them and a fresh value where losing it is harmless."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_memopt.callbacks import (
    AutoMicroBatch,
    CacheCleaner,
    GarbageCollector,
    MemoryAudit,
    MemoryMonitor,
    OOMReporter,
)
from lightning_memopt.plugins import MemoryPrecision
from tests.helpers.amb import Net, fit
from tests.helpers.trainer import make_trainer

#: A valid state of each callback (what a run of this version saves), and the keys whose loss is not harmless.
VALID = {
    GarbageCollector: ({"calls": 3, "seconds": 0.5, "collected": 7}, set()),
    CacheCleaner: ({"calls": 2, "seconds": 0.25}, set()),
    MemoryMonitor: ({"last_logged_train_step": 8}, set()),
    OOMReporter: ({"reported_steps": ["fit/train/0/3/3"], "num_reports": 1}, set()),
    MemoryAudit: ({"leak_samples": [[10, 100], [20, 200]], "leak_reported": True}, set()),
    AutoMicroBatch: (
        {
            "micro_batch_size": 4,
            "retries": 2,
            "micro_batch_elements": 24,
            "validate_micro_batch_size": 8,
            "validate_micro_batch_elements": 64,
            "test_micro_batch_size": None,
            "test_micro_batch_elements": None,
            "predict_micro_batch_size": 2,
            "predict_micro_batch_elements": 16,
        },
        {"micro_batch_size"},
    ),
}
#: Values a key legitimately holds although they look mangled (a size not found yet, empty histories).
ALSO_VALID = {
    (AutoMicroBatch, "micro_batch_size"): [None],
    **{
        (AutoMicroBatch, f"{stage}micro_batch_{what}"): [None]
        for stage in ("", "validate_", "test_", "predict_")
        for what in ("size", "elements")
    },
    (MemoryAudit, "leak_samples"): [[]],
    (OOMReporter, "reported_steps"): [[]],
    (MemoryAudit, "leak_reported"): [True],
}
MANGLED_VALUES = [None, [], -5, "x", {"a": 1}, float("nan"), True, [["x", 1]]]
WHOLE_STATES = [None, [], -1, "x", 3.5]


def _load(callback, state):
    """Load ``state``; return the warnings about it (as text) or raise what the load raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.load_state_dict(state)
    return [str(w.message) for w in caught]


def _cases():
    for cls, (valid, _) in VALID.items():
        for state in WHOLE_STATES:
            yield pytest.param(cls, "whole", state, id=f"{cls.__name__}-whole-{state!r}")
        for key in valid:
            for value in MANGLED_VALUES:
                if any(type(value) is type(ok) and value == ok for ok in ALSO_VALID.get((cls, key), [])):
                    continue
                yield pytest.param(cls, key, {**valid, key: value}, id=f"{cls.__name__}-{key}={value!r}")
            missing = {k: v for k, v in valid.items() if k != key}
            yield pytest.param(cls, key, missing, id=f"{cls.__name__}-missing-{key}")


@pytest.mark.parametrize(("cls", "key", "state"), list(_cases()))
def test_a_mangled_state_names_the_callback_and_key_or_starts_fresh(cls, key, state):
    valid, needed = VALID[cls]
    fresh = cls().state_dict()
    callback = cls()
    bad_is_needed = key in needed or (key == "whole" and needed)
    if bad_is_needed:
        with pytest.raises(ValueError) as info:
            _load(callback, state)
        message = str(info.value)
        assert message.startswith(f"{cls.__name__}: ")
        for name in needed if key == "whole" else [key]:
            assert repr(name) in message
        if key != "whole" and key in state:
            assert repr(state[key])[:20] in message
        assert "checkpoint" in message
        return
    said = _load(callback, state)
    assert len(said) == 1, said
    assert said[0].startswith(f"{cls.__name__}: ")
    if key != "whole":
        assert repr(key) in said[0]
    loaded = callback.state_dict()
    for name, value in valid.items():
        if key in ("whole", name):
            assert loaded[name] == fresh[name], name  # starts fresh
        else:
            assert loaded[name] == value, name  # the other keys are kept


@pytest.mark.parametrize("cls", list(VALID), ids=lambda c: c.__name__)
def test_a_valid_state_loads_silently_and_extra_keys_warn(cls):
    valid, _ = VALID[cls]
    callback = cls()
    assert _load(callback, dict(valid)) == []
    assert callback.state_dict() == valid
    said = _load(cls(), {**valid, "from_a_newer_version": 1})
    assert len(said) == 1 and said[0].startswith(f"{cls.__name__}: ") and "'from_a_newer_version'" in said[0]


def test_numpy_numbers_from_a_converted_checkpoint_load_as_python_numbers():
    np = pytest.importorskip("numpy")
    callback = GarbageCollector()
    assert _load(callback, {"calls": np.int64(3), "seconds": np.float32(0.5), "collected": np.int32(2)}) == []
    state = callback.state_dict()
    assert state == {"calls": 3, "seconds": 0.5, "collected": 2}
    assert [type(v) for v in state.values()] == [int, float, int]
    said = _load(callback, {"calls": 3.5, "seconds": np.float32(0.5), "collected": np.int32(2)})  # 3.5 calls: no
    assert len(said) == 1 and "'calls'" in said[0] and "3.5" in said[0] and callback.calls == 0


def test_an_auto_micro_batch_state_without_a_size_keeps_the_configured_one_and_an_older_one_restores_it():
    callback = AutoMicroBatch(micro_batch_size=8)
    evaluation = {
        f"{stage}_micro_batch_{what}": None
        for stage in ("validate", "test", "predict")
        for what in ("size", "elements")
    }
    evaluation["validate_micro_batch_size"] = 4
    assert _load(callback, {"micro_batch_size": None, "retries": 0, "micro_batch_elements": None, **evaluation}) == []
    assert callback.micro_batch_size == 8
    assert callback.eval_micro_batch_sizes == {"validate": 4, "test": None, "predict": None}
    older = AutoMicroBatch()  # micro_batch_size="auto": the checkpoint's size is where it goes on from
    said = _load(older, {"micro_batch_size": 4})  # as a version that saved only the size would (0.1)
    assert older.micro_batch_size == 4 and older.retries == 0
    assert older.eval_micro_batch_sizes == {"validate": None, "test": None, "predict": None}
    assert len(said) == 1 and "AutoMicroBatch" in said[0] and "'retries'" in said[0]
    assert "'validate_micro_batch_size'" in said[0]
    said = _load(callback, {"micro_batch_size": 4})  # the size given (8) wins over an older checkpoint's, warned
    assert callback.micro_batch_size == 8
    assert any("checkpoint's micro-batch size 4 is not used" in text for text in said), said


def test_a_huge_bad_value_is_shortened_in_the_message():
    said = _load(OOMReporter(), {"reported_steps": list(range(10**5)), "num_reports": 1})
    assert len(said) == 1 and "'reported_steps'" in said[0] and len(said[0]) < 600


def test_memory_audit_keeps_the_last_window_of_a_long_sample_list():
    callback = MemoryAudit(leak_window=3)
    samples = [[step, step * 10] for step in range(10)]
    assert _load(callback, {"leak_samples": samples, "leak_reported": False}) == []
    assert callback.state_dict()["leak_samples"] == samples[-3:]
    said = _load(callback, {"leak_samples": [[1, 2, 3]], "leak_reported": False})  # not a [step, bytes] pair
    assert len(said) == 1 and "'leak_samples'" in said[0] and callback.state_dict()["leak_samples"] == []


# ------------------------------------------------------------------------------------------- MemoryPrecision


def _precision(mode):
    plugin = MemoryPrecision(mode)
    plugin.resolve(torch.device("cpu"))
    return plugin


def test_precision_scaler_state_round_trips_and_a_bad_key_leaves_the_scaler_fresh():
    state = {**_precision("16-mixed").state_dict(), "scale": 1024.0, "_growth_tracker": 5}  # what a run found
    plugin = _precision("16-mixed")
    assert _load(plugin, dict(state)) == []
    assert plugin.state_dict() == state
    fresh = _precision("16-mixed").state_dict()
    for key, value in [("scale", -1.0), ("scale", None), ("growth_interval", "x"), ("_growth_tracker", -2)]:
        plugin = _precision("16-mixed")
        said = _load(plugin, {**state, key: value})
        assert len(said) == 1 and said[0].startswith("MemoryPrecision: ") and repr(key) in said[0]
        assert plugin.state_dict() == fresh
    plugin = _precision("16-mixed")
    said = _load(plugin, {k: v for k, v in state.items() if k != "scale"})
    assert len(said) == 1 and "'scale'" in said[0] and plugin.state_dict() == fresh


@pytest.mark.parametrize("state", [None, "x", [], -1])
def test_precision_state_that_is_not_a_dict_warns_before_and_after_setup(state):
    plugin = _precision("16-mixed")
    said = _load(plugin, state)
    assert len(said) == 1 and said[0].startswith("MemoryPrecision: ")
    pending = MemoryPrecision("16-mixed")
    assert _load(pending, state) == []  # kept until setup builds the plugin that owns it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pending.resolve(torch.device("cpu"))
    assert any(str(w.message).startswith("MemoryPrecision: ") for w in caught)


def test_precision_without_a_scaler_ignores_a_scaler_state_with_a_warning():
    plugin = _precision("bf16-mixed")
    said = _load(plugin, {"scale": 2.0})
    assert len(said) == 1 and "MemoryPrecision" in said[0] and "'scale'" in said[0]
    assert _load(plugin, {}) == []


# ------------------------------------------------------------------------------------------- a real checkpoint file


def _checkpoint(tmp_path, callbacks):
    model = Net(forward_budget=4, batch_size=16)
    trainer = fit(tmp_path / "first", model, callbacks, max_steps=2)
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    return path


def _mangle(path, state_key, state):
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["callbacks"][state_key] = state
    torch.save(checkpoint, path)


def test_fit_resumes_from_a_checkpoint_with_a_mangled_harmless_state(tmp_path):
    collector = GarbageCollector()
    path = _checkpoint(tmp_path, [AutoMicroBatch(), collector])
    _mangle(path, collector.state_key, "x")
    resumed, model = [AutoMicroBatch(), GarbageCollector()], Net(forward_budget=4, batch_size=16)
    trainer = make_trainer(tmp_path, callbacks=resumed, max_steps=4, limit_train_batches=None, limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=path)
    said = [str(w.message) for w in caught if str(w.message).startswith("GarbageCollector: ")]
    assert len(said) == 1 and "'x'" in said[0]
    assert trainer.global_step == 4
    assert resumed[0].micro_batch_size == 4 and max(model.seen_sizes) == 4  # the size still came back


def test_fit_from_a_checkpoint_with_a_bad_micro_batch_size_stops_naming_the_key(tmp_path):
    micro = AutoMicroBatch()
    path = _checkpoint(tmp_path, [micro])
    _mangle(path, micro.state_key, {"micro_batch_size": -1, "retries": 1})
    trainer = make_trainer(
        tmp_path, callbacks=[AutoMicroBatch()], max_steps=4, limit_train_batches=None, limit_val_batches=0
    )
    expected = r"AutoMicroBatch: .*'micro_batch_size' must be a positive int or None, got -1"
    with pytest.raises(ValueError, match=expected):
        trainer.fit(Net(forward_budget=4, batch_size=16), ckpt_path=path)
