"""Sharded-parameter training (FSDP2, ``torch.distributed.fsdp.fully_shard``) of models with EDM2's MP layers."""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from ..layers import register_sharded_weight_projection


def fully_shard_model(model: nn.Module, blocks: Iterable[nn.Module] = (), **fsdp_kwargs) -> nn.Module:
    """``fully_shard`` every module of ``blocks``, then ``model``, ready for training with forced weight normalisation.

    - 0-d parameters (EDM2's ``emb_gain`` / ``out_gain``), which FSDP2 cannot shard, stay replicated outside FSDP;
      their gradients are averaged over the processes as soon as they are accumulated, as FSDP does for the rest.
    - :func:`~diffusers_scalelong.layers.register_sharded_weight_projection` projects the stored dim-0 shards of every
      ``MPConv`` before each training-mode forward (the in-forward projection would land in FSDP's discarded copy).

    ``fsdp_kwargs`` go to every ``fully_shard`` call (``mesh``, ``mp_policy``, ``reshard_after_forward`` ...).
    Needs an initialised process group.
    """
    scalars = {p for p in model.parameters() if p.ndim == 0}
    ignored = set(fsdp_kwargs.pop("ignored_params", set())) | scalars
    for block in blocks:
        fully_shard(block, ignored_params=ignored, **fsdp_kwargs)
    fully_shard(model, ignored_params=ignored, **fsdp_kwargs)
    world_size = dist.get_world_size()

    def average_gradient(parameter: nn.Parameter) -> None:
        dist.all_reduce(parameter.grad)
        parameter.grad.div_(world_size)

    for parameter in scalars:
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(average_gradient)
    register_sharded_weight_projection(model)
    return model
