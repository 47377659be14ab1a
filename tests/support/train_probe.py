"""Helper run under ``torchrun`` by the 2-rank tests (not collected by pytest).

``ddp CACHE OUT [key=value ...]``: inside one 2-rank job, check the DDP properties that
need a look inside the loop, and write ``OUT/probe-rank{R}.json``:

- gradient all-reduce rounds per optimizer step, counted with a comm hook, with and
  without accumulation;
- k accumulated micro-batches on 2 ranks give the same gradient and the same update as
  one batch of their union on a plain model (fp32, no dropout);
- the fp16 (GradScaler) and bf16 (autocast) paths train.

``powersgd-overflow CACHE OUT [key=value ...]``: 8 fp16 steps with PowerSGD on from step 3;
rank 0's loss is multiplied by inf in step 5. Write ``OUT/overflow-rank{R}.json``: which
steps changed the weights, the loss scale after each, whether PowerSGD's memory is finite.

``tune-check CACHE BUDGETS LIMIT_MIB OUT [key=value ...]``: search the budgets again with
``train.tune.tune`` on every rank of the job (FSDP2), then check each row independently: a
real training step on its bucket's worst batch of B utterances fits 90 % of the limit on
every rank, one of B + 1 runs out of memory on some rank, and every rank agrees, also when
only rank 1 runs out (its limit halved). Write ``OUT/tune-check-rank{R}.json``.

``slow-ckpt STEP MARKER -- ARGS``: run ``python -m train ARGS``, but stall forever halfway
through writing checkpoint STEP after touching MARKER, so the test can kill -9 mid-write.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from melcache.errors import UserError  # noqa: E402
from melcache.loader import Batch  # noqa: E402
from train.config.tables import load_config  # noqa: E402
from train.memory.probes import MemoryCap, agreement, tensor_bytes  # noqa: E402
from train.parallel.env import setup, teardown  # noqa: E402
from train.parallel.fsdp import abandon_step  # noqa: E402
from train.run import checkpoint  # noqa: E402
from train.trainer import Trainer  # noqa: E402
from train.tune import WorstBatch, tune  # noqa: E402

TINY = REPO / "configs" / "tiny.toml"


def count_allreduce_rounds(
    env, cache: str, out: Path, overrides: list[str], accum: int
) -> list[int]:
    """The step index of every gradient bucket all-reduce during 3 optimizer steps."""
    cfg = load_config(TINY, [*overrides, f"train.grad_accum={accum}", "train.precision=fp32"])
    trainer = Trainer(cfg, cache, out / f"rounds-{accum}", env)
    calls: list[int] = []

    def counting_hook(state, bucket):
        calls.append(trainer.step)
        return default_hooks.allreduce_hook(state, bucket)

    trainer.model.register_comm_hook(None, counting_hook)
    try:
        trainer.fit(3)
    finally:
        trainer.close()
    return calls


def union(batches: list[Batch]) -> Batch:
    """One batch holding every utterance of ``batches``, re-padded to the longest."""
    T = max(b.mel.shape[1] for b in batches)
    L = max(b.text.shape[1] for b in batches)
    mel = torch.cat(
        [torch.nn.functional.pad(b.mel, (0, 0, 0, T - b.mel.shape[1])) for b in batches]
    )
    text = torch.cat([torch.nn.functional.pad(b.text, (0, L - b.text.shape[1])) for b in batches])
    return Batch(
        mel=mel,
        mel_lengths=torch.cat([b.mel_lengths for b in batches]),
        text=text,
        text_lengths=torch.cat([b.text_lengths for b in batches]),
        keys=[k for b in batches for k in b.keys],
        speaker=[s for b in batches for s in b.speaker],
        bucket=-1,  # several buckets
    )


def accumulation_matches_union(env, cache: str, out: Path, overrides: list[str], k: int) -> dict:
    """One step of k micro-batches × 2 ranks vs one plain step on their union."""
    cfg = load_config(
        TINY,
        [
            *overrides,
            f"train.grad_accum={k}",
            "train.precision=fp32",
            "optim.grad_clip=0",
            "model.args.dropout=0.0",
            "model.args.prenet_dropout=0.0",
        ],
    )
    trainer = Trainer(cfg, cache, out / "accum", env)
    reference = copy.deepcopy(trainer.parts.raw_model)
    ref_opt = torch.optim.AdamW(
        [
            {
                "params": [p for p in reference.parameters() if p.dim() >= 2],
                "weight_decay": cfg.optim.weight_decay,
            },
            {"params": [p for p in reference.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=trainer.parts.optimizer.param_groups[0]["lr"],
        betas=cfg.optim.betas,
        eps=cfg.optim.eps,
    )
    batches = iter(trainer.parts.loader)
    micro = [next(batches) for _ in range(k)]
    every = [None] * env.world_size
    dist.all_gather_object(every, micro)
    trainer.parts.optimizer.zero_grad = lambda set_to_none=True: None  # keep the grads to compare
    trainer.train_step(micro)
    whole = union([b for rank_batches in every for b in rank_batches])
    out_ref = reference(whole.mel, whole.mel_lengths, whole.text, whole.text_lengths)
    (out_ref["loss_sum"] / whole.mel_lengths.sum()).backward()
    ref_opt.step()
    grad_diff = max(
        ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
        for p, q in zip(trainer.parts.raw_model.parameters(), reference.parameters(), strict=True)
    )
    param_diff = max(
        (p - q).abs().max().item()
        for p, q in zip(trainer.parts.raw_model.parameters(), reference.parameters(), strict=True)
    )
    trainer.close()
    return {
        "micro_batches_per_rank": len(micro),
        "utterances": len(whole),
        "max_rel_grad_diff": grad_diff,
        "max_param_diff": param_diff,
        "lr": ref_opt.param_groups[0]["lr"],
    }


def precision_runs(env, cache: str, out: Path, overrides: list[str], precision: str) -> dict:
    """A few steps in ``precision``; report the final loss and the loss scale."""
    cfg = load_config(TINY, [*overrides, f"train.precision={precision}", "train.log_every=1"])
    trainer = Trainer(cfg, cache, out / precision, env)
    try:
        trainer.fit(3)
    finally:
        trainer.close()
    records = (
        [json.loads(line) for line in (out / precision / "metrics.jsonl").read_text().splitlines()]
        if env.is_main
        else []
    )
    return {
        "precision": trainer.parts.precision,
        "scaler_enabled": trainer.parts.scaler.is_enabled(),
        "scale": trainer.parts.scaler.get_scale() if trainer.parts.scaler.is_enabled() else None,
        "losses": [r["loss"] for r in records],
    }


def ddp_main(cache: str, out: Path, overrides: list[str]) -> None:
    env = setup()
    try:
        result = {
            "world_size": env.world_size,
            "rounds_accum1": count_allreduce_rounds(env, cache, out, overrides, 1),
            "rounds_accum3": count_allreduce_rounds(env, cache, out, overrides, 3),
            "union": accumulation_matches_union(env, cache, out, overrides, 3),
            "fp16": precision_runs(env, cache, out, overrides, "fp16"),
            "bf16": precision_runs(env, cache, out, overrides, "bf16"),
        }
        (out / f"probe-rank{env.rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        teardown(env)


def powersgd_overflow_main(cache: str, out: Path, overrides: list[str]) -> None:
    env = setup()
    try:
        cfg = load_config(
            TINY, [*overrides, "train.precision=fp16", "train.parallel.comm_hook=powersgd"]
        )
        trainer = Trainer(cfg, cache, out / "run", env)
        real_backward, steps = trainer._backward, []

        def overflowing_backward(out_, loss_scale):
            poison = trainer.step == 4 and env.rank == 0
            real_backward(out_, loss_scale * (math.inf if poison else 1.0))

        trainer._backward = overflowing_backward
        batches = iter(trainer.parts.loader)
        for _ in range(8):
            before = [p.detach().clone() for p in trainer.parts.raw_model.parameters()]
            trainer.train_step([next(batches)])
            trainer.step += 1
            changed = any(
                not torch.equal(a, p)
                for a, p in zip(before, trainer.parts.raw_model.parameters(), strict=True)
            )
            steps.append({"changed": changed, "scale": trainer.parts.scaler.get_scale()})
        memory = trainer.parts.powersgd.state_dict()
        result = {
            "steps": steps,
            "compressed": sorted(memory["error"]),
            "finite": all(
                bool(t.isfinite().all()) for t in [*memory["error"].values(), *memory["q"].values()]
            ),
        }
        trainer.close()
        (out / f"overflow-rank{env.rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        teardown(env)


def worst_batch(size: int, frames: int, tokens: int, bucket: int) -> Batch:
    """``size`` utterances as long as ``frames``, with ``tokens`` of text (100 mel bins, padded
    to 8): the bucket's worst batch ``train tune`` measures (``train.tune.WorstBatch``)."""
    return WorstBatch(bucket, frames, tokens, pad_multiple=8, n_mels=100).batch(size)


