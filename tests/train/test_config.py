"""Trainer config: TOML tables, overrides, validation messages, round trip, shipped presets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from melcache.errors import UserError
from train.config.tables import Config, load_config, parse_overrides
from train.model import build_model

REPO = Path(__file__).resolve().parents[2]


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.toml"
    path.write_text("")
    assert load_config(path) == Config()


def test_overrides_are_typed_and_nested() -> None:
    assert parse_overrides(
        ["train.max_steps=20", "optim.betas=[0.9, 0.95]", "model.args.dim=64", "model.impl=a.b:C"]
    ) == {
        "train": {"max_steps": 20},
        "optim": {"betas": [0.9, 0.95]},
        "model": {"args": {"dim": 64}, "impl": "a.b:C"},
    }
    cfg = load_config(REPO / "configs" / "tiny.toml", ["model.args.dim=64", "train.precision=fp16"])
    assert cfg.model.args["dim"] == 64
    assert cfg.model.args["layers"] == 3  # the rest of [model.args] is kept
    assert cfg.train.precision == "fp16"
    assert cfg.optim.betas == (0.9, 0.98)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("train.grad_accum=0", "train.grad_accum"),
        ("train.precision=fp8", "train.precision"),
        ("train.checkpoint.keep=1", "train.checkpoint.keep"),
        ("train.parallel.comm_hook=zip", "train.parallel.comm_hook"),
        ("optim.decay_steps=5", "optim.decay_steps"),
        ("optim.lr=true", "optim.lr"),
        ("data.batch_frames=0", "data.batch_frames"),
        ("data.batch_frames=true", "data.batch_frames"),
        ("data.batch_frames={a = 3}", "data.batch_frames"),
        ("data.batch_frames={}", "data.batch_frames"),
        ("data.batch_frames={0 = -5}", "data.batch_frames.0"),
        ("data.on_error=ignore", "data.on_error"),
        ("model.impl=nocolon", "model.impl"),
        ("train.max_step=3", "train.max_step"),
        ("trian.max_steps=3", "trian"),
        ("max_steps=3", "max_steps=3"),
    ],
)
def test_bad_values_name_the_key(override: str, named: str) -> None:
    with pytest.raises(UserError, match=named.replace(".", r"\.")):
        load_config(None, [override])


def test_round_trip_through_dict() -> None:
    cfg = load_config(REPO / "configs" / "base.toml")
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_shipped_presets_have_the_promised_sizes() -> None:
    def params(name: str) -> int:
        model = build_model(load_config(REPO / "configs" / name).model)
        return sum(p.numel() for p in model.parameters())

    assert params("tiny.toml") <= 1_000_000
    assert 10_000_000 <= params("base.toml") < 100_000_000


def test_unknown_model_class_names_the_key() -> None:
    cfg = load_config(None, ["model.impl=train.model:NoSuchModel"])
    with pytest.raises(UserError, match=r"model\.impl"):
        build_model(cfg.model)
    cfg = load_config(None, ["model.args.depth=3"])
    with pytest.raises(UserError, match=r"\[model.args\]"):
        build_model(cfg.model)


def test_powersgd_runs_in_every_precision_and_its_keys_are_checked() -> None:
    """fp16 is allowed: an overflow step rolls PowerSGD's memory back (tests/train/parallel/test_powersgd.py)."""
    for precision in ("fp16", "bf16", "fp32", "auto"):
        load_config(None, ["train.parallel.comm_hook=powersgd", f"train.precision={precision}"])
    cfg = load_config(
        None, ["train.parallel.powersgd_start_iter=2", "train.parallel.bucket_cap_mb=0.5"]
    ).train.parallel
    assert (cfg.powersgd_start_iter, cfg.bucket_cap_mb) == (2, 0.5)
    for bad in ("train.parallel.powersgd_start_iter=-1", "train.parallel.bucket_cap_mb=0"):
        with pytest.raises(UserError, match=bad.split("=")[0].replace(".", r"\.")):
            load_config(None, [bad])
    with pytest.raises(
        UserError, match=r"train\.parallel\.comm_hook"
    ):  # torch's broken variant: never
        load_config(None, ["train.parallel.comm_hook=batched_powersgd"])
    assert not load_config(None).train.deterministic  # deterministic kernels: opt in


