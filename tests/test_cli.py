"""The command line: the --gradient-accumulation-steps flag (a positive int, else
argparse's exit 2), and ``python -m gradaccum``'s usage and help."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

import gradaccum
from gradaccum import verify
from gradaccum.__main__ import main


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


# python -m gradaccum ------------------------------------------------------------------


def verify_options() -> list[argparse.Action]:
    """The options of verify's own parser."""
    own = verify.add_options(argparse.ArgumentParser(prog="verify"))
    return [action for action in own._actions if action.option_strings]


def every_option() -> set[str]:
    """Every option string of the top-level parser and of each command's."""
    from gradaccum.__main__ import parser

    top, commands = parser()
    return {
        name
        for command in (top, *commands.values())
        for action in command._actions
        for name in action.option_strings
    }


EVERY_OPTION = {"-h", "--help", "--steps", "--device", "--nproc", "--hsdp", "--wide", "--json"}


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_verify_and_all_its_options(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m gradaccum --help` exits 0; its usage names the verify command with every
    option verify's parser takes, and the help below describes each one."""
    with pytest.raises(SystemExit) as caught:
        main([flag])
    assert caught.value.code == 0
    usage, help_text = capsys.readouterr().out.split("\n\n", 1)
    assert usage.startswith("usage: python -m gradaccum [-h] COMMAND")
    assert "python -m gradaccum verify [-h]" in usage
    options = verify_options()
    names = {name for action in options for name in action.option_strings}
    assert {"--steps", "--device", "--nproc", "--hsdp", "--wide", "--json"} <= names
    for action in options:
        assert action.option_strings[0] in usage.split("verify", 1)[1], action
        for name in action.option_strings:
            assert name in help_text, name
        assert action.help is not None
        assert " ".join(action.help.split()[:3]) in " ".join(help_text.split())


def test_help_from_the_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real entry point: --help exits 0 on stdout and lists every option of the top
    level and of verify, pinned here; -h (here in this process, at the same width) prints
    the same."""
    width = {"COLUMNS": "100"}
    result = subprocess.run(
        [sys.executable, "-m", "gradaccum", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=os.environ | width,
    )
    assert every_option() == EVERY_OPTION  # a new option is added here, deliberately
    assert result.returncode == 0, result.stderr
    for name in EVERY_OPTION:
        assert name in result.stdout, name
    assert "{cpu,cuda}" not in result.stdout  # --device's choices are said in words
    assert "device type, cpu or cuda" in " ".join(result.stdout.split())
    monkeypatch.setenv("COLUMNS", width["COLUMNS"])
    with pytest.raises(SystemExit) as exited:
        main(["-h"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == result.stdout


@pytest.mark.parametrize("argv", [[], ["verfiy"], ["--steps", "4"]])
def test_unknown_or_missing_command_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """No command, or one that is not verify, exits 2 with the usage on stderr."""
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: python -m gradaccum [-h] COMMAND")
    assert "python -m gradaccum verify [-h]" in captured.err
    assert "error:" in captured.err


def test_verify_help_is_its_own_parser(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m gradaccum verify -h` prints verify's help, as its own parser does."""
    with pytest.raises(SystemExit) as caught:
        main(["verify", "-h"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m gradaccum verify [-h]")
    own = verify.add_options(
        argparse.ArgumentParser(prog="python -m gradaccum verify", description=verify.DESCRIPTION)
    )
    assert out == own.format_help()
