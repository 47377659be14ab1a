"""``python -m train plot runs/NAME``: loss and throughput curves of a run as one PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from melcache.errors import UserError
from train.run.metrics import METRICS_NAME, read_metrics


def plot_run(run: Path, output: Path | None = None) -> Path:
    """Draw ``run/metrics.jsonl`` into ``output`` (default ``run/metrics.png``); return its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'melcache[plot]'") from None
    path = Path(run) / METRICS_NAME
    if not path.is_file():
        raise UserError(f"{path} not found: is {run} a training run folder?")
    # A resumed run may have logged a step twice; the later record wins.
    # Event records (an out-of-memory error) carry no loss.
    every = read_metrics(path)
    logged = [r for r in every if "loss" in r]
    records = sorted({r["step"]: r for r in logged}.values(), key=lambda r: r["step"])
    if not records:
        raise UserError(f"{path} has no records yet")
    steps = [r["step"] for r in records]
    noise = any("noise_scale" in r for r in records)  # train.adapt.noise_scale: a panel
    heard = [r for r in records if "heard_epoch" in r]  # data.balance: a panel
    panels = 2 + noise + bool(heard)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3 * panels), sharex=True)
    top, bottom = axes[0], axes[1]
    top.plot(steps, _values(records, "loss"), label="loss")
    for extra in ("mel_loss", "stop_loss"):
        if extra in records[0]:
            top.plot(steps, _values(records, extra), label=extra, alpha=0.7)
    val = sorted(
        {r["step"]: r for r in every if "val_loss" in r}.values(),
        key=lambda r: r["step"],
    )
    if val:
        top.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val_loss")
    top.set_ylabel("loss (per valid frame)")
    top.legend()
    bottom.plot(steps, _values(records, "frames_per_s"), label="valid frames/s")
    bottom.set_ylabel("frames/s")
    wait = bottom.twinx()
    wait.plot(steps, _values(records, "data_wait_pct"), color="tab:red", alpha=0.6)
    wait.set_ylabel("data wait %", color="tab:red")
    if noise:
        _noise_panel(axes[2], steps, records)
    if heard:
        _heard_panel(axes[-1], heard)
    axes[-1].set_xlabel("step")
    fig.suptitle(Path(run).name)
    fig.tight_layout()
    output = Path(output) if output is not None else Path(run) / "metrics.png"
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


def _noise_panel(ax: Any, steps: list[int], records: list[dict[str, Any]]) -> None:
    """B_simple with its band against the batch the run trains on (frames per step)."""
    ax.plot(steps, _values(records, "noise_scale"), label="B_simple (frames)")
    low, high = _values(records, "noise_scale_lo"), _values(records, "noise_scale_hi")
    ax.fill_between(steps, low, high, alpha=0.3)
    ax.plot(steps, _values(records, "frames_per_step"), "--", label="frames per step")
    ax.set_ylabel("frames")
    ax.set_yscale("symlog")
    ax.legend()


def _heard_panel(ax: Any, heard: list[dict[str, Any]]) -> None:
    """Each language's share of the hours an epoch dealt (dots) against its target (dashes),
    at the step each epoch was reported, and the speakers' total-variation distance."""
    steps = [r["step"] for r in heard]
    names = sorted(
        {
            k.removeprefix("target/language/")
            for r in heard
            for k in r
            if k.startswith("target/language/")
        }
    )
    for i, name in enumerate(names):
        color = f"C{i}"
        ax.plot(steps, _values(heard, f"heard/language/{name}"), "o", color=color, label=name)
        ax.plot(steps, _values(heard, f"target/language/{name}"), "--", color=color)
    ax.plot(steps, _values(heard, "heard/speaker_tv"), "x-", color="black", label="speaker TV")
    ax.set_ylabel("share of hours heard")
    ax.legend(fontsize="small", ncol=4)


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    """``key`` of each record; NaN (a gap in the curve) where one lacks it or holds no number."""
    return [
        float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        for v in (r.get(key) for r in records)
    ]
