"""The house's one layer table, and a check that every import in the three packages obeys it;
the same for the benchmarks' rooms; and the size of every file and folder.

Each room has a rank; a module may import its own room and rooms of a lower rank in its
stack, never a higher one nor a sibling of the same rank. Every import counts, also those
inside functions and under ``TYPE_CHECKING``: an upward import hidden in a function is still
a cycle waiting to happen. docs/layout.md explains why each room exists.
"""

from __future__ import annotations

import ast
import graphlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("melcache", "preprocess", "train")

# room → (stack, rank). Rooms are module prefixes; the longest prefix names a module's room.
# melcache is the base of both stacks; preprocess and train never import each other.
LAYERS: dict[str, tuple[str, int]] = {
    "melcache": ("base", 0),
    "melcache.loader": ("base", 1),
    "preprocess.config": ("preprocess", 2),  # the [build] table
    "preprocess.job": ("preprocess", 2),  # how a build's processes cooperate
    "preprocess.inputs": ("preprocess", 2),  # the corpus layouts and the records they yield
    "preprocess.plan": ("preprocess", 3),
    "preprocess.write": ("preprocess", 4),
    "preprocess.check": ("preprocess", 5),
    "preprocess": ("preprocess", 6),  # the command line and the build's orchestration
    "train.config": ("train", 2),
    "train.optim": ("train", 3),
    "train.parallel": ("train", 4),
    "train.model": ("train", 5),
    "train.adapt": ("train", 6),
    "train.memory": ("train", 6),
    "train.run": ("train", 7),
    "train": ("train", 8),  # the commands and the loop: train/*.py
}


def room_of(module: str) -> str:
    """The room of a dotted module name: the longest prefix in :data:`LAYERS`."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return prefix
    raise KeyError(module)


def allowed(importer: str, imported: str) -> bool:
    """Whether a module of room ``importer`` may import one of room ``imported``."""
    if importer == imported:
        return True
    (stack, rank), (their_stack, their_rank) = LAYERS[importer], LAYERS[imported]
    return their_rank < rank and their_stack in ("base", stack)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(
    source: str, module: str, is_package: bool, roots: tuple[str, ...] = PACKAGES
) -> list[tuple[int, str]]:
    """(line, module) of every import of the top-level packages ``roots`` in ``source``,
    relative ones resolved against ``module``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                names = [".".join([*base, node.module] if node.module else base)]
            else:
                names = [node.module or ""]
            # ``from train.run import dcp`` imports the module train.run.dcp
            names = [f"{names[0]}.{alias.name}" for alias in node.names] or names
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in roots]
    return found


def violations(path: Path, source: str) -> list[str]:
    module = module_name(path)
    mine = room_of(module)
    out = []
    for line, imported in imports_of(source, module, path.name == "__init__.py"):
        theirs = room_of(imported)
        if not allowed(mine, theirs):
            out.append(f"{path.relative_to(REPO)}:{line}: {mine} imports {imported} ({theirs})")
    return out


def package_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def test_every_import_runs_downward() -> None:
    files = package_files()
    assert len(files) > 80, files  # the walk found the packages
    bad = [v for path in files for v in violations(path, path.read_text(encoding="utf-8"))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("where", "source", "upward"),
    [
        ("melcache/loader/stream.py", "from train.run.metrics import Metrics", True),
        ("melcache/format.py", "import melcache.loader.stream_loader", True),  # format → loader
        ("train/optim/scaler.py", "def f():\n    from train.parallel import distributed", True),
        ("train/adapt/spikes.py", "from train.memory.oom import OomGuard", True),  # a sibling
        ("train/config/tables.py", "from train.trainer import Trainer", True),  # room → root
        ("preprocess/arguments.py", "from train.data import make_loader", True),  # build → trainer
        ("train/run/parts.py", "from preprocess.build import build", True),  # trainer → build
        (
            "melcache/loader/stream_loader.py",
            "from . import stream\nfrom ..access import open",
            False,
        ),
        ("train/run/parts.py", "from train.model import contract", False),
        ("preprocess/inputs/audio.py", "from preprocess.plan import shard_plan", True),
        ("preprocess/check/verify.py", "from preprocess.write import index_table", False),
    ],
)
def test_an_upward_import_is_caught(where: str, source: str, upward: bool) -> None:
    """The check itself: each upward import is reported, and a downward one is not."""
    found = violations(REPO / where, source)
    assert bool(found) == upward, found


