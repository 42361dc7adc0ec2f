"""The suite's own settings: nothing fails for load alone."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

from tests import test_state_machine
from tests.tiers import QUICK, SLOW


def test_default_profile_is_unhurried() -> None:
    """The profile every test runs under has no deadline and no ``too_slow`` health check:
    on a loaded 2-core machine, generating one input can take a second."""
    assert settings.default.deadline is None
    assert HealthCheck.too_slow in settings.default.suppress_health_check


def test_long_profile_is_unhurried_too() -> None:
    """The soak profile asks for more examples, with the same leniency."""
    long = settings.get_profile("long")
    assert long.max_examples == 50_000
    assert long.deadline is None
    assert HealthCheck.too_slow in long.suppress_health_check


def test_quick_profile_is_unhurried_too() -> None:
    """The quick tier's profile (``--hypothesis-profile=quick``, for development) asks for
    fewer examples, with the same leniency; the default profile keeps its count."""
    quick = settings.get_profile("quick")
    assert quick.max_examples == 10 < settings.get_profile("default").max_examples
    assert quick.deadline is None
    assert HealthCheck.too_slow in quick.suppress_health_check


SLOW_PROPERTY = """
import time

from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule


@settings(max_examples=10_000)
@given(st.integers())
def test_property(x):
    time.sleep(0.02)


class Machine(RuleBasedStateMachine):
    @rule(x=st.integers())
    def step(self, x):
        time.sleep(0.02)


Machine.TestCase.settings = settings(max_examples=10_000)
TestMachine = Machine.TestCase
"""


def test_a_time_limit_that_fires_says_the_machine_was_too_slow(tmp_path: Path) -> None:
    """A property and a state machine cut off by their time limit fail with how long they
    waited and the machine's load; hypothesis neither replays the example nor calls the
    test flaky (pytest-timeout's own failure is an exception hypothesis catches)."""
    (tmp_path / "test_slow.py").write_text(SLOW_PROPERTY)
    root = Path(__file__).resolve().parent.parent
    pytest_options = ["-q", "-p", "tests.timeouts", "--timeout=1", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_options, "test_slow.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "2 failed" in out, out
    for test in ("test_property", "TestMachine::runTest"):
        assert (
            f"MachineTooSlow: test_slow.py::{test} waited 1 s of wall clock, past its 1 s limit"
            in out
        ), out
    assert "the machine was too slow (load average" in out, out
    for replayed in ("Flaky", "Inconsistent", "Unreliable", "Falsifying"):
        assert replayed not in out, out


def module_tests(path: Path) -> set[str]:
    """The names of ``path``'s tests: its ``test_*`` functions and ``Test*`` classes (and
    the state machine's chunks, classes it makes in a loop)."""
    tree = ast.parse(path.read_text())
    chunks = {name for name in vars(test_state_machine) if name.startswith("TestChunk")}
    return (
        (chunks if path.name == "test_state_machine.py" else set())
        | {
            node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and node.name.startswith(("test_", "Test"))
        }
        | {
            target.id  # TestMachine = Machine.TestCase
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name) and target.id.startswith("Test")
        }
    )


def named_in(entries: tuple[str, ...], *, whole: bool = False) -> dict[str, set[str]]:
    """The tests each entry names, by module (an empty name: the whole module); with
    ``whole``, only the entries that name all of a test's cases."""
    named: dict[str, set[str]] = {}
    for entry in entries:
        module, _, rest = entry.partition("::")
        if not (whole and "[" in rest):
            named.setdefault(module, set()).add(re.split(r"[\[:]", rest)[0])
    return named


def test_the_quick_tier_runs_every_module() -> None:
    """``-m "not slow"`` leaves no test module out: each has a test that `SLOW` does not
    name, or that `QUICK` keeps; and each name in them begins the name of a test that
    exists (a renamed test is not left in the quick tier unnoticed)."""
    root = Path(__file__).resolve().parent.parent
    slow, quick, wholly_slow = named_in(SLOW), named_in(QUICK), named_in(SLOW, whole=True)
    modules = {f"tests/{path.name}": module_tests(path) for path in root.glob("tests/test_*.py")}
    assert len(modules) > 50
    assert set(slow) | set(quick) <= set(modules)
    for module, tests in modules.items():
        prefixes = tuple(wholly_slow.get(module, ()))
        left = {test for test in tests if not test.startswith(prefixes)}
        assert left | quick.get(module, set()), f"{module}: the quick tier runs none of it"
        for name in (slow.get(module, set()) - {""}) | quick.get(module, set()):
            assert any(test.startswith(name) for test in tests), (module, name)
