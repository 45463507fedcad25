"""Forward+backward time of each long-skip scaling method vs the vanilla model, interleaved in one run.

Conv UNet: diffusers' ``UNet2DModel`` (vanilla) vs ``ScaleLongUNet2DModel`` with each ``lsc_method`` and the same
weights. U-ViT: ``UViT2DModel`` with ``lsc_method="none"`` is the vanilla U-ViT. Every round times each variant once
in a shuffled order; the table reports the median over rounds and its ratio to vanilla.

    python benchmarks/bench_scalelong_overhead.py --rounds 12
"""

import argparse
import random
import statistics
import time

import torch
from bench_scalelong_common import run_header, write_section
from diffusers import UNet2DModel
from tqdm import tqdm

from diffusers_scalelong.models import ScaleLongUNet2DModel, UViT2DModel

METHODS = ("none", "inv_sqrt2", "cs", "cs_stage", "ls", "ls_nonshared")
UNET_CONFIG = dict(
    sample_size=32,
    in_channels=1,
    out_channels=1,
    block_out_channels=(32, 64, 64, 128),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
    attention_head_dim=16,
)
UVIT_CONFIG = dict(sample_size=32, patch_size=4, in_channels=1, embed_dim=128, depth=12, num_heads=4)


def build_variants() -> dict[str, dict[str, torch.nn.Module]]:
    torch.manual_seed(0)
    vanilla = UNet2DModel(**UNET_CONFIG)
    conv = {"vanilla": vanilla}
    for method in METHODS:
        model = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method=method)
        model.load_state_dict(vanilla.state_dict(), strict=False)
        conv[method] = model
    uvit_vanilla = UViT2DModel(**UVIT_CONFIG)
    uvit = {"vanilla": uvit_vanilla}
    for method in METHODS[1:]:
        model = UViT2DModel(**UVIT_CONFIG, lsc_method=method)
        model.load_state_dict(uvit_vanilla.state_dict(), strict=False)
        uvit[method] = model
    return {"conv UNet": conv, "U-ViT": uvit}


def time_step(model: torch.nn.Module, sample: torch.Tensor, timesteps: torch.Tensor) -> tuple[float, float]:
    """(wall-clock, process CPU) seconds of one forward+backward."""
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    loss = model(sample, timesteps).sample.pow(2).mean()
    loss.backward()
    elapsed = time.perf_counter() - start_wall, time.process_time() - start_cpu
    model.zero_grad(set_to_none=True)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds per variant (after --warmup rounds)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--no_write", action="store_true", help="print the table only, do not update the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    families = build_variants()
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(args.batch_size, 1, 32, 32, generator=generator)
    timesteps = torch.randint(0, 1000, (args.batch_size,), generator=generator).float()
    order_rng = random.Random(0)
    times = {family: {name: [] for name in variants} for family, variants in families.items()}
    total = (args.warmup + args.rounds) * sum(len(v) for v in families.values())
    with tqdm(total=total, desc="fwd+bwd") as progress:
        for round_index in range(args.warmup + args.rounds):
            jobs = [(family, name) for family, variants in families.items() for name in variants]
            order_rng.shuffle(jobs)
            for family, name in jobs:
                elapsed = time_step(families[family][name], sample, timesteps)
                if round_index >= args.warmup:
                    times[family][name].append(elapsed)
                progress.update()

    lines = [
        "## Overhead: forward+backward time per method (interleaved)",
        "",
        run_header(),
        f"Batch {args.batch_size} of 1x32x32, {args.rounds} timed rounds after {args.warmup} warm-up rounds, order "
        "shuffled each round. CPU = process CPU time (less sensitive than wall-clock to other jobs on a shared "
        "machine); paired ratio = median over rounds of (method time / vanilla time in the same round). "
        "Targets: CS <= 1.02, LS <= 1.10.",
        "",
    ]
    for family, family_times in times.items():
        params = sum(p.numel() for p in families[family]["vanilla"].parameters())
        base = family_times["vanilla"]
        lines += [
            f"### {family} ({params / 1e6:.2f} M parameters)",
            "",
            "| method | median CPU ms | paired CPU ratio | median wall ms | paired wall ratio |",
            "|---|---|---|---|---|",
        ]
        for name, values in family_times.items():
            wall_ratio = statistics.median(v[0] / b[0] for v, b in zip(values, base, strict=True))
            cpu_ratio = statistics.median(v[1] / b[1] for v, b in zip(values, base, strict=True))
            cpu_ms = statistics.median(v[1] for v in values) * 1e3
            wall_ms = statistics.median(v[0] for v in values) * 1e3
            lines.append(f"| {name} | {cpu_ms:.1f} | {cpu_ratio:.3f} | {wall_ms:.1f} | {wall_ratio:.3f} |")
        lines.append("")
    markdown = "\n".join(lines)
    print(markdown)
    if not args.no_write:
        write_section("overhead", markdown)


if __name__ == "__main__":
    main()
