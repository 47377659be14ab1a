"""``train.parallel.strategy = "fsdp2" | "hsdp"`` (train/parallel/fsdp.py, train/run/dcp.py) in real 2-rank gloo
jobs: the loss follows DDP's, checkpoints are DCP shards, and a resume is bitwise."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from melcache.errors import UserError
from tests.support.helpers import checkpoint, dcp_weights, load, metrics, run_ok, train_cmd
from train.config.tables import load_config
from train.run import dcp

STRATEGIES = {
    "fsdp2": ("train.parallel.strategy=fsdp2",),
    "hsdp": ("train.parallel.strategy=hsdp", "train.parallel.hsdp_shard_size=1"),
}
TWELVE = ("train.checkpoint.every=6", "train.log_every=3")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_sharded_run_follows_ddp_and_resumes_bitwise(
    strategy: str, train_cache: Path, tmp_path: Path
) -> None:
    extra = (*STRATEGIES[strategy], *TWELVE)
    ddp, straight, resumed = tmp_path / "ddp", tmp_path / "straight", tmp_path / "resumed"
    run_ok(train_cmd(train_cache, ddp, *TWELVE, max_steps=12))
    run_ok(train_cmd(train_cache, straight, *extra, max_steps=12))
    run_ok(train_cmd(train_cache, resumed, *extra, max_steps=6))
    done = run_ok(
        train_cmd(train_cache, resumed, *extra, "train.checkpoint.async_write=true", max_steps=12)
    )
    assert "resumed from" in done.stderr
    # fp32 on CPU: the same updates as DDP up to the order of the reduction.
    sharded_loss = [r["loss"] for r in metrics(straight)]
    ddp_loss = [r["loss"] for r in metrics(ddp)]
    assert sharded_loss == pytest.approx(ddp_loss, rel=1e-3), (sharded_loss, ddp_loss)
    assert sharded_loss[-1] < 0.9 * sharded_loss[0], sharded_loss
    assert "model" not in load(checkpoint(straight, 12))  # the weights are in DCP shards
    assert_same_run(straight, resumed, 12)


def assert_same_run(a_out: Path, b_out: Path, step: int) -> None:
    """Runs ``a_out`` and ``b_out`` hold bitwise the same DCP weights at ``step`` (model,
    AdamW, EMA) and logged the same metrics."""
    a, b = dcp_weights(a_out, step), dcp_weights(b_out, step)
    assert sorted(a) == sorted(b) and {"model", "optimizer", "ema"} <= {k.split(".")[0] for k in a}
    differ = []
    for key, value in a.items():
        same = torch.equal(value, b[key]) if isinstance(value, torch.Tensor) else value == b[key]
        if not same:
            gap = (
                (value.float() - b[key].float()).abs().max().item()
                if value.is_floating_point()
                else None
            )
            differ.append(f"{key} ({value.dtype}, max gap {gap})")
    assert not differ, f"{len(differ)} of {len(a)} differ: {differ[:8]}"
    keys = ("step", "loss", "grad_norm", "lr")
    assert [{k: r[k] for k in keys} for r in metrics(b_out)] == [
        {k: r[k] for k in keys} for r in metrics(a_out)
    ]


BF16 = ("train.parallel.strategy=fsdp2", "train.precision=bf16", *TWELVE)


@pytest.fixture(scope="module")
def bf16_runs(train_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """fsdp2 + bf16 on 2 ranks: 12 steps straight, and 6 + resume + 6."""
    root = tmp_path_factory.mktemp("fsdp_bf16")
    straight, resumed = root / "straight", root / "resumed"
    run_ok(train_cmd(train_cache, straight, *BF16, max_steps=12))
    run_ok(train_cmd(train_cache, resumed, *BF16, max_steps=6))
    assert "resumed from" in run_ok(train_cmd(train_cache, resumed, *BF16, max_steps=12)).stderr
    return straight, resumed


@pytest.mark.slow
def test_fsdp2_bf16_resumes_bitwise(bf16_runs: tuple[Path, Path]) -> None:
    straight, resumed = bf16_runs
    losses = [r["loss"] for r in metrics(straight)]
    assert losses[-1] < 0.9 * losses[0], losses
    assert_same_run(straight, resumed, 12)


@pytest.mark.slow
def test_a_damaged_dcp_folder_falls_back_to_the_previous_checkpoint(
    bf16_runs: tuple[Path, Path], train_cache: Path, tmp_path: Path
) -> None:
    straight, _ = bf16_runs
    damaged = tmp_path / "damaged"
    shutil.copytree(straight, damaged)
    shard = checkpoint(damaged, 12) / dcp.WEIGHTS / "__1_0.distcp"  # rank 1's shards
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    done = run_ok(train_cmd(train_cache, damaged, *BF16, max_steps=12))
    (warning,) = [line for line in done.stderr.splitlines() if "falling back" in line]
    assert f"{shard} is cut short" in warning, warning
    assert warning.endswith(f"falling back to {checkpoint(damaged, 6)}"), warning
    assert f"resumed from {checkpoint(damaged, 6)}" in done.stderr
    assert_same_run(straight, damaged, 12)  # steps 7-12 again, from step 6: the same weights


def test_dcp_metadata_is_read_without_running_pickled_code(tmp_path: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (print, ("owned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.print"):
        dcp.SafeReader(tmp_path).read_metadata()


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("train.parallel.comm_hook=powersgd", r"train\.parallel\.comm_hook"),
        ("train.precision=fp16", r"train\.precision"),
    ],
)
def test_what_fsdp2_cannot_do_is_refused_by_name(override: str, named: str) -> None:
    with pytest.raises(UserError, match=named + ".*fsdp2"):
        load_config(None, ["train.parallel.strategy=fsdp2", override])
