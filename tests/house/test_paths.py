"""Every repository path the documentation and the code's comments name exists.

Read: the front page and ``docs/*.md``, the other READMEs, and the docstrings and comments
(never other strings) of the ``*.py`` files. A repository path is a token that starts with
one of the repository's top-level folders and ends in a file extension or ``/`` (or is quoted
whole in backticks, as ``.ci/run`` is); it must exist relative to the repository root. A Markdown link ``[text](target)`` must resolve
relative to the file it is in, and its ``#anchor`` must be a heading of the page it names.
Skipped: tokens holding a placeholder (``*``, ``{``, ``<``, ``$``, ``OUT/``, ``step-N``, or a
segment such as ``NAME.toml`` named in capitals), files the tools write (``GENERATED``) and what
a cache folder holds (``shards/`` holds only its README in the repository: the rest of
``shards/...`` is a build's output).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOP = ("melcache", "preprocess", "train", "tests", "benchmarks", "examples", "docs", "configs")
TOP += ("shards", ".ci")
DOCS = ("README.md", "docs/*.md", "shards/README.md", "examples/README.md", "benchmarks/*.md")
CODE = ("melcache", "preprocess", "train", "benchmarks", "tests", "examples")
PLACEHOLDERS = ("*", "{", "<", "$", "OUT/", "step-N")
PLACEHOLDER_WORD = re.compile(r"(?:^|/)(?:NAME|KEY|DIR|FILE|N|K)(?:[./]|$)")  # NAME.toml, K/N
GENERATED = {"benchmarks/gpu_results.jsonl"}  # written by benchmarks/gpu_bench.sh on a GPU
OUTPUT_FOLDERS = ("shards/",)  # a cache's own files, not the repository's

# A token begins after whitespace, a quote, a backtick or an opening bracket (so the ``train/``
# of ``runs/train/x.py`` or ``torch.train/`` is not one), and runs to the next such delimiter.
TOKEN = re.compile(
    r"(?:^|(?<=[\s`'\"(\[]))((?:" + "|".join(re.escape(t) for t in TOP) + r")/[^\s`'\"()\[\]]*)"
)
ENDS = re.compile(r"(?:\.[A-Za-z0-9]+|/)$")  # a file extension, or a folder's slash
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")


def path_tokens(text: str) -> Iterator[tuple[int, str]]:
    """``(line, path)`` for every token of ``text`` (line 1 is its first) that names a
    repository path to check."""
    for number, line in enumerate(text.splitlines(), 1):
        for match in TOKEN.finditer(line):
            token = match.group(1).partition("#")[0].rstrip(".,:;!?")
            if any(mark in token for mark in PLACEHOLDERS) or PLACEHOLDER_WORD.search(token):
                continue
            quoted = line[match.start(1) - 1 : match.start(1)] == "`" == line[match.end(1) :][:1]
            if not (ENDS.search(token) or quoted):
                continue
            if token in GENERATED:
                continue
            if any(
                token.startswith(out) and token != out and not token.endswith(".md")
                for out in OUTPUT_FOLDERS
            ):
                continue
            yield number, token


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text in lower case, punctuation but ``-`` and ``_``
    dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page (repeated headings get ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not (heading := re.match(r"#{1,6} (.*)", line)):
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problems(page: Path, text: str) -> Iterator[tuple[int, str]]:
    """``(line, target)`` for every relative Markdown link of ``text`` (the content of
    ``page``) whose file or anchor is missing."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve() if file else page
            if not resolved.exists() or (
                anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)
            ):
                yield number, target


def commentary(source: str) -> Iterator[tuple[int, str]]:
    """``(first line, text)`` of each comment and docstring of a Python source."""
    if not TOKEN.search(source):  # nothing to find: spare the parse
        return
    docstrings = set()
    statements: list[ast.AST] = [ast.parse(source)]
    while statements:  # statements only: a docstring is never inside an expression
        node = statements.pop()
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.add((first.lineno, first.col_offset))
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                statements.extend(children)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (
            token.type == tokenize.STRING and token.start in docstrings
        ):
            yield token.start[0], token.string


