"""``python -m train export RUN [RUN ...] --out DIR``: a run's weights out of melcache.

For each run it reads the newest complete checkpoint (``train/run/checkpoint.py``): the model
state of ``shared.pt`` for a DDP run, or the DCP shards of ``weights/`` consolidated in one
process for an FSDP2/HSDP run (``train/run/dcp.py`` ``read_full``, no pickle run). Both are
the same full tensors, so both export the same bytes. It writes::

    DIR/weights/NAME/model.safetensors   the weights (the EMA's with --ema), keyed as the model's
    DIR/weights/NAME/run.json            impl, step, the checkpoint it came from, its config
    DIR/export.json                      the runs exported

Where a model's adapter declares a home format (``melcache_contract["home"] =
"package.module:function"``, ``train/model/contract.py``), the runs of that format are handed
to ``function(runs, DIR, release)``, which writes it beside (for ChatTTS: ``DIR/asset/``, the
folder ChatTTS's ``Chat`` loads; ``examples/chattts/home.py``) and returns lines saying what it
wrote. ``DIR`` must be empty or new; with ``--force`` an export writes into a non-empty one,
replacing files of the names it writes and deleting nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from melcache.errors import UserError
from train.model.contract import declared
from train.run import dcp
from train.run.checkpoint import SHARED, CorruptCheckpoint, complete_checkpoints, read_state

log = logging.getLogger(__name__)

WEIGHTS = "weights"  # DIR/weights/NAME: the plain export of each run


@dataclasses.dataclass(frozen=True)
class ExportedRun:
    """One run's weights as the export read them: what a home writer is given."""

    run: Path  # the run folder
    checkpoint: Path  # its step-N folder
    step: int
    impl: str  # [model] impl
    config: dict[str, Any]  # the run's whole config, as its checkpoint holds it
    weights: dict[str, torch.Tensor]  # full tensors on the CPU, keyed as the model's state


HomeWriter = Callable[[list[ExportedRun], Path, "Path | None"], list[str]]


def parser() -> argparse.ArgumentParser:
    """The ``python -m train export`` command line."""
    p = argparse.ArgumentParser(
        prog="python -m train export",
        description="Write runs' weights as safetensors (DDP and FSDP2 runs alike), with their "
        "config and step, and, where a model's adapter declares one, its home format (ChatTTS: "
        "DIR/asset/, which ChatTTS's own Chat loads). Bad input is one line and exit 2.",
    )
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run folder (train --out)")
    p.add_argument("--out", type=Path, required=True, help="folder to write (empty or new)")
    p.add_argument(
        "--release",
        type=Path,
        help="a released model's folder of the home format (ChatTTS: the folder holding asset/) "
        "to take the parts no run trained from (ChatTTS's Decoder and Vocos)",
    )
    p.add_argument("--ema", action="store_true", help="export the runs' EMA weights")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier export's files in a non-empty --out",
    )
    return p


def export(
    runs: list[Path],
    out: Path,
    *,
    release: Path | None = None,
    ema: bool = False,
    force: bool = False,
) -> list[str]:
    """Export ``runs`` into ``out`` (see the module docstring); the lines saying what was
    written. :class:`UserError` in one line for a run without a complete checkpoint, a name
    given twice, a non-empty ``out`` without ``force`` and what a home writer refuses."""
    _check_out(out, force)
    names = [run.resolve().name for run in runs]
    if len(set(names)) != len(names):
        raise UserError(f"runs {names} share a folder name: export them into separate --out")
    started = time.perf_counter()
    read = [read_run(run, ema=ema) for run in runs]
    lines = []
    for one in read:
        lines.append(_write_plain(one, out / WEIGHTS / one.run.resolve().name))
    for writer, group in _home_writers(read).items():
        lines.extend(writer(group, out, release))
    (out / "export.json").write_text(
        json.dumps({"runs": [str(r.run) for r in read], "ema": ema}, indent=1) + "\n"
    )
    lines.append(f"exported in {time.perf_counter() - started:.1f} s into {out}")
    return lines


def read_run(run: Path, *, ema: bool = False) -> ExportedRun:
    """The newest complete checkpoint of ``run``: its model (or EMA) weights as full tensors."""
    done = complete_checkpoints(run / "checkpoints")
    if not done:
        raise UserError(f"{run}: no complete checkpoint in {run / 'checkpoints'}")
    path = done[0]
    try:
        shared = read_state(path / SHARED, mmap=True)
        if (path / dcp.WEIGHTS).exists():  # FSDP2/HSDP: every rank's shards, consolidated
            dcp.check(path / dcp.WEIGHTS)
            shared = {**shared, **dcp.read_full(path / dcp.WEIGHTS)}
    except (CorruptCheckpoint, OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot be exported: {exc}") from None
    weights = {k: _plain(v) for k, v in shared["model"].items()}
    if ema:  # the EMA averages the trained parameters: buffers and frozen ones are the model's
        if not shared.get("ema"):
            raise UserError(f"{path}: the run kept no EMA (train.ema_decay): export without --ema")
        for name, value in shared["ema"]["shadow"].items():
            weights[name] = _plain(value).to(weights[name].dtype)
    config = shared["config"]
    return ExportedRun(run, path, int(shared["step"]), config["model"]["impl"], config, weights)


def save_weights(weights: dict[str, torch.Tensor], path: Path) -> None:
    """``weights`` as one safetensors file (contiguous CPU tensors; ``format: pt`` as Hugging
    Face's loaders expect)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    save_file(plain, str(path), metadata={"format": "pt"})


def _plain(value: Any) -> torch.Tensor:
    """A full CPU tensor in memory: DCP's consolidation gives plain tensors, DDP's state
    mapped ones (cloned: the file may be replaced while the export writes)."""
    full = getattr(value, "full_tensor", None)  # a DTensor, should one come through
    return (full() if callable(full) else value).detach().to("cpu").clone()


def _write_plain(run: ExportedRun, folder: Path) -> str:
    save_weights(run.weights, folder / "model.safetensors")
    meta = {
        "impl": run.impl,
        "step": run.step,
        "checkpoint": str(run.checkpoint),
        "config": run.config,
    }
    (folder / "run.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    count = sum(t.numel() for t in run.weights.values())
    return f"{run.run}: step {run.step}, {count / 1e6:.1f} M parameters → {folder}"


def _home_writers(runs: list[ExportedRun]) -> dict[HomeWriter, list[ExportedRun]]:
    """The runs grouped by the home writer their model class declares (none: no group)."""
    groups: dict[HomeWriter, list[ExportedRun]] = {}
    for run in runs:
        cls = _imported(run.impl, f"the run's model.impl = {run.impl!r}")
        home = declared(cls, run.impl).home
        if home is not None:
            writer = _imported(home, f"{run.impl}'s home format {home!r}")
            groups.setdefault(writer, []).append(run)
    return groups


def _imported(spec: str, what: str) -> Any:
    """``package.module:name``, imported; one line naming ``what`` where it cannot be."""
    module_name, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"{what} cannot be imported: {exc}") from None


def _check_out(out: Path, force: bool) -> None:
    """Refuse a file, or a non-empty folder without ``force``, as ``out``."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(
            f"--out {out} is not empty: export into a new folder, or add --force to write "
            "into it (files of the names an export writes are replaced; nothing is deleted)"
        )
    out.mkdir(parents=True, exist_ok=True)


def main(argv: list[str]) -> int:
    """Run the command; print what was written."""
    args = parser().parse_args(argv)
    for line in export(args.runs, args.out, release=args.release, ema=args.ema, force=args.force):
        print(line)
    return 0
