"""The trackers ``train.trackers`` names, each a :class:`Backend` opened by name on its own
thread (``train/run/trackers.py``). Each imports its package only when opened, so a run that
asks for neither never imports either.

- ``tensorboard``: event files in ``OUT/tensorboard/`` written by TensorBoard's own writer
  (``torch.utils.tensorboard.SummaryWriter``), scalars in float64, so what TensorBoard reads
  back equals ``metrics.jsonl``; a resumed run purges the steps after its checkpoint.
- ``wandb``: ``wandb.init(id=..., resume="allow")`` with the id the checkpoint keeps, in
  ``OUT/wandb/`` unless ``WANDB_DIR`` says; project, entity, mode (``WANDB_MODE=offline``),
  name (default: the run folder's) and console capture (default off) follow W&B's own
  ``WANDB_*`` variables. Charts are drawn against the trainer's step (``step``), so a record
  logged again after a resume or a rewind is kept, not dropped as an old step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class Backend(Protocol):
    """What a tracker does with the records it is handed, on its own thread."""

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def picture(self, step: int, tag: str, path: Path) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Opening:
    """What a tracker is opened with: the run folder, the step the run starts from, the W&B
    run id (``None`` without W&B) and the resolved config."""

    out: Path
    start_step: int
    wandb_run_id: str | None
    config: dict[str, Any]


class TensorBoard:
    """TensorBoard event files in ``OUT/tensorboard/``."""

    def __init__(self, opening: Opening) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run logs again from its checkpoint's step + 1: TensorBoard hides what an
        # earlier process wrote from there on.
        self.writer = SummaryWriter(
            log_dir=str(opening.out / "tensorboard"), purge_step=opening.start_step + 1
        )

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step, new_style=True, double_precision=True)

    def picture(self, step: int, tag: str, path: Path) -> None:
        import numpy as np
        from PIL import Image  # matplotlib's own dependency, there when a picture is

        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
        self.writer.add_image(tag, pixels, step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run, continued across resumes by the id the checkpoint keeps."""

    def __init__(self, opening: Opening) -> None:
        import wandb

        env = os.environ
        self.run = wandb.init(
            id=opening.wandb_run_id,
            resume="allow",
            dir=None if "WANDB_DIR" in env else str(opening.out),
            name=None if "WANDB_NAME" in env else opening.out.name,
            config=opening.config,
            settings=wandb.Settings(console=env.get("WANDB_CONSOLE", "off")),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self._image = wandb.Image

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def picture(self, step: int, tag: str, path: Path) -> None:
        self.run.log({"step": step, tag: self._image(str(path))})

    def close(self) -> None:
        self.run.finish()


# The names train.trackers accepts (train/config/train_table.py TRACKERS), each with the
# package it needs installed and how it opens.
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb"}
# The folder each tracker writes into, checked before the first step (train/run/trackers.py).
DESTINATIONS: dict[str, Callable[[Opening], Path]] = {
    "tensorboard": lambda opening: opening.out / "tensorboard",
    "wandb": lambda opening: Path(os.environ.get("WANDB_DIR") or opening.out),
}
OPENERS: dict[str, Callable[[Opening], Backend]] = {"tensorboard": TensorBoard, "wandb": WandB}