def documents() -> list[Path]:
    pages = {page for pattern in DOCS for page in REPO.glob(pattern)}
    return sorted(pages)


def sources() -> list[Path]:
    return sorted(path for folder in CODE for path in (REPO / folder).rglob("*.py"))


def named_paths() -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
    """Every ``(file, line, path)`` named, and those of them that do not exist."""
    named, missing = [], []
    for page in documents():
        text = page.read_text()
        where = page.relative_to(REPO).as_posix()
        for number, token in path_tokens(text):
            named.append((where, number, token))
            if not (REPO / token).exists():
                missing.append((where, number, token))
        for number, target in link_problems(page, text):
            named.append((where, number, target))
            missing.append((where, number, f"link ({target})"))
    for path in sources():
        where = path.relative_to(REPO).as_posix()
        for first, text in commentary(path.read_text()):
            for offset, token in path_tokens(text):
                named.append((where, first + offset - 1, token))
                if not (REPO / token).exists():
                    missing.append((where, first + offset - 1, token))
    return named, missing


def report(missing: list[tuple[str, int, str]]) -> str:
    """One line per missing path: ``file:line: path``."""
    return "\n".join(f"{file}:{line}: {path}" for file, line, path in missing)


def test_every_named_path_exists() -> None:
    named, missing = named_paths()
    assert len(documents()) >= 10 and len(sources()) >= 50, "the files to read were not found"
    assert len(named) > 200, f"only {len(named)} paths found: the extraction is broken"
    assert not missing, "named but missing:\n" + report(missing)


def test_the_extraction_finds_what_it_should_and_skips_the_rest() -> None:
    text = (
        "See `train/no_such_module.py`, and melcache/format.py.\n"
        "Built into shards/b00-000000.tar under OUT/.build/ (not repository paths), or\n"
        "`melcache/presets/<name>.toml`, `train/*.py`, runs/train/x.py, docs/ (a folder).\n"
        "A word like train/ed is not a path; (see tests/support/helpers.py) is.\n"
        "[the format](shards/README.md#shards), melcache/presets/NAME.toml, --part K/N.\n"
        "`.ci/run` and ``examples/f5tts`` are paths, examples/wavs, in prose, is not.\n"
    )
    found = list(path_tokens(text))
    assert found == [
        (1, "train/no_such_module.py"),
        (1, "melcache/format.py"),
        (3, "docs/"),
        (4, "tests/support/helpers.py"),
        (5, "shards/README.md"),
        (6, ".ci/run"),
        (6, "examples/f5tts"),
    ]
    assert [path for _, path in found if not (REPO / path).exists()] == ["train/no_such_module.py"]
    page = REPO / "README.md"
    links = "[ok](docs/) [gone](docs/no-such-page.md) [web](https://example.org/x.md)\n"
    links += "```\n[in a fence](nowhere.md)\n```\n[bad anchor](#no-such-heading)\n"
    assert list(link_problems(page, links)) == [
        (1, "docs/no-such-page.md"),
        (5, "#no-such-heading"),
    ]
    assert list(link_problems(page, "[fine](shards/README.md#utterancestable)\n")) == []
    assert list(link_problems(page, "[no](shards/README.md#no-such-part)\n")) == [
        (1, "shards/README.md#no-such-part")
    ]
    assert slug("Batch budgets per bucket: `train tune`") == "batch-budgets-per-bucket-train-tune"
    assert slug("Sync (§6.1): `python -m a.b_c`") == "sync-61-python--m-ab_c"
    assert report([("docs/x.md", 7, "train/gone.py")]) == "docs/x.md:7: train/gone.py"
    source = '"""Module: see `train/gone.py`."""\nx = "train/not_checked.py"  # train/also.py\n'
    source += 'if x:\n    class A:\n        def f(self):\n            """See tests/f.py."""\n'
    source += '            return "train/not_either.py"\n'
    assert list(commentary(source)) == [
        (1, '"""Module: see `train/gone.py`."""'),
        (2, "# train/also.py"),
        (6, '"""See tests/f.py."""'),
    ]
