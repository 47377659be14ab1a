"""DDP wrapping with bucket-view gradients and the comm hooks, and ``no_sync`` for a
micro-batch that must not all-reduce.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from train.config.train_table import TrainConfig
from train.parallel.env import Env


def wrap_model(
    model: nn.Module, env: Env, cfg: TrainConfig, powersgd: Any | None = None
) -> nn.Module:
    """``torch.compile`` (optional), then DDP with bucket-view gradients.

    Compile goes inside DDP, as in nanoGPT, so DDP's ``no_sync`` runs eagerly around the
    compiled module. ``static_graph`` stays off: with ``no_sync`` it crashes or silently
    skips the gradient all-reduce (pytorch#143580, accelerate#3679). Buffers are broadcast
    from rank 0 once, at wrapping, not before every forward: a forward then holds no
    collective, so a rank whose forward ran out of memory can run it again on a stand-in
    without falling out of step with the others (``train/memory/oom.py``).
    """
    if cfg.compile:
        model = torch.compile(model)
    if not env.distributed or isinstance(getattr(model, "_orig_mod", model), FSDPModule):
        return model  # sharded by train.parallel.fsdp.shard already
    ddp = DistributedDataParallel(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        find_unused_parameters=cfg.parallel.find_unused_parameters,
        forward_sync_buffers=False,
        bucket_cap_mb=cfg.parallel.bucket_cap_mb,
    )
    _register_comm_hook(ddp, cfg, powersgd)
    return ddp


def _register_comm_hook(ddp: DistributedDataParallel, cfg: TrainConfig, powersgd: Any) -> None:
    """Gradient compression (none: DDP's C++ all-reduce). bf16/fp16 from torch's own
    ``ddp_comm_hooks`` halve the bytes on the wire (bf16 needs NCCL ≥ 2.10); PowerSGD
    (``train/parallel/powersgd.py``, a ``train.parallel.powersgd.PowerSGD``) sends low-rank factors with error
    feedback after ``powersgd_start_iter`` plain steps."""
    if cfg.parallel.comm_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif cfg.parallel.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif powersgd is not None:
        powersgd.register(ddp)


def no_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` around forward *and* backward of a micro-batch that must not
    all-reduce; a no-op for the last micro-batch and for an unwrapped model. FSDP2 gets
    ``set_requires_gradient_sync(sync)``: no reduce-scatter until the last micro-batch."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()
