"""Training-step cost of EDM2UNet2DModel vs a diffusers UNet2DModel of similar size, and of forced weight normalisation.

Measured side by side, interleaved (every round runs every variant once), median over rounds:
- fwd+bwd time of a training step (train mode) and the activation memory it needs: the bytes autograd saves for
  backward (unique storages; on CUDA additionally the peak allocated memory);
- EDM2 with forced weight normalisation switched off (to price the in-place projection);
- eval (sampling): two batch-1 forwards per timing, EDM2 with the per-forward weight normalisation and inside
  ``cached_weight_normalization`` (built on the first forward, reused on the second).

    python benchmarks/bench_edm2_unet.py --rounds 5 --output benchmarks/results/edm2_unet.md
"""

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
from diffusers import UNet2DModel
from tqdm import tqdm

from diffusers_scalelong.layers import MPConv, cached_weight_normalization
from diffusers_scalelong.models import EDM2UNet2DModel


def edm2_model(resolution: int) -> EDM2UNet2DModel:
    levels = (1, 2, 3, 4)
    return EDM2UNet2DModel(
        sample_size=resolution, in_channels=3, model_channels=32, channel_mult=levels, layers_per_block=2,
        attention_resolutions=(resolution // 2, resolution // 4), channels_per_head=32,
    )  # fmt: skip


def diffusers_model(resolution: int) -> UNet2DModel:
    return UNet2DModel(
        sample_size=resolution, in_channels=3, out_channels=3, block_out_channels=(32, 64, 96, 128),
        layers_per_block=2, attention_head_dim=32, norm_num_groups=16,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    )  # fmt: skip


@contextmanager
def forced_weight_normalization_disabled():
    original = MPConv.force_weight_normalization
    MPConv.force_weight_normalization = lambda self: None
    try:
        yield
    finally:
        MPConv.force_weight_normalization = original


def saved_activation_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``step()`` (then runs backward)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = step()
    loss.backward()
    return sum(storages.values())


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds taken by ``fn()``: wall clock on CUDA, process CPU time on CPU (robust on a shared machine)."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = clock()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - start


def run(resolution: int, batch_size: int, rounds: int, device: torch.device) -> list[dict]:
    torch.manual_seed(0)
    edm2, reference = edm2_model(resolution).to(device), diffusers_model(resolution).to(device)
    x = torch.randn(batch_size, 3, resolution, resolution, device=device)
    c_noise = torch.full((batch_size,), 0.1, device=device)
    integer_t = torch.full((batch_size,), 500, device=device)

    def train_edm2() -> torch.Tensor:
        return edm2(x, c_noise).sample.square().mean() + edm2.out_gain.square()  # out_gain = 0: keep every grad

    def train_reference() -> torch.Tensor:
        return reference(x, integer_t).sample.square().mean()

    def train_edm2_without_forced_wn() -> torch.Tensor:
        with forced_weight_normalization_disabled():
            return train_edm2()

    def backward(step: Callable[[], torch.Tensor], model: torch.nn.Module) -> Callable[[], None]:
        def fn():
            model.zero_grad(set_to_none=True)
            step().backward()

        return fn

    train_variants = {
        "EDM2UNet2DModel, train step": (edm2, train_edm2),
        "EDM2UNet2DModel, train step, forced WN off": (edm2, train_edm2_without_forced_wn),
        "diffusers UNet2DModel, train step": (reference, train_reference),
    }
    edm2_eval = edm2_model(resolution).to(device).eval()

    def two_forwards(model: torch.nn.Module, t: torch.Tensor, cached: bool = False) -> Callable[[], None]:
        def fn():
            with cached_weight_normalization(model) if cached else nullcontext():
                for _ in range(2):
                    model(x[:1], t[:1])

        return fn

    eval_variants = {
        "EDM2UNet2DModel, eval": two_forwards(edm2_eval, c_noise),
        "EDM2UNet2DModel, eval, cached weight normalisation": two_forwards(edm2_eval, c_noise, cached=True),
        "diffusers UNet2DModel, eval": two_forwards(reference, integer_t),
    }
    times: dict[str, list[float]] = {name: [] for name in [*train_variants, *eval_variants]}
    for _ in tqdm(range(rounds + 1), desc=f"{resolution}x{resolution}", leave=False):
        for name, (model, step) in train_variants.items():
            model.train()
            times[name].append(timed(backward(step, model), device))
        reference.eval()
        with torch.no_grad():
            for name, forward in eval_variants.items():
                times[name].append(timed(forward, device))

    rows = []
    for name, samples in times.items():
        samples = samples[1:]  # the first round warms up
        row = {"resolution": resolution, "variant": name, "median_s": statistics.median(samples)}
        row["batch"] = batch_size if name in train_variants else 1
        row["throughput"] = (row["batch"] if name in train_variants else 2) / row["median_s"]
        if name in train_variants:
            model, step = train_variants[name]
            model.train()
            row["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            row["saved_MiB"] = saved_activation_bytes(step) / 2**20
            if device.type == "cuda":
                row["peak_MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
        rows.append(row)
    return rows


def write_markdown(rows: list[dict], args: argparse.Namespace, device: torch.device, path: str) -> None:
    lines = [
        "# EDM2UNet2DModel vs diffusers UNet2DModel: training-step cost",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", {torch.get_num_threads()} torch threads",
        f"- command: `python benchmarks/bench_edm2_unet.py --rounds {args.rounds} --batch_32 {args.batch_32} "
        f"--batch_64 {args.batch_64} --threads {args.threads}`",
        "- interleaved: every round runs every variant once; median of the rounds after one warm-up round.",
        "- time: "
        + ("wall clock (synchronised)" if device.type == "cuda" else "process CPU time (all threads)")
        + "; throughput = samples/s for training steps, forwards/s for eval (two forwards of batch 1).",
        f"- note: {args.note}" if args.note else "",
        "",
        "| res | variant | params (M) | batch | median time (s) | throughput | saved for backward (MiB) |"
        + (" peak (MiB) |" if device.type == "cuda" else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if device.type == "cuda" else ""),
    ]
    for row in rows:
        params = f"{row['params_M']:.2f}" if "params_M" in row else ""
        saved = f"{row['saved_MiB']:.0f}" if "saved_MiB" in row else ""
        line = (
            f"| {row['resolution']} | {row['variant']} | {params} | {row['batch']} | {row['median_s']:.4f} "
            f"| {row['throughput']:.1f} | {saved} |"
        )
        if device.type == "cuda":
            line += f" {row.get('peak_MiB', 0):.0f} |" if "peak_MiB" in row else " |"
        lines.append(line)
    lines += ["", "Ratios (same resolution, medians):", ""]
    for resolution in sorted({row["resolution"] for row in rows}):
        t = {row["variant"]: row for row in rows if row["resolution"] == resolution}
        edm2, no_wn = t["EDM2UNet2DModel, train step"], t["EDM2UNet2DModel, train step, forced WN off"]
        ref = t["diffusers UNet2DModel, train step"]
        plain, cached = t["EDM2UNet2DModel, eval"], t["EDM2UNet2DModel, eval, cached weight normalisation"]
        lines.append(
            f"- {resolution}x{resolution}: EDM2 train step {edm2['median_s'] / ref['median_s']:.2f}x the time and "
            f"{edm2['saved_MiB'] / ref['saved_MiB']:.2f}x the saved activations of UNet2DModel; forced weight "
            f"normalisation {100 * (edm2['median_s'] / no_wn['median_s'] - 1):+.1f}% of the step; cached weight "
            f"normalisation {100 * (cached['median_s'] / plain['median_s'] - 1):+.1f}% eval time; EDM2 eval "
            f"{plain['median_s'] / t['diffusers UNet2DModel, eval']['median_s']:.2f}x UNet2DModel's."
        )
    lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(path)), delete=False) as handle:
        handle.write("\n".join(line for line in lines if line is not None) + "\n")
    os.replace(handle.name, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per variant (after one warm-up round)")
    parser.add_argument("--batch_32", type=int, default=8, help="training batch size at 32x32")
    parser.add_argument("--batch_64", type=int, default=2, help="training batch size at 64x64")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 avoids spin-wait noise)")
    parser.add_argument("--note", default="", help="free text for the results file (e.g. 'machine shared')")
    parser.add_argument("--output", default="benchmarks/results/edm2_unet.md", help="markdown results file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    rows = run(32, args.batch_32, args.rounds, device) + run(64, args.batch_64, args.rounds, device)
    for row in rows:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    write_markdown(rows, args, device, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
