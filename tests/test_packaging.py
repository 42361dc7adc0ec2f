"""The package's metadata, as a package index shows it: pyproject.toml's classifiers and
keywords."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parent.parent


def project() -> dict[str, Any]:
    """The ``[project]`` table of pyproject.toml."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        table: dict[str, Any] = tomllib.load(file)["project"]
    return table


def test_python_classifiers_start_at_requires_python() -> None:
    """The Python-version classifiers begin at the oldest version ``requires-python``
    admits and run on without a gap, each one admitted."""
    requires = re.fullmatch(r">=3\.(\d+)", project()["requires-python"])
    assert requires, "a lower bound alone, so the classifiers below can be checked"
    oldest = int(requires[1])
    minors = [
        int(match[1])
        for classifier in project()["classifiers"]
        if (match := re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", classifier))
    ]
    assert minors == list(range(oldest, oldest + len(minors)))
    assert len(minors) >= 4  # 3.10 to 3.13 at least
    assert "Programming Language :: Python :: 3 :: Only" in project()["classifiers"]


def test_classifiers_say_how_mature_and_are_sorted() -> None:
    """One Development Status; the license is the SPDX ``license`` field alone, since
    PEP 639 replaces the ``License ::`` classifiers (an index may refuse both)."""
    classifiers = project()["classifiers"]
    assert len([c for c in classifiers if c.startswith("Development Status :: ")]) == 1
    assert not [c for c in classifiers if c.startswith("License ::")]
    assert project()["license"] == "MIT"
    assert classifiers == sorted(classifiers)


def test_keywords_name_what_a_user_searches_for() -> None:
    """The keywords are there and name the library's job."""
    keywords = project()["keywords"]
    assert {"pytorch", "gradient accumulation"} <= set(keywords)
    assert len(keywords) == len(set(keywords))
