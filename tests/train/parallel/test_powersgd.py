"""PowerSGD (train/parallel/powersgd.py) in real 2-rank gloo jobs: several DDP buckets without a hang,
a bitwise resume of its per-rank memory, and fp16 through an overflow step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.helpers import PROBE, SMALL, checkpoint, load, run_ok, torchrun, train_cmd

pytestmark = pytest.mark.slow  # 2-process torchrun jobs: the full tier

# Buckets of 50 kB: the tiny model's gradients fill several; compression from step 3.
POWERSGD = (
    "train.parallel.comm_hook=powersgd",
    "train.parallel.powersgd_start_iter=2",
    "train.parallel.powersgd_rank=2",
    "train.parallel.bucket_cap_mb=0.05",
    "train.checkpoint.every=6",
)
WATCHDOG_S = 180  # torch's own hook hangs here forever: run_ok's timeout fails the test


def test_powersgd_with_several_buckets_resumes_bitwise(train_cache: Path, tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_ok(train_cmd(train_cache, straight, *POWERSGD, max_steps=12), timeout=WATCHDOG_S)
    run_ok(train_cmd(train_cache, resumed, *POWERSGD, max_steps=6), timeout=WATCHDOG_S)
    done = run_ok(train_cmd(train_cache, resumed, *POWERSGD, max_steps=12), timeout=WATCHDOG_S)
    assert "resumed from" in done.stderr
    a, b = checkpoint(straight, 12), checkpoint(resumed, 12)
    for key, tensor in load(a)["model"].items():
        assert torch.equal(tensor, load(b)["model"][key]), f"model {key} differs"
    for rank in (0, 1):
        mine, theirs = (load(c, f"rank-{rank:05d}.pt")["powersgd"] for c in (a, b))
        assert mine["iter"] == theirs["iter"] == 12
        assert mine["buckets"] >= 2, mine["buckets"]  # the case torch's hook hangs on
        assert len(mine["error"]) >= 4 and set(mine["q"]) == set(mine["error"])
        for kind in ("error", "q"):
            for name, tensor in mine[kind].items():
                assert torch.equal(tensor, theirs[kind][name]), f"rank {rank} {kind} {name}"
    six = load(checkpoint(resumed, 6), "rank-00000.pt")["powersgd"]
    assert not torch.equal(six["error"][name], mine["error"][name])  # the memory moved on


def test_fp16_powersgd_survives_an_overflow_step(train_cache: Path, tmp_path: Path) -> None:
    overrides = [o for o in POWERSGD if "ckpt_every" not in o]
    run_ok(
        torchrun(
            str(PROBE), "powersgd-overflow", str(train_cache), str(tmp_path), *SMALL, *overrides
        ),
        timeout=WATCHDOG_S,
    )
    for rank in (0, 1):
        result = json.loads((tmp_path / f"overflow-rank{rank}.json").read_text())
        changed = [s["changed"] for s in result["steps"]]
        # Step 1 may overflow at GradScaler's initial scale, as without PowerSGD. Step 5 (rank
        # 0's inf) is skipped on both ranks, and only it: the memory was rolled back.
        assert changed[1:] == [True] * 3 + [False] + [True] * 3, result["steps"]
        scales = [s["scale"] for s in result["steps"]]
        assert scales[4] == scales[3] / 2, scales
        assert result["finite"] and result["compressed"], result


def test_memory_is_keyed_by_name_and_the_closed_form_counts_factors() -> None:
    """In-process: what is compressed, what one rank sends, and a foreign state refused."""
    from train.parallel.powersgd import PowerSGD

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 2))
    state = PowerSGD(model, rank=4, start_iter=0, seed=0)
    grads = [p.detach() for p in model.parameters()]  # 32×64, 32, 2×32, 2
    assert [state.compressible(g) for g in grads] == [True, False, False, False]
    assert state.elements_sent(grads) == 4 * (32 + 64) + 32 + 2 * 32 + 2
    state.load_state_dict({"iter": 3, "buckets": 1, "error": {"0.weight": grads[0]}, "q": {}})
    assert state.state_dict()["iter"] == 3
    with pytest.raises(ValueError, match=r"9\.weight"):
        state.load_state_dict({"iter": 0, "buckets": 0, "error": {"9.weight": grads[0]}, "q": {}})


class _Bucket:
    """What the hook reads of DDP's ``GradBucket``: the model's gradients as views into one
    flat buffer, starting ``offset`` elements in (a bucket layout forced apart from another)."""

    def __init__(self, model: torch.nn.Module, grads: list[torch.Tensor], offset: int) -> None:
        self.params = list(model.parameters())
        self.flat = torch.zeros(offset + sum(g.numel() for g in grads))
        self.views, start = [], offset
        for g in grads:
            self.views.append(self.flat[start : start + g.numel()].view_as(g).copy_(g))
            start += g.numel()

    def buffer(self) -> torch.Tensor:
        return self.flat

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        return self.views

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


@pytest.fixture
def one_process_group(tmp_path: Path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_compression_does_not_depend_on_where_a_gradient_sits(
    one_process_group, monkeypatch
) -> None:
    """The cause of #35: the same gradients at every offset in a bucket (alignments 4 to 64
    bytes) give bitwise the same compressed gradients, error memory and Q, over three steps
    (the second and third start from the memory). On AMD EPYC the hook that multiplied the
    bucket's own views failed this at every offset that is not a multiple of 4 floats; on any
    CPU, every matrix product's operands must start 64-byte aligned, wherever the bucket is."""
    from train.parallel.powersgd import PowerSGD, powersgd_hook

    matmul, misaligned = torch.Tensor.__matmul__, []

    def spied(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        misaligned.extend(t.data_ptr() % 64 for t in (a, b) if t.data_ptr() % 64)
        return matmul(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", spied)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.Linear(100, 256))
    steps = [[torch.randn_like(p) for p in model.parameters()] for _ in range(3)]

    def run(offset: int) -> list[list[torch.Tensor]]:
        state, seen = PowerSGD(model, rank=2, start_iter=0, seed=7), []
        for grads in steps:
            bucket = _Bucket(model, grads, offset)
            powersgd_hook(state, bucket).wait()  # type: ignore[arg-type]
            seen.append([v.clone() for v in bucket.views])
            seen.append([*state.error.values(), *state.q.values()])
        return seen

    aligned = run(0)
    assert not torch.equal(aligned[0][0], steps[0][0])  # compressed, not passed through
    for offset in range(1, 17):
        for got, want in zip(run(offset), aligned, strict=True):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), f"offset {offset} changes the result"
    assert not misaligned, f"a product read a matrix {misaligned[0]} bytes past alignment"
