"""ChatTTS's GPT planned on code frames alone, as every model was before ``data.sequence``:
today's arm of ``sequence_tune_bench --model chattts-gpt`` (a module of its own, since it needs
the ``chattts`` extra)."""

from __future__ import annotations

from typing import Any, ClassVar

from examples.chattts_gpt.adapter import GPT


class GPTPlannedOnFrames(GPT):
    """The adapter's GPT with its contract less its declared sequence."""

    melcache_contract: ClassVar[dict[str, Any]] = {
        key: value for key, value in GPT.melcache_contract.items() if key != "sequence"
    }
