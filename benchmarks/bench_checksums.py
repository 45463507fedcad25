"""The cost of content checksums: snapshot writes, reconstruction reads and checkpoint manifests, with and without.

The model is the one of ``bench_posthoc_ema.py``: a ~10M-parameter stack of linear layers tracked by
``PowerFunctionEMA`` with sigma_rel 0.05 and 0.10. Cases, each timed ``--repeats`` times interleaved (median wall
time, one torch thread):

* snapshot write (both profiles, float16 and float32): ``save_snapshots`` as shipped (checksum of the tensors, finite
  check, atomic write) against the same tensors written by ``safetensors.torch.save_file`` through the same atomic
  write, without checksum or finite check;
* reconstruction read: ``reconstruct_ema`` of sigma_rel 0.075 from ``--snapshots`` float16 snapshot files, verifying
  every file's checksum while streaming, against the same call with the per-tensor hashing replaced by a no-op;
* checkpoint manifest: ``folder_manifest`` (SHA-256 of every file) of a checkpoint-like folder (the model and two
  Adam moments in float32) against writing those files;
* raw hash throughput of SHA-256 and BLAKE2b on 256 MiB (why SHA-256).

Writes ``benchmarks/results/checksums.md``.

    python benchmarks/bench_checksums.py [--repeats 5] [--snapshots 16]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from diffusers_scalelong.atomic import atomic_path
from diffusers_scalelong.ema import PowerFunctionEMA, reconstruct_ema
from diffusers_scalelong.ema import reconstruct as reconstruct_module
from diffusers_scalelong.ema.snapshots import snapshot_filename, storage_dtype
from diffusers_scalelong.integrity import folder_manifest

WIDTH, DEPTH = 1000, 10  # 10 x (1000 x 1000 + 1000) = 10.01M parameters, as in bench_posthoc_ema.py
PROFILES = (0.05, 0.10)
RESULTS = Path(__file__).parent / "results" / "checksums.md"


def build_tracker() -> tuple[nn.Module, PowerFunctionEMA]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    ema = PowerFunctionEMA(model, sigma_rels=PROFILES)
    for step in range(1, 4):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * torch.randn_like(parameter))
        ema.update(model, step)
    return model, ema


def write_without_checksum(ema: PowerFunctionEMA, folder: Path, dtype: str) -> None:
    """The same files as ``save_snapshots`` minus the checksum and finite check: plain save_file, atomic."""
    for sigma_rel in PROFILES:
        tensors = {k: v.to(storage_dtype(dtype)).contiguous() for k, v in ema.averaged_state_dict(sigma_rel).items()}
        with atomic_path(folder / snapshot_filename(ema.last_step, sigma_rel)) as temporary:
            save_file(tensors, str(temporary), metadata={"phema": "{}"})


class NoDigest:
    """Stands in for ``TensorDigest`` (with a no-op ``check_recorded_digest``) to time a reconstruction without
    verification."""

    def add(self, name, tensor, raw_sha256=None) -> None:
        pass

    def hexdigest(self) -> None:
        return None


def median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def timed(function, *args, **kwargs) -> float:
    start = time.perf_counter()
    function(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--snapshots", type=int, default=16, help="snapshot files per reconstruction")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, ema = build_tracker()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for dtype in ("float16", "float32"):
            with_, without = [], []
            for repeat in range(args.repeats):
                with_.append(timed(ema.save_snapshots, str(tmp / f"with-{repeat}"), dtype=dtype))
                without.append(timed(write_without_checksum, ema, tmp / f"without-{repeat}", dtype))
            rows.append((f"snapshot write, 2 profiles, {dtype}", median_ms(without), median_ms(with_)))

        folder = tmp / "series"
        step = ema.last_step
        for _ in range(args.snapshots // len(PROFILES)):
            step += 1
            ema.update(model, step)
            ema.save_snapshots(str(folder), dtype="float16")
        verified, unverified = [], []
        names = ("TensorDigest", "check_recorded_digest", "data_sha256")
        shipped = [getattr(reconstruct_module, name) for name in names]
        for _ in range(args.repeats):
            verified.append(timed(reconstruct_ema, folder, [0.075]))
            for name, stand_in in zip(names, (NoDigest, lambda *_: None, lambda _: None), strict=True):
                setattr(reconstruct_module, name, stand_in)
            try:
                unverified.append(timed(reconstruct_ema, folder, [0.075]))
            finally:
                for name, original in zip(names, shipped, strict=True):
                    setattr(reconstruct_module, name, original)
        rows.append(
            (f"reconstruction from {args.snapshots} float16 snapshots", median_ms(unverified), median_ms(verified))
        )

        state = {k: v.detach() for k, v in model.state_dict().items()}
        checkpoint = tmp / "checkpoint"
        checkpoint.mkdir()
        write, manifest = [], []
        for _ in range(args.repeats):
            write.append(
                timed(
                    lambda: [
                        save_file(state, str(checkpoint / f"{name}.safetensors"))
                        for name in ("model", "exp_avg", "exp_avg_sq")
                    ]
                )
            )
            manifest.append(timed(folder_manifest, checkpoint))
        rows.append(
            (
                "checkpoint files (model + 2 Adam moments, fp32)",
                median_ms(write),
                median_ms(write) + median_ms(manifest),
            )
        )

    data = os.urandom(256 << 20)
    throughput = {name: len(data) / timed(hashlib.new, name, data) / 1e9 for name in ("sha256", "blake2b")}

    lines = [
        "# Content checksums: cost with and without",
        "",
        f"Machine: {platform.machine()} {platform.processor() or ''} ({os.cpu_count()} cores visible, shared), "
        f"Python {platform.python_version()}, torch {torch.__version__}, 1 torch thread; {datetime.date.today()}.",
        f"Command: `python benchmarks/bench_checksums.py --repeats {args.repeats} --snapshots {args.snapshots}`",
        f"Model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters (as in bench_posthoc_ema.py). "
        f"Median of {args.repeats} interleaved repeats, wall time.",
        "",
        "| case | without checksum (ms) | with checksum (ms) | overhead |",
        "|---|---:|---:|---:|",
    ]
    for name, without_ms, with_ms in rows:
        lines.append(f"| {name} | {without_ms:.0f} | {with_ms:.0f} | {100 * (with_ms / without_ms - 1):+.0f}% |")
    lines += [
        "",
        "The checkpoint row's 'with' is writing the files plus hashing them for the manifest (`folder_manifest`).",
        "",
        "Raw hash throughput on 256 MiB: "
        + ", ".join(f"{name} {rate:.2f} GB/s" for name, rate in throughput.items())
        + " (SHA-256 uses the CPU's SHA extensions where present).",
        "",
    ]
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
