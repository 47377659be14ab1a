"""What is trained and what it must honour: the built-in TextToMel, the model contract, guards, tokenizers; imports config, parallel and the loader.

``TextToMel`` and ``build_model`` are named here because presets, configs and every
checkpoint store ``[model] impl = "train.model:TextToMel"``.
"""

from train.model.text_to_mel import TextToMel, build_model, describe

__all__ = ["TextToMel", "build_model", "describe"]
