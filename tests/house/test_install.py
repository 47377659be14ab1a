"""A non-editable ``pip install .`` works outside the repository: the presets ship in the
package, so ``--config hifigan`` and ``--config tiny`` build and train the sample corpus."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support.helpers import REPO, SAMPLE_CORPUS

# What the wheel is built from; a copy, since pip builds in the source tree (build/, egg-info).
PROJECT_FILES = ("pyproject.toml", "README.md", "melcache", "preprocess", "train")


def _venv_reusing_this_environment(root: Path) -> Path:
    """A fresh venv that sees this interpreter's packages (torch and the rest, pip and
    setuptools too) after its own, so installing the project needs no download; returns its
    python."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120
    )
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A plain path line: this environment's own .pth hooks (its editable melcache) stay off.
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(purelib) / "outer-environment.pth").write_text("\n".join(sorted(outer)) + "\n")
    return python


def _run(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [python, *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow  # creates a venv, builds a wheel and runs the commands in subprocesses
def test_a_regular_install_builds_and_trains_with_presets_by_name(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in PROJECT_FILES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(REPO / name, source / name)
    python = _venv_reusing_this_environment(tmp_path / "venv")
    away = tmp_path / "elsewhere"  # the cwd: nothing of the repository is importable from it
    away.mkdir()
    pip = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    _run(python, away, *pip, "--no-deps", "--no-build-isolation", "--ignore-installed", str(source))
    where = _run(python, away, "-c", "import melcache, train; print(melcache.__file__)").stdout
    assert Path(where.strip()).is_relative_to(tmp_path / "venv")

    shards = away / "shards"
    build = ("-m", "preprocess", "build", "--src", str(SAMPLE_CORPUS), "--out", str(shards))
    _run(python, away, *build, "--config", "hifigan", "--workers", "1")
    features = json.loads((shards / "index.json").read_text())["features"]
    assert (features["sample_rate"], features["n_mels"]) == (22050, 80)
    hifigan_model = ("model.n_mels=80", "model.sample_rate=22050", "data.num_workers=0")
    train = ("-m", "train", "--shards", str(shards), "--config", "tiny", "--out", str(away / "run"))
    _run(python, away, *train, "--max-steps", "2", *hifigan_model)
    metrics = (away / "run" / "metrics.jsonl").read_text().splitlines()
    assert metrics and all(json.loads(line) for line in metrics)
    assert list((away / "run" / "checkpoints").iterdir())
