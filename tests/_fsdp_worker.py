"""Run by ``torchrun --nproc_per_node 2``: FSDP2-sharded EDM2 training vs single-process training of the same batches.

Every rank trains an ``EDM2UNet2DModel`` sharded block by block with ``fully_shard_model`` (gloo, CPU, gradient
checkpointing on) on its half of each global batch. Rank 0 additionally trains an unsharded copy with the same
initial weights on the whole global batch, then compares the parameters (gathered once) tensor by tensor, and the
post-hoc EMA snapshots written from the sharded run with those of the unsharded run. Writes a JSON report to the
path given as the first argument; ``--without_shard_projection`` leaves out the forced weight normalisation of the
stored shards (to show what it is for).
"""

import json
import os
import sys
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from diffusers_scalelong.ema import PowerFunctionEMA
from diffusers_scalelong.models import EDM2UNet2DModel
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


def shard(model: EDM2UNet2DModel, project_shards: bool = True) -> EDM2UNet2DModel:
    """Every block, then the whole model; ``project_shards=False`` leaves out the projection of the stored shards."""
    if project_shards:
        return fully_shard_model(model, [*model.encoder_blocks, *model.decoder_blocks])
    with patch("diffusers_scalelong.trainer.sharding.register_sharded_weight_projection", lambda model: None):
        return fully_shard_model(model, [*model.encoder_blocks, *model.decoder_blocks])


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


def train(model: torch.nn.Module, batches, rank: int, world: int, snapshot_dir: Path) -> PowerFunctionEMA:
    model.train()
    model.enable_gradient_checkpointing()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ema = PowerFunctionEMA(model, sigma_rels=SIGMA_RELS)
    for step, (x, c_noise, labels, target) in enumerate(batches, start=1):
        part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        loss = (model(x[part], c_noise[part], labels[part]).sample - target[part]).square().mean()
        loss.backward()  # FSDP averages the ranks' gradients: the gradient of the global batch's mean loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model, step)
    ema.save_snapshots(snapshot_dir, STEPS, is_main_process=rank == 0)
    return ema


def main() -> None:
    report_path = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    batches = global_batches()

    sharded = shard(build_model(), project_shards="--without_shard_projection" not in sys.argv)
    ema = train(sharded, batches, rank, world, report_path.parent / "sharded")
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
    main()
