"""OOMReporter: reports on CPU from hand-raised out-of-memory errors, 2-process DDP, and a real CUDA OOM."""

import gc
import json
import os
import pickle
import re
import warnings

import pytest
import torch

from lightning_memopt import OOMReporter
from lightning_memopt.callbacks import oom_reporter as module
from lightning_memopt.cli import main as cli_main
from lightning_memopt.functional import footprint
from lightning_memopt.functional.oom import REDACTED, REPORT_FORMAT
from lightning_memopt.functional.oom import sections as oom_sections
from lightning_memopt.functional.oom import store as oom_store
from tests.helpers.lightning import pl
from tests.helpers.models import TinyModel
from tests.helpers.oom_schema import check_against_schema
from tests.helpers.trainer import make_trainer

MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB. (raised by the test)"


class _BackwardOOM(torch.autograd.Function):
    error = None

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise _BackwardOOM.error


class FailingModel(TinyModel):
    """Raises an out-of-memory error in `where` at batch `at` (global step for training)."""

    def __init__(self, where="forward", at=2, error=None):
        super().__init__()
        self.where, self.at, self.error = where, at, error
        self.raised = None
        self._phase = None

    def _raise(self):
        self.raised = self.error if self.error is not None else torch.OutOfMemoryError(MESSAGE)
        raise self.raised

    def forward(self, x):
        if self.where == "forward" and self._phase == "train" and self._idx == self.at:
            self._raise()
        out = self.layer(x)
        if self.where == "backward" and self._phase == "train" and self._idx == self.at:
            self.raised = _BackwardOOM.error = torch.OutOfMemoryError(MESSAGE)
            out = _BackwardOOM.apply(out)
        return out

    def training_step(self, batch, batch_idx):
        self._phase, self._idx = "train", batch_idx
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.where == "validation" and batch_idx == self.at:
            self._raise()
        return super().validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        if self.where == "predict" and batch_idx == self.at:
            self._raise()
        return super().predict_step(batch, batch_idx)


def _fit_and_fail(tmp_path, model, reporter, **trainer_kwargs):
    trainer = make_trainer(tmp_path, callbacks=[reporter], **trainer_kwargs)
    with pytest.raises(BaseException) as info:
        trainer.fit(model)
    return trainer, info.value


def _files(directory):
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def _documented(directory):
    """The documented names (links to the newest report); each report is also kept under a name of its own."""
    return [n for n in _files(directory) if re.fullmatch(r"oom_(report|snapshot)_rank\d+\.\w+", n)]


def _kept(directory, ext=".json"):
    return [n for n in _files(directory) if re.fullmatch(r"oom_(report|snapshot)_rank\d+-.+", n) and n.endswith(ext)]


