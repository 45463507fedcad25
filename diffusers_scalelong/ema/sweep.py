"""Score a range of EMA lengths after training (EDM2 Fig. 5 at any scale): ``scalelong-sweep-ema``.

The targets ``sigma_rel_1..N`` at one snapshot time are reconstructed in one streaming pass over the snapshots
(:func:`~diffusers_scalelong.ema.reconstruct_ema`), then each is sampled (EDM Heun, fixed seed) and scored:
Frechet distance (and KID when reference features are at hand) in the feature space of a classifier (the
package's Fashion-MNIST network by default, see :mod:`diffusers_scalelong.metrics`) against Fashion-MNIST, a
folder of reference images, or stored reference statistics ``(mu, sigma)``. The sample-noise band of FD is the
standard deviation of ``FD`` over bootstrap resamples of the generated features.

Outputs in ``output_dir``: ``sweep.jsonl`` (one JSON line per target, written as each finishes; a rerun skips
finished targets) and ``sweep.png`` (score vs sigma_rel with its band, the best target marked).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time as clock
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open

from ..atomic import atomic_path, atomic_write_text
from ..metrics import (
    REFERENCES,
    fd_kid_from_features,
    frechet_distance,
    gaussian_stats,
    get_feature_extractor,
    load_reference_images,
)
from ..pipelines import EDM2Pipeline
from ..schedulers import EDMHeunScheduler
from .explorer.source import SnapshotSource, add_source_arguments, source_from_args
from .reconstruct import reconstruct_ema, resolve_model_class

SWEEP_FILE = "sweep.jsonl"
CURVE_FILE = "sweep.png"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
# Settings that must agree for two records to share one curve (a rerun with other settings is refused).
SETTINGS = ("time", "num_samples", "num_inference_steps", "seed", "reference", "feature_space")


class Reference:
    """Reference features ``[N, D]`` (FD and KID) or only their statistics ``(mu, sigma)`` (FD)."""

    def __init__(self, name: str, features: torch.Tensor | None, stats: tuple[np.ndarray, np.ndarray]) -> None:
        self.name, self.features, self.stats = name, features, stats


@functools.lru_cache(maxsize=4)
def _named_reference(reference: str, feature_space: str, resolution: int) -> Reference:
    features = get_feature_extractor(feature_space)(load_reference_images(reference, resolution=resolution))
    return Reference(reference, features, gaussian_stats(features))


def load_reference(
    feature_space: str,
    resolution: int,
    channels: int,
    reference: str | None = None,
    reference_images: str | os.PathLike | None = None,
    reference_stats: str | os.PathLike | None = None,
) -> Reference:
    """The reference: a named Fashion-MNIST split, a folder of images, or a safetensors file with ``mu`` ``[D]``
    and ``sigma`` ``[D, D]`` (features of the same ``feature_space``); exactly one of them."""
    given = [x for x in (reference, reference_images, reference_stats) if x is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of reference, reference_images and reference_stats")
    if reference is not None:
        if reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}")
        return _named_reference(reference, feature_space, resolution)
    if reference_images is not None:
        folder = Path(reference_images)
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []
        if len(files) < 2:
            raise ValueError(f"reference_images must be a folder with at least 2 images, got {folder}")
        mode = "L" if channels == 1 else "RGB"
        arrays = [np.asarray(Image.open(p).convert(mode), dtype=np.float32) for p in files]
        if len({a.shape for a in arrays}) != 1:
            raise ValueError(f"reference_images in {folder} differ in size; give images of one size")
        images = torch.from_numpy(np.stack(arrays)).reshape(len(arrays), *arrays[0].shape[:2], -1)
        features = get_feature_extractor(feature_space)(images.permute(0, 3, 1, 2) / 127.5 - 1)
        return Reference(str(folder), features, gaussian_stats(features))
    try:
        with safe_open(str(reference_stats), framework="np") as handle:
            mu, sigma = handle.get_tensor("mu").astype(np.float64), handle.get_tensor("sigma").astype(np.float64)
    except Exception as error:  # safetensors raises its own error types for a missing key or a damaged file
        raise ValueError(
            f"reference_stats {reference_stats} is not a safetensors file with mu and sigma: {error}"
        ) from None
    if mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
        raise ValueError(
            f"reference_stats {reference_stats}: mu must be [D] and sigma [D, D], got {mu.shape}, {sigma.shape}"
        )
    return Reference(str(reference_stats), None, (mu, sigma))


def score_images(
    images: torch.Tensor, reference: Reference, feature_space: str, *, bootstrap: int = 20, seed: int = 0
) -> dict[str, float | int]:
    """FD (and KID when the reference has features) of ``images`` in ``[-1, 1]``, with ``FD-<net>-std``: the
    standard deviation of FD over ``bootstrap`` resamples (with replacement) of the generated features."""
    extractor = get_feature_extractor(feature_space)
    generated = extractor(images)
    name = f"FD-{extractor.name}"
    if generated.shape[1] != len(reference.stats[0]):
        raise ValueError(
            f"reference has {len(reference.stats[0])} features, {feature_space} gives {generated.shape[1]}"
        )
    if reference.features is not None:
        scores = fd_kid_from_features(generated, reference.features, extractor.name, seed)
    else:
        scores = {name: frechet_distance(*gaussian_stats(generated), *reference.stats), "num_generated": len(generated)}
    rng = np.random.default_rng(seed)
    resampled = [
        frechet_distance(*gaussian_stats(generated[rng.integers(0, len(generated), len(generated))]), *reference.stats)
        for _ in range(bootstrap)
    ]
    scores[f"{name}-std"] = float(np.std(resampled))
    return scores


@torch.no_grad()
def sample_images(pipeline: EDM2Pipeline, count: int, steps: int, seed: int, batch_size: int = 128) -> torch.Tensor:
    """``count`` images in ``[-1, 1]`` from one generator seeded with ``seed`` (classes in turn if conditional)."""
    generator = torch.Generator().manual_seed(seed)
    images = []
    for start in range(0, count, batch_size):
        size = min(batch_size, count - start)
        labels = None if pipeline.num_classes is None else [(start + i) % pipeline.num_classes for i in range(size)]
        output = pipeline(
            batch_size=size, class_labels=labels, num_inference_steps=steps, generator=generator, output_type="pt"
        )
        images.append(output.images * 2 - 1)
    return torch.cat(images)


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``sweep.jsonl`` (``[]`` when it does not exist); ``ValueError`` naming a bad line."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
            _ = float(record["sigma_rel"]) + float(record["score"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}, line {number}: not a sweep record ({error!r})") from None
        records.append(record)
    return records


def sweep_figure(records: Sequence[dict[str, Any]], mark: float | None = None):
    """A matplotlib ``Figure``: score vs sigma_rel with its +-1 std band, the best target starred, ``mark`` dashed."""
    from matplotlib.figure import Figure

    records = sorted(records, key=lambda r: r["sigma_rel"])
    x = np.array([r["sigma_rel"] for r in records])
    y = np.array([r["score"] for r in records])
    band = np.array([r["score_std"] for r in records])
    figure = Figure(figsize=(6, 3.5))
    ax = figure.subplots()
    ax.fill_between(x, y - band, y + band, alpha=0.25, label="sample noise (bootstrap std)")
    ax.plot(x, y, "o-", label=records[0]["metric"])
    best = int(np.argmin(y))
    ax.plot([x[best]], [y[best]], "*", markersize=16, color="C3", label=f"best: sigma_rel={x[best]:.3f}")
    if mark is not None:
        ax.axvline(mark, linestyle="--", color="0.3", label=f"current: {mark:.3f}")
    ax.set_xlabel("sigma_rel (EMA length relative to training time)")
    ax.set_ylabel(f"{records[0]['metric']} (lower is better)")
    ax.set_title(
        f"{records[0]['num_samples']} samples per point at time {records[0]['time']} {records[0]['time_unit']}"
    )
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _write_curve(records: Sequence[dict[str, Any]], path: Path) -> None:
    figure = sweep_figure(records)
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=100)


def sweep_ema(
    source: SnapshotSource | str | os.PathLike,
    sigma_rels: Sequence[float],
    output_dir: str | os.PathLike,
    *,
    time: int | None = None,
    num_samples: int = 256,
    num_inference_steps: int = 12,
    seed: int = 0,
    reference: str | None = None,
    reference_images: str | os.PathLike | None = None,
    reference_stats: str | os.PathLike | None = None,
    feature_space: str = "fmnist-classifier",
    bootstrap: int = 20,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Reconstruct, sample and score each target; returns every record of ``output_dir/sweep.jsonl``.

    Everything is checked (source, reachability of each target, reference, earlier records' settings) before
    anything is written. Targets already in ``sweep.jsonl`` are skipped; the others come from one streaming pass.
    Without a reference, one-channel models are scored against the Fashion-MNIST test split.
    """
    source = source if isinstance(source, SnapshotSource) else SnapshotSource(source)
    time = source.times[-1] if time is None else time
    if time not in source.times:
        raise ValueError(f"time must be one of the snapshot times {source.times}, got {time!r}")
    sigma_rels = [float(s) for s in sigma_rels]
    if not sigma_rels or len(set(sigma_rels)) != len(sigma_rels):
        raise ValueError(f"sigma_rels must be distinct values, at least one, got {sigma_rels}")
    plans = {s: source.plan(s, time) for s in sigma_rels}  # refuses unreachable targets
    if not (isinstance(num_samples, int) and num_samples >= 2):
        raise ValueError(f"num_samples must be an integer >= 2, got {num_samples!r}")
    model_class = resolve_model_class(source.model_class or "")
    config = source.model_config or {}
    if reference is None and reference_images is None and reference_stats is None:
        if config.get("in_channels") != 1:
            raise ValueError(
                "give reference_images or reference_stats: only one-channel models default to Fashion-MNIST"
            )
        reference = "fashion-mnist-test"
    size = config.get("sample_size", 28)
    ref = load_reference(
        feature_space, size if isinstance(size, int) else 28, config.get("in_channels", 1), reference,
        reference_images, reference_stats,
    )  # fmt: skip
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"output_dir {output_dir} exists and is not a folder")
    settings = {
        "time": int(time), "num_samples": num_samples, "num_inference_steps": num_inference_steps, "seed": seed,
        "reference": ref.name, "feature_space": feature_space,
    }  # fmt: skip
    records = read_records(output_dir / SWEEP_FILE)
    for record in records:
        if any(record.get(key) != value for key, value in settings.items()):
            raise ValueError(
                f"{output_dir / SWEEP_FILE} holds records made with other settings "
                f"({ {k: record.get(k) for k in SETTINGS} }); use another output_dir"
            )
    done = {round(r["sigma_rel"], 9) for r in records}
    pending = [s for s in sigma_rels if round(s, 9) not in done]
    if pending:
        output_dir.mkdir(parents=True, exist_ok=True)
        snapshots = source.local_snapshots(time)
        states = reconstruct_ema(snapshots, pending, time, progress=progress)  # one pass for all targets
        unet = model_class.from_config(config).eval()
        pipeline = EDM2Pipeline(unet=unet, scheduler=EDMHeunScheduler())
        pipeline.set_progress_bar_config(disable=True)
        for sigma_rel, state in zip(pending, states, strict=True):
            started = clock.perf_counter()
            unet.load_state_dict(state, strict=True)
            images = sample_images(pipeline, num_samples, num_inference_steps, seed)
            scores = score_images(images, ref, feature_space, bootstrap=bootstrap, seed=seed)
            metric = next(k for k in scores if k.startswith("FD-") and not k.endswith("-std"))
            records.append({
                "sigma_rel": sigma_rel, "time_unit": source.time_unit, **settings, "metric": metric,
                "score": scores[metric], "score_std": scores[f"{metric}-std"], **scores,
                "relative_profile_error": float(plans[sigma_rel].relative_errors[0]),
                "seconds": round(clock.perf_counter() - started, 3),
            })  # fmt: skip
            atomic_write_text(output_dir / SWEEP_FILE, "".join(json.dumps(r) + "\n" for r in records))
            if progress:
                print(f"sigma_rel {sigma_rel:.4g}: {metric} {scores[metric]:.4g} +- {scores[f'{metric}-std']:.2g}")
    if records:
        _write_curve(records, output_dir / CURVE_FILE)
    return records


