"""The suite's own settings: nothing fails for load alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings


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