def test_the_largest_tensors_are_named_by_their_owner(tmp_path):
    model = FailingModel("forward", at=1)
    model.big = torch.nn.Parameter(torch.zeros(2048, 4096))  # 32 MiB: larger than anything else alive here
    reporter = OOMReporter(dirpath=tmp_path / "reports", max_listed=3)
    _fit_and_fail(tmp_path, model, reporter, max_steps=5)
    top = json.loads((tmp_path / "reports" / "oom_report_rank0.json").read_text())["holders"]["top_tensors"]
    assert (top[0]["name"], top[0]["shape"], top[0]["bytes"]) == ("big", [2048, 4096], 32 * 2**20)
    del model.big  # the traceback kept by the trainer's error keeps the model alive until a collection
    gc.collect()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_training_oom_report_has_every_field(tmp_path, where):
    model = FailingModel(where, at=2)
    reporter = OOMReporter(dirpath=tmp_path / "reports", max_listed=5)
    _, err = _fit_and_fail(tmp_path, model, reporter, accumulate_grad_batches=1, max_steps=10)
    # the original exception, unchanged
    assert err is model.raised and type(err) is torch.OutOfMemoryError and str(err) == MESSAGE
    assert _documented(tmp_path / "reports") == ["oom_report_rank0.json", "oom_report_rank0.md"]
    assert len(_files(tmp_path / "reports")) == 4  # and the same two files under the report's own name
    report = json.loads((tmp_path / "reports" / "oom_report_rank0.json").read_text())

    assert report["format"] == REPORT_FORMAT
    check_against_schema(report)  # every key defined in functional/oom/schema.py, required ones present
    when = report["when"]
    assert when["time"] > 0 and when["rank"] == 0 and when["world_size"] == 1 and when["device"] == "cpu"
    assert (when["fn"], when["stage"], when["epoch"], when["global_step"], when["batch_idx"]) == (
        "fit",
        "train",
        0,
        2,
        2,
    )
    assert report["error"]["type"] == "torch.OutOfMemoryError" and report["error"]["message"] == MESSAGE
    assert ("_raise" if where == "forward" else "backward") in report["error"]["location"]
    assert "test_oom_reporter.py" in report["error"]["location"]

    batch = report["batch"]
    assert batch["tensors"] == [
        {"path": "batch", "shape": [4, 32], "dtype": "torch.float32", "device": "cpu", "bytes": 512}
    ]
    assert batch["micro_batch_size"] == 4 and batch["found_in"]

    memory = report["memory"]
    assert memory["device"] == "cpu" and memory["host_rss_bytes"] > 0 and memory["allocated_bytes"] is None
    assert memory["message_requested_bytes"] == 2 * 1024**3 and "summary" in memory

    holders = report["holders"]
    assert holders["bytes_by_category"]["parameters"] == (32 * 2 + 2) * 4
    assert {r["category"] for r in holders["rows"]} >= {"parameters"}
    assert len(holders["top_tensors"]) == 5 and "unexplained_bytes" in holders
    own = [t for t in holders["top_tensors"] if t["shape"] == [2, 32]]  # the model's weight, when among the largest
    assert all(t["name"] in ("layer.weight", "layer.weight.grad") for t in own), own

    config = report["config"]
    assert config["precision"] == "32-true" and config["accumulate_grad_batches"] == 1
    assert config["micro_batch_size"] == 4 and config["effective_batch_size"] == 4
    assert config["strategy"] == "SingleDeviceStrategy" and config["num_devices"] == 1
    assert set(config["allocator"]) == {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"}
    assert config["versions"]["torch"] == str(torch.__version__) and config["versions"]["lightning_memopt"]

    assert report["suggestions"] and report["suggestions"][0]["rank"] == 1
    assert any("accumulate_grad_batches" in s["action"] for s in report["suggestions"])
    assert report["snapshot"]["path"] is None and "record_history=True" in report["snapshot"]["reason"]
    assert isinstance(report["environment"], dict) and report["report_errors"] == []

    md = (tmp_path / "reports" / "oom_report_rank0.md").read_text()
    assert md.startswith("# Out-of-memory report: rank 0 of 1, train, global step 2")
    assert "## Suggestions" in md and "| batch | (4, 32) | torch.float32 | cpu | 512 B |" in md


def test_accumulation_is_in_the_effective_batch(tmp_path):
    model = FailingModel("forward", at=5)
    _fit_and_fail(
        tmp_path,
        model,
        OOMReporter(dirpath=tmp_path, max_listed=0),
        accumulate_grad_batches=3,
        max_steps=5,
        limit_train_batches=8,
    )
    report = json.loads((tmp_path / "oom_report_rank0.json").read_text())
    assert report["config"]["accumulate_grad_batches"] == 3 and report["config"]["effective_batch_size"] == 12
    assert report["when"]["batch_idx"] == 5 and report["when"]["global_step"] == 1
    assert "top_tensors" not in report["holders"]


def test_validation_oom_and_default_dirpath_created(tmp_path):
    model = FailingModel("validation", at=1)
    _, err = _fit_and_fail(tmp_path / "root", model, OOMReporter())
    assert err is model.raised
    directory = tmp_path / "root" / "memopt"  # the one default of every writer, next to the memory logs
    assert _documented(directory) == ["oom_report_rank0.json", "oom_report_rank0.md"]
    report = json.loads((directory / "oom_report_rank0.json").read_text())
    assert (report["when"]["fn"], report["when"]["stage"], report["when"]["batch_idx"]) == ("fit", "validate", 1)
    assert report["suggestions"][0]["action"].startswith("Lower the validate batch size")


def test_predict_oom_and_nested_dirpath_that_does_not_exist(tmp_path):
    model = FailingModel("predict", at=0)
    target = tmp_path / "a" / "b" / "c"
    trainer = make_trainer(tmp_path, callbacks=[OOMReporter(dirpath=target)])
    with pytest.raises(torch.OutOfMemoryError):
        trainer.predict(model)
    report = json.loads((target / "oom_report_rank0.json").read_text())
    assert (report["when"]["fn"], report["when"]["stage"]) == ("predict", "predict")


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"),
    ],
)
def test_other_backend_oom_is_reported_with_its_type(tmp_path, error):
    model = FailingModel("forward", at=0, error=error)
    _, err = _fit_and_fail(tmp_path, model, OOMReporter(dirpath=tmp_path))
    assert err is error
    assert json.loads((tmp_path / "oom_report_rank0.json").read_text())["error"]["type"] == "RuntimeError"


