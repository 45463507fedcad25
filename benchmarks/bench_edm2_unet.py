"""EDM2UNet2DModel vs a diffusers UNet2DModel of equal parameter count: training step and sampling step.

The configuration is the one of the speed anchor: 1 input channel, widths (64, 128, 128), 2 blocks per level,
attention at 8x8 (EDM2: 6.75M parameters; UNet2DModel: 6.47M), at 32x32 and 64x64. Measured side by side,
interleaved (every round runs every variant once), median over rounds:

- training step: forward + backward in train mode (EDM2 with forced weight normalisation) and the activation memory
  it needs: the bytes autograd saves for backward (unique storages; on CUDA also the peak allocated memory);
- sampling step: one no-grad eval forward of the batch; EDM2 also inside ``cached_weight_normalization``;
- EDM2 in channels-last memory format, and compiled with ``torch.compile`` (``--compile``; inductor, default mode,
  static shapes: compile time is reported separately and excluded from the step times), for sampling also compiled
  in channels-last with the weights normalised once;
- ``--profile``: a torch.profiler table (self CPU time) of one EDM2 training step.

    python benchmarks/bench_edm2_unet.py --rounds 7 --batch 16 --compile --profile
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack

import torch
from diffusers import UNet2DModel
from tqdm import tqdm

from diffusers_scalelong.layers import cached_weight_normalization
from diffusers_scalelong.models import EDM2UNet2DModel

ANCHOR_OFFICIAL_S, ANCHOR_OURS_S, ANCHOR_UNET2D_S = 2.06, 2.10, 1.66
"""The anchor measurement (train step, batch 16 at 32x32, 1 thread): the official EDM2 network, EDM2UNet2DModel
before this benchmark's optimisations, UNet2DModel; the official code cannot run here, so it enters as the ratio
official / UNet2DModel = 2.06 / 1.66 of that run."""


def edm2_model(resolution: int) -> EDM2UNet2DModel:
    return EDM2UNet2DModel(
        sample_size=resolution, in_channels=1, model_channels=64, channel_mult=(1, 2, 2), layers_per_block=2,
        attention_resolutions=(8,), channels_per_head=64,
    )  # fmt: skip


def diffusers_model(resolution: int) -> UNet2DModel:
    return UNet2DModel(
        sample_size=resolution, in_channels=1, out_channels=1, block_out_channels=(64, 128, 128), layers_per_block=2,
        down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"), attention_head_dim=64,
    )  # fmt: skip


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


class Variant:
    """One timed case: ``step()`` returns a loss (training) or runs a no-grad forward (sampling)."""

    def __init__(self, name: str, kind: str, model: torch.nn.Module, step: Callable[[], torch.Tensor | None]):
        self.name, self.kind, self.model, self.step = name, kind, model, step
        self.times: list[float] = []
        self.compile_s: float | None = None

    def run(self) -> None:
        if self.kind == "train":
            self.model.train()
            self.model.zero_grad(set_to_none=True)
            self.step().backward()
        else:
            self.model.eval()
            with torch.no_grad():
                self.step()


def build_variants(
    resolution: int, batch: int, device: torch.device, compile_: bool, contexts: ExitStack
) -> list[Variant]:
    torch.manual_seed(0)
    edm2, reference = edm2_model(resolution).to(device), diffusers_model(resolution).to(device)
    edm2_cl = edm2_model(resolution).to(device, memory_format=torch.channels_last)
    edm2_cl.load_state_dict(edm2.state_dict())
    # A sampling loop enters the cache once: a separate eval copy keeps it valid across rounds (the training
    # variants project the other copy's weights in place, which would invalidate it every round).
    edm2_cached = contexts.enter_context(cached_weight_normalization(edm2_model(resolution).to(device).eval()))
    edm2_cached.load_state_dict(edm2.state_dict())
    x = torch.randn(batch, 1, resolution, resolution, device=device)
    x_cl = x.to(memory_format=torch.channels_last)
    c_noise = torch.full((batch,), 0.1, device=device)
    integer_t = torch.full((batch,), 500, device=device)

    def edm2_loss(model: torch.nn.Module, sample: torch.Tensor) -> Callable[[], torch.Tensor]:
        # out_gain starts at 0: adding its square keeps every parameter's gradient in the graph.
        return lambda: model(sample, c_noise).sample.square().mean() + edm2.out_gain.square()

    variants = [
        Variant("EDM2UNet2DModel", "train", edm2, edm2_loss(edm2, x)),
        Variant("EDM2UNet2DModel, channels-last", "train", edm2_cl, edm2_loss(edm2_cl, x_cl)),
        Variant("diffusers UNet2DModel", "train", reference, lambda: reference(x, integer_t).sample.square().mean()),
        Variant("EDM2UNet2DModel", "sample", edm2, lambda: edm2(x, c_noise)),
        Variant("EDM2UNet2DModel, cached weight normalisation", "sample", edm2_cached, lambda: edm2_cached(x, c_noise)),
        Variant("EDM2UNet2DModel, channels-last", "sample", edm2_cl, lambda: edm2_cl(x_cl, c_noise)),
        Variant("diffusers UNet2DModel", "sample", reference, lambda: reference(x, integer_t)),
    ]
    if compile_:
        # One graph per mode (train / eval), both kept in dynamo's cache. Static shapes: each resolution compiles
        # its own graphs (with automatic dynamic shapes the second resolution's graph fails to lower in inductor).
        compiled = torch.compile(edm2, dynamic=False)
        # The fastest sampling set-up: compiled, channels-last, weights normalised once (as EDM2Pipeline does).
        fast = contexts.enter_context(cached_weight_normalization(edm2_model(resolution).to(device).eval()))
        fast.load_state_dict(edm2.state_dict())
        fast_compiled = torch.compile(fast.to(memory_format=torch.channels_last), dynamic=False)
        variants += [
            Variant("EDM2UNet2DModel, torch.compile", "train", edm2, edm2_loss(compiled, x)),
            Variant("EDM2UNet2DModel, torch.compile", "sample", edm2, lambda: compiled(x, c_noise)),
            Variant(
                "EDM2UNet2DModel, torch.compile + channels-last + cached weight normalisation",
                "sample",
                fast,
                lambda: fast_compiled(x_cl, c_noise),
            ),
        ]
        for variant in variants[-3:]:
            start = time.perf_counter()
            variant.run()  # the compilation (wall clock), then one more call to settle
            variant.run()
            variant.compile_s = time.perf_counter() - start
    return variants


def run(resolution: int, batch: int, rounds: int, device: torch.device, compile_: bool) -> list[dict]:
    with ExitStack() as contexts:
        variants = build_variants(resolution, batch, device, compile_, contexts)
        for _ in tqdm(range(rounds + 1), desc=f"{resolution}x{resolution}", leave=False):
            for variant in variants:
                variant.times.append(timed(variant.run, device))
    rows = []
    for variant in variants:
        samples = variant.times[1:]  # the first round warms up
        row = {"resolution": resolution, "kind": variant.kind, "variant": variant.name, "batch": batch}
        row["median_s"] = statistics.median(samples)
        row["spread"] = (max(samples) - min(samples)) / row["median_s"]
        row["compile_s"] = variant.compile_s
        if variant.kind == "train":
            variant.model.train()
            row["params_M"] = sum(p.numel() for p in variant.model.parameters()) / 1e6
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            variant.model.zero_grad(set_to_none=True)
            row["saved_MiB"] = saved_activation_bytes(variant.step) / 2**20
            if device.type == "cuda":
                row["peak_MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
        rows.append(row)
    return rows


def profile_table(batch: int, device: torch.device, row_limit: int = 15) -> str:
    """Self-CPU-time table of one EDM2 training step at 32x32 (after a warm-up step)."""
    from torch.profiler import ProfilerActivity, profile

    with ExitStack() as contexts:
        variant = next(v for v in build_variants(32, batch, device, False, contexts) if v.kind == "train")
    variant.run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        variant.run()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit, max_name_column_width=50)


def cpu_model_name() -> str:
    """The CPU's model name as ``lscpu`` gives it (else the architecture)."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine_description(device: torch.device) -> str:
    text = f"{cpu_model_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, device {device}"
    if device.type == "cuda":
        text += f" ({torch.cuda.get_device_name(device)})"
    return text + f", {torch.get_num_threads()} torch threads"