def evenly_spaced(low: float, high: float, count: int) -> list[float]:
    """``count`` sigma_rel values from ``low`` to ``high`` evenly spaced in log scale (3 decimals, distinct)."""
    values = sorted({round(v, 3) for v in np.geomspace(low, high, count)})
    return [v for v in values if low <= v <= high]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalelong-sweep-ema",
        description="Reconstruct N post-hoc EMA lengths in one pass over the snapshots, sample and score each "
        "(FD/KID), and write the scores as JSON lines and a PNG curve; a rerun skips finished targets.",
    )
    add_source_arguments(parser)
    targets = parser.add_mutually_exclusive_group(required=True)
    targets.add_argument("--sigma_rels", type=float, nargs="+", help="the targets, e.g. 0.03 0.05 0.08 0.12")
    targets.add_argument("--num_targets", type=int, help="N targets spread over the reachable range")
    parser.add_argument("--output_dir", required=True, help="folder for sweep.jsonl and sweep.png")
    parser.add_argument("--time", type=int, default=None, help="snapshot time to reconstruct at (default: newest)")
    parser.add_argument("--num_samples", type=int, default=256, help="generated images per target")
    parser.add_argument("--num_inference_steps", type=int, default=12, help="EDM Heun steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    refs = parser.add_mutually_exclusive_group()
    refs.add_argument("--reference", choices=REFERENCES, help="Fashion-MNIST split (default for 1-channel models)")
    refs.add_argument("--reference_images", help="a folder of reference images")
    refs.add_argument("--reference_stats", help="a safetensors file with reference feature statistics mu, sigma")
    parser.add_argument("--feature_space", default="fmnist-classifier", help="fmnist-classifier or efficientnet-lite0")
    parser.add_argument("--bootstrap", type=int, default=20, help="resamples for the FD noise band")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        source = source_from_args(args)
        time = source.times[-1] if args.time is None else args.time
        if args.num_targets is not None:
            if args.num_targets < 1:
                raise ValueError(f"--num_targets must be >= 1, got {args.num_targets}")
            reach = source.reachable_range(time) if time in source.times else None
            if reach is None:
                raise ValueError(f"no sigma_rel is reachable at time {time}")
            sigma_rels = evenly_spaced(*reach, args.num_targets)
        else:
            sigma_rels = args.sigma_rels
        records = sweep_ema(
            source, sigma_rels, args.output_dir, time=time, num_samples=args.num_samples,
            num_inference_steps=args.num_inference_steps, seed=args.seed, reference=args.reference,
            reference_images=args.reference_images, reference_stats=args.reference_stats,
            feature_space=args.feature_space, bootstrap=args.bootstrap, progress=True,
        )  # fmt: skip
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    best = min(records, key=lambda r: r["score"])
    print(f"best: sigma_rel {best['sigma_rel']:.4g} ({best['metric']} {best['score']:.4g} +- {best['score_std']:.2g})")
    print(f"wrote {Path(args.output_dir) / SWEEP_FILE} and {Path(args.output_dir) / CURVE_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
