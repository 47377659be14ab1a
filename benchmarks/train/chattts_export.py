"""ChatTTS in and out at its released size: the time to start a run from a release, to export a
run back into ChatTTS's ``asset/`` layout, and for ChatTTS's ``Chat`` to load the export.

    python -m benchmarks.train.chattts_export [--repeats 3] [--data DIR] [--tiny]

1. A release at ChatTTS's released sizes, made from its own modules at random init
   (``examples/chattts/random_release.py``: nothing can be downloaded here; the time does not
   depend on the values).
2. Import: the GPT example built from it (``release = DIR``: ``gpt/`` and ``Embed`` mapped
   strictly) against the same model at random init; the DVAE example the same way.
3. Export: ``python -m train export`` of a run folder holding the GPT's weights and an AdamW
   state of the same size (what a real checkpoint's ``shared.pt`` holds), with the release's
   DVAE, Decoder and Vocos; then ``examples.chattts.chat.load_chat`` of the export.

One JSON line per row: medians and the spread of ``--repeats`` runs, in seconds. ``--tiny``:
the examples' sizes instead (a check that every row runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def timed(repeats: int, work: Callable[[], object]) -> dict[str, float]:
    """Median, fastest and slowest wall seconds of ``repeats`` calls of ``work``."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - started)
    return {"median_s": round(statistics.median(seconds), 3), "min_s": round(min(seconds), 3),
            "max_s": round(max(seconds), 3)}  # fmt: skip


def saved_run(folder: Path, model: torch.nn.Module, release: Path, args: dict) -> Path:
    """A run folder in the trainer's layout: the model's weights and an AdamW state of its
    size at step 1, its config naming the release's tokenizer."""
    from examples.chattts.asset import ASSET, TOKENIZER

    step = folder / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
    data = {"tokenizer": "examples.chattts_gpt.tokenizer:ChatTTSTokenizer",
            "vocab": str(release / ASSET / TOKENIZER)}  # fmt: skip
    config = {"model": {"impl": "examples.chattts_gpt.adapter:GPT", "args": args}, "data": data}
    state = {"step": 1, "config": config, "model": model.state_dict(),
             "optimizer": optimizer.state_dict()}  # fmt: skip
    torch.save(state, step / "shared.pt")
    (step / "COMPLETE.json").write_text(json.dumps({"step": 1, "world_size": 1}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train.chattts_export")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each row")
    parser.add_argument("--data", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--tiny", action="store_true", help="the examples' sizes")
    args = parser.parse_args()
    from examples.chattts.chat import load_chat
    from examples.chattts.random_release import fabricate
    from examples.chattts_dvae.adapter import DVAE
    from examples.chattts_gpt.adapter import GPT
    from train.export import export

    with tempfile.TemporaryDirectory(dir=args.data) as work:
        root = Path(work)
        release = fabricate(
            root / "release", tiny=args.tiny, text_tokens=300 if args.tiny else 21178
        )
        sizes = {"hidden": 64, "layers": 2, "heads": 4, "intermediate": 128} if args.tiny else {}
        dvae_sizes = {"dim": 64, "hidden": 32, "layers": 2, "bn_dim": 16, "vq_dim": 128}
        dvae_sizes = dvae_sizes if args.tiny else {}
        vocab = 300 if args.tiny else 21178

        def gpt(**release_arg: str) -> GPT:
            return GPT(vocab_size=vocab, **sizes, **release_arg)

        rows = {
            "GPT from the release (import)": lambda: gpt(release=str(release)),
            "GPT at random init (beside it)": gpt,
            "DVAE from the release (import)": lambda: DVAE(
                n_mels=100, release=str(release), **dvae_sizes
            ),
            "DVAE at random init (beside it)": lambda: DVAE(n_mels=100, **dvae_sizes),
        }
        for name, work_ in rows.items():
            print(json.dumps({"row": name, **timed(args.repeats, work_)}))
        run = saved_run(root / "run", gpt(release=str(release)), release, sizes)
        size = (run / "checkpoints/step-00000001/shared.pt").stat().st_size
        out = root / "export"
        row = timed(args.repeats, lambda: export([run], out, release=release, force=True))
        print(json.dumps({"row": "export of a GPT run (train export)", "shared_pt_gb":
                          round(size / 1e9, 2), **row}))  # fmt: skip
        row = timed(args.repeats, lambda: load_chat(out, "cpu"))
        print(json.dumps({"row": "ChatTTS's Chat.load of the export (load_chat)", **row}))


if __name__ == "__main__":
    main()
