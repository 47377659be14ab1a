"""The README installs ``.[test]`` only; CI adds ``.[test,chattts,f5tts]``. A test that needs
the examples' extras must skip without them and name the extra (``helpers.needs_extra``), so
the two cannot part again (issue 55: ``benchmarks.build.derive_bench`` imports
``examples.chattts_dvae.adapter``, and its test failed on a fresh clone). These tests hide the
extras' packages with a ``sys.meta_path`` finder, in this process's children only."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import REPO

# Top-level modules the chattts and f5tts extras bring that [test] does not.
EXTRA_ONLY = ("ChatTTS", "transformers", "f5_tts", "x_transformers", "torchdiffeq", "ema_pytorch")
# Fixtures that skip by themselves without the chattts extra (tests/conftest.py).
SKIPPING_FIXTURES = {"dvae_run", "derived"}
BLOCKER = f"""
import importlib.abc, sys
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRA_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden: extras not installed)", name=name)
        return None
sys.meta_path.insert(0, _Hide())
"""


def without_extras(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python processes cannot import the extras' packages."""
    hide = tmp_path / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join([str(hide), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def benchmark_module(path: Path) -> str:
    """The dotted module name of a file under ``benchmarks/`` (a room's ``__init__``: the room)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_needing_extras(tmp_path: Path) -> set[str]:
    """The benchmarks and examples modules that do not import without the extras."""
    names = [benchmark_module(p) for p in (REPO / "benchmarks").rglob("*.py")]
    names += [f"examples.{p.parent.name}.{p.stem}" for p in (REPO / "examples").glob("*/*.py")]
    probe = (
        "import importlib, json, sys\nfailed = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n        failed.append(name)\n"
        "print(json.dumps(failed))"
    )
    command = [sys.executable, "-c", probe, *names]
    done = subprocess.run(
        command, env=without_extras(tmp_path), capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def names_in(function: ast.AST) -> set[str]:
    """Every string constant and dotted import in ``function``, ``benchmarks.`` prefixed where
    a room's benchmark is named without it (``bench_rows("build.derive_bench", ...)``)."""
    found: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found |= {node.value, f"benchmarks.{node.value}", node.value.split(":")[0]}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def reaching_them(needing: set[str]) -> set[str]:
    """``needing`` grown by the benchmarks modules that import or name one of them anywhere,
    lazily inside a function too (``derive_bench`` imports the DVAE adapter inside ``main``)."""
    trees = {
        benchmark_module(p): ast.parse(p.read_text()) for p in (REPO / "benchmarks").rglob("*.py")
    }
    while True:
        grown = needing | {name for name, tree in trees.items() if names_in(tree) & needing}
        if grown == needing:
            return needing
        needing = grown


def test_every_test_running_a_module_that_needs_an_extra_skips_without_it(tmp_path: Path) -> None:
    needing = reaching_them(modules_needing_extras(tmp_path))
    assert (
        "benchmarks.build.derive_bench" in needing
    )  # the instance issue 55 found: the probe sees it
    unguarded = []
    for file in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(file.read_text())
        module_guarded = any(
            isinstance(n, ast.Expr) and "importorskip" in ast.unparse(n) for n in tree.body
        )
        for node in ast.walk(tree):
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            used = names_in(node) & needing
            guarded = "needs_extra(" in ast.unparse(node) or module_guarded
            guarded |= bool(SKIPPING_FIXTURES & {a.arg for a in node.args.args})
            if used and not guarded:
                unguarded.append(f"{file.relative_to(REPO)}::{node.name} runs {sorted(used)}")
    assert not unguarded, "call helpers.needs_extra(module, extra) first:\n" + "\n".join(unguarded)


def test_without_the_extras_the_tests_collect_and_skip_naming_the_extra(tmp_path: Path) -> None:
    tests = [
        "tests/examples/test_chattts_gpt.py",
        "tests/benchmarks/test_benchmarks.py::test_derive_bench_prints_every_row",
    ]
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(
        command, env=without_extras(tmp_path), capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 2 and all("'chattts' extra" in line for line in skipped), done.stdout
