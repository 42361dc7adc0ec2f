"""The suite's own settings: nothing fails for load alone."""

from __future__ import annotations

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
