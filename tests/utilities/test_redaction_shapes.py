"""Secrets by shape (release 0.2): secret flags whatever the secret word's place, self-identifying credentials
under harmless names, and the ordinary values that look a little like them and must stay.

Credentials are assembled at run time (a prefix and a body), so that the repository holds no string a secret
scanner takes for a real token.
"""

import pytest

from lightning_memopt.utilities.redaction import REDACTED, redact_secrets, redact_text

R = REDACTED
B62 = "aB3dE5gH7jK9mN1pQ2rS4tU6vW8xY0zC"  # 32 letters and digits, mixed: the body of a random token

JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9"
    + ".eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkEifQ"
    + ".Sfl_KxwRJSMeKKF2QT4fwpM-eJf36POk6yJV_adQssw5c"
)
JWT_UNSIGNED = "eyJhbGciOiJub25lIn0" + ".eyJzdWIiOiIxIn0" + "."
AWS_KEY_ID = "AKIA" + "IOSFODNN7EXAMPL2"
AWS_TEMPORARY = "ASIA" + "Y3FQ2X7EXAMPLE45"
GITHUB = {prefix: prefix + B62 + "0aZ9" for prefix in ("ghp_", "gho_", "ghu_", "ghs_", "ghr_")}
GITHUB_PAT = "github_pat_" + "11ABCDEFG0" + "abcdefghijkl_" + B62 + "xYz0123456789AbCdEfGhIjKlMnOp"
HUGGING_FACE = "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZaBcDeFgH"
OPENAI = "sk-" + B62 + "T3BlbkFJ" + B62[:8]
OPENAI_PROJECT = "sk-proj-" + B62 + "_" + B62[::-1] + "-" + B62
SLACK = {kind: f"xox{kind}-" + "1234567890-1234567890123-" + "AbCdEfGhIjKlMnOpQrStUvWx" for kind in "bpa"}
PEM_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7\nVJTUt9Us8cKjMzEfYyjiWA4R4/M2bS1GB4t7NXp98C3SC6dV\n"
PEM = f"-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}-----END RSA PRIVATE KEY-----"

TOKENS = [JWT, JWT_UNSIGNED, AWS_KEY_ID, AWS_TEMPORARY, *GITHUB.values(), GITHUB_PAT, HUGGING_FACE, OPENAI]
TOKENS += [OPENAI_PROJECT, *SLACK.values()]


# ------------------------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize("flag", ["password", "secret", "token", "key", "credentials", "passwd", "jwt", "api-key"])
@pytest.mark.parametrize("form", ["--{flag} {value} --lr 1", "--{flag}={value} --lr 1", "-{flag} {value} --lr 1"])
def test_a_flag_that_is_the_secret_word_hides_its_value(flag, form):
    text = "python train.py " + form.format(flag=flag, value="hunter2")
    assert redact_text(text) == "python train.py " + form.format(flag=flag, value=R)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the secret word at the start, in the middle, at the end of the flag's name
        ("run --password-file /etc/pw", f"run --password-file {R}"),
        ("run --my-secret-value abc", f"run --my-secret-value {R}"),
        ("run --db-password hunter2", f"run --db-password {R}"),
        ("run --DB_PASSWORD hunter2", f"run --DB_PASSWORD {R}"),
        # quoted values, several flags, a flag as the last word
        ('run --token "abc def" --x 1', f'run --token "{R}" --x 1'),
        ("run --token 'a b' --secret=c --lr 1", f"run --token '{R}' --secret={R} --lr 1"),
        ("run --password", "run --password"),
        ("run --password ", "run --password "),
        ("run --password=", "run --password="),
        # a flag that takes no value keeps the word after it; the next flag is never taken as a value
        ("docker login --password-stdin registry.example.com", "docker login --password-stdin registry.example.com"),
        ("run --token --lr 1", "run --token --lr 1"),
        # inside an error message and an environment variable's value
        ("error: unrecognized arguments: --jwt abc.def", f"error: unrecognized arguments: --jwt {R}"),
        ("--credentials c1 --passwd p1", f"--credentials {R} --passwd {R}"),
    ],
)
def test_secret_flags_in_every_position_of_the_name(text, expected):
    assert redact_text(text) == expected
    assert redact_text(expected) == expected


@pytest.mark.parametrize(
    "text",
    [
        "run --tokenizer t5-small --pad-token x --max-tokens 5 --key-file /k --keyframe-dir /f",
        "run --author me --sort-key name --auth-mode oauth --use-auth-token --lr 0.1",
        "run --passes 3 --secretary no",
    ],
)
def test_flags_that_only_contain_a_secret_looking_word_keep_their_value(text):
    assert redact_text(text) == text


def test_argument_lists_follow_the_same_rule():
    argv = ["--password", "pw", "--password-stdin", "registry", "--token", "t", "--lr", "1"]
    assert redact_secrets(argv) == ["--password", R, "--password-stdin", "registry", "--token", R, "--lr", "1"]


