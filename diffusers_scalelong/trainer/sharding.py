"""Sharded-parameter training (FSDP2, ``torch.distributed.fsdp.fully_shard``) of models with EDM2's MP layers."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..layers import register_sharded_weight_projection

NEEDS_PROCESSES = (
    "distributed_type fsdp shards the model over processes: launch 2 or more, e.g. torchrun --nproc_per_node 2 "
    "or accelerate launch --multi_gpu --num_processes 2"
)
# Full (unsharded) tensors, on the CPU of the main process only: the form checkpoints are written in.
FULL_ON_MAIN = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Full tensors given on the main process only (other processes pass {}), broadcast and cut into each one's shards.
FULL_FROM_MAIN = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


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


def repeated_blocks(unet: nn.Module) -> list[nn.Module]:
    """The blocks of a UNet or U-ViT that become FSDP units of their own: the elements of every ``nn.ModuleList``
    attribute whose name ends in ``blocks`` (``encoder_blocks``, ``down_blocks``, ``in_blocks`` ...) and
    ``mid_block``. Each is gathered just before it runs and freed after, so only one block is ever whole."""
    blocks = []
    for name, child in unet.named_children():
        if isinstance(child, nn.ModuleList) and name.endswith("blocks"):
            blocks.extend(child)
        elif name == "mid_block" and child is not None:
            blocks.append(child)
    return blocks


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a mix of sharded (``DTensor``) and replicated gradients.

    The total norm is ``sqrt(sum_p ||g_p||^2)`` over the full gradients: each process sums the squares of its
    shards, the sums are added over processes, and replicated gradients (the same on every process) are counted
    once. Gradients are scaled by ``min(1, max_norm / (norm + 1e-6))``; returns the norm before clipping.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
    replicated = [g for g in grads if not isinstance(g, DTensor)]
    device = (sharded or replicated)[0].device
    shard_sum = sum((g.double().square().sum() for g in sharded), torch.zeros((), dtype=torch.float64, device=device))
    dist.all_reduce(shard_sum)
    replicated_sum = sum((g.double().square().sum() for g in replicated), torch.zeros_like(shard_sum))
    norm = (shard_sum + replicated_sum).sqrt().float()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in sharded + replicated:
        g.mul_(scale.to(g.dtype))
    return norm


class ShardedTraining:
    """One module trained with FSDP2 over all processes of a run, and what the training loop needs from it.

    The main process keeps an unsharded CPU copy of the module (made before sharding): checkpoints, sample grids
    and the final pipeline are written from it after :meth:`gather` has filled it with the current weights.

    Args:
        module: the trained module (the UNet, or a preconditioner holding the UNet and the uncertainty head, which
            are then sharded together as one root).
        unet: the UNet inside ``module``; its repeated blocks become FSDP units of their own.
        device: this process's device.
        is_main_process: the process that keeps the copy and writes.
        bf16: compute forward and backward in bfloat16 on float32 stored shards, reduce gradients in float32.
    """

    def __init__(self, module: nn.Module, unet: nn.Module, device: torch.device, is_main_process: bool, bf16: bool):
        if not dist.is_initialized() or dist.get_world_size() < 2:
            raise ValueError(NEEDS_PROCESSES)
        unet_name = next(name for name, child in module.named_modules() if child is unet)
        self.copy = copy.deepcopy(module).cpu() if is_main_process else None
        self.unet_copy = self.copy.get_submodule(unet_name) if self.copy is not None else None
        self.module = module.to(device)
        policy = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        fully_shard_model(module, repeated_blocks(unet), mesh=mesh, mp_policy=policy)

    def gather(self) -> nn.Module | None:
        """Collective (every process calls it): the main process's copy with the current weights; None elsewhere."""
        state = get_model_state_dict(self.module, options=FULL_ON_MAIN)
        if self.copy is None:
            return None
        self.copy.load_state_dict(state)
        return self.copy

    def scatter(self) -> None:
        """Collective: give the shards the weights of the main process's copy (after a checkpoint was loaded
        into it)."""
        state = self.copy.state_dict() if self.copy is not None else {}
        set_model_state_dict(self.module, state, options=FULL_FROM_MAIN)

    def save_optimizer_in_full(self, prepared: torch.optim.Optimizer) -> None:
        """Make Accelerate's optimizer wrapper ``prepared`` speak full tensors keyed by parameter name in
        ``state_dict()`` / ``load_state_dict()`` (what ``save_state`` writes from the main process and every process
        loads), so a checkpoint holds the whole optimiser state. Both calls become collectives."""
        module, optimizer = self.module, prepared.optimizer

        def state_dict() -> dict:
            return get_optimizer_state_dict(module, optimizer, options=FULL_ON_MAIN)

        def load_state_dict(state: dict) -> None:
            set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))

        prepared.state_dict = state_dict
        prepared.load_state_dict = load_state_dict
