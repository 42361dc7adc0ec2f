"""The --gradient-accumulation-steps flag: parsed as a positive int, else argparse exit 2."""

from __future__ import annotations

import argparse

import pytest

import gradaccum


def parser() -> argparse.ArgumentParser:
    return gradaccum.add_arguments(argparse.ArgumentParser(prog="train"))


@pytest.mark.parametrize(
    ("argv", "expected"), [([], 1), (["--gradient-accumulation-steps", "4"], 4)]
)
def test_flag_parses_positive_ints(argv: list[str], expected: int) -> None:
    """The default is 1 (no accumulation); a positive value is taken as given."""
    assert parser().parse_args(argv).gradient_accumulation_steps == expected


@pytest.mark.parametrize("value", ["0", "-3", "2.5", "abc", "True"])
def test_flag_refuses_with_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad values exit with argparse's status 2 and a message naming flag and value."""
    with pytest.raises(SystemExit) as caught:
        parser().parse_args([f"--gradient-accumulation-steps={value}"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "--gradient-accumulation-steps" in err
    assert f"got '{value}'" in err
    assert "pass 1 for no accumulation" in err


def test_flag_goes_into_an_argument_group() -> None:
    """Trainers that group their flags can add it to a group."""
    top = argparse.ArgumentParser()
    group = top.add_argument_group("training")
    assert gradaccum.add_arguments(group) is group
    assert top.parse_args(["--gradient-accumulation-steps", "8"]).gradient_accumulation_steps == 8