def import_graph() -> dict[str, set[str]]:
    """module → the house's modules it imports (every import, also in functions and under
    ``TYPE_CHECKING``), each named by the longest prefix that is a module file: ``from
    melcache.loader.stream_loader import StreamLoader`` is an edge to ``melcache.loader.stream_loader``."""
    files = package_files()
    modules = {module_name(path) for path in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        module = module_name(path)
        source = path.read_text(encoding="utf-8")
        edges = graph.setdefault(module, set())
        for _, imported in imports_of(source, module, path.name == "__init__.py"):
            parts = imported.split(".")
            target = next(
                (
                    ".".join(parts[:end])
                    for end in range(len(parts), 0, -1)
                    if ".".join(parts[:end]) in modules
                ),
                None,
            )
            if target is not None and target != module:
                edges.add(target)
    return graph


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (its modules in order), or ``[]`` when there is none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return []


def test_no_file_imports_itself_in_a_circle() -> None:
    """The layer table allows any import inside a room; this finds a circle between files."""
    graph = import_graph()
    assert len(graph) > 80, graph  # the walk found the packages
    assert not circle(graph), " → ".join(circle(graph))


def test_a_circle_is_caught() -> None:
    """The check itself: the stream importing back from a stage below it (as under
    ``TYPE_CHECKING`` before the spec module) closes a circle."""
    graph = import_graph()
    assert "melcache.loader.spec" in graph["melcache.loader.reads.shards"]
    graph["melcache.loader.spec"].add("melcache.loader.stream")
    assert circle(graph), graph


def test_the_loaders_face_is_lazy_and_whole() -> None:
    """``from melcache.loader import DataConfig`` loads the [data] table, not the workers;
    every name in ``__all__`` (the errors callers catch included) resolves."""
    code = (
        "import sys, melcache.loader as L\n"
        "from melcache.loader import DataConfig\n"
        "assert 'melcache.loader.workers' not in sys.modules, sorted(sys.modules)\n"
        "assert 'melcache.loader.stream_loader' not in sys.modules, sorted(sys.modules)\n"
        "assert sorted(L.__all__) == sorted(L._WHERE), L.__all__\n"
        "assert all(getattr(L, name) is not None for name in L.__all__)\n"
        "assert issubclass(L.LoaderStateError, Exception)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# Public module-level functions that share a name on purpose (docs/layout.md, "One name, one
# meaning"): each is the same role in a parallel room, reached through its module's name.
SHARED_NAMES = {
    "main": "each command's entry point (preprocess/arguments.py, train/__main__.py)",
    "load_config": "each package's own TOML (the build's, the trainer's); they never meet",
    "init_worker": "each pool's initializer (a shard writer's, a field encoder's)",
    "read_range": "location.read_range dispatches to objectstore.read_range for s3://",
    "save": "resume.save checkpoints a run; it calls dcp.save for the sharded weights",
}


def test_each_function_name_is_defined_once() -> None:
    """No twins: a public module-level function name means one thing across the packages."""
    where: dict[str, list[str]] = {}
    for path in package_files():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            public = not getattr(node, "name", "_").startswith("_")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and public:
                where.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    twins = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert set(twins) <= set(SHARED_NAMES), {n: twins[n] for n in set(twins) - set(SHARED_NAMES)}
    assert set(SHARED_NAMES) <= set(twins), set(SHARED_NAMES) - set(twins)  # none left stale


# benchmarks/ room → rank: the stage rooms share common/ and never import one another (a helper
# two stages need moves down to common/); results.py, at the root, reruns them all.
BENCHMARK_ROOMS: dict[str, int] = {
    "benchmarks.common": 0,  # corpora, caches, an S3 server, timers: no benchmark of its own
    "benchmarks.build": 1,
    "benchmarks.loader": 1,
    "benchmarks.train": 1,
    "benchmarks.store": 1,
    "benchmarks": 2,  # results.py
}


ROOTS = (*PACKAGES, "benchmarks", "tests")  # what a benchmark may import, checked or not


def benchmark_violations(path: Path, source: str) -> list[str]:
    """Each import in a file of ``benchmarks/`` that is not downward in :data:`BENCHMARK_ROOMS`
    (the house's packages below it are free to import; tests/ is not)."""
    module = module_name(path)
    mine = max((r for r in BENCHMARK_ROOMS if f"{module}.".startswith(f"{r}.")), key=len)
    out = []
    for line, imported in imports_of(source, module, path.name == "__init__.py", ROOTS):
        if imported.split(".")[0] == "tests":
            out.append(f"{path.relative_to(REPO)}:{line}: imports {imported} (tests/)")
            continue
        if imported.split(".")[0] != "benchmarks":
            continue
        theirs = max((r for r in BENCHMARK_ROOMS if f"{imported}.".startswith(f"{r}.")), key=len)
        if theirs != mine and BENCHMARK_ROOMS[theirs] >= BENCHMARK_ROOMS[mine]:
            out.append(f"{path.relative_to(REPO)}:{line}: {mine} imports {imported} ({theirs})")
    return out


def test_benchmarks_import_downward_and_the_packages_never_import_them() -> None:
    files = sorted((REPO / "benchmarks").rglob("*.py"))
    assert len(files) > 30, files  # the walk found the benchmarks
    bad = [v for path in files for v in benchmark_violations(path, path.read_text("utf-8"))]
    for path in package_files():  # the packages stand on neither benchmarks/ nor tests/
        source = path.read_text(encoding="utf-8")
        found = imports_of(source, module_name(path), path.name == "__init__.py", ROOTS)
        above = [(n, m) for n, m in found if m.split(".")[0] in ("benchmarks", "tests")]
        bad += [f"{path.relative_to(REPO)}:{n}: imports {m}" for n, m in above]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("where", "source", "upward"),
    [
        ("benchmarks/store/storage_bench.py", "from benchmarks.loader.loader_bench import x", True),
        ("benchmarks/common/caches.py", "from benchmarks.build import build_bench", True),
        ("benchmarks/build/derive_bench.py", "from tests.support.helpers import REPO", True),
        (
            "benchmarks/train/tracker_bench.py",
            "from benchmarks.train.trainer_bench import x",
            False,
        ),
        ("benchmarks/loader/schedule_bench.py", "from benchmarks.common import speech", False),
        ("benchmarks/results.py", "def f():\n    from benchmarks.train import gpu_bench", False),
    ],
)
def test_an_upward_benchmark_import_is_caught(where: str, source: str, upward: bool) -> None:
    """The check itself: a stage importing a sibling stage, or common/ a stage, is reported."""
    found = benchmark_violations(REPO / where, source)
    assert bool(found) == upward, found


MAX_LINES = 500
MAX_MODULES = 16  # a folder's modules, its __init__ not counted
# Files allowed over MAX_LINES, each with why it stays whole (none at present); one that
# shrinks under it must leave the list, so that the list stays true.
LONG_FILES: dict[str, str] = {}
# Folders allowed over MAX_MODULES, each with why (none at present; docs/layout.md says it too).
CROWDED_FOLDERS: dict[str, str] = {}


def house_files() -> list[Path]:
    """Every Python file of the packages, benchmarks, tests and examples."""
    roots = [*PACKAGES, "benchmarks", "tests", "examples"]
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py"))


def test_no_file_is_over_500_lines_and_no_folder_over_16_modules() -> None:
    files = house_files()
    assert len(files) > 200, files  # the walk found the house
    lines = {str(p.relative_to(REPO)): len(p.read_text("utf-8").splitlines()) for p in files}
    long = {path: count for path, count in lines.items() if count > MAX_LINES}
    assert set(long) == set(LONG_FILES), {p: long.get(p) for p in set(long) ^ set(LONG_FILES)}
    modules: dict[Path, int] = {}
    for path in files:
        modules[path.parent] = modules.get(path.parent, 0) + (path.name != "__init__.py")
    crowded = {str(f.relative_to(REPO)): n for f, n in modules.items() if n > MAX_MODULES}
    assert set(crowded) == set(CROWDED_FOLDERS), crowded