def ratio_lines(rows: list[dict]) -> list[str]:
    lines = []
    official_per_unet2d = ANCHOR_OFFICIAL_S / ANCHOR_UNET2D_S
    for resolution in sorted({row["resolution"] for row in rows}):
        t = {(row["kind"], row["variant"]): row["median_s"] for row in rows if row["resolution"] == resolution}
        for kind, label in (("train", "training step"), ("sample", "sampling step")):
            unet2d = t[(kind, "diffusers UNet2DModel")]
            parts = []
            for name, value in t.items():
                if name[0] == kind and name[1] != "diffusers UNet2DModel":
                    vs_official = ""
                    if resolution == 32 and kind == "train":
                        vs_official = f", {value / unet2d / official_per_unet2d:.2f}x the official network"
                    parts.append(f"{name[1]} {value / unet2d:.2f}x{vs_official}")
            lines.append(f"- {resolution}x{resolution} {label}, time relative to UNet2DModel: " + "; ".join(parts))
    return lines


def write_markdown(rows: list[dict], args: argparse.Namespace, device: torch.device, profile: str | None) -> None:
    cuda = device.type == "cuda"
    command = (
        f"python benchmarks/bench_edm2_unet.py --rounds {args.rounds} --batch {args.batch} --threads {args.threads}"
    )
    command += " --compile" * args.compile + " --profile" * args.profile
    lines = [
        "# EDM2UNet2DModel vs diffusers UNet2DModel: training and sampling step",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {machine_description(device)}",
        f"- load average (1, 5, 15 min) at start: {args.load_start}; at end: {os.getloadavg()}",
        f"- command: `{command}`",
        "- interleaved: every round runs every variant once; median of the rounds after one warm-up round; spread = "
        "(max - min) / median over those rounds.",
        "- time: "
        + ("wall clock (synchronised)" if cuda else "process CPU time (all threads)")
        + "; training step = forward + backward of a batch, sampling step = one no-grad forward of the batch.",
        f"- note: {args.note}" if args.note else "",
        "",
        "| res | step | variant | params (M) | batch | median (s) | spread | compile (s) | saved for backward (MiB) |"
        + (" peak (MiB) |" if cuda else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if cuda else ""),
    ]
    for row in rows:
        params = f"{row['params_M']:.2f}" if "params_M" in row else ""
        saved = f"{row['saved_MiB']:.0f}" if "saved_MiB" in row else ""
        compile_s = f"{row['compile_s']:.0f}" if row["compile_s"] is not None else ""
        line = (
            f"| {row['resolution']} | {row['kind']} | {row['variant']} | {params} | {row['batch']} "
            f"| {row['median_s']:.4f} | {row['spread']:.0%} | {compile_s} | {saved} |"
        )
        if cuda:
            line += f" {row['peak_MiB']:.0f} |" if "peak_MiB" in row else " |"
        lines.append(line)
    lines += ["", "Ratios (same resolution and run, medians):", "", *ratio_lines(rows)]
    lines += [
        "",
        f"The official network's time enters through the anchor run (official {ANCHOR_OFFICIAL_S} s, UNet2DModel "
        f"{ANCHOR_UNET2D_S} s at 32x32, batch 16): official = {ANCHOR_OFFICIAL_S / ANCHOR_UNET2D_S:.3f} x UNet2DModel.",
    ]
    if profile:
        lines += ["", "Profile of one EDM2UNet2DModel training step (32x32, self CPU time):", "", "```", profile, "```"]
    lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(args.output)), delete=False) as handle:
        handle.write("\n".join(line for line in lines if line is not None) + "\n")
    os.replace(handle.name, args.output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per variant (after one warm-up round)")
    parser.add_argument("--batch", type=int, default=16, help="batch size at 32x32 (other sizes: same pixels per step)")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[32, 64], help="image sizes (multiples of 4)")
    parser.add_argument("--compile", action="store_true", help="add torch.compile (inductor) variants")
    parser.add_argument("--profile", action="store_true", help="add a torch.profiler table of one training step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 avoids spin-wait noise)")
    parser.add_argument("--note", default="", help="free text for the results file (e.g. 'machine shared')")
    parser.add_argument("--output", default="benchmarks/results/edm2_unet.md", help="markdown results file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    if any(r < 4 or r % 4 for r in args.resolutions):
        parser.error("--resolutions must be positive multiples of 4 (the networks down-sample twice)")
    args.load_start = os.getloadavg()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    profile = profile_table(args.batch, device) if args.profile else None
    # Larger images get a proportionally smaller batch: the same pixels per step (batch 16 at 32x32 = 4 at 64x64).
    batches = {r: max(1, args.batch * 32**2 // r**2) for r in args.resolutions}
    rows = [row for r in args.resolutions for row in run(r, batches[r], args.rounds, device, args.compile)]
    for row in rows:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    write_markdown(rows, args, device, profile)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
