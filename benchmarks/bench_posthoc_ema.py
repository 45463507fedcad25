"""Post-hoc EMA reconstruction: time, peak memory and error vs ema-pytorch's PostHocEMA, for 8/32/128 snapshots.

A ~10M-parameter model (a stack of linear layers) follows a random-walk trajectory for ``--steps`` steps while
``PowerFunctionEMA`` tracks sigma_rel 0.05 and 0.10 (snapshots every few steps, stored as float16) and, separately,
0.075 (the reference). Each case reconstructs 0.075 at the last step from 8, 32 or 128 snapshot files:

* ``ours``: ``diffusers_scalelong.ema.reconstruct_ema`` on the safetensors snapshots;
* ``ema-pytorch``: ``ema_pytorch.PostHocEMA.synthesize_ema_model`` on the same tensors saved in its own checkpoint
  format (``<profile index>.<step>.pt`` files holding a ``KarrasEMA`` state dict);
* ``read``: only reading the bytes of the snapshot files, the floor for any streaming method.

The sweep: 8 targets (sigma_rel 0.05 ... 0.12, including 0.075) from the ``--sweep_files`` snapshots, as one streaming pass of
``reconstruct_ema`` (every file read once, 8 accumulators), as 8 single-target passes, and as 8
``synthesize_ema_model`` calls of ema-pytorch.

The tracking cost (``--update_cost``): ``PowerFunctionEMA.update`` with two profiles, timed interleaved with the
training step it follows (forward + backward + Adam, 1 torch thread, process CPU time, median), for the demo's
EDM2 network and a ~100M-parameter EDM2 network.

Every reconstruction runs in a fresh subprocess (peak RSS: Linux VmHWM, reset right before the measured call and
reported above the RSS at that moment); cases are interleaved. Writes ``benchmarks/results/posthoc_ema.md``.

    python benchmarks/bench_posthoc_ema.py [--steps 256] [--cases 8 32 128] [--sweep_files 32] [--update_cost]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_edm2_unet import cpu_model_name
from safetensors.torch import load_file, save_file
from torch import nn

TARGET = 0.075
SWEEP = (0.05, 0.06, 0.07, 0.075, 0.08, 0.09, 0.10, 0.12)  # includes TARGET: its error is checked
PROFILES = (0.05, 0.10)
WIDTH, DEPTH = 1000, 10  # 10 x (1000 x 1000 + 1000) = 10.01M parameters


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def measure(call):
    """Run `call()`; return (result, seconds, peak RSS above the RSS at the start in MiB) - Linux VmHWM reset."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_mib("VmRSS")
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    return result, seconds, _status_mib("VmHWM") - base


