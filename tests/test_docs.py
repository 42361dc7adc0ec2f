"""The documentation site: every code block in docs/*.md runs and fits a 1280-pixel window,
and the API page is whole and shows what a user handles.

Sybil runs the pages' code: it reads the fenced blocks of a Markdown file in order, in one
namespace per page, so a page can build its example up over several blocks the way a
reader follows it, and an HTML comment (``<!-- invisible-code-block: python -->``) can
hold setup a reader does not need to see. Its parsers run inside this pytest file, so the
pages are checked by the same command as the code, with no plugin and no separate
collection. A ``bash`` block is not run (it trains for minutes, or on several ranks); each
command in it must name files that exist and flags that its script defines. A ``text``
block is output, not code. A block in any other language fails, so nothing escapes both.

A ``python`` block whose lines are all pymdownx snippet includes (``--8<-- "path"``) shows
a whole file on the site, which the build pastes in. Sybil sees only the include line, and
running the file here would not do either: a torchrun script needs its ranks. So such a
block is checked, not run: each path must be a file under ``examples/`` that a test under
``tests/`` names (a test that runs it, as ``tests/test_distributed.py`` launches
``examples/distributed.py`` under torchrun). That keeps the shown code tested without a
``skip`` marker, which would also hide a block that should run. ``ruff format`` formats
python blocks in Markdown and would rewrite an include into ``--8 < --"path"``, so such a
block sits between ``<!-- fmt: off -->`` and ``<!-- fmt: on -->``; a rewritten one is no
longer an include, runs as python here, and fails.
"""

from __future__ import annotations

import ast
import html
import math
import os
import re
import shlex
import subprocess
import sys
import unittest
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch.distributed as dist
from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

import gradaccum
import gradaccum.testing
from gradaccum import verify

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
LANGUAGES = {"python", "bash", "text"}
FENCE = re.compile(r"^ *```(\S*)", flags=re.MULTILINE)


def _script_text(command: list[str]) -> tuple[list[str], str] | None:
    """The script's arguments and the source their flags must come from (None: the command
    runs no script of ours). A script's flags may come from `gradaccum.add_arguments` too.
    """
    cli = (ROOT / "gradaccum" / "cli.py").read_text(encoding="utf-8")
    if command[:3] == ["python", "-m", "gradaccum"]:
        sources = [ROOT / "gradaccum" / "__main__.py", ROOT / "gradaccum" / "verify.py"]
        return command[3:], "".join(path.read_text(encoding="utf-8") for path in sources)
    for index, word in enumerate(command):
        if word.endswith(".py"):
            path = ROOT / word
            assert path.is_file(), f"{word} does not exist"
            return command[index + 1 :], path.read_text(encoding="utf-8") + cli
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
            arguments, text = script
            for word in arguments:
                flag = word.split("=")[0]
                if flag.startswith("--"):
                    assert f'"{flag}"' in text, f"{part.strip()}: the script defines no {flag}"


SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')


def snippet_paths(source: str) -> list[str]:
    """The files a block includes, when every line of it is a snippet include; else []."""
    lines = [line.strip() for line in source.splitlines() if line.strip()]
    matches = [SNIPPET.match(line) for line in lines]
    return [m[1] for m in matches if m] if lines and all(matches) else []


def check_snippets(example: Example) -> None:
    """Each included file exists under examples/ and a test file names it (and runs it)."""
    tests = [path.read_text(encoding="utf-8") for path in (ROOT / "tests").glob("test_*.py")]
    named = "\n".join(tests).replace('" / "', "/")  # ROOT / "examples" / "x.py" names x.py
    for path in snippet_paths(str(example.parsed)):
        assert (ROOT / path).is_file(), f"{path} does not exist"
        assert path.startswith("examples/"), f"{path}: only examples, which tests run, are shown"
        assert path in named, f"{path} is shown but no test under tests/ names it"


