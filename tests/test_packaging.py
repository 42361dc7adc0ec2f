"""The package's metadata, as a package index shows it: pyproject.toml's classifiers and
keywords, and the long description (PYPI.md), which is written for the index and kept in
step with README.md, the repository's page."""

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


def long_description() -> str:
    """The text the index shows, from the file pyproject.toml's ``readme`` names."""
    return (ROOT / project()["readme"]["file"]).read_text(encoding="utf-8")


# A Markdown link or image, inline (``[text](target)``) or a reference definition
# (``[name]: target``), and an HTML href/src: the target, whatever the form.
LINK = re.compile(
    r"\]\(\s*<?([^)\s>]+)|^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)|(?:href|src)=\"([^\"]+)", re.M
)


def link_targets(text: str) -> list[str]:
    """Every link target in ``text``."""
    return ["".join(match) for match in LINK.findall(text)]


def test_link_targets_finds_every_form() -> None:
    """The link finder sees inline links, images, reference definitions and HTML, so the
    test below cannot pass by missing one."""
    text = (
        '[a](docs/a.md) ![b](docs/images/b.png "b") <a href="c.html">c</a>\n'
        "[d]: d.md\n[e](https://example.org) [f](#top)\n"
    )
    assert link_targets(text) == [
        "docs/a.md",
        "docs/images/b.png",
        "c.html",
        "d.md",
        "https://example.org",
        "#top",
    ]


def test_long_description_is_markdown_without_relative_links() -> None:
    """The index renders the text as Markdown, and nothing in it points at a file of the
    repository: on an index a relative link resolves nowhere. The package is not
    published, so the text says so and installs from a clone; it offers no
    ``pip install gradaccum`` to run (change this test with the first release)."""
    assert project()["readme"]["content-type"] == "text/markdown"
    text = long_description()
    relative = [t for t in link_targets(text) if not re.match(r"https?://|#", t)]
    assert relative == []
    assert "not published on the package index yet" in text
    assert "pip install -e .   # in the clone's folder" in text
    assert "\npip install gradaccum" not in text


def test_long_description_keeps_step_with_the_readme() -> None:
    """The index text says what README.md says: the same opening paragraph, the same
    example (which tests/test_public_api.py runs), the same feature list, and every page
    of the documentation by the title mkdocs.yml gives it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    text = long_description()
    lead = next(part for part in readme.split("\n\n") if part.startswith("gradaccum turns"))
    assert f"\n\n{lead}\n\n" in text

    def python_blocks(markdown: str) -> list[str]:
        return re.findall(r"```python\n(.*?)```", markdown, flags=re.DOTALL)

    assert python_blocks(text) == python_blocks(readme)[:1]

    def features(markdown: str) -> list[str]:
        return re.findall(r"^- \*\*(.+?)\*\*", markdown, flags=re.M)

    assert features(text) == features(readme)
    assert len(features(text)) >= 6
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    titles = re.findall(r"^ +- ([^:]+): \S+\.md$", nav, flags=re.M)
    assert len(titles) >= 10
    flowing = " ".join(text.split())  # a title may break over two lines
    assert [title for title in titles if title not in flowing] == []


def test_source_distribution_holds_what_the_long_description_names() -> None:
    """The text sends the reader to the source distribution for the docs, tests, examples
    and changelog; hatch's sdist includes each, and mkdocs.yml, to build the site."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["hatch"][
        "build"
    ]["targets"]["sdist"]["include"]
    readme = project()["readme"]["file"]
    wanted = {"docs", "mkdocs.yml", "tests", "examples", "benchmarks", "CHANGELOG.md", readme}
    assert wanted <= set(include)