def relative_error(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    num = sum(float((state[k].double() - v.double()).pow(2).sum()) for k, v in reference.items())
    den = sum(float(v.double().pow(2).sum()) for v in reference.values())
    return (num / den) ** 0.5


# ------------------------------------------------------------------------------------------------ generation
def generate(workdir: Path, steps: int, every: int) -> None:
    """Random-walk training trajectory; snapshots of 0.05/0.10 every `every` steps; tracked 0.075 as reference."""
    from tqdm import tqdm

    from diffusers_scalelong.ema import PowerFunctionEMA

    model = build_model()
    ema = PowerFunctionEMA(model, sigma_rels=PROFILES)
    reference = PowerFunctionEMA(model, sigma_rels=(TARGET,))
    generator = torch.Generator().manual_seed(1)
    drift = [torch.randn(p.shape, generator=generator) * 1e-3 for p in model.parameters()]
    ours, theirs = workdir / "ours", workdir / "ema_pytorch"
    theirs.mkdir(parents=True)
    with torch.no_grad():
        for step in tqdm(range(1, steps + 1), desc="trajectory", unit="step"):
            for p, d in zip(model.parameters(), drift, strict=True):
                p.add_(d).add_(torch.randn(p.shape, generator=generator), alpha=2e-3)
            ema.update(model, step)
            reference.update(model, step)
            if step % every == 0:
                for index, path in enumerate(ema.save_snapshots(ours, step, dtype=torch.float16)):
                    tensors = load_file(path)
                    package = {"initted": torch.tensor(True), "step": torch.tensor(step)}
                    package.update({f"ema_model.{k}": v for k, v in tensors.items()})
                    torch.save(package, theirs / f"{index}.{step}.pt")
    save_file(reference.averaged_state_dict(TARGET), str(workdir / "reference.safetensors"))


def case_folders(workdir: Path, steps: int, num_files: int, exist_ok: bool = False) -> tuple[Path, Path]:
    """Hard-linked folders with the `num_files` snapshots (num_files / 2 evenly spaced times, both profiles)."""
    stride = steps // (num_files // 2)
    ours, theirs = workdir / f"case{num_files}" / "ours", workdir / f"case{num_files}" / "ema_pytorch"
    if exist_ok and ours.is_dir() and theirs.is_dir():
        return ours, theirs
    ours.mkdir(parents=True)
    theirs.mkdir(parents=True)
    for path in (workdir / "ours").iterdir():
        if int(path.name.split("-")[1]) % stride == 0:
            os.link(path, ours / path.name)
    for path in (workdir / "ema_pytorch").iterdir():
        if int(path.name.split(".")[1]) % stride == 0:
            os.link(path, theirs / path.name)
    assert len(os.listdir(ours)) == len(os.listdir(theirs)) == num_files
    return ours, theirs


# --------------------------------------------------------------------------------------------------- workers
def worker(kind: str, folder: Path, reference_path: Path, steps: int) -> dict:
    reference = load_file(reference_path)
    if kind == "read":  # raw bytes of every file into one reusable buffer: the I/O floor
        files = sorted(folder.iterdir())
        buffer = bytearray(max(p.stat().st_size for p in files))

        def read_all():
            for path in files:
                with open(path, "rb", buffering=0) as f:
                    f.readinto(buffer)

        _, seconds, peak = measure(read_all)
        return {"seconds": seconds, "peak_mib": peak}
    if kind == "ours":
        from diffusers_scalelong.ema import reconstruct_ema

        (state,), seconds, peak = measure(lambda: reconstruct_ema(folder, [TARGET]))
        return {"seconds": seconds, "peak_mib": peak, "error": relative_error(state, reference)}
    if kind == "ours_sweep":
        from diffusers_scalelong.ema import reconstruct_ema

        states, seconds, peak = measure(lambda: reconstruct_ema(folder, list(SWEEP)))
        return {"seconds": seconds, "peak_mib": peak, "error": relative_error(states[SWEEP.index(TARGET)], reference)}
    if kind == "ours_single":
        from diffusers_scalelong.ema import reconstruct_ema

        states, seconds, peak = measure(lambda: [reconstruct_ema(folder, [t])[0] for t in SWEEP])
        return {"seconds": seconds, "peak_mib": peak, "error": relative_error(states[SWEEP.index(TARGET)], reference)}
    if kind == "ema_pytorch_sweep":
        from ema_pytorch import PostHocEMA

        posthoc = PostHocEMA(
            build_model(), sigma_rels=PROFILES, checkpoint_folder=str(folder), checkpoint_every_num_steps="manual"
        )
        states, seconds, peak = measure(
            lambda: [posthoc.synthesize_ema_model(sigma_rel=t, step=steps).ema_model.state_dict() for t in SWEEP]
        )
        return {"seconds": seconds, "peak_mib": peak, "error": relative_error(states[SWEEP.index(TARGET)], reference)}
    if kind == "ema_pytorch":
        from ema_pytorch import PostHocEMA

        posthoc = PostHocEMA(
            build_model(), sigma_rels=PROFILES, checkpoint_folder=str(folder), checkpoint_every_num_steps="manual"
        )
        synthesized, seconds, peak = measure(lambda: posthoc.synthesize_ema_model(sigma_rel=TARGET, step=steps))
        state = synthesized.ema_model.state_dict()
        return {"seconds": seconds, "peak_mib": peak, "error": relative_error(state, reference)}
    raise ValueError(kind)


def run_worker(kind: str, folder: Path, workdir: Path, steps: int) -> dict:
    command = [sys.executable, __file__, "--worker", kind, "--folder", str(folder), "--workdir", str(workdir)]
    result = subprocess.run(command + ["--steps", str(steps)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------- update cost
def update_cost_models() -> dict[str, tuple[nn.Module, int, int, int]]:
    """name: (EDM2 network, batch, resolution, channels): the demo's network and a ~100M-parameter one."""
    from diffusers_scalelong.models import EDM2UNet2DModel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import demo as demo_script  # the main job's network and batch

    torch.manual_seed(0)
    demo = EDM2UNet2DModel(sample_size=demo_script.RESOLUTION, in_channels=1, **demo_script.NETWORK)
    large = EDM2UNet2DModel(
        sample_size=32, in_channels=4, model_channels=128, channel_mult=(1, 2, 3, 4), layers_per_block=2,
        attention_resolutions=(16, 8),
    )  # fmt: skip
    return {
        "demo EDM2 (examples/demo.py)": (demo, demo_script.BATCH_SIZE, demo_script.RESOLUTION, 1),
        "EDM2, ~100M parameters": (large, 8, 32, 4),
    }


def update_cost(rounds: int) -> list[dict]:
    """Median process CPU time of a training step and of the ``PowerFunctionEMA.update`` after it, interleaved."""
    from diffusers_scalelong.ema import PowerFunctionEMA

    torch.set_num_threads(1)
    rows = []
    for name, (model, batch, resolution, channels) in update_cost_models().items():
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        ema = PowerFunctionEMA(model, sigma_rels=PROFILES)
        images = torch.randn(batch, channels, resolution, resolution)
        step_times, update_times = [], []
        for step in range(1, rounds + 2):  # the first round warms up
            start = time.process_time()
            model(images, torch.randn(batch)).sample.square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_times.append(time.process_time() - start)
            start = time.process_time()
            ema.update(model, step)
            update_times.append(time.process_time() - start)
            print(name, step_times[-1], update_times[-1], flush=True)
        train, update = statistics.median(step_times[1:]), statistics.median(update_times[1:])
        params = sum(p.numel() for p in model.parameters()) / 1e6
        rows.append({"name": name, "params_M": params, "batch": batch, "resolution": resolution, "train": train})
        rows[-1].update(update=update, fraction=update / train)
    return rows


# ---------------------------------------------------------------------------------------------------- report
def write_report(
    path: Path,
    rows: list[dict],
    args: argparse.Namespace,
    generate_seconds: float,
    sweep: dict | None,
    update_rows: list[dict],
) -> None:
    from importlib.metadata import version

    lines = [
        "# Post-hoc EMA reconstruction vs ema-pytorch PostHocEMA",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {cpu_model_name()}, {os.cpu_count()} CPUs ({args.reconstruct_threads} torch threads in the "
        f"reconstructions), {platform.system()} {platform.release()}; load "
        f"average (1, 5, 15 min) at start {args.load_start}, at end {os.getloadavg()} (on a loaded machine the times "
        "are indicative; ratios within one row are fairer)",
        f"- software: python {platform.python_version()}, torch {torch.__version__}, ema-pytorch {version('ema-pytorch')}, "
        f"safetensors {version('safetensors')}",
        f"- command: `python benchmarks/bench_posthoc_ema.py --steps {args.steps} --cases {' '.join(map(str, args.cases))} "
        f"--sweep_files {args.sweep_files}" + (f" --update_cost --rounds {args.rounds}`" if args.update_cost else "`"),
        f"- model: {DEPTH} x Linear({WIDTH}, {WIDTH}) = {DEPTH * (WIDTH * WIDTH + WIDTH) / 1e6:.2f}M parameters; random-walk "
        f"trajectory of {args.steps} steps (generation + writing: {generate_seconds:.0f} s); snapshots of sigma_rel 0.05 and "
        f"0.10 stored as float16 ({DEPTH * (WIDTH * WIDTH + WIDTH) * 2 / 2**20:.0f} MiB per file), half of the files per "
        "profile, evenly spaced; target sigma_rel 0.075 at the last step, compared with the same profile tracked directly "
        "in float32",
        "- files were just written, so reads come from the page cache (warm); each number is one fresh subprocess; "
        "peak memory = peak RSS above the RSS right before the measured call (ema-pytorch additionally holds the model "
        "and one EMA copy per profile before the call, not counted)",
        "",
        "| snapshots | read only (s) | ours (s) | ema-pytorch (s) | ours peak (MiB) | ema-pytorch peak (MiB) | "
        "read peak (MiB) | ours rel. L2 error | ema-pytorch rel. L2 error |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['n']} | {row['read']['seconds']:.2f} | {row['ours']['seconds']:.2f} | "
            f"{row['ema_pytorch']['seconds']:.2f} | {row['ours']['peak_mib']:.0f} | {row['ema_pytorch']['peak_mib']:.0f} | "
            f"{row['read']['peak_mib']:.0f} | {row['ours']['error']:.2e} | {row['ema_pytorch']['error']:.2e} |"
        )
    lines += [
        "",
        "Error: relative L2 distance over all parameters between the reconstruction and the directly tracked "
        "sigma_rel 0.075 average. ema-pytorch solves A x = b with `torch.linalg.solve` and does not rescale the "
        "coefficients to sum 1; ours uses float64 least squares plus the rescaling.",
        "",
    ]
    if sweep is not None:
        one_pass = sweep["ours_sweep"]["seconds"]
        lines += [
            f"## Sweep: 8 targets ({', '.join(map(str, SWEEP))}) from {args.sweep_files} snapshot files",
            "",
            "| method | time (s) | peak (MiB) | rel. L2 error at 0.075 | time / ema-pytorch |",
            "|---|---:|---:|---:|---:|",
        ]
        for kind, label in (
            ("ours_sweep", "ours, one streaming pass (`reconstruct_ema(folder, targets)`)"),
            ("ours_single", "ours, 8 single-target passes"),
            ("ema_pytorch_sweep", "ema-pytorch, 8 `synthesize_ema_model` calls"),
        ):
            r = sweep[kind]
            lines.append(
                f"| {label} | {r['seconds']:.2f} | {r['peak_mib']:.0f} | {r['error']:.2e} | "
                f"{r['seconds'] / sweep['ema_pytorch_sweep']['seconds']:.2f}x |"
            )
        lines += ["", f"One pass vs 8 passes of ours: {one_pass / sweep['ours_single']['seconds']:.2f}x the time.", ""]
    if update_rows:
        lines += [
            "## Tracking cost: `PowerFunctionEMA.update` (2 profiles) per training step",
            "",
            f"1 torch thread, process CPU time, median of {args.rounds} interleaved steps after one warm-up; training "
            "step = forward + backward + Adam step of an EDM2UNet2DModel; load average at the end: "
            f"{os.getloadavg()}.",
            "",
            "| model | params (M) | batch x resolution | training step (s) | update (s) | update / step |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for r in update_rows:
            lines.append(
                f"| {r['name']} | {r['params_M']:.1f} | {r['batch']} x {r['resolution']}^2 | {r['train']:.3f} "
                f"| {r['update']:.4f} | {r['fraction']:.2%} |"
            )
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=256, help="trajectory length (a multiple of max(cases) / 2)")
    parser.add_argument("--cases", type=int, nargs="+", default=[8, 32, 128], help="numbers of snapshot files")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary folder, removed)")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "posthoc_ema.md"))
    parser.add_argument("--sweep_files", type=int, default=32, help="snapshot files of the 8-target sweep (0: skip)")
    parser.add_argument("--update_cost", action="store_true", help="also time PowerFunctionEMA.update per step")
    parser.add_argument("--rounds", type=int, default=5, help="timed training steps of the update-cost part")
    worker_kinds = ["read", "ours", "ema_pytorch", "ours_sweep", "ours_single", "ema_pytorch_sweep"]
    parser.add_argument("--worker", choices=worker_kinds, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = worker(args.worker, Path(args.folder), Path(args.workdir) / "reference.safetensors", args.steps)
        print(json.dumps(result))
        return

    args.load_start = os.getloadavg()
    args.reconstruct_threads = torch.get_num_threads()  # what the reconstruction subprocesses get
    every = args.steps // (max(args.cases) // 2)
    if args.sweep_files and args.sweep_files > max(args.cases):
        parser.error("--sweep_files must not exceed the largest of --cases")
    if args.steps % (max(args.cases) // 2) or any(args.steps % (n // 2) for n in [*args.cases, args.sweep_files] if n):
        parser.error("--steps must be divisible by every case's number of snapshot times (case / 2)")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-posthoc-ema-"))
    try:
        start = time.perf_counter()
        generate(workdir, args.steps, every)
        generate_seconds = time.perf_counter() - start
        rows = []
        for n in args.cases:
            ours, theirs = case_folders(workdir, args.steps, n)
            row = {"n": n}
            for kind, folder in (("read", ours), ("ours", ours), ("ema_pytorch", theirs)):
                row[kind] = run_worker(kind, folder, workdir, args.steps)
                print(n, kind, row[kind], flush=True)
            rows.append(row)
        sweep = None
        if args.sweep_files:
            ours, theirs = case_folders(workdir, args.steps, args.sweep_files, exist_ok=True)
            sweep = {}
            for kind, folder in (("ours_sweep", ours), ("ours_single", ours), ("ema_pytorch_sweep", theirs)):
                sweep[kind] = run_worker(kind, folder, workdir, args.steps)
                print("sweep", kind, sweep[kind], flush=True)
        update_rows = update_cost(args.rounds) if args.update_cost else []
        write_report(Path(args.output), rows, args, generate_seconds, sweep, update_rows)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
