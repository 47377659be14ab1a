"""What a plugged-in model declares, what it is handed, and what it must return.

A model class may declare, in a class attribute ``melcache_contract`` (a dict; every key
optional, the defaults being the reference :class:`train.model.text_to_mel.TextToMel`'s):

- ``"inputs"``: ``"tensors"`` — ``forward(mel, mel_lengths, text, text_lengths)`` — or
  ``"batch"`` — ``forward(batch)`` with the whole :class:`melcache.loader.batch.Batch` (mel, lengths,
  text, speaker, keys, bucket and any field the loader adds, such as ``source``).
- ``"mel_dtype"``: ``"float16"`` (as stored), ``"float32"`` or ``"bfloat16"``: the mel is cast
  to it on the device before the forward.
- ``"pad"``: ``"multiple"`` (mel and text padded to ``data.pad_multiple``) or ``"longest"``
  (never past the longest utterance of the batch, for models that tie frames to positions).
- ``"features"``: a preset name (``melcache.features.feature_presets``: ``"chattts"``, ``"hifigan"``) or
  a table of feature keys; the cache must match every key, the log floor included.
- ``"extras"``: per-utterance fields the model needs in ``batch.extras`` (with ``"inputs":
  "batch"``): fields the cache was built to carry (``[build] extras``, e.g. ``"language"``: a
  list of ``B`` values) and ``"reference"`` (int64 ``[B]``: the row of another utterance of the
  same speaker in the batch, or -1; ``melcache/loader/batch.py``). A field a cache lacks is refused at
  start, by name.
- ``"fields"``: derived fields (``python -m preprocess derive``, docs/fields.md) the model needs
  in ``batch.fields`` / ``batch.field_lengths`` (with ``"inputs": "batch"``): a list of names,
  or a table of names to the provenance keys the cache's field must equal (``{"codes":
  {"encoder": "examples.chattts_dvae.adapter:encoder"}}``); ``[data] field_provenance`` adds
  per-run ones (a checkpoint digest). A field the cache lacks or whose provenance differs is
  refused at start, naming both.
- ``"mel"``: ``False`` for a model that reads fields only: the loader then reads the field
  shards alone (no mel byte), ``batch.mel`` is ``[B, T, 0]``, and ``mel_lengths``, bucketing,
  budgets and the schedule count the first field's frames.
- ``"sequence"``: what the model's sequence is made of: ``"frames"`` (the default),
  ``"text+frames"`` (the text's tokens then one position per frame, ChatTTS's GPT): the
  loader then plans, budgets and cuts on ``text + frames``; or ``"text,frames"`` (an
  encoder-decoder's text and frames, two axes each padded and budgeted on its own,
  ``data.batch_text`` beside ``data.batch_frames``): ``data.sequence``,
  ``melcache/loader/sequence.py``, docs/loader.md "One sequence".
- ``"home"``: ``"package.module:function"``, the writer of the model's home format, which
  ``python -m train export`` calls with the runs of models declaring it (``train/export.py``;
  ChatTTS's ``asset/`` folder: ``examples/chattts/home.py``).

A constructor with a ``vocab_size`` parameter is given the tokenizer's vocabulary size.

The forward returns a dict with either ``"loss_sum"`` (a float32 scalar: the sum of the loss
over what it counts) and optionally ``"loss_count"`` (how many it summed over; default the
valid mel frames of the batch), or ``"loss"`` (a mean) and ``"loss_weight"`` (what it
averages over). The trainer sums counts over passes and ranks and logs ``Σ loss_sum ÷ Σ
count``; gradients follow the same mean. Other ``"<name>_sum"`` scalars are logged as
``<name>`` divided by the same count. The first step checks all this (:func:`check_outputs`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from melcache.errors import UserError
from melcache.features import feature_presets
from melcache.fields.format import name_problem as field_name_problem
from melcache.loader.batch import Batch
from melcache.loader.data_config import SEQUENCES, DataConfig
from train.config.tables import ModelConfig
from train.parallel.env import Env, all_reduce_sum

_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
_CHOICES = {
    "inputs": ("tensors", "batch"),
    "mel_dtype": tuple(_DTYPES),
    "pad": ("multiple", "longest"),
    "sequence": SEQUENCES,
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model class's ``melcache_contract``, checked."""

    inputs: str = "tensors"
    mel_dtype: str = "float16"
    pad: str = "multiple"
    features: str | Mapping[str, Any] | None = None
    extras: tuple[str, ...] = ()
    fields: tuple[str, ...] | Mapping[str, Mapping[str, Any]] = ()
    mel: bool = True
    home: str | None = None
    sequence: str = "frames"