def test_a_budget_table_is_read_from_toml_and_later_files_win(tmp_path: Path) -> None:
    tuned = tmp_path / "budgets.toml"
    tuned.write_text("[data.batch_frames]\n0 = 24000\n2 = 8000\n01 = 16000\n")
    cfg = load_config([REPO / "configs" / "tiny.toml", tuned])
    assert cfg.data.batch_frames == {"0": 24000, "1": 16000, "2": 8000}
    assert [cfg.data.budget(b) for b in (0, 1, 2)] == [24000, 16000, 8000]
    assert cfg.data.max_batch_size == 16  # the rest of tiny.toml's [data] is kept
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert load_config([tuned], ["data.batch_frames=5000"]).data.budget(7) == 5000


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.args.heads=0", r"heads = 0, .*heads ≥ 1"),  # once a ZeroDivisionError
        ("model.args.dim=100000000", r"GiB of parameters, more than the .* GiB of memory"),
        ("model.args.x=" + "[" * 5000 + "]" * 5000, "model.args.x: its value is nested too deeply"),
        ("model.args.x={" + "a={" * 3000 + "}" * 3001, "nested too deeply"),
        ("model.args." + "a." * 5000 + "b=1", "more than 32 keys deep"),
    ],
    ids=["heads=0", "dim=1e8", "deep array", "deep table", "deep key"],
)
def test_values_that_escaped_validation_are_one_line_errors(override: str, named: str) -> None:
    with pytest.raises(UserError, match=named) as failure:
        build_model(load_config(REPO / "configs" / "tiny.toml", [override]).model)
    assert "\n" not in str(failure.value)


@pytest.mark.parametrize("limit", [float("nan"), 0.0, -5.0, float("inf")])
def test_tune_refuses_a_memory_limit_that_is_no_positive_number(limit: float) -> None:
    from train.tune import tune

    # No cache at all: the limit is refused before the cache or the model is touched.
    with pytest.raises(UserError, match=r"--memory-limit-mib .* expected a positive number"):
        tune(load_config(None), "/nonexistent-cache", memory_limit_mib=limit)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory", "deep"])
def test_a_config_that_is_no_small_toml_file_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "config.toml"
    if kind == "fifo":
        os.mkfifo(path)  # never written: opening it must not wait for a writer
    elif kind == "/dev/zero":
        path = Path("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_text("x = " + "[" * 50_000)
    with pytest.raises(UserError, match=f"config file {path} cannot be read") as failure:
        load_config([REPO / "configs" / "tiny.toml", path])
    assert "\n" not in str(failure.value)


@pytest.mark.parametrize(
    ("trackers", "why"),
    [
        ('["tensorbord"]', "expected tensorboard or wandb"),
        ('["wandb", "wandb"]', "wandb twice"),
        ('"wandb"', "a list of names"),
    ],
)
def test_trackers_refuse_unknown_and_repeated_names(trackers: str, why: str) -> None:
    """A typo in a tracker's name must stop the run, not leave it silently untracked."""
    with pytest.raises(UserError, match=rf"train\.trackers = .*{why}"):
        load_config(None, [f"train.trackers={trackers}"])


def test_trackers_default_to_none_and_round_trip() -> None:
    assert load_config(None).train.trackers == ()
    cfg = load_config(None, ['train.trackers=["wandb", "tensorboard"]'])
    assert cfg.train.trackers == ("wandb", "tensorboard")
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_a_config_value_of_the_wrong_type_names_the_type_in_words() -> None:
    with pytest.raises(
        UserError, match=r"data\.num_workers = 'two' is invalid: expected an integer$"
    ):
        load_config(None, ["data.num_workers='two'"])


def test_a_list_override_whose_quotes_the_shell_dropped_says_to_quote_it() -> None:
    """``train.trackers=["tensorboard"]`` typed unquoted in a shell arrives as ``[tensorboard]``."""
    with pytest.raises(UserError, match=r"""quote the whole override, as in 'train\.trackers=\["""):
        parse_overrides(["train.trackers=[tensorboard]"])
    assert parse_overrides(['train.trackers=["tensorboard"]']) == {
        "train": {"trackers": ["tensorboard"]}
    }
