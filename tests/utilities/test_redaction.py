"""Credentials inside values: URLs, query parameters, HTTP authorization; names that look secret."""

import copy

import pytest
import torch

from lightning_memopt.utilities.redaction import REDACTED, is_secret_name, redact_secrets, redact_text

R = REDACTED


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # URL userinfo: the password goes, the user stays; a lone userinfo (a token) goes whole
        ("https://user:pw@host/path", f"https://user:{R}@host/path"),
        ("postgres://etl:p@ss:w0rd@db.internal:5432/runs", f"postgres://etl:{R}@db.internal:5432/runs"),
        ("https://ghp_0123456789abcdef@github.com/org/repo.git", f"https://{R}@github.com/org/repo.git"),
        ("see s3://AKIA:wJalr@bucket/key and more", f"see s3://AKIA:{R}@bucket/key and more"),
        # secret-named query parameters; the others stay
        ("?token=abc&key=xyz", f"?token={R}&key={R}"),
        ("https://h/p?access_token=a1&x=1", f"https://h/p?access_token={R}&x=1"),
        (
            "https://h/p?api_key=a1&apikey=b2&password=c3&secret=d4",
            f"https://h/p?api_key={R}&apikey={R}&password={R}&secret={R}",
        ),
        ("https://blob.example/c/f?sv=2021&sig=AbC%2Bd&se=2030", f"https://blob.example/c/f?sv=2021&sig={R}&se=2030"),
        (
            "https://h/f?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=f00d",
            f"https://h/f?X-Amz-Credential={R}&X-Amz-Signature={R}",
        ),
        ("https://h/f?signature=abc#frag", f"https://h/f?signature={R}#frag"),
        ("HF_TOKEN=hf_abc123 python train.py", f"HF_TOKEN={R} python train.py"),
        # HTTP authorization
        ("Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0", f"Bearer {R}"),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", f"Authorization: Bearer {R}"),
        ("Authorization: Basic dXNlcjpwYXNzd29yZA==", f"Authorization: Basic {R}"),
        ("basic dXNlcjpwYXNzd29yZA== in a header", f"basic {R} in a header"),
        ("proxy-authorization=tok123", f"proxy-authorization={R}"),
        ("Authorization: token ghp_abc123", f"Authorization: token {R}"),
        # every key/value syntax, with a secret name (issue 22)
        ("Cfg(db_password='hunter2', lr=0.1)", f"Cfg(db_password='{R}', lr=0.1)"),
        ('Cfg(api_key="k\\"y", seed=1)', f'Cfg(api_key="{R}", seed=1)'),
        ("model: t5\npassword: correct horse\nlr: 0.1", f"model: t5\npassword: {R}\nlr: 0.1"),
        ('{"client_secret": "s3", "id": 7}', f'{{"client_secret": "{R}", "id": 7}}'),
        ('{"client_secret":"s3","id":7}', f'{{"client_secret":"{R}","id":7}}'),
        ('{\\"password\\": \\"pw\\"}', f'{{\\"password\\": \\"{R}\\"}}'),
        ("{'token': 'abc', 'mode': 'x'}", f"{{'token': '{R}', 'mode': 'x'}}"),
        ("[aws]\naws_secret_access_key = abc/def+g\nregion = eu", f"[aws]\naws_secret_access_key = {R}\nregion = eu"),
        ("python t.py --db-password pw --lr 1", f"python t.py --db-password {R} --lr 1"),
        ("python t.py --api-key=pw --lr=1", f"python t.py --api-key={R} --lr=1"),
        ("[('token', 'abc'), ('mode', 'x')]", f"[('token', '{R}'), ('mode', 'x')]"),
        ("['--db-password', 'pw', '--lr', '1']", f"['--db-password', '{R}', '--lr', '1']"),
        ('[{"name": "DB_PASSWORD", "value": "pw"}]', f'[{{"name": "DB_PASSWORD", "value": "{R}"}}]'),
        (
            "- name: HF_TOKEN\n  value: hf_x\n- name: MODE\n  value: fast",
            f"- name: HF_TOKEN\n  value: {R}\n- name: MODE\n  value: fast",
        ),
        ("AccountName=acc;AccountKey=abc==;EndpointSuffix=x", f"AccountName=acc;AccountKey={R};EndpointSuffix=x"),
        ("postgres://etl:pa/ss@db/runs", f"postgres://etl:{R}@db/runs"),
        ("https://etl:pa#ss?x@db/runs", f"https://etl:{R}@db/runs"),
        ("redis://:pw@cache:6379/0", f"redis://:{R}@cache:6379/0"),
    ],
)
def test_redact_text_replaces_the_credential_only(text, expected):
    assert redact_text(text) == expected
    assert redact_text(expected) == expected  # idempotent