class PythonOrSnippetParser:
    """Python blocks, run; those made only of snippet includes, checked by `check_snippets`."""

    def __init__(self) -> None:
        self.python = PythonCodeBlockParser()

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self.python(document):
            if isinstance(region.parsed, str) and snippet_paths(region.parsed):
                region.evaluator = check_snippets
            yield region


SYBIL = Sybil(
    parsers=[
        PythonOrSnippetParser(),
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
    """Every python block of the page runs, in order, in one namespace, except one that a
    ``skip: next "reason"`` comment marks; files it writes land in a temporary directory."""
    text = page.read_text(encoding="utf-8")
    languages = set(FENCE.findall(text)[::2])  # opening fences only
    assert languages <= LANGUAGES, f"{page.name}: blocks in {languages - LANGUAGES}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # a page may add its example's folder
    document = SYBIL.parse(page)
    try:
        for example in document.examples():
            try:
                example.evaluate()
            except unittest.SkipTest:  # `<!-- skip: next "reason" -->`: that block only
                continue
    finally:  # a page that failed before its own teardown leaves no group to later tests
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_snippet_block_is_checked_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A python block of only snippet includes passes when it shows a tested example, and
    fails when the file is missing, is not an example, or no test names it; a block with
    code besides an include still runs as python."""
    page = tmp_path / "page.md"
    for include, error in [
        ('--8<-- "examples/distributed.py"', None),
        ('--8<-- "examples/missing.py"', "does not exist"),
        ('--8<-- "gradaccum/cli.py"', "only examples"),
    ]:
        page.write_text(f"```python\n{include}\n```\n", encoding="utf-8")
        (example,) = SYBIL.parse(page).examples()
        if error is None:
            example.evaluate()
        else:
            with pytest.raises(AssertionError, match=error):
                example.evaluate()
    page.write_text('```python\n--8<-- "examples/distributed.py"\nx = 1\n```\n')
    (example,) = SYBIL.parse(page).examples()
    with pytest.raises(TypeError, match="unary -"):  # run as python: -(-8 < -"path")
        example.evaluate()
    root = tmp_path / "root"
    (root / "examples").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "examples" / "untested.py").write_text("print()\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", root)
    page.write_text('```python\n--8<-- "examples/untested.py"\n```\n')
    (example,) = SYBIL.parse(page).examples()
    with pytest.raises(AssertionError, match="no test under tests/ names it"):
        example.evaluate()


def test_api_page_documents_every_public_name() -> None:
    """api.md generates an entry for each name in gradaccum's and gradaccum.testing's
    `__all__`, and for nothing else."""
    documented = set(re.findall(r"^::: (gradaccum\.\S+)$", (DOCS / "api.md").read_text(), re.M))
    public = {f"gradaccum.{name}" for name in gradaccum.__all__ if name != "__version__"}
    testing = {f"gradaccum.testing.{name}" for name in gradaccum.testing.__all__}
    assert documented == public | testing | {"gradaccum.testing", "gradaccum.testing.strategies"}


# mkdocs-material's layout at a 1280-pixel window, in rem (20 px there): the left sidebar
# and the content's margins; code is 0.85em of the 0.8rem text, padded 1.1765em each side.
# A monospace glyph is 0.6em wide in Roboto Mono, 0.602em in DejaVu Sans Mono (the
# fallback offline). The grid's width is docs/stylesheets/extra.css's.
SIDEBAR_REM, MARGINS_REM, CODE_REM, PADDING_EM, GLYPH_EM = 12.1, 1.2 + 0.8, 0.68, 1.1765, 0.602
WINDOW_PX, REM_PX, SCROLLBAR_PX = 1280, 20, 17
STYLESHEET = DOCS / "stylesheets" / "extra.css"
BLOCK = re.compile(r"^( *)```(\w+)\n(.*?)^\1```", flags=re.MULTILINE | re.DOTALL)


def code_columns(font_rem: float) -> int:
    """Columns of monospace a code block shows without scrolling at a 1280-pixel window."""
    css = STYLESHEET.read_text(encoding="utf-8")
    grid = re.search(r"\.md-grid \{\s*max-width: ([\d.]+)rem;", css)
    assert grid, "extra.css sets the grid's width"
    assert float(grid[1]) * REM_PX <= WINDOW_PX - SCROLLBAR_PX  # the window is wider
    box = float(grid[1]) - SIDEBAR_REM - MARGINS_REM
    return math.floor((box - 2 * PADDING_EM * font_rem) / (GLYPH_EM * font_rem))


def test_code_fits_a_1280_pixel_window() -> None:
    """Every code block shows whole at a 1280-pixel window, with no sideways scrolling,
    by what this pins (a browser measured it when it was set up; CI has none): the table
    of contents in the left sidebar, so the content area is wider; the stylesheet, which
    wraps program output; every python and bash line (files a page includes too) within
    the columns of code, and every line of output in columns, which a wrap would break
    (the verify table), within the columns of output's smaller type."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^    - toc\.integrate$", config, flags=re.MULTILINE)
    assert re.search(r"^extra_css:\n  - stylesheets/extra\.css$", config, flags=re.MULTILINE)
    assert "pygments_lang_class: true" in config  # the language-text class extra.css wraps
    css = STYLESHEET.read_text(encoding="utf-8")
    output = re.search(r"\.language-text pre > code \{([^}]*)\}", css)
    assert output, "extra.css styles the text blocks"
    assert "white-space: pre-wrap;" in output[1]
    font = re.search(r"font-size: ([\d.]+)rem;", output[1])
    assert font, "the output's type size, in rem"
    code, text = code_columns(CODE_REM), code_columns(float(font[1]))
    assert (code, text) == (110, 117)  # what the browser showed; a change is deliberate
    ruff = re.search(r"^line-length = (\d+)$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert ruff, "pyproject.toml sets ruff's line length"
    assert int(ruff[1]) <= code  # docstring examples on the API page; the examples
    assert text >= verify.WIDTH  # its table, wherever a page shows it
    too_long, blocks = [], 0
    for page in PAGES:
        for indent, language, body in BLOCK.findall(page.read_text(encoding="utf-8")):
            blocks += 1
            lines = [line.removeprefix(indent) for line in body.splitlines()]
            for path in snippet_paths(body) if language == "python" else []:
                lines += (ROOT / path).read_text(encoding="utf-8").splitlines()
            if language == "text":
                limit = text
                lines = [line for line in lines if re.search(r"\S {2,}\S", line)]
            else:
                limit = code
            too_long += [f"{page.name}: {line}" for line in lines if len(line) > limit]
    assert blocks == sum(len(FENCE.findall(page.read_text())) // 2 for page in PAGES)
    assert too_long == []


def test_getting_started_installs_with_readmes_command() -> None:
    """Getting started's install block, broken over lines to fit the page, is README's
    setup command, which .ci/run runs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    setup = re.findall(r"```bash\n(.*?)```", readme, flags=re.DOTALL)[0]
    install = re.findall(r"```bash\n(.*?)```", index, flags=re.DOTALL)[0]
    assert " ".join(install.replace("\\\n", " ").split()) == " ".join(setup.split())


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site, built once for this file's tests (a second or two)."""
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra builds the site")
    directory = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", str(directory)],
        cwd=ROOT,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
        check=True,
        timeout=120,
    )
    return directory


def test_api_page_shows_step_fields_not_its_constructor(site: Path) -> None:
    """The built API page's `Step` entry lists its fields, each with its type, and not the
    accumulator's internal constructor: no signature, no ``losses`` or ``divisor``."""
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    entry = page.split('<h2 id="gradaccum.Step"')[1].split("<h2 ")[0]
    assert "doc-signature" not in entry.split("doc-contents")[0]  # the class's own
    text = html.unescape(re.sub(r"<[^>]+>", " ", entry))
    assert not re.search(r"\b(losses\s*[:=]|divisor)", text), text
    table = entry.split("Attributes:")[1].split("</table>")[0]
    rows = {
        name: " ".join(html.unescape(re.sub(r"<[^>]+>", " ", kind)).split())
        for name, kind in re.findall(
            r'<tr class="doc-section-item">\s*<td><code>(?:<[^>]+>)*(\w+).*?</td>\s*<td>(.*?)</td>',
            table,
            flags=re.DOTALL,
        )
    }
    assert {
        "boundary": "bool",
        "global_step": "int",
        "loss": "Tensor | None",
        "grad_norm": "Tensor | None",
        "lr": "float | Tensor | None",
        "skipped": "bool",
    }.items() <= rows.items()
    assert all(rows.values()), f"fields without a type: {rows}"


def _warning_texts() -> list[str]:
    """Each warning's first literal text in gradaccum's source: the message of every
    ``warn(...)`` call, and for the ranks' length check, the text its callers pass to
    ``agree()`` (its ``warn`` formats that text). Calls that pass a message made elsewhere
    (``warn(message)`` in errors.py, the ranks' formatted text) hold no literal."""
    texts = []
    for path in sorted((ROOT / "gradaccum").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not isinstance(
                node.func, (ast.Name, ast.Attribute)
            ):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            message = node.args[0] if name == "warn" else node.args[1] if name == "agree" else None
            if isinstance(message, ast.JoinedStr):  # a value stands in as "{}"
                texts.append("".join(_literal(part) for part in message.values).strip())
            elif message is not None:
                texts.append(_literal(message).strip())
    return [text for text in texts if text.strip("{} ")]


def _literal(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return "{}"


def _skeleton(text: str) -> list[str]:
    """The first six words that are not a value: ``{}`` in the source, a one-letter
    stand-in (``k``, ``N``) or ``…`` in a heading; one-letter words drop on both sides."""
    words = [word.strip(",.;:()") for word in text.split()]
    return [word for word in words if "{" not in word and len(word) > 1][:6]


def test_faq_lists_every_warning() -> None:
    """Each warning in the source has its own heading on the FAQ page, quoting its start
    (its first words),
    and the page lists no warning that the source no longer emits."""
    faq = (DOCS / "faq.md").read_text(encoding="utf-8")
    headings = re.findall(r'^### "(.+)"$', faq.split("## Warnings")[1].split("\n## ")[0], re.M)
    texts = _warning_texts()
    assert len(texts) == len(headings) == 14, (texts, headings)
    for text in texts:
        matches = [_skeleton(heading) == _skeleton(text) for heading in headings]
        assert matches.count(True) == 1, text


@pytest.mark.parametrize(
    ("command", "complaint"),
    [
        ("python examples/resume.py --no-such-flag", "defines no --no-such-flag"),
        ("torchrun --nproc_per_node 2 examples/missing.py", "does not exist"),
        ("torchrun --nproc_per_node 2 examples/distributed.py --wrapp ddp", "defines no --wrapp"),
        ("python -m gradaccum verify --stepz 4", "defines no --stepz"),
    ],
)
def test_a_bash_block_with_a_wrong_command_fails(command: str, complaint: str) -> None:
    """The check of ``bash`` blocks catches a renamed flag or a moved script."""

    class Block:
        parsed = command

    with pytest.raises(AssertionError, match=complaint):
        check_commands(Block())  # type: ignore[arg-type]


def test_a_launchers_own_flags_are_not_the_scripts() -> None:
    """torchrun's flags before the script are not checked against the script."""

    class Block:
        parsed = "torchrun --nproc_per_node 2 examples/distributed.py --wrap fully_shard"

    check_commands(Block())  # type: ignore[arg-type]
