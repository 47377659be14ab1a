"""Command line: ``[torchrun ...] -m train --shards DIR --config FILE --out RUN``,
``python -m train tune --shards DIR --config FILE``, ``python -m train plot RUN`` and
``python -m train export RUN [RUN ...] --out DIR``.

Examples::

    torchrun --standalone --nproc-per-node 2 -m train --shards shards \\
        --config tiny --out runs/tiny --max-steps 50 train.precision=fp32
    python -m train plot runs/tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from melcache.errors import ShardError, UserError

log = logging.getLogger("train")


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train",
        description="Train on a melcache cache; the same command under torchrun runs DDP. "
        "Rerunning with the same --out resumes from its latest complete checkpoint.",
        epilog="Also: `python -m train plot RUN [--output PNG]` draws a run's loss, frames/s "
        "and data-wait % from RUN/metrics.jsonl; `python -m train tune --shards DIR --config "
        "FILE` finds per-bucket batch budgets for this device; `python -m train export RUN --out "
        "DIR` writes a run's weights as safetensors (and its model's home format). Bad input is one line on stderr "
        "and exit 2.",
    )
    p.add_argument(
        "--shards",
        required=True,
        action="append",
        help="cache folder (or URL prefix) with index.json; repeat it for a mix, weighted by "
        "[data.mix] (keyed by these locations) or by hours",
    )
    p.add_argument(
        "--config",
        type=Path,
        action="append",
        help="trainer TOML ([model], [data], [optim], [train]) or a preset name (tiny, base); "
        "repeat it to merge files in order, e.g. a preset then the budgets `train tune` wrote",
    )
    p.add_argument("--out", type=Path, required=True, help="run folder: checkpoints, metrics")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    p.add_argument(
        "--val-shards",
        help="validation cache (data.val_shards), used every train.validation.every steps",
    )
    p.add_argument("overrides", nargs="*", metavar="table.key=value", help="config overrides")
    return p


def _tune_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train tune",
        description="Find, per length bucket, the largest batch budget whose training step fits "
        "train.memory.target of this device's memory (a GPU tool; see train/tune.py), print a "
        "table and write a [data.batch_frames] table to pass as a second --config. Under torchrun "
        "it searches train.parallel.strategy = fsdp2/hsdp with every rank in step.",
    )
    p.add_argument("--shards", required=True, help="cache folder (or URL prefix) with index.json")
    p.add_argument("--config", type=Path, action="append", help="trainer TOML, as for training")
    p.add_argument("--output", type=Path, default=Path("budgets.toml"), help="TOML to write")
    p.add_argument(
        "--memory-limit-mib",
        type=float,
        help="on CPU: search against this many MiB of live tensors (tests the search)",
    )
    p.add_argument("overrides", nargs="*", metavar="table.key=value", help="config overrides")
    return p


def _plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train plot", description="Plot a run's metrics.")
    p.add_argument("run", type=Path, help="run folder holding metrics.jsonl")
    p.add_argument("--output", type=Path, help="PNG to write (default RUN/metrics.png)")
    return p


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")  # checked by train.parallel.env.setup, not here
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the command; return the exit status (2 for bad input)."""
    argv = sys.argv[1:] if argv is None else argv
    _setup_logging()
    try:
        if argv[:1] == ["plot"]:
            from train.plot import plot_run

            args = _plot_parser().parse_args(argv[1:])
            print(plot_run(args.run, args.output))
            return 0
        if argv[:1] == ["export"]:
            from train.export import main as export_main

            return export_main(argv[1:])
        if argv[:1] == ["tune"]:
            from train.config.tables import load_config
            from train.parallel.env import setup, teardown
            from train.tune import render, tune

            args = _tune_parser().parse_args(argv[1:])
            cfg = load_config(args.config, args.overrides)
            env = setup()  # under torchrun: the ranks search a sharded strategy in step
            try:
                rows, where = tune(
                    cfg, args.shards, memory_limit_mib=args.memory_limit_mib, env=env
                )
            finally:
                teardown(env)
            if env.is_main:
                table, toml = render(rows, where)
                args.output.write_text(toml, encoding="utf-8")
                print(f"{table}\n\nwritten to {args.output}")
            return 0
        args = _train_parser().parse_intermixed_args(argv)  # overrides on both sides of options
        from train.config.tables import load_config
        from train.trainer import run

        overrides = list(args.overrides)
        if args.max_steps is not None:
            overrides.append(f"train.max_steps={args.max_steps}")
        if args.val_shards is not None:
            overrides.append(f"data.val_shards={json.dumps(args.val_shards)}")
        cfg = load_config(args.config, overrides)
        run(cfg, args.shards, args.out)
        return 0
    except (UserError, ShardError) as exc:
        log.error("%s", _reason(exc))
        return 2


def _reason(exc: Exception) -> str:
    """The error's own one-line message: DataLoader re-raises a loader worker's error with the
    worker's traceback as its message, whose last line is ``module.Class: message``."""
    text = str(exc).strip()
    if "\nOriginal Traceback" not in text:
        return text
    return text.splitlines()[-1].split(": ", 1)[-1]


if __name__ == "__main__":
    sys.exit(main())
