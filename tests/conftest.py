"""Hypothesis profiles: the default one runs in CI; ``--hypothesis-profile=long`` runs
many more examples (hours, for a soak before a release)."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("long", max_examples=50_000, deadline=None)
