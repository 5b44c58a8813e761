"""``lightning-memopt``: a hint for a repeated flag given several values, and a description in each ``--help``."""

from __future__ import annotations

import pytest

from lightning_memopt.cli import main
from tests.test_cli_estimate import TINY

ERROR = "lightning-memopt estimate: error: "


@pytest.mark.parametrize(
    ("given", "values"),
    [
        (["--batch-shape", "B,16", "B,16"], ["B,16", "B,16"]),
        (["--batch-shape", "B,16", "B,16", "--model.width", "16"], ["B,16", "B,16"]),
        (["--batch-shape=x=B,16", "y=B,16:int64", "B"], ["x=B,16", "y=B,16:int64", "B"]),
        (["--batch-shape", "B,16", "--batch-shape", "B,16", "B,16"], ["B,16", "B,16"]),
    ],
)
def test_several_values_after_one_batch_shape_say_to_repeat_the_flag(given, values, capsys):
    assert main(["estimate", "--model", TINY, "--batch-size", "2", *given]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(ERROR), err
    assert f"`--batch-shape` takes one value per flag, got {len(values)} after one --batch-shape" in err
    repeated = " ".join(f"--batch-shape {v}" for v in values)
    assert err.endswith(f"repeat the flag for each: {repeated}\n"), err


def test_several_configs_after_one_flag_say_to_repeat_it(tmp_path, capsys):
    assert main(["estimate", "--config", "a.yaml", "b.yaml", "--model", TINY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "repeat the flag for each: --config a.yaml --config b.yaml" in err, err


def test_the_repeated_flag_with_overrides_still_estimates(capsys):
    given = ["--batch-shape", "B,16", "--batch-shape", "B,16", "--model.width", "16", "--batch-size", "2"]
    assert main(["estimate", "--model", TINY, *given]) == 0, capsys.readouterr().err
    assert "repeat the flag" not in capsys.readouterr().err


def test_a_stray_value_elsewhere_is_still_an_unrecognized_argument(capsys):
    assert main(["estimate", "--model", TINY, "--batch-shape", "B,16", "--model.width", "16", "17"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized argument '17'" in err and "repeat the flag" not in err, err


def _help(command: str, capsys) -> list[str]:
    """The blocks of ``command --help`` between blank lines."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out.split("\n\n")


@pytest.mark.parametrize("command", ["analyze", "report", "estimate"])
def test_every_subcommand_help_has_a_description(command, capsys):
    blocks = _help(command, capsys)
    assert blocks[0].startswith(f"usage: lightning-memopt {command}")
    description = blocks[1]
    assert not description.startswith(("positional arguments:", "options:")), blocks[:2]
    assert len(" ".join(description.split())) > 150, description


def test_report_help_says_what_it_prints_and_what_a_directory_means(capsys):
    text = " ".join(" ".join(_help("report", capsys)).split())
    for words in (
        "Print an out-of-memory report written by OOMReporter (oom_report_rank*.json) as Markdown",
        "each stands for the newest report of each rank in it",
        "the printed Markdown is cut at 4 million characters",
        "exit codes: 0 printed; 2 bad input",
    ):
        assert words in text


@pytest.mark.parametrize(
    ("section", "key", "shown"),
    [
        ({"class_path": "pkg.Model", "init_args": [1, 2]}, "init_args", "[1, 2]"),
        ({"class_path": "pkg.Model", "init_args": {"width": 8}, "dict_kwargs": "width=8"}, "dict_kwargs", "'width=8'"),
    ],
)
def test_a_config_section_whose_arguments_are_not_a_mapping_is_refused_naming_it(section, key, shown):
    from lightning_memopt.cli_estimate import EstimateInputError
    from lightning_memopt.cli_estimate.config import class_spec

    with pytest.raises(EstimateInputError) as raised:
        class_spec(section, "model")
    assert str(raised.value) == f"model.{key}: must be a mapping, got {shown}."
