"""Run by ``torchrun --nproc_per_node 2``: FSDP2-sharded EDM2 training vs single-process training of the same batches.

Every rank trains an ``EDM2UNet2DModel`` sharded block by block with ``fully_shard_model`` (gloo, CPU, gradient
checkpointing on) on its half of each global batch. Rank 0 additionally trains an unsharded copy with the same
initial weights on the whole global batch, then compares the parameters (gathered once) tensor by tensor, and the
post-hoc EMA snapshots written from the sharded run with those of the unsharded run. Writes a JSON report to the
path given as the first argument; ``--without_shard_projection`` leaves out the forced weight normalisation of the
stored shards (to show what it is for).

Resume: ``--stop_after K --checkpoint DIR`` trains the sharded model for K steps and writes a checkpoint (model and
optimizer as full tensors in safetensors files, JSON for the rest; ``PowerFunctionEMA.save_state``, gathered once);
a new launch with ``--resume DIR`` loads it into a freshly sharded model and trains the remaining steps.
"""

import json
import os
from argparse import ArgumentParser
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy

from diffusers_scalelong.ema import PowerFunctionEMA
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.trainer.cli import run_and_exit
from diffusers_scalelong.trainer.sharding import fully_shard_model

STEPS, GLOBAL_BATCH, SIGMA_RELS = 3, 4, (0.05, 0.10)


def build_model() -> EDM2UNet2DModel:
    torch.manual_seed(0)
    model = EDM2UNet2DModel(
        sample_size=8, in_channels=2, model_channels=16, channel_mult=(1, 2), layers_per_block=1,
        attention_resolutions=(4,), channels_per_head=16, num_class_embeds=3,
    )  # fmt: skip
    with torch.no_grad():  # non-zero gains, so that every weight gets a gradient from the first step
        model.out_gain.fill_(0.5)
        for block in [*model.encoder_blocks, *model.decoder_blocks]:
            block.emb_gain.fill_(0.3)
    return model


def shard(model: EDM2UNet2DModel, project_shards: bool = True, bf16: bool = False) -> EDM2UNet2DModel:
    """Every block, then the whole model; ``project_shards=False`` leaves out the projection of the stored shards;
    ``bf16``: bfloat16 forward/backward on float32 stored shards, gradients reduced in float32."""
    blocks = [*model.encoder_blocks, *model.decoder_blocks]
    kwargs = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    if project_shards:
        return fully_shard_model(model, blocks, **kwargs)
    with patch("diffusers_scalelong.trainer.sharding.register_sharded_weight_projection", lambda model: None):
        return fully_shard_model(model, blocks, **kwargs)


def global_batches() -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(GLOBAL_BATCH, 2, 8, 8, generator=generator),
            torch.randn(GLOBAL_BATCH, generator=generator),
            torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator),
            torch.randn(GLOBAL_BATCH, 2, 8, 8, generator=generator),
        )
        for _ in range(STEPS)
    ]


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(folder: Path, model, optimizer, ema: PowerFunctionEMA, rank: int) -> None:
    """Model and optimizer gathered as full tensors, written by rank 0; the EMA state gathered once by every rank."""
    model_state = get_model_state_dict(model, options=FULL)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    ema.save_state(folder / "ema_state.safetensors", is_main_process=rank == 0)
    if rank == 0:
        save_file(model_state, folder / "model.safetensors")
        moments = {f"{fqn}/{name}": t for fqn, state in optimizer_state["state"].items() for name, t in state.items()}
        save_file(moments, folder / "optimizer.safetensors")
        (folder / "optimizer.json").write_text(json.dumps(optimizer_state["param_groups"]))
    dist.barrier()


def load_checkpoint(folder: Path, model, optimizer, ema: PowerFunctionEMA) -> None:
    """Every rank reads the full tensors and keeps its own shards."""
    set_model_state_dict(model, load_file(folder / "model.safetensors"), options=FULL)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(folder / "optimizer.safetensors").items():
        fqn, name = key.split("/")
        state.setdefault(fqn, {})[name] = tensor
    param_groups = json.loads((folder / "optimizer.json").read_text())
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": param_groups}, options=FULL)
    ema.load_state(folder / "ema_state.safetensors")


