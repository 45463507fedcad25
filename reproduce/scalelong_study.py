"""ScaleLong (arXiv 2310.13545) at CPU scale: instability sweep and long-skip method comparison.

One run = a tiny U-ViT (or conv UNet) trained with the DDPM epsilon loss and AdamW (the official ScaleLong betas
0.99/0.999, weight decay 0.03, no gradient clipping) on Fashion-MNIST at 16x16. Recorded per run: per-step loss and
global gradient norm (spikes, divergence, oscillation), every ``record_every`` steps the norms of every block's output
and of every decoder block's two inputs (hidden state and scaled long skip), at the end the robustness
``||f(x + d) - f(x)|| / ||d||`` and, for the comparison, FD-FMNISTNet at half and full length.
"""

from __future__ import annotations

import math
import statistics

import torch
from common import (
    ActivationProbe,
    ResultStore,
    cpu_seconds,
    ddpm_loss,
    fd,
    fd_two_sets,
    global_grad_norm,
    oscillation,
    run_once,
    sample_ddim,
    smoothed,
    spike_statistics,
    stalled,
    training_images,
)
from diffusers import DDPMScheduler

from diffusers_scalelong import ScaleLongUNet2DModel, UViT2DModel

SWEEP_TABLE = "scalelong_sweep"
COMPARE_TABLE = "scalelong_compare"
METHODS = ("none", "inv_sqrt2", "cs:0.5", "cs:0.7", "cs:0.9", "ls", "ls_nonshared")
CORE_METHODS = ("none", "cs:0.5", "ls")
CONV_METHODS = ("none", "cs:0.5", "cs_stage:0.5", "ls")


def build_model(family: str, depth: int, width: int, method: str, resolution: int) -> torch.nn.Module:
    """``family`` "uvit" (patch 4, 4 heads) or "conv" (diffusers UNet2DModel layout, 3 levels); ``method`` is
    ``name`` or ``name:kappa``."""
    name, _, kappa = method.partition(":")
    lsc = {"lsc_method": name, "lsc_kappa": float(kappa or 0.5)}
    if family == "uvit":
        return UViT2DModel(
            sample_size=resolution, patch_size=4, in_channels=1, embed_dim=width, depth=depth, num_heads=4, **lsc
        )
    return ScaleLongUNet2DModel(
        sample_size=resolution,
        in_channels=1,
        out_channels=1,
        block_out_channels=(width, 2 * width, 2 * width),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=16,
        **lsc,
    )


def probe_for(model: torch.nn.Module, family: str) -> ActivationProbe:
    if family == "uvit":
        ins = [f"in_blocks.{i}" for i in range(len(model.in_blocks))]
        outs = [f"out_blocks.{i}" for i in range(len(model.out_blocks))]
        return ActivationProbe(model, [*ins, "mid_block", *outs], inputs=outs)
    downs = [f"down_blocks.{i}" for i in range(len(model.down_blocks))]
    ups = [f"up_blocks.{i}" for i in range(len(model.up_blocks))]
    return ActivationProbe(model, [*downs, "mid_block", *ups])


@torch.no_grad()
def robustness(model: torch.nn.Module, images: torch.Tensor, seed: int) -> float:
    """Mean over t in {100, 400, 700} of ``||f(x_t + d, t) - f(x_t, t)|| / ||d||`` with ``d ~ 0.01 N(0, I)``."""
    generator = torch.Generator().manual_seed(seed + 12345)
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    batch = images[torch.randint(0, len(images), (64,), generator=generator)]
    model.eval()
    ratios = []
    for t in (100, 400, 700):
        timesteps = torch.full((len(batch),), t)
        noisy = scheduler.add_noise(batch, torch.randn(batch.shape, generator=generator), timesteps)
        delta = 0.01 * torch.randn(batch.shape, generator=generator)
        change = model(noisy + delta, timesteps.float()).sample - model(noisy, timesteps.float()).sample
        ratios.append((change.flatten(1).norm(dim=1) / delta.flatten(1).norm(dim=1)).mean().item())
    model.train()
    return statistics.mean(ratios)


