"""Training stability with and without ScaleLong on the embedded Fashion-MNIST test split.

For each backbone (U-ViT depth 12 and 16, as in the paper's Fig. 1, and a diffusers conv UNet), every long-skip
method is trained for the same number of steps from the same initial weights, data order and noise (same seed):
DDPM epsilon prediction, AdamW with the official ScaleLong betas (0.99, 0.999) at a deliberately high learning rate.
``StabilityDiagnostics`` records every ``--record_every`` steps; the table reports, per run, the loss over the last
quarter of training, the windowed relative oscillation (std / mean within windows) of the decoder-input feature
norms, the scaled-skip norms, the mid-block output norm and the global gradient norm, the robustness
``||f(x + d) - f(x)|| / ||d||``, and (when the foundation metric is available) FD-FMNISTNet of DDIM samples.

    python benchmarks/bench_scalelong_stability.py --steps 300
"""

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
from bench_scalelong_common import run_header, write_section
from diffusers import DDIMScheduler, DDPMScheduler
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

from diffusers_scalelong.data import load_fashion_mnist_arrays
from diffusers_scalelong.models import ScaleLongUNet2DModel, UViT2DModel
from diffusers_scalelong.scalelong import StabilityDiagnostics

HERE = os.path.dirname(os.path.abspath(__file__))
PLOT_DIR = os.path.join(HERE, "scalelong")


def backbones(args) -> dict[str, tuple[type, dict, tuple[str, ...]]]:
    uvit = dict(sample_size=32, patch_size=4, in_channels=1, embed_dim=args.uvit_width, num_heads=4, mlp_ratio=4.0)
    conv = dict(
        sample_size=32,
        in_channels=1,
        out_channels=1,
        block_out_channels=(args.conv_width, 2 * args.conv_width, 2 * args.conv_width),
        layers_per_block=2,
        down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=16,
    )
    return {
        "U-ViT depth 12": (UViT2DModel, {**uvit, "depth": 12}, ("none", "cs", "ls")),
        "U-ViT depth 16": (UViT2DModel, {**uvit, "depth": 16}, ("none", "cs", "ls")),
        "conv UNet (9 skips)": (ScaleLongUNet2DModel, conv, ("none", "cs", "cs_stage", "ls")),
    }


def load_images() -> torch.Tensor:
    """Embedded Fashion-MNIST test split as [N, 1, 32, 32] in [-1, 1] (28x28 padded with background)."""
    images, _ = load_fashion_mnist_arrays(embedded=True)
    tensor = torch.from_numpy(images.copy()).float().div(127.5).sub(1.0).unsqueeze(1)
    return F.pad(tensor, (2, 2, 2, 2), value=-1.0)


def train_run(model, images, args, seed: int, label: str) -> tuple[StabilityDiagnostics, torch.nn.Module]:
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.99, 0.999), weight_decay=0.03)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    diagnostics = StabilityDiagnostics(model, every_n_steps=args.record_every, window=args.window, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for step in tqdm(range(args.steps), desc=label, leave=False):
        batch = images[torch.randint(0, len(images), (args.batch_size,), generator=generator)]
        noise = torch.randn(batch.shape, generator=generator)
        timesteps = torch.randint(0, 1000, (args.batch_size,), generator=generator)
        noisy = scheduler.add_noise(batch, noise, timesteps)
        diagnostics.begin_step(step)
        prediction = model(noisy, timesteps.float()).sample
        losses = (prediction - noise).pow(2).flatten(1).mean(1)
        diagnostics.record_loss(losses, timesteps)
        losses.mean().backward()
        diagnostics.record_gradients()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        diagnostics.probe_robustness(noisy, timesteps.float())
        optimizer.step()
        warmup.step()
        optimizer.zero_grad(set_to_none=True)
        diagnostics.end_step()
    diagnostics.detach()
    return diagnostics, model


@torch.no_grad()
def sample_images(model, num_images: int, steps: int, seed: int) -> torch.Tensor:
    scheduler = DDIMScheduler(num_train_timesteps=1000)
    scheduler.set_timesteps(steps)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_images, 1, 32, 32, generator=generator)
    model.eval()
    for t in scheduler.timesteps:
        x = scheduler.step(model(x, t.float()).sample, t, x).prev_sample
    return x.clamp(-1, 1)