@pytest.mark.parametrize(
    "text",
    [
        "NCCL_DEBUG=INFO",
        "INFO",
        "https://host/path?x=1",
        "https://host/path?x=1&page=2#top",
        "/data/runs/2024-01-01/checkpoints/last.ckpt",
        "C:\\Users\\me\\runs",
        "expandable_segments:True,max_split_size_mb:128",
        "alice@example.com",
        "Basic usage: pass --plot",
        "the bearer of this note",
        "CUDA out of memory. Tried to allocate 2.00 GiB. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "",
        "api_key=None, token: null, password: ~",
        "--use-auth-token --lr 0.1",
        "(key): Linear(in_features=2, out_features=2, bias=True)",
        "http://localhost:8080/users/@me",
        "tokenizer: t5-small, author: me, sort_key=name, keyframe_dir=/k, pad_token='<pad>'",
    ],
)
def test_redact_text_leaves_harmless_text_alone(text):
    assert redact_text(text) == text


def test_redact_text_returns_non_strings_as_they_are():
    assert redact_text(5) == 5 and redact_text(None) is None


def test_is_secret_name():
    assert all(
        map(
            is_secret_name,
            ["TORCH_HUB_TOKEN", "api_key", "db_password", "PASSWD", "gcp_credentials", "auth_header", "client_secret"],
        )
    )
    assert not any(map(is_secret_name, ["NCCL_DEBUG", "lr", "precision", "batch_size"]))


def test_redact_secrets_hparams_like_dict():
    hparams = {
        "lr": 3e-4,
        "batch_size": 32,
        "num_key_value_heads": 8,  # a number under a KEY-ish name is a setting, not a secret
        "use_auth": True,
        "wandb_api_key": "0123456789abcdef",
        "optimizer": {"name": "adamw", "betas": (0.9, 0.95)},
        "data": {"root": "/data/train", "url": "https://reader:pa55@data.example/set?token=t0k&shard=3"},
        "callbacks": ["https://hooks.example/notify?key=k3y", "/tmp/out"],
        "credentials": {"user": "me", "password": "x"},
    }
    original = copy.deepcopy(hparams)
    out = redact_secrets(hparams)
    assert hparams == original  # the input is not changed
    assert out == {
        "lr": 3e-4,
        "batch_size": 32,
        "num_key_value_heads": 8,
        "use_auth": True,
        "wandb_api_key": R,
        "optimizer": {"name": "adamw", "betas": (0.9, 0.95)},
        "data": {"root": "/data/train", "url": f"https://reader:{R}@data.example/set?token={R}&shard=3"},
        "callbacks": [f"https://hooks.example/notify?key={R}", "/tmp/out"],
        "credentials": R,
    }


def test_redact_secrets_config_like_dict():
    config = {
        "trainer": {
            "logger": {
                "class_path": "MLFlowLogger",
                "init_args": {
                    "tracking_uri": "https://ml:hunter2@mlflow.example",
                    "tags": {"Authorization": "Basic dXNlcjpwYXNz"},
                },
            }
        },
        "env": [("PL_LOGGER_URI", "https://h/api?access_token=zzz"), ("NCCL_DEBUG", "INFO")],
    }
    out = redact_secrets(config)
    init = out["trainer"]["logger"]["init_args"]
    assert init["tracking_uri"] == f"https://ml:{R}@mlflow.example"
    assert init["tags"] == {"Authorization": R}
    assert out["env"] == [("PL_LOGGER_URI", f"https://h/api?access_token={R}"), ("NCCL_DEBUG", "INFO")]
    assert out["trainer"]["logger"]["class_path"] == "MLFlowLogger"


def test_redact_secrets_never_raises_and_keeps_odd_values():
    class Weird:
        def __str__(self):
            raise RuntimeError("no")

    class BadMapping(dict):
        def items(self):
            raise RuntimeError("no")

    tensor = torch.zeros(2)
    loop: list = []
    loop.append(loop)
    weird = Weird()
    out = redact_secrets(
        {
            "t": tensor,
            "w": weird,
            "b": b"token=abc",
            1: "x",
            None: 2.5,
            "loop": loop,
            "bad": BadMapping(a=1),
            "s": {"https://u:p@h"},
            "f": frozenset({"ok"}),
        }
    )
    assert out["t"] is tensor and out["w"] is weird and out["b"] == b"token=abc" and out[1] == "x"
    assert out[None] == 2.5 and out["loop"] == [R] and out["bad"] == R
    assert out["s"] == {f"https://u:{R}@h"} and out["f"] == frozenset({"ok"})
    assert redact_secrets("Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0") == f"Bearer {R}"
    assert redact_secrets(None) is None and redact_secrets(3) == 3
    deep: dict = {}
    node = deep
    for _ in range(200):
        node["next"] = {}
        node = node["next"]
    redact_secrets(deep)  # deeper than the walk goes: replaced, not a RecursionError


def test_redact_secrets_returns_new_containers():
    data = {"a": [1, {"b": "c"}]}
    out = redact_secrets(data)
    assert out == data and out is not data and out["a"] is not data["a"] and out["a"][1] is not data["a"][1]