def test_other_errors_write_nothing(tmp_path):
    model = FailingModel("forward", at=1, error=ValueError("a bug, not memory"))
    _, err = _fit_and_fail(tmp_path, model, OOMReporter(dirpath=tmp_path / "r"))
    assert isinstance(err, ValueError) and not (tmp_path / "r").exists()


def test_reporter_never_raises_over_the_original_error(tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("reporter bug")

    # a section failing: listed in the report, the rest written
    monkeypatch.setattr(oom_sections, "describe_batch", broken)
    monkeypatch.setattr(footprint, "model_footprint", broken)
    model = FailingModel("forward", at=1)
    _, err = _fit_and_fail(tmp_path, model, OOMReporter(dirpath=tmp_path / "r"))
    assert err is model.raised
    report = json.loads((tmp_path / "r" / "oom_report_rank0.json").read_text())
    assert any("failing batch" in p for p in report["report_errors"])
    assert any("who holds memory" in p for p in report["report_errors"])
    check_against_schema(report)
    assert "## Parts of this report that could not be gathered" in (tmp_path / "r" / "oom_report_rank0.md").read_text()

    # writing itself failing (a full disk): logged and warned, the original error still arrives
    def full_disk(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(oom_store, "write_text_atomic", full_disk)
    model = FailingModel("forward", at=1)
    with caplog.at_level("ERROR", logger="lightning_memopt"), pytest.warns(UserWarning, match="could not be written"):
        _, err = _fit_and_fail(tmp_path, model, OOMReporter(dirpath=tmp_path / "full"))
    assert err is model.raised and type(err) is torch.OutOfMemoryError and str(err) == MESSAGE
    assert "could not be written" in caplog.text and "No space left" in caplog.text
    (message,) = [m for m in caplog.messages if "could not be written" in m]
    header, *failures = message.splitlines()
    assert len(header) <= 100 and failures  # one line per failure, each starting with the file that failed
    assert all(line.startswith(f"  {tmp_path / 'full'}") and "No space left" in line for line in failures)


def test_each_oom_is_reported_once_and_a_retry_gets_its_own_report(tmp_path):
    reporter = OOMReporter(dirpath=tmp_path, max_listed=0)
    retried = []

    class Retrying(FailingModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1 and not retried:
                try:  # e.g. a user retry loop: report, then try again at a smaller batch
                    raise torch.OutOfMemoryError(MESSAGE + " (first try)")
                except torch.OutOfMemoryError as err:
                    reporter.on_exception(self.trainer, self, err)
                    reporter.on_exception(self.trainer, self, err)  # the same error seen twice: one report
                    retried.append(err)
            return super().training_step(batch, batch_idx)

    model = Retrying("forward", at=1)
    _, err = _fit_and_fail(tmp_path, model, reporter)  # the retry fails too, at the same step: a new error
    assert err is model.raised
    kept = _kept(tmp_path)
    assert len(kept) == 2 and len(_kept(tmp_path, ".md")) == 2 and "oom_report_rank0.json" in _files(tmp_path)
    assert reporter.state_dict()["num_reports"] == 2
    assert reporter.state_dict()["reported_steps"] == ["fit/train/0/1/1", "fit/train/0/1/1"]
    newest = json.loads((tmp_path / "oom_report_rank0.json").read_text())
    assert newest["error"]["message"] == MESSAGE
    messages = sorted(json.loads((tmp_path / n).read_text())["error"]["message"] for n in kept)
    assert messages == [MESSAGE, MESSAGE + " (first try)"]
    # Lightning itself calls `on_exception` once more with the escaping error: still two reports
    reporter.on_exception(model.trainer, model, err)
    assert reporter.state_dict()["num_reports"] == 2 and len(_files(tmp_path)) == 6


def test_second_run_keeps_the_first_report(tmp_path):
    _fit_and_fail(tmp_path, FailingModel("forward", at=1), OOMReporter(dirpath=tmp_path, max_listed=0))
    first = (tmp_path / "oom_report_rank0.json").read_text()
    first_md = (tmp_path / "oom_report_rank0.md").read_text()
    _fit_and_fail(tmp_path, FailingModel("forward", at=2), OOMReporter(dirpath=tmp_path, max_listed=0))
    kept = _kept(tmp_path)
    assert len(kept) == 2 and "oom_report_rank0.json" in _files(tmp_path)
    first_json = next(n for n in kept if (tmp_path / n).read_text() == first)
    assert (tmp_path / (first_json[:-5] + ".md")).read_text() == first_md
    assert json.loads((tmp_path / "oom_report_rank0.json").read_text())["when"]["global_step"] == 2
    assert os.path.samefile(tmp_path / "oom_report_rank0.json", tmp_path / max(kept))  # a link to the newest
    # a third run within the same second still keeps both earlier reports
    _fit_and_fail(tmp_path, FailingModel("forward", at=3), OOMReporter(dirpath=tmp_path, max_listed=0))
    assert len(_kept(tmp_path)) == 3 and len(_files(tmp_path)) == 8


def test_secrets_from_the_environment_are_in_no_file(tmp_path, monkeypatch):
    secrets = {
        "TORCH_TEST_API_TOKEN": "tok-0a1b2c3d",
        "NCCL_SECRET": "sec-4e5f6a7b",
        "CUDA_PASSWORD": "pw-8c9d0e1f",
        "MY_APP_KEY": "key-2a3b4c5d",
        "HF_TOKEN": "hf-6e7f8a9b",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    _fit_and_fail(tmp_path, FailingModel("forward", at=0), OOMReporter(dirpath=tmp_path / "r"))
    files = list((tmp_path / "r").iterdir())
    assert len(files) == 4
    for path in files:
        text = path.read_text()
        for value in secrets.values():
            assert value not in text, (path.name, value)
    env = json.loads((tmp_path / "r" / "oom_report_rank0.json").read_text())["environment"]
    assert env["TORCH_TEST_API_TOKEN"] == REDACTED and env["NCCL_DEBUG"] == "INFO" and "HF_TOKEN" not in env


class _ModelWithHparams(FailingModel):
    def __init__(self, hparams):
        super().__init__("forward", at=0)
        self.save_hyperparameters(hparams)


def test_credentials_inside_values_are_redacted_in_env_hparams_and_config(tmp_path, monkeypatch):
    """Allow-listed names, secret values: URL userinfo, token/key parameters, Bearer credentials, anywhere."""
    secrets = [
        "pw-1a2b3c4d",
        "qtok-5e6f7a8b",
        "qkey-9c0d1e2f",
        "eyJhbGciOiJIUzI1NiJ9abcdef012345",
        "hp-3a4b5c6d",
        "cfgpw-7e8f9a0b",
    ]
    monkeypatch.setenv("LIGHTNING_CLOUD_URL", f"https://alice:{secrets[0]}@cloud.example.com/api")
    monkeypatch.setenv("PL_LOGGER_URI", f"https://logs.example.com/run?token={secrets[1]}&api_key={secrets[2]}&x=1")
    monkeypatch.setenv("TORCH_HEADERS", f"Authorization: Bearer {secrets[3]}")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", f"expandable_segments:True,https://u:{secrets[5]}@h")
    hparams = {"lr": 0.1, "wandb": {"api_key": secrets[4]}, "data_url": f"s3://bob:{secrets[0]}@bucket/data"}
    _fit_and_fail(tmp_path, _ModelWithHparams(hparams), OOMReporter(dirpath=tmp_path / "r"))
    for path in (tmp_path / "r").iterdir():
        text = path.read_text()
        for value in secrets:
            assert value not in text, (path.name, value)
    report = json.loads((tmp_path / "r" / "oom_report_rank0.json").read_text())
    env = report["environment"]
    assert env["LIGHTNING_CLOUD_URL"] == f"https://alice:{REDACTED}@cloud.example.com/api"
    assert env["PL_LOGGER_URI"] == f"https://logs.example.com/run?token={REDACTED}&api_key={REDACTED}&x=1"
    assert env["TORCH_HEADERS"] == f"Authorization: Bearer {REDACTED}"
    # hparams are in the report, readable except for the secrets
    assert report["hparams"]["lr"] == 0.1
    assert report["hparams"]["wandb"] == {"api_key": REDACTED}
    assert report["hparams"]["data_url"] == f"s3://bob:{REDACTED}@bucket/data"
    assert f"u:{REDACTED}@h" in json.dumps(report["config"]["allocator"])
    markdown = (tmp_path / "r" / "oom_report_rank0.md").read_text()
    assert "Hyperparameters" in markdown and "data_url" in markdown


def test_record_history_on_cpu_is_one_inactive_note_and_still_reports(tmp_path, caplog):
    reporter = OOMReporter(dirpath=tmp_path, record_history=True)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO"):
        warnings.simplefilter("always")
        _fit_and_fail(tmp_path, FailingModel("forward", at=1), reporter)
    assert [w for w in caught if "record_history" in str(w.message)] == []
    notes = [m for m in caplog.messages if m.startswith("lightning-memopt: inactive here")]
    assert len(notes) == 1 and "OOMReporter(record_history=True) (no allocator history on cpu)" in notes[0]
    report = json.loads((tmp_path / "oom_report_rank0.json").read_text())
    assert report["snapshot"]["path"] is None and "not available" in report["snapshot"]["reason"]
    assert _documented(tmp_path) == ["oom_report_rank0.json", "oom_report_rank0.md"]


def test_record_history_on_a_cuda_build_without_it_warns_from_this_module(tmp_path, monkeypatch):
    monkeypatch.setattr(module._torch_private, "supports_memory_history", lambda: False)
    monkeypatch.setattr(module, "trainer_device", lambda trainer: torch.device("cuda", 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[OOMReporter(dirpath=tmp_path, record_history=True)], max_steps=1).fit(
            TinyModel()
        )
    ours = [w for w in caught if "record_history" in str(w.message)]
    assert len(ours) == 1 and "records no CUDA allocator history" in str(ours[0].message)
    assert os.path.basename(ours[0].filename) == "oom_reporter.py"  # filterable by module, not Lightning's call.py


class _FakeHistory:
    def __init__(self):
        self.calls = []

    def install(self, monkeypatch):
        private = module._torch_private
        monkeypatch.setattr(private, "supports_memory_history", lambda: True)
        monkeypatch.setattr(private, "start_memory_history", lambda n: self.calls.append(("start", n)) or True)
        monkeypatch.setattr(private, "stop_memory_history", lambda: self.calls.append(("stop",)) or True)

        def dump(path):
            self.calls.append(("dump", str(path)))
            with open(path, "wb") as f:
                pickle.dump({"segments": [], "device_traces": []}, f)
            return True

        monkeypatch.setattr(private, "dump_memory_snapshot", dump)
        monkeypatch.setattr(module, "trainer_device", lambda trainer: torch.device("cuda", 0))
        return self


def test_record_history_started_at_setup_dumped_at_oom_and_stopped(tmp_path, monkeypatch):
    history = _FakeHistory().install(monkeypatch)
    reporter = OOMReporter(dirpath=tmp_path, record_history=True, max_entries=1234)
    _fit_and_fail(tmp_path, FailingModel("forward", at=1), reporter)
    assert [c[0] for c in history.calls] == ["start", "dump", "stop"] and history.calls[0] == ("start", 1234)
    assert _documented(tmp_path) == ["oom_report_rank0.json", "oom_report_rank0.md", "oom_snapshot_rank0.pickle"]
    report = json.loads((tmp_path / "oom_report_rank0.json").read_text())
    snapshot = report["snapshot"]["path"]  # the snapshot's own name, which stays when a newer report comes
    assert os.path.samefile(snapshot, tmp_path / "oom_snapshot_rank0.pickle") and snapshot in history.calls[1][1]
    assert "memory_viz" in report["snapshot"]["how_to_open"]
    assert os.path.basename(snapshot) in (tmp_path / "oom_report_rank0.md").read_text()
    # a second failing run keeps the first snapshot together with its report
    _fit_and_fail(tmp_path, FailingModel("forward", at=2), OOMReporter(dirpath=tmp_path, record_history=True))
    assert len(_kept(tmp_path, ".pickle")) == 2 and os.path.exists(snapshot)


def test_record_history_stopped_at_teardown_of_a_good_run(tmp_path, monkeypatch):
    history = _FakeHistory().install(monkeypatch)
    reporter = OOMReporter(dirpath=tmp_path, record_history=True)
    make_trainer(tmp_path, callbacks=[reporter], max_steps=2).fit(TinyModel())
    assert [c[0] for c in history.calls] == ["start", "stop"] and _files(tmp_path) == []
    clone = pickle.loads(pickle.dumps(reporter))
    assert clone._recording is False


def test_non_oom_error_also_stops_history(tmp_path, monkeypatch):
    history = _FakeHistory().install(monkeypatch)
    _fit_and_fail(
        tmp_path,
        FailingModel("forward", at=1, error=ValueError("bug")),
        OOMReporter(dirpath=tmp_path, record_history=True),
    )
    assert [c[0] for c in history.calls] == ["start", "stop"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_entries": 0}, "`max_entries` must be a positive int, got 0"),
        ({"max_listed": -1}, "`max_listed` must be a non-negative int, got -1"),
        ({"record_history": "yes"}, r"`record_history` must be a bool \(True or False\), got 'yes'"),
        ({"dirpath": 3}, r"`dirpath` must be a path \(str or os.PathLike\) or None, got 3"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OOMReporter(**kwargs)


def test_state_dict_round_trip():
    reporter = OOMReporter()
    reporter.load_state_dict({"reported_steps": ["fit/train/0/1/1"], "num_reports": 1})
    assert OOMReporter().state_key == reporter.state_key != OOMReporter(dirpath="x").state_key
    assert reporter.state_dict() == {"reported_steps": ["fit/train/0/1/1"], "num_reports": 1}


def test_cli_report_prints_markdown(tmp_path, capsys):
    _fit_and_fail(tmp_path, FailingModel("forward", at=1), OOMReporter(dirpath=tmp_path, max_listed=0))
    assert cli_main(["report", str(tmp_path / "oom_report_rank0.json")]) == 0
    out = capsys.readouterr().out
    assert out == (tmp_path / "oom_report_rank0.md").read_text()
    assert cli_main(["report", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.cuda
def test_real_cuda_oom_with_snapshot(tmp_path):
    from torch.cuda import _memory_viz

    total = torch.cuda.get_device_properties(0).total_memory

    class Huge(TinyModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                torch.empty(2 * total, dtype=torch.uint8, device=self.device)
            return super().training_step(batch, batch_idx)

    reporter = OOMReporter(dirpath=tmp_path, record_history=True)
    trainer = make_trainer(tmp_path, accelerator="cuda", callbacks=[reporter])
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(Huge())
    names = _documented(tmp_path)
    assert names == ["oom_report_rank0.json", "oom_report_rank0.md", "oom_snapshot_rank0.pickle"]
    report = json.loads((tmp_path / "oom_report_rank0.json").read_text())
    assert report["memory"]["allocated_bytes"] > 0 and report["memory"]["device_total_bytes"] == total
    assert report["memory"]["message_requested_bytes"] is not None and report["memory"]["summary"]
    assert report["holders"]["bytes_by_category"]["parameters"] > 0
    assert report["suggestions"][0]["action"].startswith("Check the shape")
    with open(tmp_path / "oom_snapshot_rank0.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert "segments" in snapshot and "device_traces" in snapshot
    assert "<html" in _memory_viz.trace_plot(snapshot).lower()
    # history switched off after the exception: a fresh snapshot has no new trace entries
    torch.cuda.empty_cache()
    after = torch.cuda.memory._snapshot()
    torch.ones(1, device="cuda")
    assert torch.cuda.memory._snapshot()["device_traces"] == after["device_traces"]


class _BlockModel(FailingModel):
    """A transformer layer before the linear head; fails in forward at step 1."""

    def __init__(self, hf_switch=False):
        super().__init__("forward", at=1)
        self.block = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        if hf_switch:
            self.block.gradient_checkpointing = True  # what Hugging Face's switch sets on its blocks

    def forward(self, x):
        return super().forward(self.block(x.unsqueeze(1)).squeeze(1))


@pytest.mark.parametrize("how", ["callback-first", "callback-last", "hf-switch", "off"])
def test_report_records_activation_checkpointing_and_does_not_suggest_it_again(tmp_path, how):
    from lightning_memopt import GradientCheckpointing

    reporter = OOMReporter(dirpath=tmp_path / "r", max_listed=0)
    callbacks = {
        "callback-first": [GradientCheckpointing(), reporter],
        "callback-last": [reporter, GradientCheckpointing()],
    }.get(how, [reporter])
    model = _BlockModel(hf_switch=how == "hf-switch")
    trainer = make_trainer(tmp_path, callbacks=callbacks)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(model)
    report = json.loads((tmp_path / "r" / "oom_report_rank0.json").read_text())
    state = report["config"]["activation_checkpointing"]
    actions = [s["action"] for s in report["suggestions"]]
    suggested = any(a.startswith("Enable activation checkpointing") for a in actions)
    if how == "off":
        assert state["on"] is False and suggested, actions
    else:
        assert state["on"] is True and not suggested, actions
        assert state["wrapped" if how.startswith("callback") else "model_switch"] == ["block"]
    assert "of allocated" not in json.dumps(report["suggestions"])  # CPU: allocated bytes are unknown


# ---------------------------------------------------------------- issue 23: one module, names, console width
def test_trainer_reads_live_in_the_callback_module_and_the_old_name_is_gone():
    import importlib.util

    assert importlib.util.find_spec("lightning_memopt.callbacks.oom_trainer") is None
    assert callable(module._trainer_position) and callable(module._trainer_settings)
    with pytest.raises(TypeError, match="top_k_tensors"):
        OOMReporter(top_k_tensors=3)
    assert OOMReporter(max_listed=3).max_listed == 3


def test_console_summary_fits_100_columns(tmp_path, caplog):
    directory = tmp_path / "r"
    with caplog.at_level("WARNING", logger="lightning_memopt"):
        _fit_and_fail(tmp_path, FailingModel("forward", at=1), OOMReporter(dirpath=directory, max_listed=0))
    (summary,) = [m for m in caplog.messages if "out-of-memory on rank 0" in m]
    first, path = summary.splitlines()
    assert first == "OOMReporter: out-of-memory on rank 0; report written to"
    assert path.startswith(f"  {directory / 'oom_report_rank0-'}") and path.endswith(".md")  # alone on its line


def test_a_lengths_fn_gives_the_lengths_of_a_batch_without_masks(tmp_path):
    # TinyModel's batches are [4, 32] floats: read as "samples of 32 positions, the nonzero first ones real"
    model = FailingModel("forward", at=1)
    reporter = OOMReporter(dirpath=tmp_path / "reports", max_listed=0, lengths_fn=lambda batch: batch[:, :24] != 0)
    _fit_and_fail(tmp_path, model, reporter, max_steps=5)
    report = json.loads((tmp_path / "reports" / "oom_report_rank0.json").read_text())
    [lengths] = report["batch"]["lengths"]
    assert lengths["path"] == "lengths_fn(batch)" and lengths["padded_to"] == 24 and lengths["samples"] == 4
    assert "Sample lengths" in (tmp_path / "reports" / "oom_report_rank0.md").read_text()
    with pytest.raises(ValueError, match="`lengths_fn` must be a function or None"):
        OOMReporter(lengths_fn="peaks")


def test_a_lengths_fn_that_fails_costs_the_lengths_only(tmp_path):
    model = FailingModel("forward", at=1)
    reporter = OOMReporter(dirpath=tmp_path / "reports", max_listed=0, lengths_fn=lambda batch: batch["missing"])
    _, err = _fit_and_fail(tmp_path, model, reporter, max_steps=5)
    assert err is model.raised  # the user's error, unchanged
    report = json.loads((tmp_path / "reports" / "oom_report_rank0.json").read_text())
    assert "lengths" not in report["batch"] and report["batch"]["tensors"]
    assert any("lengths_fn" in problem for problem in report["report_errors"])


class PaddedToMaxLength(pl.LightningModule):
    """Batches padded to 128 where the samples are 3 to 24 tokens long; out of memory at the sixth batch."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(128, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return self.layer(batch["attention_mask"].float()).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        samples = []
        for i in range(64):
            mask = torch.zeros(128, dtype=torch.long)
            mask[: 3 + i % 22] = 1
            samples.append({"attention_mask": mask})
        return torch.utils.data.DataLoader(samples, batch_size=8)


def test_batches_padded_far_beyond_where_99_percent_of_the_data_fits_get_the_tip_to_cap_max_length(tmp_path):
    reporter = OOMReporter(dirpath=tmp_path / "r", max_listed=0)
    _fit_and_fail(tmp_path, PaddedToMaxLength(), reporter, max_steps=20, limit_train_batches=None)
    report = json.loads((tmp_path / "r" / "oom_report_rank0.json").read_text())
    sampled = report["batch"]["data_lengths"]
    assert sampled == {"batches": 6, "samples": 48, "p99": 24, "longest": 24}  # the failing batch counted too
    actions = [s["action"] for s in report["suggestions"]]
    assert any(a.startswith("Cap `max_length` at 24") for a in actions)
    assert any(a.startswith("Pad each batch to its longest sample") for a in actions)
