"""Presets by name: ``--config hifigan`` reads the TOML shipped in the package, a path is read
as a path, and a name that is neither is one line listing the presets."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import REPO, SAMPLE_CORPUS

from melcache.errors import UserError
from melcache.sections import find_config, preset_names
from preprocess.arguments import main as preprocess_main
from preprocess.config import load_config as load_build_config
from train.config.tables import load_config as load_train_config

PRESETS = REPO / "melcache" / "presets"


def test_the_presets_are_the_package_files_and_configs_links_to_them() -> None:
    assert preset_names() == ["base", "chattts", "hifigan", "tiny"]
    assert sorted(p.stem for p in PRESETS.glob("*.toml")) == preset_names()
    # one source of truth: the repository's configs/ is a link, not a second copy
    assert (REPO / "configs").is_symlink() and (REPO / "configs").resolve() == PRESETS
    for name in preset_names():
        assert find_config(name) == PRESETS / f"{name}.toml"


def test_a_name_and_its_path_give_the_same_config() -> None:
    for name in ("chattts", "hifigan"):
        assert load_build_config(Path(name)) == load_build_config(REPO / "configs" / f"{name}.toml")
    assert load_build_config(Path("hifigan"))[0].sample_rate == 22050
    for name in ("tiny", "base"):
        by_name = load_train_config(Path(name)).to_dict()
        assert by_name == load_train_config(REPO / "configs" / f"{name}.toml").to_dict()
    assert load_train_config([Path("tiny"), Path("base")]).to_dict() == (
        load_train_config(PRESETS / "base.toml").to_dict()
    )


def test_a_file_with_a_preset_name_is_read_as_the_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("hifigan").write_text("[features]\nn_mels = 64\n")
    assert find_config("hifigan") == Path("hifigan")
    assert load_build_config(Path("hifigan"))[0].n_mels == 64


def test_an_unknown_name_is_one_line_listing_the_presets(capsys) -> None:
    listed = r"config file tinyy does not exist and is not a preset name \(base, chattts, hifigan, tiny\)"
    with pytest.raises(UserError, match=listed):
        load_train_config(Path("tinyy"))
    args = ["build", "--src", str(SAMPLE_CORPUS), "--config", "hifi", "--dry-run"]
    assert preprocess_main(args) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: config file hifi does not exist and is not a preset name "
        "(base, chattts, hifigan, tiny)\n"
    )
