"""EDM2 (arXiv 2312.02696) at CPU scale: magnitudes, post-hoc EMA, learned uncertainty, EDM2 vs DDPM recipe.

Variants (all on Fashion-MNIST at 16x16, same data order per seed):

- ``edm2``: ``EDM2UNet2DModel`` (magnitude-preserving layers, forced weight normalisation) in ``EDMPreconditioner``,
  ``EDM2Loss`` with or without ``LearnedUncertainty``, Adam (0.9, 0.99) with ``inverse_sqrt_lr_lambda``,
  ``PowerFunctionEMA`` (sigma_rel 0.05, 0.10) with snapshots for the post-hoc reconstruction;
- ``unet2d_edm``: diffusers' ``UNet2DModel`` (standard layers) of about the same size in the same preconditioner,
  loss and schedule (its own lr: standard layers do not train at the MP network's lr);
- ``ddpm``: the same ``UNet2DModel`` with diffusers' DDPM recipe (epsilon loss, AdamW, cosine schedule with warm-up,
  ``EMAModel`` with warm-up), sampled with DDIM at the same number of network evaluations as the EDM Heun sampler.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import warnings

import numpy as np
import torch
from common import (
    ActivationProbe,
    ResultStore,
    cpu_seconds,
    ddpm_loss,
    fd,
    fd_two_sets,
    global_grad_norm,
    run_once,
    sample_ddim,
    sample_edm,
    smoothed,
    spike_statistics,
    training_images,
    weight_growth,
)
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel

from diffusers_scalelong import (
    EDM2Loss,
    EDM2UNet2DModel,
    EDMPreconditioner,
    LearnedUncertainty,
    PowerFunctionEMA,
    inverse_sqrt_lr_lambda,
    reconstruct_ema,
)
from diffusers_scalelong.ema import InexactReconstructionWarning, fit_error

TABLE = "edm2_runs"
FULL = {
    "edm_channels": 16,
    "edm_steps": 1000,
    "edm_batch": 16,
    "edm_record_every": 20,
    "edm_samples": 300,
    "heun_steps": 6,
    "posthoc_sigma_rels": sorted({0.05, 0.1, *(float(s) for s in np.geomspace(0.02, 0.28, 13).round(4))}),
    "num_snapshots": 8,
    "lsc_steps": 600,
}
SMOKE = {
    "edm_channels": 8,
    "edm_steps": 8,
    "edm_batch": 4,
    "edm_record_every": 2,
    "edm_samples": 16,
    "heun_steps": 2,
    "posthoc_sigma_rels": [0.05, 0.1, 0.2],
    "num_snapshots": 2,
    "lsc_steps": 8,
}
LRS = {"edm2": 1e-2, "unet2d_edm": 1e-3, "ddpm": 1e-3}


def build_unet(variant: str, channels: int, resolution: int, lsc: str) -> torch.nn.Module:
    if variant == "edm2":
        name, _, kappa = lsc.partition(":")
        return EDM2UNet2DModel(
            sample_size=resolution,
            in_channels=1,
            model_channels=channels,
            channel_mult=(1, 2, 2),
            layers_per_block=1,
            attention_resolutions=(resolution // 4,),
            channels_per_head=channels,
            lsc_method=name,
            lsc_kappa=float(kappa or 0.5),
        )
    return UNet2DModel(
        sample_size=resolution,
        in_channels=1,
        out_channels=1,
        block_out_channels=(channels, 2 * channels, 2 * channels),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=channels,
    )


def block_names(unet: torch.nn.Module) -> list[str]:
    if isinstance(unet, EDM2UNet2DModel):
        return [f"encoder_blocks.{i}" for i in range(len(unet.encoder_blocks))] + [
            f"decoder_blocks.{i}" for i in range(len(unet.decoder_blocks))
        ]
    return [
        *(f"down_blocks.{i}" for i in range(len(unet.down_blocks))),
        "mid_block",
        *(f"up_blocks.{i}" for i in range(len(unet.up_blocks))),
    ]


def configs(scale: dict, stage: str) -> list[dict]:
    base = {"steps": scale["edm_steps"], "batch": scale["edm_batch"], "channels": scale["edm_channels"], "lsc": "none"}
    edm2 = {**base, "variant": "edm2", "uncertainty": True}

    def of(seed):
        return [
            {**edm2, "uncertainty": False, "seed": seed},
            {**base, "variant": "ddpm", "uncertainty": False, "seed": seed},
        ]

    if stage == "main":
        return [{**edm2, "seed": 0, "posthoc": True}, {**base, "variant": "unet2d_edm", "uncertainty": True, "seed": 0}]
    if stage == "recipe0":
        return of(0)
    if stage == "seed1":
        return [{**edm2, "seed": 1}, *of(1)]
    if stage == "lsc":
        lsc = {**edm2, "steps": scale["lsc_steps"]}
        return [{**lsc, "lsc": m, "seed": s} for s in (0, 1) for m in ("none", "cs:0.5", "ls")]
    raise ValueError(f"unknown stage {stage!r}")


def run_stage(store: ResultStore, scale: dict, stage: str) -> None:
    for config in configs(scale, stage):
        run_once(store, TABLE, config, lambda config=config: train(config, scale))


def train(config: dict, scale: dict) -> dict:
    resolution = scale["resolution"]
    images = training_images(scale)
    variant, steps = config["variant"], config["steps"]
    torch.manual_seed(config["seed"])
    unet = build_unet(variant, config["channels"], resolution, config["lsc"])
    initial = {n: p.detach().clone() for n, p in unet.named_parameters()}
    if variant == "ddpm":
        model = unet
        optimizer = torch.optim.AdamW(unet.parameters(), lr=LRS[variant], betas=(0.95, 0.999), weight_decay=1e-6)
        schedule = get_scheduler("cosine", optimizer, num_warmup_steps=max(1, steps // 20), num_training_steps=steps)
        ema = EMAModel(unet.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=0.75)
        ddpm = DDPMScheduler(num_train_timesteps=1000)
    else:
        uncertainty = LearnedUncertainty() if config["uncertainty"] else None
        model = EDMPreconditioner(unet, uncertainty)
        betas = (0.9, 0.99)
        optimizer = torch.optim.Adam(model.parameters(), lr=LRS[variant], betas=betas, eps=1e-8)
        lr_lambda = inverse_sqrt_lr_lambda(t_ref=max(1, steps // 4), warmup_steps=max(1, steps // 20))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        ema = PowerFunctionEMA(unet, sigma_rels=(0.05, 0.10))
        loss_fn = EDM2Loss(P_mean=-0.8, P_std=1.6)
        snapshot_dir = tempfile.mkdtemp(prefix="phema-") if config.get("posthoc") else None
        snapshot_every = max(1, steps // scale["num_snapshots"])
    generator = torch.Generator().manual_seed(config["seed"])
    measure_quality = variant != "unet2d_edm"  # the standard-layer EDM run exists for the magnitude plots only
    names = block_names(unet)
    probe = ActivationProbe(unet, names)
    losses, grads, magnitudes, checkpoints = [], [], [], {}
    start = cpu_seconds()

    def sample_with(net, seed, num=None):
        num = num or scale["edm_samples"]
        if variant == "ddpm":
            return sample_ddim(net, num, resolution, 2 * scale["heun_steps"] - 1, seed)
        return sample_edm(net, num, resolution, scale["heun_steps"], seed)

    def averaged():
        if variant == "ddpm":
            net = copy.deepcopy(unet)
            ema.copy_to(net.parameters())
            return net
        return ema.averaged_model(unet, 0.10)

    for step in range(steps):
        probe.active = step % scale["edm_record_every"] == 0 or step == steps - 1
        batch = images[torch.randint(0, len(images), (config["batch"],), generator=generator)]
        if variant == "ddpm":
            loss = ddpm_loss(unet, batch, ddpm, generator)
        else:
            loss = loss_fn(model, batch, generator=generator).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(global_grad_norm(model))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if variant == "ddpm":
            ema.step(unet.parameters())
        else:
            ema.update(unet, step + 1)
            if snapshot_dir and (step + 1) % snapshot_every == 0:
                ema.save_snapshots(snapshot_dir)
        if probe.active:
            magnitudes.append(
                {"step": step, "act_rms": {k[:-4]: v for k, v in probe.current.items() if k.endswith("/rms")}}
            )
            magnitudes[-1]["weight_growth"] = weight_growth(unet, initial, names)
        if step + 1 == steps // 2 and measure_quality:
            before = cpu_seconds()
            checkpoints[str(step + 1)] = {"cpu_s": before - start, "fd": fd(sample_with(averaged(), 0), scale)}
            start += cpu_seconds() - before  # the checkpoint's sampling is not training time
    train_seconds = cpu_seconds() - start
    probe.remove()
    result = {"train_cpu_s": train_seconds, "params": sum(p.numel() for p in unet.parameters())}
    result["loss_tail"] = float(np.mean(losses[-max(1, steps // 4) :]))
    result.update({f"loss_{k}": v for k, v in spike_statistics(losses).items()})
    if measure_quality:
        final = fd_two_sets(lambda seed: sample_with(averaged(), seed), 0, scale)
        checkpoints[str(steps)] = {"cpu_s": train_seconds, "fd": final["fd"]}
        result.update({f"final_{k}": v for k, v in final.items()}, checkpoints=checkpoints)
    if config.get("posthoc"):  # one sample set each, all from the same noise: differences are paired
        result["raw_fd"] = fd(sample_with(unet, 0), scale)
        result["tracked"] = {str(s): fd(sample_with(ema.averaged_model(unet, s), 0), scale) for s in ema.sigma_rels}
    if config.get("posthoc"):
        result["posthoc"] = posthoc_curve(unet, snapshot_dir, scale, sample_with)
        result["posthoc_profile_error"] = posthoc_profile_errors(snapshot_dir, scale)
        shutil.rmtree(snapshot_dir, ignore_errors=True)
    every = max(1, steps // 100)
    result["series"] = {
        "step": list(range(0, steps, every)),
        "loss": smoothed(losses, max(10, steps // 20))[::every],
        "grad": grads[::every],
        "magnitudes": magnitudes,
    }
    return result


def posthoc_curve(unet: torch.nn.Module, folder: str, scale: dict, sample_with) -> dict:
    """FD of the EMA reconstructed from the snapshots at each target sigma_rel: one sample set each, all from the
    same initial noise (seed 0), so neighbouring points differ by the model, not by the draw."""
    targets = scale["posthoc_sigma_rels"]
    curve = {}
    # the curve spans targets past what the snapshots reach well; each point's profile error is recorded beside it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InexactReconstructionWarning)
        states = reconstruct_ema(folder, targets, allow_inexact=True)
    for sigma_rel, state in zip(targets, states, strict=True):
        net = copy.deepcopy(unet)
        net.load_state_dict(state)
        curve[str(sigma_rel)] = fd(sample_with(net, 0), scale)
    return curve


def posthoc_profile_errors(folder: str, scale: dict) -> dict:
    """The relative profile error of each target's reconstruction (``ema.fit_error``; above 0.1 the package refuses
    it unless asked), to read the curve's ends by."""
    targets = scale["posthoc_sigma_rels"]
    return {str(s): float(e) for s, e in zip(targets, fit_error(folder, targets), strict=True)}
