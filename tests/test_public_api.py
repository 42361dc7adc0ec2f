"""The public surface: pinned exports, executed docstring examples and README example."""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradaccum

ROOT = Path(__file__).resolve().parent.parent


def test_exports_are_pinned() -> None:
    """Adding or removing a public name is a deliberate change to this list."""
    assert gradaccum.__all__ == [
        "Accumulator",
        "ConfigError",
        "ConfigTypeError",
        "GlobalOrder",
        "GradaccumError",
        "GradaccumWarning",
        "NonFiniteError",
        "OutOfMemoryError",
        "RankFailedError",
        "Step",
        "SyncPolicy",
        "SyncStrategy",
        "UsageError",
        "__version__",
        "add_arguments",
        "interval",
        "loader_state",
        "no_sync",
        "random_state",
        "register_sync_strategy",
        "set_random_state",
        "steps_at_epoch",
        "steps_for",
        "steps_per_epoch",
        "total_steps",
    ]
    assert gradaccum.__all__ == sorted(gradaccum.__all__)
    for name in gradaccum.__all__:
        assert hasattr(gradaccum, name)


def test_testing_exports_are_pinned() -> None:
    """gradaccum.testing and its strategies have their own pinned, sorted lists."""
    import gradaccum.testing
    import gradaccum.testing.strategies

    assert gradaccum.testing.__all__ == [
        "AccumulationReport",
        "CollectiveCounter",
        "Counts",
        "DDPBucketCounter",
        "LaunchError",
        "check_accumulation",
        "expected_windows",
        "run_ranks",
    ]
    assert gradaccum.testing.strategies.__all__ == [
        "Epoch",
        "epoch_lengths",
        "epochs",
        "item_counts",
        "steps",
    ]
    for module in (gradaccum.testing, gradaccum.testing.strategies):
        assert module.__all__ == sorted(module.__all__)
        for name in module.__all__:
            assert hasattr(module, name)


def test_import_gradaccum_leaves_testing_and_hypothesis_out() -> None:
    """``import gradaccum`` stays torch + typing-extensions: gradaccum.testing is not
    imported, and hypothesis only by gradaccum.testing.strategies."""
    code = (
        "import sys, gradaccum; a = {'gradaccum.testing', 'hypothesis'} & set(sys.modules); "
        "import gradaccum.testing; b = 'hypothesis' in sys.modules; "
        "import gradaccum.testing.strategies; c = 'hypothesis' in sys.modules; "
        "print(sorted(a), b, c)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.split("\n")[-2] == "[] False True"


def test_errors_subclass_the_matching_builtins() -> None:
    """Callers can catch the library's errors or the builtin they already expect."""
    assert issubclass(gradaccum.ConfigError, ValueError)
    assert issubclass(gradaccum.ConfigTypeError, TypeError)
    assert issubclass(gradaccum.UsageError, RuntimeError)
    assert issubclass(gradaccum.NonFiniteError, FloatingPointError)
    assert issubclass(gradaccum.RankFailedError, RuntimeError)
    assert issubclass(gradaccum.OutOfMemoryError, RuntimeError)
    for error in (
        gradaccum.ConfigError,
        gradaccum.ConfigTypeError,
        gradaccum.UsageError,
        gradaccum.NonFiniteError,
        gradaccum.OutOfMemoryError,
        gradaccum.RankFailedError,
    ):
        assert issubclass(error, gradaccum.GradaccumError)


@pytest.mark.parametrize(
    "module",
    [
        *("accumulator", "checks", "cli", "errors", "faults", "misuse", "rng", "schedule"),
        "sync",
        *("testing.counting", "testing.equivalence", "testing.ranks", "testing.strategies"),
        "verify",
    ],
)
def test_docstring_examples_run(module: str) -> None:
    """Every `Examples:` section in the docstrings is executed and its output checked."""
    imported = importlib.import_module(f"gradaccum.{module}")
    globs = vars(imported) | {"torch": torch}
    failed, attempted = doctest.testmod(imported, globs=globs, raise_on_error=False, verbose=False)
    assert failed == 0
    if module.startswith("testing."):  # each part of gradaccum.testing shows itself
        assert attempted > 0


def test_torchdata_is_never_imported() -> None:
    """torchdata's StatefulDataLoader is recognised by its methods: no module of gradaccum
    imports torchdata (a test dependency only)."""
    for path in sorted((ROOT / "gradaccum").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not [name for name in names if name.split(".")[0] == "torchdata"], path


def test_readme_example_runs() -> None:
    """The README's user-loop example is a real, runnable program."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert blocks, "README.md has no python example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["acc"].global_step > 0


def test_readme_commands_are_what_ci_runs() -> None:
    """README's first two commands set up + verify and run the tests; .ci/run runs the latter."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, flags=re.DOTALL)
    setup, tests = commands[0].strip(), commands[1].strip()
    assert "torch==2.13.0" in setup
    assert "python -m gradaccum verify" in setup
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup in ci
    assert tests in ci


@pytest.mark.parametrize("steps", ["1", "4"])
def test_example_runs(steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/single_process.py trains, logs and checkpoints with the CLI flag."""
    spec = importlib.util.spec_from_file_location(
        "example", ROOT / "examples" / "single_process.py"
    )
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    loss = example.main(["--gradient-accumulation-steps", steps])
    out = capsys.readouterr().out
    assert "checkpoint of 0 bytes" not in out
    assert f"{gradaccum.total_steps(26, int(steps), 3)} optimizer steps" in out
    assert loss == loss  # not NaN: at least one window was logged