def tune_check_main(cache: str, budgets: Path, limit_mib: float, out: Path, overrides: list[str]):
    env = setup()
    try:
        cfg = load_config([TINY, budgets], overrides)
        rows, _ = tune(cfg, cache, memory_limit_mib=limit_mib, env=env)
        trainer = Trainer(cfg, cache, out / f"check-{env.rank}", env)
        baseline = tensor_bytes(trainer.parts.raw_model.state_dict().values())
        cap = MemoryCap(0.9 * limit_mib * 2**20, baseline, agree=agreement(env))

        def fits(batch: Batch) -> bool:
            gc.collect()
            cap.reset_peak()
            try:
                with cap:
                    verdict = trainer.train_step([batch])
                cap.settle()
                return not verdict.skipped
            except (torch.OutOfMemoryError, UserError):  # FSDP2's trainer: a UserError
                if not cap.raised:
                    raise
                abandon_step(trainer.parts.raw_model)
                return False

        assert fits(worst_batch(1, 29, 8, 0))  # the optimizer state, as in one process
        result = {
            "budgets": {str(r.bucket): r.budget for r in rows},
            "verdicts": {
                str(r.bucket): [fits(worst_batch(n, r.max_frames, r.text_tokens, 0)) for n in
                                (r.samples, r.samples + 1)]
                for r in rows
            },
        }  # fmt: skip
        # Ranks that disagree: rank 1 alone has half the memory. It runs out mid-forward;
        # rank 0, which would fit, must raise with it rather than wait in the next all-gather.
        cap.limit /= 1 + env.rank
        first = rows[0]
        result["uneven"] = fits(worst_batch(first.samples, first.max_frames, first.text_tokens, 0))
        trainer.close()
        (out / f"tune-check-rank{env.rank}.json").write_text(json.dumps(result))
    finally:
        teardown(env)


def slow_checkpoint_main(step: int, marker: Path, argv: list[str]) -> int:
    """``python -m train`` whose write of checkpoint ``step`` stalls halfway."""
    real_write = checkpoint._write

    def stalling_write(state, path: Path) -> None:
        if path.parent.name.endswith(f"step-{step:08d}"):
            data = _serialise(state)
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
            marker.touch()
            time.sleep(3600)  # the test kills us here
        real_write(state, path)

    checkpoint._write = stalling_write
    from train.__main__ import main

    return main(argv)


def _serialise(state) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "ddp":
        ddp_main(rest[0], Path(rest[1]), rest[2:])
    elif mode == "powersgd-overflow":
        powersgd_overflow_main(rest[0], Path(rest[1]), rest[2:])
    elif mode == "tune-check":
        tune_check_main(rest[0], Path(rest[1]), float(rest[2]), Path(rest[3]), rest[4:])
    elif mode == "slow-ckpt":
        sys.exit(slow_checkpoint_main(int(rest[0]), Path(rest[1]), rest[3:]))
    else:
        sys.exit(f"unknown mode {mode}")
