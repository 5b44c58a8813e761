"""Redaction runs in time linear in the text (issue 22, point 3): 1 MB of adversarial text well under a second.

The cases run in a fresh interpreter with a time-out, so that a quadratic pattern fails the test instead of
hanging it (the patterns this replaced took 4-17 s on ``"a." * 20000`` alone).
"""

import json

import pytest

from lightning_memopt.utilities.redaction import REDACTED, cap_text, redact_secrets, redact_text
from tests.helpers.subprocess_run import run_script

MB = 1_000_000
#: name -> Python expression of about 1 MB of text built to make a backtracking pattern slow.
CASES = {
    "dotted run": '"a." * 500_000',
    "one long name": '"a" * 1_000_000',
    "equals signs": '"=" * 1_000_000',
    "colons": '":" * 1_000_000',
    "quotes": '"\'" * 1_000_000',
    "escaped quotes": '"\\\\\'" * 500_000',
    "spaces": '" " * 1_000_000',
    "dashes": '"-" * 1_000_000',
    "schemes without @": '"a://" * 250_000',
    "schemes and @": '"://@" * 250_000',
    "at signs": '"a@" * 500_000',
    "secret words glued": '"key" * 333_333',
    "secret words spaced": '"key " * 250_000',
    "secret flags": '"--api-key " * 100_000',
    "many secrets": '"key=a " * 166_666',
    "unclosed quoted secrets": '"password=\'" * 100_000',
    "URLs with passwords": '"https://u:p@" * 80_000',
    "bearer words": '"bearer " * 140_000',
    "name/value records": '"name: DB_PASSWORD, value: x " * 35_000',
    # credentials by shape (release 0.2)
    "JWT starts": '"eyJ" * 333_333',
    "JWT without an end": '"eyJ" + "a" * 20 + "." + "b" * 999_000',
    "JWT parts": '(" eyJ" + "a" * 12 + "." + "b" * 40) * 17_000',
    "private-key headers": '"-----BEGIN PRIVATE KEY-----" * 37_000',
    "private-key blocks": '"-----BEGIN PRIVATE KEY-----x-----END PRIVATE KEY-----" * 18_000',
    "token prefixes": '"ghp_hf_sk-xoxb-" * 66_000',
    "token-like names": '("sk-" + "a" * 30 + " ") * 29_000',
    "AWS prefixes": '"AKIA" * 250_000',
    "secret flags glued": '"--password" * 100_000',
    "module names (180 KB x 6)": '(".".join(f"encoder.block.{i}.layer.0.SelfAttention.q" for i in range(4500))) * 6',
}
SCRIPT = """
import json, sys, time
from lightning_memopt.utilities.redaction import redact_text
cases = json.loads(sys.argv[1])
seconds = {}
for name, expression in cases.items():
    text = eval(expression)
    start = time.perf_counter()
    redact_text(text)
    seconds[name] = (len(text), time.perf_counter() - start)
print(json.dumps(seconds))
"""


@pytest.mark.parametrize(
    "chunk", [list(CASES)[:10], list(CASES)[10:19], list(CASES)[19:]], ids=["runs", "candidates", "shapes"]
)
def test_one_megabyte_of_adversarial_text_is_redacted_well_under_a_second(tmp_path, chunk):
    result = run_script(SCRIPT, tmp_path, timeout=300, args=(json.dumps({name: CASES[name] for name in chunk}),))
    assert result.returncode == 0, result.stderr
    seconds = json.loads(result.stdout.strip().splitlines()[-1])
    for name, (length, took) in seconds.items():
        assert length >= 0.95 * MB, name
        assert took < 1.0, (name, took)


def test_a_string_with_too_many_candidates_is_cut_not_scanned_forever():
    text = "key=a " * 30_000
    out = redact_text(text)
    assert "key=a" not in out and out.count(f"key={REDACTED}") == 20_000
    assert out.endswith(f"{REDACTED}...[{len(text) - 20_000 * 6} chars not scanned: more than 20000 candidates]")


def test_values_are_capped_with_a_visible_marker():
    text = "module." * 20_000  # 140,000 characters
    out = redact_secrets({"frozen": text, "nested": [text]})
    assert out["frozen"] == text[:65_536] + f"...[truncated {len(text) - 65_536} chars]"
    assert out["nested"] == [out["frozen"]]
    assert redact_secrets(out) == out  # a value cut once is not cut again
    assert redact_secrets({"x": "y" * 100}, max_chars=10) == {"x": "y" * 10 + "...[truncated 90 chars]"}
    assert cap_text("short") == "short"


def test_a_secret_across_the_cut_is_still_redacted():
    text = "x" * 65_530 + "password='hunter2-long-secret'" + "y" * 100_000
    out = redact_text(text, max_chars=65_536)
    assert "hunter" not in out and out.endswith(f"...[truncated {len(text) - 65_536} chars]")


def test_containers_are_capped_too():
    out = redact_secrets({"ids": list(range(25_000)), "table": {str(i): i for i in range(12_000)}})
    assert out["ids"][:3] == [0, 1, 2] and out["ids"][-1] == "...[truncated 15000 items]" and len(out["ids"]) == 10_001
    assert out["table"]["..."] == "[truncated 2000 items]" and len(out["table"]) == 10_001