def foundation_metric(images: torch.Tensor) -> tuple[str, float] | None:
    try:
        from diffusers_scalelong.metrics import compute_fd_kid

        result = compute_fd_kid(images, kid_subset_size=min(100, len(images)))
    except (ImportError, FileNotFoundError, OSError) as error:  # the metric's network weights are not shipped yet
        print(f"foundation metric unavailable: {error}")
        return None
    name = next(key for key in result if key.startswith("FD-"))
    return name, float(result[name])


def relative_oscillation(summary: dict, keys: list[str]) -> float:
    """Mean over ``keys`` of (mean windowed std) / (mean value)."""
    values = [summary[k]["osc_std"] / max(abs(summary[k]["mean"]), 1e-12) for k in keys if k in summary]
    return statistics.mean(values) if values else float("nan")


def summarise(diagnostics: StabilityDiagnostics) -> dict[str, float]:
    summary = diagnostics.summary()
    keys = diagnostics.keys()
    _, losses = diagnostics.series("loss/mean")
    tail = losses[-max(1, len(losses) // 4) :]
    robustness = [summary[k]["last"] for k in keys if k.startswith("robustness/")]
    return {
        "loss_tail": statistics.mean(tail),
        "loss_osc": relative_oscillation(summary, ["loss/mean"]),
        "decoder_norm_osc": relative_oscillation(summary, [k for k in keys if k.endswith("/decoder")]),
        "skip_norm_osc": relative_oscillation(summary, [k for k in keys if k.endswith("/scaled")]),
        "mid_norm": summary["block/mid"]["mean"],
        "mid_norm_osc": relative_oscillation(summary, ["block/mid"]),
        "grad_norm": summary["grad/global"]["mean"],
        "grad_norm_osc": relative_oscillation(summary, ["grad/global"]),
        "robustness": statistics.mean(robustness) if robustness else float("nan"),
    }


def plot_family(family: str, runs: dict[str, StabilityDiagnostics], path: str) -> None:
    figure = Figure(figsize=(12, 6.4))
    FigureCanvasAgg(figure)
    panels = [
        ("mean decoder-input norm", lambda k: k.endswith("/decoder")),
        ("mid-block output norm", lambda k: k == "block/mid"),
        ("global gradient norm", lambda k: k == "grad/global"),
        ("training loss", lambda k: k == "loss/mean"),
    ]
    for position, (title, wanted) in enumerate(panels, start=1):
        axes = figure.add_subplot(2, 2, position)
        for method, diagnostics in runs.items():
            keys = [k for k in diagnostics.keys() if wanted(k)]
            steps = [step for step, _ in diagnostics.history]
            values = [statistics.mean(row[k] for k in keys if k in row) for _, row in diagnostics.history]
            axes.plot(steps, values, label=method, linewidth=1)
        axes.set_title(title)
        axes.set_xlabel("step")
        if title in ("global gradient norm", "training loss"):
            axes.set_yscale("log")
        axes.legend(fontsize=7)
    figure.suptitle(f"{family}: long-skip methods, same seed")
    figure.tight_layout()
    temporary = path + ".tmp.png"
    figure.savefig(temporary, dpi=100)
    os.replace(temporary, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3, help="high on purpose: ScaleLong targets unstable regimes")
    parser.add_argument("--warmup_steps", type=int, default=20)
    parser.add_argument("--clip", type=float, default=1e3, help="gradient clipping norm (large: effectively off)")
    parser.add_argument("--kappa", type=float, default=0.5)
    parser.add_argument("--record_every", type=int, default=5)
    parser.add_argument("--window", type=int, default=10, help="records per oscillation window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--uvit_width", type=int, default=64)
    parser.add_argument("--conv_width", type=int, default=16)
    parser.add_argument("--families", nargs="*", default=None, help="subset of backbones to run")
    parser.add_argument("--num_samples", type=int, default=128, help="DDIM samples for the metric (0: skip)")
    parser.add_argument("--sample_steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no_write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    images = load_images()
    os.makedirs(PLOT_DIR, exist_ok=True)
    rows, raw = [], {}
    for family, (cls, config, methods) in backbones(args).items():
        if args.families and family not in args.families:
            continue
        torch.manual_seed(args.seed)
        base = cls(**config)
        runs = {}
        for method in methods:
            torch.manual_seed(args.seed + 1)  # same LS gate initialisation for every family
            model = cls(**config, lsc_method=method, lsc_kappa=args.kappa)
            model.load_state_dict(base.state_dict(), strict=False)
            diagnostics, model = train_run(model, images, args, args.seed, f"{family} {method}")
            runs[method] = diagnostics
            stats = summarise(diagnostics)
            if args.num_samples:
                metric = foundation_metric(sample_images(model, args.num_samples, args.sample_steps, args.seed))
                stats["metric"] = metric
            raw[f"{family} / {method}"] = stats
            rows.append((family, method, stats))
            print(family, method, json.dumps(stats))
        slug = family.split(" (")[0].lower().replace(" ", "_").replace("-", "")
        plot_family(family, runs, os.path.join(PLOT_DIR, f"stability_{slug}.png"))
        if "ls" in runs:
            runs["ls"].plot(os.path.join(PLOT_DIR, f"diagnostics_{slug}_ls.png"), title=f"{family}, LS")
        del base, runs

    metric_name = next((s["metric"][0] for _, _, s in rows if s.get("metric")), None)
    header = (
        "| backbone | method | loss (last 25%) | loss osc | decoder-norm osc | skip-norm osc | mid norm "
        "| mid-norm osc | grad norm | grad-norm osc | robustness |" + (f" {metric_name} |" if metric_name else "")
    )
    lines = [
        "## Stability: vanilla vs CS vs LS, same seed",
        "",
        run_header(),
        f"{args.steps} steps, batch {args.batch_size}, AdamW lr {args.lr} (betas 0.99/0.999, wd 0.03, "
        f"{args.warmup_steps} warm-up steps), kappa {args.kappa}, DDPM epsilon loss on the embedded Fashion-MNIST "
        f"test split padded to 32x32, seed {args.seed}. Records every {args.record_every} steps; 'osc' = mean over "
        f"sliding windows of {args.window} records of std/mean (relative oscillation), averaged over skips where "
        "several. Robustness: last record, mean over noise bins. Plots: `benchmarks/scalelong/`.",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for family, method, s in rows:
        line = (
            f"| {family} | {method} | {s['loss_tail']:.4f} | {s['loss_osc']:.3f} | {s['decoder_norm_osc']:.3f} "
            f"| {s['skip_norm_osc']:.3f} | {s['mid_norm']:.1f} | {s['mid_norm_osc']:.3f} | {s['grad_norm']:.3f} "
            f"| {s['grad_norm_osc']:.3f} | {s['robustness']:.3f} |"
        )
        if metric_name:
            line += f" {s['metric'][1]:.2f} |" if s.get("metric") else " - |"
        lines.append(line)
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    if not args.no_write:
        write_section("stability", markdown)
        with open(os.path.join(PLOT_DIR, "stability.json.tmp"), "w") as handle:
            json.dump(raw, handle, indent=1)
        os.replace(os.path.join(PLOT_DIR, "stability.json.tmp"), os.path.join(PLOT_DIR, "stability.json"))


if __name__ == "__main__":
    main()