def train(
    model: torch.nn.Module,
    batches,
    rank: int,
    world: int,
    snapshot_dir: Path,
    steps: range | None = None,
    checkpoint: Path | None = None,
    resume: Path | None = None,
) -> PowerFunctionEMA:
    """Train ``steps`` (default: all, or those after ``resume``); then write ``checkpoint`` if given, else the EMA
    snapshots."""
    model.train()
    model.enable_gradient_checkpointing()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ema = PowerFunctionEMA(model, sigma_rels=SIGMA_RELS)
    if resume is not None:
        load_checkpoint(resume, model, optimizer, ema)
    for step in steps or range(1 if resume is None else ema.last_step + 1, STEPS + 1):
        x, c_noise, labels, target = batches[step - 1]
        part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        loss = (model(x[part], c_noise[part], labels[part]).sample - target[part]).square().mean()
        loss.backward()  # FSDP averages the ranks' gradients: the gradient of the global batch's mean loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model, step)
    if checkpoint is not None:
        save_checkpoint(checkpoint, model, optimizer, ema, rank)
    else:
        ema.save_snapshots(snapshot_dir, STEPS, is_main_process=rank == 0)
    return ema


def main() -> None:
    parser = ArgumentParser()
    parser.add_argument("report", type=Path)
    parser.add_argument("--without_shard_projection", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision (MixedPrecisionPolicy)")
    parser.add_argument("--stop_after", type=int, default=STEPS)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    report_path = args.report
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    batches = global_batches()

    sharded = shard(build_model(), project_shards=not args.without_shard_projection, bf16=args.bf16)
    if args.checkpoint is not None:  # the first part of an interrupted run
        train(sharded, batches, rank, world, None, range(1, args.stop_after + 1), checkpoint=args.checkpoint)
        if rank == 0:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            report_path.write_text(json.dumps({"stopped_after": args.stop_after}))
        dist.destroy_process_group()
        return
    ema = train(sharded, batches, rank, world, report_path.parent / "sharded", resume=args.resume)
    full_state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sharded.state_dict().items()}
    local_shapes = {k: list(v.to_local().shape) for k, v in sharded.state_dict().items() if hasattr(v, "to_local")}

    if rank == 0:
        single = build_model()
        train(single, batches, 0, 1, report_path.parent / "single")
        reference = single.state_dict()
        differences = {k: (full_state[k] - reference[k]).abs().max().item() for k in reference}
        snapshot_differences = {}
        for name in sorted(os.listdir(report_path.parent / "single")):
            ours = load_file(report_path.parent / "sharded" / name)
            theirs = load_file(report_path.parent / "single" / name)
            snapshot_differences[name] = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
        report = {
            "world_size": world,
            "num_tensors": len(reference),
            "max_abs_difference": max(differences.values()),
            "worst_tensor": max(differences, key=differences.get),
            "max_abs_change_from_init": max(
                (reference[k] - v).abs().max().item() for k, v in build_model().state_dict().items()
            ),
            # ||sharded - single|| / ||single - initial|| over all tensors: the difference against the change
            "relative_difference": (
                sum((full_state[k] - reference[k]).square().sum() for k in reference)
                / sum((reference[k] - v).square().sum() for k, v in build_model().state_dict().items())
            )
            .sqrt()
            .item(),
            "stored_dtypes": sorted({str(v.dtype) for v in sharded.state_dict().values()}),
            "sharded_snapshots": sorted(os.listdir(report_path.parent / "sharded")),
            "snapshot_max_abs_difference": snapshot_differences,
            "ema_local_numel": sum(
                (t.to_local() if hasattr(t, "to_local") else t).numel() for t in ema.averages[0].values()
            ),
            "model_numel": sum(t.numel() for t in reference.values()),
            "local_shapes_example": local_shapes.get("conv_out.weight"),
        }
        report_path.write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_exit(main)  # FSDP2 leaves a gloo process group whose threads can abort the interpreter's teardown