# ------------------------------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize("token", TOKENS, ids=lambda t: t[:6])
def test_a_credential_known_by_its_shape_goes_wherever_it_stands(token):
    assert redact_text(token) == R
    assert redact_text(f"harmless_name={token} lr=0.1") == f"harmless_name={R} lr=0.1"
    assert redact_text(f"error: {token} was refused.") == f"error: {R} was refused."
    assert redact_text(f"https://example.com/hook/{token}?x=1") == f"https://example.com/hook/{R}?x=1"
    assert redact_text(f"https://example.com/p?q={token}&x=1") == f"https://example.com/p?q={R}&x=1"
    assert redact_text(f"{{'note': '{token}'}}") == f"{{'note': '{R}'}}"
    out = redact_secrets({token: 1, "nested": {"run": [f"x {token} y"]}, "model": "t5-small"})
    assert out == {R: 1, "nested": {"run": [f"x {R} y"]}, "model": "t5-small"}


def test_a_credential_under_a_secret_name_is_redacted_once():
    assert redact_text(f"HF_TOKEN={HUGGING_FACE} x=1") == f"HF_TOKEN={R} x=1"
    assert redact_text(f"Authorization: Bearer {JWT}") == f"Authorization: Bearer {R}"
    assert redact_text(f"https://{GITHUB['ghp_']}@github.com/o/r.git") == f"https://{R}@github.com/o/r.git"
    assert (
        redact_text(f"https://x-access-token:{GITHUB['ghs_']}@github.com/o")
        == f"https://x-access-token:{R}@github.com/o"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (PEM, f"-----BEGIN RSA PRIVATE KEY-----{R}-----END RSA PRIVATE KEY-----"),
        (
            f"a\n{PEM}\nb\n{PEM.replace('RSA ', 'OPENSSH ')}\nc",
            f"a\n-----BEGIN RSA PRIVATE KEY-----{R}-----END RSA PRIVATE KEY-----\nb\n"
            f"-----BEGIN OPENSSH PRIVATE KEY-----{R}-----END OPENSSH PRIVATE KEY-----\nc",
        ),
        # escaped in JSON or a repr, and under a secret name
        (
            '{"cert": "-----BEGIN ENCRYPTED PRIVATE KEY-----\\nMIIF\\n-----END ENCRYPTED PRIVATE KEY-----\\n"}',
            f'{{"cert": "-----BEGIN ENCRYPTED PRIVATE KEY-----{R}-----END ENCRYPTED PRIVATE KEY-----\\n"}}',
        ),
        ('{"private_key": "' + PEM.replace("\n", "\\n") + '"}', f'{{"private_key": "{R}"}}'),
        # cut off before its END line (a capped value): everything after the BEGIN line goes
        (f"key:\n-----BEGIN PRIVATE KEY-----\n{PEM_BODY}", f"key:\n-----BEGIN PRIVATE KEY-----{R}"),
        (
            "-----BEGIN PGP PRIVATE KEY BLOCK-----\nlQ\n-----END PGP PRIVATE KEY BLOCK-----",
            f"-----BEGIN PGP PRIVATE KEY BLOCK-----{R}-----END PGP PRIVATE KEY BLOCK-----",
        ),
    ],
)
def test_private_key_blocks_lose_their_body(text, expected):
    assert redact_text(text) == expected
    assert redact_text(expected) == expected


# --------------------------------------------------------------------------------------------- false positives

ORDINARY = [
    "3f786850e387550fdab836ed7d6dc881de23001b",  # a git commit
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",  # a sha256
    "123e4567-e89b-12d3-a456-426614174000",  # a UUID
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
    "data:application/json;base64,eyJhbGciOiJub25lIn0sInR5cCI6IkpXVCJ9",  # base64 JSON, not three parts
    "wandb/run-20241101_120000-abc123de/files/config.yaml",
    "lightning_logs/version_3/checkpoints/epoch=2-step=300.ckpt",
    "/home/me/.cache/huggingface/hub/models--bert-base-uncased/snapshots/86b5e0934494bd15c9632b12f734a8a67f723594",
    "sk-learn",
    "scikit-learn==1.5.2 skorch sk-learn-compatible-gradient-boosting-wrapper",
    "sk-resnet50-imagenet-finetuned-v2",
    "hf_hub",
    "hf_hub_download hf_transfer HF_HUB_ENABLE_HF_TRANSFER=1 hf_MyModelCheckpointV2",
    "ghp_ gho_short github_pat_",
    "xoxo-hugs-and-kisses xoxb-",
    "AKIA AKIATOOSHORT AKIAIOSFODNN7EXAMPLE2LONG ASIA-pacific",
    "model: sentence-transformers/all-MiniLM-L6-v2, tokenizer: openai/whisper-large-v3",
    "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----",
    "-----BEGIN PUBLIC KEY-----\nMIIB\n-----END PUBLIC KEY-----",
    "eyJhbGciOiJIUzI1NiJ9",  # a JWT header alone
    "zoo.hockeyJerseyClassifier.resnet50 monkeyJumpingDataset.train.v1",  # "eyJ" inside a word, dotted names
    "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 sk-abcdefghijklmnopqrstuvwxyz",  # long, but one kind of character
    "file.eyJ.json",
    "The run was killed: CUDA out of memory. Tried to allocate 2.00 GiB.",
]


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_values_that_look_a_little_like_credentials_stay(text):
    assert redact_text(text) == text
    assert redact_secrets({text: [text]}) == {text: [text]}
