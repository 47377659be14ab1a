"""Training precision: what ``train.precision = "auto"`` means on a device, its dtypes, autocast."""

from __future__ import annotations

import contextlib

import torch

from melcache.errors import UserError

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """Turn ``"auto"`` into bf16 or fp32 for this device; refuse bf16 where CUDA lacks it."""
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)  # pre-Ampere: emulated
    else:  # without AVX-512 bf16 is emulated and slower than fp32 on CPU
        try:
            bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            bf16 = False
    if precision == "auto":
        return "bf16" if bf16 else "fp32"
    if precision == "bf16" and device.type == "cuda" and not bf16:
        raise UserError(
            f"config key train.precision = 'bf16' is not supported on "
            f"{torch.cuda.get_device_name(device)}: use fp16 (with loss scaling) or fp32"
        )
    return precision


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast to ``precision``'s dtype on ``device``; nothing for fp32."""
    dtype = AMP_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