def train_run(config: dict, scale: dict, with_fd: bool) -> dict:
    """Train one configuration; return its metrics and compact series for the figures."""
    resolution = scale["resolution"]
    images = training_images(scale)
    torch.manual_seed(config["seed"])  # same initial weights for every method of a seed (gates are created last)
    model = build_model(config["family"], config["depth"], config["width"], config["method"], resolution)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], betas=(0.99, 0.999), weight_decay=0.03)
    warmup = max(1, config["warmup"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    generator = torch.Generator().manual_seed(config["seed"])
    probe = probe_for(model, config["family"])
    losses, grads, records, record_steps, fds = [], [], [], [], {}
    start = cpu_seconds()
    steps = config["steps"]
    for step in range(steps):
        probe.active = step % scale["record_every"] == 0 or step == steps - 1
        batch = images[torch.randint(0, len(images), (config["batch"],), generator=generator)]
        loss = ddpm_loss(model, batch, scheduler, generator)
        loss.backward()
        losses.append(loss.item())
        grads.append(global_grad_norm(model))
        if probe.active:
            records.append(dict(probe.current))
            record_steps.append(step)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss) or loss.item() > 1e3:  # diverged: nothing more to learn from this run
            break
        if with_fd and step + 1 == steps // 2:
            before = cpu_seconds()
            fds[str(step + 1)] = fd(sample_ddim(model, scale["num_samples"], resolution, scale["ddim_steps"], 0), scale)
            start += cpu_seconds() - before  # sampling is not training time
    train_seconds = cpu_seconds() - start
    probe.remove()
    finished = len(losses) == steps and all(map(torch.isfinite, map(torch.tensor, losses)))
    result = {"steps_done": len(losses), "train_cpu_s": train_seconds, **summarise(losses, grads, records, steps)}
    result["params"] = sum(p.numel() for p in model.parameters())
    if finished:
        result["robustness"] = robustness(model, images, config["seed"])
    if with_fd and finished:

        def sampler(seed):
            return sample_ddim(model, scale["num_samples"], resolution, scale["ddim_steps"], seed)

        final = fd_two_sets(sampler, 0, scale)
        fds[str(steps)] = final["fd"]
        result.update({f"final_{k}": v for k, v in final.items()})
    result["fd_at"] = fds
    every = max(1, len(losses) // 100)
    smooth = smoothed(losses, max(10, steps // 20))
    result["series"] = {
        "step": list(range(0, len(losses), every)),
        "loss": smooth[::every],
        "grad": grads[::every],
        "record_step": record_steps,
        "mid_norm": [r.get("mid_block/norm") for r in records],
        "decoder_norm": [_mean_matching(r, "/in0/norm") for r in records],
        "skip_norm": [_mean_matching(r, "/in1/norm") for r in records],
        "out_norm": [_mean_matching(r, "up_blocks", "out_blocks", suffix="/norm") for r in records],
    }
    return result


def _mean_matching(record: dict, *parts: str, suffix: str | None = None) -> float | None:
    """Mean of the record's values whose key ends with ``parts[0]`` (or, with ``suffix``, starts with any part
    and ends with ``suffix``, excluding inputs)."""
    if suffix is None:
        values = [v for k, v in record.items() if k.endswith(parts[0])]
    else:
        values = [v for k, v in record.items() if k.startswith(parts) and k.endswith(suffix) and "/in" not in k]
    return statistics.mean(values) if values else None


def summarise(losses: list[float], grads: list[float], records: list[dict], steps: int) -> dict:
    quarter = max(1, len(losses) // 4)
    loss_means = [statistics.mean(losses[i : i + 10]) for i in range(0, len(losses) - 9, 10)]
    summary = {
        "loss_tail": statistics.mean(losses[-quarter:]),
        "loss_osc": oscillation(loss_means),
        "grad_tail": statistics.mean(grads[-quarter:]),
        "grad_osc": oscillation(grads),
        **{f"loss_{k}": v for k, v in spike_statistics(losses).items()},
        **{f"grad_{k}": v for k, v in spike_statistics(grads, factor=5.0).items()},
    }
    if records:
        keys = [k for k in records[0] if k.endswith("/norm")]
        series = {k: [r[k] for r in records if k in r] for k in keys}
        q = max(1, len(records) // 4)
        summary["feature_norm_last"] = {k: v[-1] for k, v in series.items()}
        summary["feature_norm_growth"] = {
            k: statistics.mean(v[-q:]) / statistics.mean(v[:q]) for k, v in series.items() if len(v) >= 2
        }
        summary["feature_norm_osc"] = {k: oscillation(v, 5) for k, v in series.items() if len(v) >= 5}
    return summary


# ---------------------------------------------------------------------------------------------------- plans
def sweep_configs(scale: dict, extended: bool) -> list[dict]:
    """Vanilla U-ViT (and conv UNet) runs over learning rate, warm-up, depth, width and batch."""
    base = {
        "family": "uvit",
        "depth": scale["depths"][0],
        "width": scale["width"],
        "batch": scale["batch"],
        "method": "none",
    }
    base.update({"seed": 0, "steps": scale["sweep_steps"], "warmup": 0})
    configs = []
    if not extended:
        for depth in scale["depths"][:2]:
            for lr in scale["lrs"]:
                configs.append({**base, "depth": depth, "lr": lr})
            for lr in scale["lrs"][-2:]:
                configs.append({**base, "depth": depth, "lr": lr, "warmup": scale["warmup"]})
        return configs
    top = scale["lrs"][-2:]
    configs += [{**base, "depth": scale["depths"][-1], "lr": lr} for lr in top]
    configs += [{**base, "width": 2 * scale["width"], "lr": lr} for lr in top]
    configs += [{**base, "batch": 2 * scale["batch"], "lr": lr} for lr in top]
    conv = {**base, "family": "conv", "depth": 0, "width": scale["conv_width"]}
    configs += [{**conv, "lr": lr} for lr in top]
    return configs


def pick_regimes(store: ResultStore, scale: dict) -> dict[str, dict] | None:
    """From the sweep: 'unstable' = the smallest no-warm-up lr where vanilla spikes (>= 3 loss or gradient spikes),
    diverges or stalls, for the first depth that has one; 'stable' = the largest lr with warm-up and none of these;
    'edge' = the geometric mean of the unstable lr and the largest no-warm-up lr below it at which vanilla trained
    (the edge of stability, where seeds may go either way), when there is one."""
    rows = [
        r
        for r in store.rows(SWEEP_TABLE)
        if r["config"]["family"] == "uvit"
        and r["config"]["method"] == "none"
        and (r["config"]["width"], r["config"]["batch"]) == (scale["width"], scale["batch"])  # not the extended rows
    ]
    if not rows:
        return None

    def unstable(r):
        return r["loss_diverged"] or stalled(r) or r["loss_spikes"] + r["grad_spikes"] >= 3

    for depth in scale["depths"]:
        cands = [r for r in rows if r["config"]["depth"] == depth and r["config"]["warmup"] == 0 and unstable(r)]
        if cands:
            chosen = min(cands, key=lambda r: r["config"]["lr"])["config"]
            break
    else:
        chosen = max((r["config"] for r in rows if r["config"]["warmup"] == 0), key=lambda c: c["lr"])
    quiet = [r["config"] for r in rows if r["config"]["warmup"] > 0 and not unstable(r)]
    stable = max(quiet, key=lambda c: c["lr"]) if quiet else {**chosen, "lr": min(scale["lrs"])}
    stable = {**stable, "depth": chosen["depth"]}
    regimes = {"unstable": chosen, "stable": stable}
    trained = [
        r["config"]
        for r in rows
        if r["config"]["depth"] == chosen["depth"]
        and r["config"]["warmup"] == 0
        and r["config"]["lr"] < chosen["lr"]
        and not unstable(r)
    ]
    if trained:
        below = max(trained, key=lambda c: c["lr"])
        regimes["edge"] = {**chosen, "lr": float(f"{math.sqrt(below['lr'] * chosen['lr']):.3g}")}
    return regimes


def compare_configs(store: ResultStore, scale: dict, regime: str, seeds: list[int], methods=METHODS) -> list[dict]:
    regimes = pick_regimes(store, scale)
    if regimes is None or regime not in regimes:
        return []
    base = {**regimes[regime], "steps": scale["compare_steps"], "regime": regime}
    return [{**base, "method": m, "seed": s} for s in seeds for m in methods]


def conv_compare_configs(scale: dict, seeds: list[int]) -> list[dict]:
    """The conv UNet (diffusers layout, GroupNorm) at the sweep's top lr without warm-up."""
    base = {"family": "conv", "depth": 0, "width": scale["conv_width"], "batch": scale["batch"], "warmup": 0}
    base.update({"lr": scale["lrs"][-1], "steps": scale["compare_steps"], "regime": "conv"})
    return [{**base, "method": m, "seed": s} for s in seeds for m in CONV_METHODS]


def run_configs(store: ResultStore, table: str, configs: list[dict], scale: dict, with_fd: bool) -> None:
    for config in configs:
        run_once(store, table, config, lambda config=config: train_run(config, scale, with_fd))
