"""What is trained and what it must honour: the built-in TextToMel and EncoderDecoder, the model contract, guards, tokenizers; imports config, parallel and the loader.

``TextToMel``, ``EncoderDecoder`` and ``build_model`` are named here because presets, configs
and every checkpoint store ``[model] impl = "train.model:TextToMel"`` (or ``:EncoderDecoder``).
"""

from train.model.encoder_decoder import EncoderDecoder
from train.model.text_to_mel import TextToMel, build_model, describe

__all__ = ["EncoderDecoder", "TextToMel", "build_model", "describe"]
