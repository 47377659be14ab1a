"""``python -m train export`` for any model (issue #50): the built-in model's run, trained by
the real trainer, comes out as safetensors equal to its checkpoint, with its config and step;
no home format is written for a model that declares none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.helpers import REPO, checkpoint, load, tiny_fit


@pytest.mark.slow
def test_a_run_of_the_built_in_model_exports_its_weights_config_and_step(
    train_cache: Path, tmp_path: Path
) -> None:
    tiny_fit(train_cache, tmp_path / "run", 2, ["train.checkpoint.every=2", "train.ema_decay=0.9"])
    command = [sys.executable, "-m", "train", "export", str(tmp_path / "run"), "--out"]
    done = subprocess.run([*command, str(tmp_path / "out")], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = load(checkpoint(tmp_path / "run", 2))
    exported = load_file(tmp_path / "out/weights/run/model.safetensors")
    assert exported.keys() == saved["model"].keys()
    assert all(torch.equal(exported[k], v) for k, v in saved["model"].items())
    meta = json.loads((tmp_path / "out/weights/run/run.json").read_text())
    assert meta["step"] == 2 and meta["impl"] == saved["config"]["model"]["impl"]
    assert meta["config"] == json.loads(json.dumps(saved["config"], default=str))  # as JSON
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["export.json", "weights"]
    ema = subprocess.run([*command, str(tmp_path / "ema"), "--ema"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ema.returncode == 0, ema.stderr
    averaged = load_file(tmp_path / "ema/weights/run/model.safetensors")
    shadow = saved["ema"]["shadow"]
    assert shadow and all(
        torch.equal(averaged[k], v.to(averaged[k].dtype)) for k, v in shadow.items()
    )
    refused = subprocess.run([*command, str(tmp_path / "out")], cwd=REPO, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 2 and "is not empty" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
