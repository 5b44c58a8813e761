"""utilities.json_capped: a streamed JSON reader that keeps at most its limits, with markers for the rest."""

import io
import json
import random

import pytest

from lightning_memopt.utilities.json_capped import JSONLimits, JSONReadError, load_json_capped

UNLIMITED = JSONLimits(max_items=10**9, max_chars=10**9, max_depth=100, max_total_chars=10**12)


def _random_value(rng, depth=0):
    roll = rng.random()
    if depth > 4 or roll < 0.3:
        return rng.choice(
            [0, -1, 1.5, -2e-10, 12345678901234567890, True, False, None, "", "/", "\x01\x1f",
             'a"b\\c\n\t\u00e9\U0001f600\u202e', "x" * rng.randint(0, 50)]
        )  # fmt: skip
    if roll < 0.65:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    keys = ["k" + str(i) + rng.choice(["", "\u2603", '"q"']) for i in range(rng.randint(0, 5))]
    return {key: _random_value(rng, depth + 1) for key in keys}


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_within_its_limits_it_reads_what_json_reads_whatever_the_chunk_boundaries(chunk):
    rng = random.Random(chunk)
    for _ in range(300):
        value = _random_value(rng)
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=2)):
            assert load_json_capped(io.StringIO(text), UNLIMITED, chunk=chunk) == json.loads(text), text


@pytest.mark.parametrize("text", ["", "{not json", "[1,", "[1 2]", '{"a" 1}', '"abc', '"\\x"', "[1]]", "tru", '"\x01"'])
@pytest.mark.parametrize("chunk", [1, 1 << 20])
def test_what_json_refuses_it_refuses_with_the_line(text, chunk):
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(JSONReadError, match=r" at line 1$"):
        load_json_capped(io.StringIO(text), UNLIMITED, chunk=chunk)
    with pytest.raises(JSONReadError) as info:
        load_json_capped(io.StringIO('{"a":\n1,\n"b":\n' + text), UNLIMITED, chunk=chunk)
    assert info.value.lineno in (3, 4)


def test_long_values_are_cut_with_a_marker_saying_how_much_is_left_out():
    nested = {str(i): [i, {"a": ","}] for i in range(6)}  # commas inside items are no items of their own
    text = json.dumps({"list": list(range(10)), "text": "x" * 30, "deep": [[[[1, 2]]]], "map": nested})
    got = load_json_capped(io.StringIO(text), JSONLimits(max_items=4, max_chars=5, max_depth=3), chunk=4)
    assert got["list"] == [0, 1, 2, 3, "... (6 more items not shown)"]
    assert got["text"] == "xxxxx... (25 more characters not shown)"
    assert got["deep"] == [["... (nested deeper than 3 levels, not shown: 1 items)"]]
    assert list(got["map"]) == ["0", "1", "2", "3", "..."] and got["map"]["..."] == "... (2 more keys not shown)"
    # a document-wide budget: once spent, further strings keep nothing
    budget = load_json_capped(io.StringIO(json.dumps(["abcd", "efgh", "ijkl"])), JSONLimits(max_total_chars=6))
    assert budget == ["abcd", "ef... (2 more characters not shown)", "... (4 more characters not shown)"]


def test_absurd_numbers_and_non_standard_constants():
    got = load_json_capped(io.StringIO("[NaN, -Infinity, " + "9" * 5000 + "]"))
    assert got[1] == float("-inf") and got[0] != got[0]
    assert got[2].startswith("99999999999999999999... (a number of more than 1000 characters")
