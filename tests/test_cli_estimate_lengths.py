"""``lightning-memopt estimate --lengths FILE``: the largest batch per length bucket for a budget, from the command
line, and the one-line errors of its flags."""

from __future__ import annotations

import re

import pytest
from torch import nn

from lightning_memopt.cli import main
from lightning_memopt.cli_estimate.lengths import parse_buckets, read_lengths


class TokenModel(nn.Module):
    """Token ids in, a mean over a vocabulary's logits out: memory grows with the batch and the length."""

    def __init__(self, vocab: int = 64, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids, more=None):
        out = self.head(self.embed(ids)).mean()
        return out if more is None else out + self.head(self.embed(more)).mean()


MODEL = f"{__name__}.TokenModel"


def _run(capsys, *argv):
    code = main(["estimate", "--model", MODEL, "--device", "cpu", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _lengths(tmp_path, lines):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_table_for_the_lengths_of_a_file(tmp_path, capsys):
    path = _lengths(tmp_path, ["# lengths of the training set", *[str(8 + 7 * i) for i in range(40)], ""])
    code, out, err = _run(
        capsys, "--batch-shape", "B,L:int64", "--lengths", path, "--length-buckets", "32,128,281",
        "--device-memory", "4MB",
    )  # fmt: skip
    assert code == 0, err
    sizes = [int(m) for m in re.findall(r"^\s+(?:32|128|281)\s+(\d+)", out, re.MULTILINE)]
    assert len(sizes) == 3 and sizes[0] > sizes[1] > sizes[2] > 0
    assert "budget = {32: " in out and "TokenBudgetBatchSampler(lengths, budget=budget)" in out
    assert "lengths (32,): largest batch" in err  # a progress line per bucket


def test_two_axes_and_buckets_from_the_quantiles(tmp_path, capsys):
    path = _lengths(tmp_path, [f"{8 * (i % 9 + 1)},{4 * (i % 5 + 1)}" for i in range(45)])
    code, out, err = _run(
        capsys, "--batch-shape", "ids=B,L0:int64", "--batch-shape", "more=B,L1:int64", "--lengths", path,
        "--length-buckets", "4", "--device-memory", "4MB",
    )  # fmt: skip
    assert code == 0, err
    [line] = [line for line in out.splitlines() if line.startswith("budget = ")]
    table = eval(line.removeprefix("budget = "))  # the line pastes as Python: tuple keys, one length per axis
    assert len(table) == 4 and all(len(key) == 2 and size > 0 for key, size in table.items())


BUDGET = ["--device-memory", "4MB"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-shape", "B,L:int64", *BUDGET], "needs --lengths FILE"),
        (["--batch-shape", "B,16:int64", "--lengths", "FILE", *BUDGET], "no --batch-shape dimension is a length"),
        (["--batch-shape", "B,L:int64", "--lengths", "FILE"], "needs a budget"),
        (["--batch-shape", "B,L1:int64", "--lengths", "FILE", *BUDGET], "L1 but --lengths has 1"),
        (["--batch-shape", "B,L:int64", "--length-buckets", "4", "--batch-size", "2"], "needs --lengths FILE"),
        (
            ["--batch-shape", "B,L:int64", "--lengths", "FILE", "--length-buckets", "a,b", *BUDGET],
            "--length-buckets: 'a,b' is neither a count",
        ),
    ],
)
def test_each_flag_misused_is_named_in_one_line(tmp_path, capsys, argv, message):
    path = _lengths(tmp_path, ["12", "30"])
    code, _, err = _run(capsys, *[path if a == "FILE" else a for a in argv])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_line_of_the_lengths_file_is_named(tmp_path):
    with pytest.raises(Exception, match=r"line 3: '12,x' is not 1 positive int"):
        read_lengths(_lengths(tmp_path, ["", "7", "12,x"]))
    with pytest.raises(Exception, match=r"line 2: '5' is not 2 positive int"):
        read_lengths(_lengths(tmp_path, ["3,4", "5"]))
    with pytest.raises(Exception, match="holds no sample"):
        read_lengths(_lengths(tmp_path, ["# nothing"]))
    assert parse_buckets(None) == 16
