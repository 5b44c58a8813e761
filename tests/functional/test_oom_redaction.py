"""Every form a credential takes in an OOM report (issue 22, point 1), end to end through ``build_oom_report``.

Each row puts one secret into the hyperparameters (as ``save_hyperparameters`` stores them), the environment or
the error message, builds the report, and checks that the secret is in neither the JSON nor the Markdown while
a harmless neighbour of it still is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import types
import typing

import pytest
import torch
from lightning.pytorch import LightningModule

from lightning_memopt.functional.oom import (
    ReportSources,
    build_oom_report,
    collect_environment,
    render_markdown,
    report_json,
)
from lightning_memopt.utilities.redaction import REDACTED
from tests.helpers import oom_fixtures as F

SECRET = "hunter2-S3cr3t/x#y"
PLAIN_SECRET = "hunter2S3cr3t"  # for the forms where a "/" or "#" would end the value (query strings, URLs)


@dataclasses.dataclass
class DbConfig:
    host: str
    db_password: str
    tokenizer: str = "t5-small"


class Login(typing.NamedTuple):
    user: str
    password: str


class Settings:  # a plain object: its repr would show nothing, its fields are walked
    def __init__(self) -> None:
        self.endpoint = "https://api.example.com"
        self.access_token = SECRET


class _Configured(LightningModule):
    def __init__(self, **hparams: typing.Any) -> None:
        super().__init__()
        self.save_hyperparameters()


# (form, where, value, kept): `where` is "hparams" (value: the keyword arguments saved), "env" (value: the
# environment) or "message" (value: the error message); `kept` must still be in the JSON report.
FORMS = [
    ("dict key", "hparams", {"api_key": SECRET, "lr": 0.25}, "0.25"),
    ("nested dict key", "hparams", {"wandb": {"project": "p-keep", "api_key": SECRET}}, "p-keep"),
    ("camelCase key", "hparams", {"logger": {"clientSecret": SECRET, "name": "n-keep"}}, "n-keep"),
    ("dataclass field (repr db_password='...')", "hparams", {"db": DbConfig("db-keep", SECRET)}, "db-keep"),
    ("argparse.Namespace", "hparams", {"args": argparse.Namespace(db_password=SECRET, seed=1234)}, "1234"),
    ("SimpleNamespace", "hparams", {"cfg": types.SimpleNamespace(auth_token=SECRET, mode="m-keep")}, "m-keep"),
    ("named tuple", "hparams", {"login": Login("u-keep", SECRET)}, "u-keep"),
    ("object with __dict__", "hparams", {"settings": Settings()}, "api.example.com"),
    ("tuple pair ('token', x)", "hparams", {"pair": ("token", SECRET), "other": ("t-keep", "x")}, "t-keep"),
    ("list pair ['password', x]", "hparams", {"pairs": [["password", SECRET], ["user", "u-keep"]]}, "u-keep"),
    ("argv pair", "hparams", {"argv": ["train.py", "--db-password", SECRET, "--lr", "0.5"]}, "--lr"),
    ("argv --name=value", "hparams", {"argv": ["train.py", f"--api-key={SECRET}", "--seed=7"]}, "--seed=7"),
    (
        "name/value list",
        "hparams",
        {"env": [{"name": "DB_PASSWORD", "value": SECRET}, {"name": "MODE", "value": "v-keep"}]},
        "v-keep",
    ),
    ("repr string", "hparams", {"cfg": f"DbConfig(host='h-keep', db_password='{SECRET}')"}, "h-keep"),
    ("Namespace repr string", "hparams", {"cfg": f"Namespace(db_password='{SECRET}', seed=99)"}, "seed=99"),
    ("YAML string", "hparams", {"config": f"model: m-keep\npassword: {SECRET}\nlr: 0.1\n"}, "m-keep"),
    ("YAML name/value list", "hparams", {"k8s": f"- name: DB_PASSWORD\n  value: {SECRET}\n- name: X\n"}, "DB_PASSWORD"),
    ("JSON string", "hparams", {"config": json.dumps({"password": SECRET, "model": "m-keep"})}, "m-keep"),
    ("compact JSON string", "hparams", {"config": f'{{"client_secret":"{SECRET}","id":"i-keep"}}'}, "i-keep"),
    ("INI string", "hparams", {"ini": f"[default]\naws_secret_access_key = {SECRET}\nregion = r-keep\n"}, "r-keep"),
    ("command line string", "hparams", {"cmd": f"python train.py --db-password {SECRET} --lr 0.5"}, "--lr 0.5"),
    ("env-file line", "hparams", {"dotenv": f"HF_TOKEN={PLAIN_SECRET}\nSEED=s-keep"}, "s-keep"),
    ("URL password", "hparams", {"uri": f"https://alice:{PLAIN_SECRET}@db.example/x"}, "alice"),
    ("URL password with /", "hparams", {"uri": "postgres://etl:pa/ss-S3cr3t@db.example/runs"}, "db.example/runs"),
    ("URL password with #", "hparams", {"uri": "https://etl:pa#ss-S3cr3t@db.example/runs"}, "db.example/runs"),
    ("URL token as user", "hparams", {"repo": f"https://ghp_{PLAIN_SECRET}0000@github.com/o/r"}, "github.com/o/r"),
    ("query parameter", "hparams", {"hook": f"https://h.example/x?sig={PLAIN_SECRET}&q=q-keep"}, "q-keep"),
    (
        "Bearer header",
        "hparams",
        {"headers": {"X-Trace": "t-keep", "X-Forwarded": f"Bearer {PLAIN_SECRET}00000"}},
        "t-keep",
    ),
    ("Authorization: Basic", "hparams", {"header": "Authorization: Basic ZXRsOmh1bnRlcjJTM2NyM3Q="}, "Authorization"),
    ("env name", "env", {"TORCH_HUB_TOKEN": SECRET, "NCCL_DEBUG": "INFO"}, "INFO"),
    ("env value YAML", "env", {"PL_CONFIG": f"password: {SECRET}", "PL_MODE": "e-keep"}, "e-keep"),
    ("env value URL", "env", {"LIGHTNING_URI": f"https://u-keep:{PLAIN_SECRET}@h/x"}, "u-keep"),
    ("env value INI", "env", {"PL_INI": f"aws_secret_access_key = {SECRET}"}, "aws_secret_access_key"),
    ("error message", "message", f"CUDA out of memory. token={PLAIN_SECRET} Tried to allocate 2.00 GiB", "2.00 GiB"),
]
SECRETS_IN = ("hunter2", "S3cr3t", "ZXRsOmh1bnRlcjJTM2NyM3Q")


def _report(where: str, value: typing.Any) -> dict:
    hparams = value if where == "hparams" else {}
    environ = value if where == "env" else {}
    message = value if where == "message" else "CUDA out of memory."
    sources = ReportSources(
        settings=lambda: F.SETTINGS,
        environment=lambda: collect_environment(environ),
        live_tensors=lambda *args, **kwargs: [],
    )
    report = build_oom_report(
        torch.OutOfMemoryError(message),
        when={"stage": "train", "rank": 0, "world_size": 1},
        memory={},
        device=torch.device("cpu"),
        module=_Configured(**hparams),
        sources=sources,
    )
    return typing.cast(dict, report)


def test_the_table_covers_the_forms_of_the_issue():
    assert len(FORMS) >= 28 and len({form for form, *_ in FORMS}) == len(FORMS)


@pytest.mark.parametrize(("form", "where", "value", "kept"), FORMS, ids=[form for form, *_ in FORMS])
def test_no_form_of_a_credential_reaches_the_report(form, where, value, kept):
    report = _report(where, value)
    text = report_json(report)
    markdown = render_markdown(json.loads(text))
    for piece in SECRETS_IN:
        assert piece not in text, (form, piece)
        assert piece not in markdown, (form, piece)
    assert REDACTED in text
    assert kept in text, (form, kept)
    if where == "hparams":
        assert set(report["hparams"]) == set(value)  # every hyperparameter is still there, only its secret went


def test_structured_hparams_become_their_fields():
    report = _report("hparams", {"db": DbConfig("db-host", SECRET), "args": argparse.Namespace(seed=3, token=SECRET)})
    assert report["hparams"]["db"] == {"host": "db-host", "db_password": REDACTED, "tokenizer": "t5-small"}
    assert report["hparams"]["args"] == {"seed": 3, "token": REDACTED}


def test_a_huge_hparam_string_is_capped_and_the_report_comes_back_promptly():
    """A 180 KB string of module names (issue 22, point 3) used to delay the OOM by 34 s."""
    names = ".".join(f"encoder.block.{i}.layer.0.SelfAttention.q" for i in range(4500))  # one run: no separator
    assert len(names) > 180_000
    start = time.perf_counter()
    report = _report("hparams", {"frozen_modules": names, "api_key": SECRET})
    markdown = render_markdown(json.loads(report_json(report)))
    seconds = time.perf_counter() - start
    assert seconds < 1.0, seconds
    value = report["hparams"]["frozen_modules"]
    assert value.startswith(names[:1000]) and value.endswith(f"...[truncated {len(names) - 65_536} chars]")
    assert "...[truncated" in markdown and report["hparams"]["api_key"] == REDACTED
