"""Secret names are judged on whole words: credentials go, configuration that merely contains KEY/TOKEN/AUTH stays.

Each name is checked three ways: :func:`is_secret_name`, as a key of a dict given to :func:`redact_secrets`
(hyperparameters, config) and as ``name=value`` inside a string given to :func:`redact_text`.
"""

import pytest

from lightning_memopt.utilities.redaction import REDACTED, is_secret_name, redact_secrets, redact_text

VALUE = "v4lue-Xy7"

MUST_REDACT = [
    "api_key",
    "API_KEY",
    "apiKey",
    "apikey",
    "wandb_api_key",
    "OPENAI_API_KEY",
    "x-api-key",
    "access_token",
    "accessToken",
    "auth_token",
    "AUTH_TOKEN",
    "session_token",
    "refresh_token",
    "id_token",
    "HF_TOKEN",
    "TORCH_HUB_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "github_token",
    "token",
    "password",
    "db_password",
    "DB_PASSWORD",
    "dbPassword",
    "PGPASSWORD",
    "passwd",
    "MYSQL_PWD",
    "passphrase",
    "secret",
    "client_secret",
    "clientSecret",
    "AWS_SECRET_ACCESS_KEY",
    "secret_key",
    "private_key",
    "privateKey",
    "ssh_private_key",
    "encryption_key",
    "signing_key",
    "AccountKey",
    "credentials",
    "credential",
    "gcp_credentials",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "creds",
    "bearer",
    "bearer_token",
    "Proxy-Authorization",
    "auth_header",
    "auth",
    "--db-password",
    "--api-key",
    "logger.init_args.api_key",
    "X-Amz-Signature",
    "X-Amz-Credential",
    "sig",
    "slack_webhook_url",
    "sentry_dsn",
    "db_pass",
    "cookie",
    "jwt",
    "key",
]

MUST_KEEP = [
    "tokenizer",
    "tokenizer_name",
    "TOKENIZER_PATH",
    "tokenizerName",
    "author",
    "authors",
    "author_email",
    "authority",
    "keyframe_dir",
    "key_padding",
    "key_padding_mask",
    "sort_key",
    "sortKey",
    "primary_key_column",
    "auth_mode",
    "auth_type",
    "authMode",
    "use_auth",
    "hotkeys",
    "keyword",
    "keywords",
    "keys",
    "keyboard_layout",
    "monkey_patch",
    "pad_token",
    "eos_token",
    "bos_token",
    "mask_token",
    "pad_token_id",
    "max_tokens",
    "num_tokens",
    "max_new_tokens",
    "token_type_ids",
    "special_tokens",
    "token_budget",
    "num_key_value_heads",
    "key_dim",
    "public_key",
    "cache_key",
    "partition_key",
    "passthrough",
    "bypass_cache",
    "forward_pass",
    "num_passes",
    "secretary",
    "credits",
    "signal_handler",
    "design",
    "NCCL_DEBUG",
    "PWDEBUG",
    "lr",
    "batch_size",
]


def test_the_tables_are_long_enough_and_disjoint():
    assert len(MUST_REDACT) >= 40 and len(MUST_KEEP) >= 40
    assert not set(MUST_REDACT) & set(MUST_KEEP)


@pytest.mark.parametrize("name", MUST_REDACT)
def test_secret_names_are_redacted(name):
    assert is_secret_name(name)
    assert redact_secrets({name: VALUE, "lr": 0.1}) == {name: REDACTED, "lr": 0.1}
    text = redact_text(f"run --lr 0.1 {name}={VALUE} --epochs 3")
    assert VALUE not in text and f"{REDACTED} --epochs 3" in text and text.startswith("run --lr 0.1 ")


@pytest.mark.parametrize("name", MUST_KEEP)
def test_harmless_names_are_kept(name):
    assert not is_secret_name(name)
    assert redact_secrets({name: VALUE}) == {name: VALUE}
    assert redact_text(f"{name}={VALUE}") == f"{name}={VALUE}"
    assert redact_text(f"{name}: {VALUE}") == f"{name}: {VALUE}"
    assert redact_text(f"--{name} {VALUE}") == f"--{name} {VALUE}"


@pytest.mark.parametrize(
    "url",
    [
        "git+ssh://git@github.com/org/repo.git",
        "ssh://ubuntu@10.0.0.1/home",
        "https://medium.com/@alice/post",
        "http://localhost:8080/users/@me",
        "https://host:8443/a@b",
        "alice@example.com",
    ],
)
def test_a_url_user_without_password_is_kept(url):
    assert redact_text(url) == url
    assert redact_secrets({"repo": url}) == {"repo": url}


def test_non_string_names_are_not_secret():
    assert not is_secret_name(None) and not is_secret_name(3) and not is_secret_name(b"password")
