"""The documentation site: every code block in docs/*.md runs, and the API page is whole.

Sybil runs the pages' code: it reads the fenced blocks of a Markdown file in order, in one
namespace per page, so a page can build its example up over several blocks the way a
reader follows it, and an HTML comment (``<!-- invisible-code-block: python -->``) can
hold setup a reader does not need to see. Its parsers run inside this pytest file, so the
pages are checked by the same command as the code, with no plugin and no separate
collection. A ``bash`` block is not run (it trains for minutes, or on several ranks); each
command in it must name files that exist and flags that its script defines. A ``text``
block is output, not code. A block in any other language fails, so nothing escapes both.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

import gradaccum
import gradaccum.testing

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
LANGUAGES = {"python", "bash", "text"}
FENCE = re.compile(r"^ *```(\S*)", flags=re.MULTILINE)


def _script_text(command: list[str]) -> tuple[Path, str] | None:
    """The file a command runs and the source its flags must come from (None: no script).

    A script's flags may come from `gradaccum.add_arguments` too.
    """
    cli = (ROOT / "gradaccum" / "cli.py").read_text(encoding="utf-8")
    if command[:3] == ["python", "-m", "gradaccum"]:
        main = ROOT / "gradaccum" / "__main__.py"
        return main, main.read_text() + (ROOT / "gradaccum" / "verify.py").read_text()
    for word in command:
        if word.endswith(".py"):
            path = ROOT / word
            assert path.is_file(), f"{word} does not exist"
            return path, path.read_text(encoding="utf-8") + cli
    return None


def check_commands(example: Example) -> None:
    """Each command names files that exist and flags its script defines."""
    source = example.parsed.replace("\\\n", " ")
    for line in source.splitlines():
        for part in line.split("&&"):
            command = shlex.split(part, comments=True)
            if not command:
                continue
            script = _script_text(command)
            if script is None:
                continue
            path, text = script
            after = command[command.index(path.name) + 1 :] if path.name in command else command
            for word in after:
                flag = word.split("=")[0]
                if flag.startswith("--"):
                    assert f'"{flag}"' in text, f"{path.name} defines no {flag} ({part.strip()})"


SYBIL = Sybil(
    parsers=[
        PythonCodeBlockParser(),
        CodeBlockParser(language="bash", evaluator=check_commands),
        SkipParser(),
    ],
)


def test_pages_exist() -> None:
    """The site's pages are found, so the test below cannot pass by running nothing."""
    assert len(PAGES) >= 10
    assert (DOCS / "index.md") in PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_code_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every python block of the page runs, in order, in one namespace; files it writes
    land in a temporary directory."""
    text = page.read_text(encoding="utf-8")
    languages = set(FENCE.findall(text)[::2])  # opening fences only
    assert languages <= LANGUAGES, f"{page.name}: blocks in {languages - LANGUAGES}"
    monkeypatch.chdir(tmp_path)
    document = SYBIL.parse(page)
    for example in document.examples():
        example.evaluate()


def test_api_page_documents_every_public_name() -> None:
    """api.md generates an entry for each name in gradaccum's and gradaccum.testing's
    `__all__`, and for nothing else."""
    documented = set(re.findall(r"^::: (gradaccum\.\S+)$", (DOCS / "api.md").read_text(), re.M))
    public = {f"gradaccum.{name}" for name in gradaccum.__all__ if name != "__version__"}
    testing = {f"gradaccum.testing.{name}" for name in gradaccum.testing.__all__}
    assert documented == public | testing | {"gradaccum.testing", "gradaccum.testing.strategies"}