def test_structured_objects_are_walked_field_by_field_without_calling_their_code():
    import argparse
    import dataclasses
    import enum
    import types

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        user: str
        password: str

    class Color(enum.Enum):
        RED = "token=abc"  # an enum is shown by its name, never walked

    class Exploding:
        def __init__(self):
            self.name = "ok"
            self.loop = self

        def __repr__(self):
            raise AssertionError("repr must not be called")

        @property
        def password(self):  # not in __dict__: never read
            raise AssertionError("properties must not be called")

    class BrokenField:
        def __init__(self):
            self.visible = 1

        def __getattribute__(self, name):
            if name == "visible":
                raise RuntimeError("no")
            return object.__getattribute__(self, name)

    module = torch.nn.Linear(1, 1)
    module.api_key = "sk-kept-inside-a-module"  # a module is shown by its repr, which holds no attributes
    out = redact_secrets(
        {
            "slotted": Slotted("me", "pw"),
            "ns": argparse.Namespace(nested=types.SimpleNamespace(client_secret="s", depth=2)),
            "color": Color.RED,
            "exploding": Exploding(),
            "broken": BrokenField(),
            "module": module,
            "cls": Slotted,
        }
    )
    assert out["slotted"] == {"user": "me", "password": R}
    assert out["ns"] == {"nested": {"client_secret": R, "depth": 2}}
    assert out["color"] is Color.RED and out["module"] is module and out["cls"] is Slotted
    assert out["exploding"] == {"name": "ok", "loop": R}  # the cycle is cut
    assert out["broken"] == {"visible": R}


def test_sequences_argv_pairs_and_name_value_entries():
    argv = ["train.py", "--db-password", "pw1", "--use-auth-token", "--lr", "0.1", "--api-key=k2", "--token", "-x"]
    assert redact_secrets(argv) == [
        "train.py",
        "--db-password",
        R,
        "--use-auth-token",
        "--lr",
        "0.1",
        f"--api-key={R}",
        "--token",
        R,  # a value may start with a single dash
    ]
    assert redact_secrets(("token", "abc")) == ("token", R)
    assert redact_secrets(["tokenizer", "t5-small"]) == ["tokenizer", "t5-small"]
    assert redact_secrets(("api_key", 3)) == ("api_key", 3)  # a number is a setting
    env = [{"name": "DB_PASSWORD", "value": "pw"}, {"name": "MODE", "value": "fast"}, {"key": "HF_TOKEN", "val": "t"}]
    assert redact_secrets(env) == [
        {"name": "DB_PASSWORD", "value": R},
        {"name": "MODE", "value": "fast"},
        {"key": R, "val": R},  # "key" alone is a secret name too (Google's ?key=): both go
    ]


def test_redaction_is_one_module_without_old_names():
    """Names, strings and structures live in ``utilities/redaction.py``; the unreleased alias is gone."""
    import importlib.util

    from lightning_memopt.utilities import redaction

    assert not hasattr(redaction, "SECRET_FRAGMENTS")
    assert set(redaction.__all__) >= {"SECRET_WORDS", "cap_text", "name_words", "redact_secrets", "redact_text"}
    for old in ("secret_names", "secret_text"):
        assert importlib.util.find_spec(f"lightning_memopt.utilities.{old}") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # an empty user and a password holding "/": the userinfo still ends at its "@"
        ("https://:pa/ss@host/path", f"https://:{R}@host/path"),
        ("see https://:pa/ss@host/path?x=1 now", f"see https://:{R}@host/path?x=1 now"),
        # a lone userinfo is a token from 16 characters on, or from 12 with a digit; shorter, a user
        ("https://abcdefghij123456@github.com/org/repo.git", f"https://{R}@github.com/org/repo.git"),
        ("https://abcdefghijklmnop@github.com/org/repo.git", f"https://{R}@github.com/org/repo.git"),
        ("https://abcdefghijklmno@github.com/org/repo.git", "https://abcdefghijklmno@github.com/org/repo.git"),
        ("https://abcdefghij12@host/x", f"https://{R}@host/x"),
        ("https://abcdefghi12@host/x", "https://abcdefghi12@host/x"),
        # the user of a URL that is itself a secret name keeps the host
        ("https://x-access-token:t0k3n@github.com/o/r", f"https://x-access-token:{R}@github.com/o/r"),
        # a secret name with nothing after it: nothing to redact, and no failure (which would redact it all)
        ("password=", "password="),
        ("db_password=", "db_password="),
        ("lr=0.1 password=", "lr=0.1 password="),
        ("password: ", "password: "),
        ("password='", "password='"),
        ("token=None password=", "token=None password="),
    ],
)
def test_userinfo_edges_and_a_name_at_the_end_of_the_text(text, expected):
    assert redact_text(text) == expected
    assert redact_text(expected) == expected