def declared(cls: type, impl: str) -> ModelSpec:
    """The checked ``melcache_contract`` of model class ``cls`` (``impl`` names it in errors)."""
    table = getattr(cls, "melcache_contract", {})
    if not isinstance(table, Mapping):
        raise UserError(f"{impl}.melcache_contract must be a dict, not {type(table).__name__}")
    unknown = set(table) - {f.name for f in dataclasses.fields(ModelSpec)}
    if unknown:
        raise UserError(f"{impl}.melcache_contract has unknown keys {sorted(unknown)}")
    for key, choices in _CHOICES.items():
        if key in table and table[key] not in choices:
            raise UserError(
                f"{impl}.melcache_contract[{key!r}] = {table[key]!r}: expected {' or '.join(choices)}"
            )
    features = table.get("features")
    if isinstance(features, str) and features not in feature_presets():
        raise UserError(
            f"{impl}.melcache_contract['features'] = {features!r} is no preset: "
            f"{', '.join(feature_presets())}"
        )
    extras = table.get("extras", ())
    if not isinstance(extras, (list, tuple)) or not all(isinstance(n, str) for n in extras):
        raise UserError(
            f"{impl}.melcache_contract['extras'] = {extras!r}: expected a list of names"
        )
    if extras and table.get("inputs") != "batch":
        raise UserError(
            f"{impl}.melcache_contract asks for extras {list(extras)}, which only reach a model "
            'given the whole batch: add "inputs": "batch"'
        )
    home = table.get("home")
    if home is not None and not (isinstance(home, str) and ":" in home):
        raise UserError(
            f"{impl}.melcache_contract['home'] = {home!r}: expected 'package.module:function'"
        )
    fields = table.get("fields", ())
    _check_fields(fields, impl, table)
    if not isinstance(fields, Mapping):
        fields = tuple(fields)
    return ModelSpec(**{**table, "extras": tuple(extras), "fields": fields})


def _check_fields(fields: Any, impl: str, table: Mapping[str, Any]) -> None:
    """One line for a ``fields`` or ``mel`` declaration that is not one."""
    names = list(fields) if isinstance(fields, (list, tuple, Mapping)) else None
    if (
        names is None
        or any(field_name_problem(n) for n in names)
        or (
            isinstance(fields, Mapping) and not all(isinstance(v, Mapping) for v in fields.values())
        )
    ):
        raise UserError(
            f"{impl}.melcache_contract['fields'] = {fields!r}: expected a list of field names "
            "or a table of names to provenance tables"
        )
    if names and table.get("inputs") != "batch":
        raise UserError(
            f"{impl}.melcache_contract asks for fields {names}, which only reach a model "
            'given the whole batch: add "inputs": "batch"'
        )
    if not isinstance(table.get("mel", True), bool) or (table.get("mel") is False and not names):
        raise UserError(
            f"{impl}.melcache_contract['mel'] = {table.get('mel')!r}: expected true, or false "
            "for a model that declares the fields it reads instead"
        )


def expected_features(model: ModelConfig, spec: ModelSpec) -> dict[str, Any]:
    """Every feature key the cache must match: ``[model]``'s three and all the model declares."""
    keys = model.expected_features()
    features = spec.features
    stated = (
        feature_presets()[features].to_dict() if isinstance(features, str) else dict(features or {})
    )
    for key in set(keys) & set(stated):
        if stated[key] != keys[key]:
            raise UserError(
                f"config key model.{key} = {keys[key]!r} contradicts {model.impl}'s declared "
                f"features ({key} = {stated[key]!r}): set model.{key} = {stated[key]!r}"
            )
    return {**keys, **stated}


def loader_data(data: DataConfig, spec: ModelSpec) -> DataConfig:
    """The ``[data]`` table the loader gets: padded only to the longest when the model says so,
    with the extras the model asks for added to ``data.extras``."""
    extras = tuple(dict.fromkeys((*data.extras, *spec.extras)))
    pad_multiple = 1 if spec.pad == "longest" else data.pad_multiple
    fields = tuple(dict.fromkeys((*data.fields, *spec.fields)))
    provenance = {k: dict(v) for k, v in data.field_provenance.items()}
    for name, keys in spec.fields.items() if isinstance(spec.fields, Mapping) else ():
        provenance[name] = {**keys, **provenance.get(name, {})}
    return dataclasses.replace(
        data, pad_multiple=pad_multiple, extras=extras, fields=fields,
        field_provenance=provenance, read_mel=data.read_mel and spec.mel,
        sequence=spec.sequence if data.sequence == "frames" else data.sequence,
    )  # fmt: skip


