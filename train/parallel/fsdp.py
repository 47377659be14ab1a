"""Sharded data parallelism: ``train.parallel.strategy = "fsdp2" | "hsdp"`` through torch's FSDP2.

``fully_shard`` turns each parameter into a DTensor sharded over a device mesh: ``fsdp2``
shards over every rank (ZeRO-3: each rank holds 1/N of parameters, gradients and AdamW
state); ``hsdp`` shards over groups of ``hsdp_shard_size`` ranks and replicates across the
groups (a ``(replicate, shard)`` mesh), so the all-gathers stay inside a node. Each block of
the model's ``nn.ModuleList``\\ s is one unit (all-gathered for its forward, freed after), the
root holds the rest. Parameters are all-gathered and compute in bf16 under bf16 precision
(fp32 otherwise); the master copy and the gradient reduction are fp32 always: a bf16 reduction loses precision as ranks grow (torchtitan reduces in fp32).

What the DDP path does differently (``train/parallel/ddp.py``): accumulation skips the
reduce-scatter with ``set_requires_gradient_sync(False)``; clipping takes the norm of the
DTensor gradients (the result is replicated, ``train/optim/clipping.py``); the weights are checkpointed in torch's
distributed checkpoint format, each rank writing its shards (``train/run/dcp.py``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from melcache.errors import UserError
from train.config.train_table import ParallelConfig
from train.optim.optimizer import EMA
from train.parallel.env import Env


def sharded(cfg: ParallelConfig, env: Env) -> bool:
    """Whether this run shards its parameters (FSDP2 or HSDP under torchrun)."""
    return cfg.strategy != "ddp" and env.distributed


def shard(model: nn.Module, env: Env, cfg: ParallelConfig, param_dtype: torch.dtype) -> nn.Module:
    """``fully_shard`` ``model`` in place for ``fsdp2`` / ``hsdp`` (before the optimizer is
    built, which must see the DTensor parameters), all-gathering parameters in
    ``param_dtype``; unchanged for ``ddp`` or one process."""
    if not sharded(cfg, env):
        return model
    mesh = device_mesh(env, cfg)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for blocks in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def device_mesh(env: Env, cfg: ParallelConfig) -> DeviceMesh:
    """``(shard,)`` over all ranks for fsdp2; ``(replicate, shard)`` for hsdp, shard groups of
    ``hsdp_shard_size`` ranks (0: the ranks of one node, torchrun's LOCAL_WORLD_SIZE)."""
    kind = env.device.type
    if cfg.strategy == "fsdp2":
        return init_device_mesh(kind, (env.world_size,), mesh_dim_names=("shard",))
    size = cfg.hsdp_shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    if env.world_size % size:
        raise UserError(
            f"train.parallel.hsdp_shard_size = {size} does not divide the {env.world_size} ranks of "
            "this job: pick a divisor (0 = the ranks of one node)"
        )
    shape = (env.world_size // size, size)
    return init_device_mesh(kind, shape, mesh_dim_names=("replicate", "shard"))


def abandon_step(model: nn.Module) -> None:
    """After a step abandoned midway (an out-of-memory error every rank agreed on): drop its
    gradients and reset FSDP2's per-iteration state (it reshards what was all-gathered), so
    the next step runs as a fresh one."""
    model.zero_grad(set_to_none=True)
    if isinstance(model, FSDPModule):
        model.reset_iter_state()


def weights_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA | None, is_sharded: bool
) -> dict[str, Any]:
    """Model, optimizer and EMA state: plain for DDP (rank 0 writes it), DTensor shards keyed
    by parameter name for FSDP2 (every rank writes its own, ``train/run/dcp.py``)."""
    if is_sharded:
        model_state, optim_state = get_state_dict(model, optimizer)
    else:
        model_state, optim_state = model.state_dict(), optimizer.state_dict()
    return {
        "model": model_state,
        "optimizer": optim_state,
        "ema": None if ema is None else ema.state_dict(),
    }


def load_weights(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: EMA | None,
    state: dict[str, Any],
    is_sharded: bool,
) -> None:
    """Restore what :func:`weights_state` gave."""
    if is_sharded:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if ema is not None and state["ema"] is not None:
        ema.load_state_dict(state["ema"])