def construct(cls: type, impl: str, args: dict[str, Any], vocab_size: int) -> torch.nn.Module:
    """``cls(**args)``, with ``vocab_size`` added when its constructor takes one."""
    try:
        takes_vocab = "vocab_size" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a builtin or C extension: no signature to read
        takes_vocab = False
    if takes_vocab and "vocab_size" in args:
        raise UserError(
            f"config key model.args.vocab_size is set by the tokenizer (data.tokenizer: "
            f"{vocab_size}) for {impl}: remove it"
        )
    try:
        model = cls(**args, **({"vocab_size": vocab_size} if takes_vocab else {}))
    except TypeError as exc:
        raise UserError(f"config table [model.args] does not fit {impl}: {exc}") from None
    if not isinstance(model, torch.nn.Module):  # checked once, here, before .to(device)
        raise UserError(
            f"config key model.impl = {impl!r} made a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def cast_mel(batch: Batch, spec: ModelSpec) -> Batch:
    """``batch`` with its mel in the model's declared dtype."""
    dtype = _DTYPES[spec.mel_dtype]
    return (
        batch if batch.mel.dtype == dtype else dataclasses.replace(batch, mel=batch.mel.to(dtype))
    )


def model_inputs(batch: Batch, spec: ModelSpec) -> tuple[Any, ...]:
    """The positional arguments of the model's forward for ``batch`` (on the device)."""
    batch = cast_mel(batch, spec)
    if spec.inputs == "batch":
        return (batch,)
    return batch.mel, batch.mel_lengths, batch.text, batch.text_lengths


def normalise(out: Any) -> dict[str, torch.Tensor]:
    """A mean and its weight become a sum and its count; anything else passes unchanged."""
    if isinstance(out, Mapping) and "loss" in out and "loss_sum" not in out:
        rest = {k: v for k, v in out.items() if k not in ("loss", "loss_weight")}
        weight = out.get("loss_weight")
        if weight is None:
            return dict(out)  # check_outputs names what is missing
        return {**rest, "loss_sum": out["loss"] * weight, "loss_count": weight}
    return out


def check_outputs(out: Any, impl: str) -> None:
    """Refuse, in one line naming ``impl``, what the trainer cannot use (first step only:
    reading the values waits for the device)."""
    if not isinstance(out, Mapping):
        raise UserError(f"{impl}.forward returned {type(out).__name__}, not a dict of tensors")
    if "loss_sum" not in out:
        hint = ' with "loss_weight"' if "loss" in out else ""
        raise UserError(
            f'{impl}.forward returned keys {sorted(out)} without "loss_sum" (or "loss"{hint}): '
            "see train/model/contract.py"
        )
    for name, value in out.items():
        if not name.endswith(("_sum", "_count")):
            continue
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise UserError(
                f'{impl}.forward returned "{name}" of shape {shape}: it must be a scalar '
                "(sum a per-utterance loss over the batch, and return the count it covers)"
            )
        if name.endswith("_sum") and value.dtype not in (torch.float32, torch.float64):
            raise UserError(
                f'{impl}.forward returned "{name}" as {value.dtype}: sums must be float32 '
                "(a half-precision sum overflows); call .float() before summing"
            )
        if not torch.isfinite(value).item():
            raise UserError(f'{impl}.forward returned a non-finite "{name}" ({value.item()})')
    if "loss_count" in out and not out["loss_count"].item() > 0:
        raise UserError(f'{impl}.forward returned "loss_count" = {out["loss_count"].item()}: ≤ 0')


def inverse_count(
    sums: list[dict[str, torch.Tensor]], inv_frames: torch.Tensor, env: Env
) -> torch.Tensor:
    """1 / Σ counts over passes and ranks: ``inv_frames`` itself (no collective) when the model
    counts valid frames, else one small all-reduce (every rank's model is the same)."""
    if not sums or "loss_count" not in sums[0]:
        return inv_frames
    count = torch.stack([s["loss_count"].double() for s in sums]).sum().reshape(1)
    return (1.0 / all_reduce_sum(count, env)[0]).float()


def rescale_gradients(model: torch.nn.Module, factor: torch.Tensor) -> None:
    """Gradients of Σ loss_sum ÷ valid frames turned into Σ loss_sum ÷ Σ count."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)
