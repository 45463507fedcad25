"""Command line: reconstruct power-function EMA models from snapshot files (``scalelong-reconstruct-ema``)."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from safetensors import SafetensorError

from .plot import plot_reconstruction
from .profiles import MAX_PROFILE_ERROR
from .reconstruct import MAX_TARGETS, InexactReconstructionWarning, plan_reconstruction, save_planned_models
from .snapshots import list_snapshots, storage_dtype


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalelong-reconstruct-ema",
        description=(
            "Reconstruct EMA models of any length (sigma_rel) from power-function EMA snapshots written by "
            "PowerFunctionEMA.save_snapshots (EDM2 post-hoc EMA, Algorithm 3). Several targets are built in one "
            "pass over the snapshots."
        ),
    )
    parser.add_argument("snapshot_dir", help="folder with phema-<time>-<sigma_rel>.safetensors snapshot files")
    parser.add_argument(
        "--sigma_rel",
        type=float,
        nargs="+",
        required=True,
        help=(
            f"target relative EMA lengths, each in [1e-4, 0.2887), at most {MAX_TARGETS}, "
            "e.g. --sigma_rel 0.05 0.075 0.1"
        ),
    )
    parser.add_argument(
        "--target_step",
        type=int,
        default=None,
        help="time stamp to reconstruct at; must be one of the snapshot times (default: the newest)",
    )
    parser.add_argument("--output_dir", default=None, help="where to write one model folder per target")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="dtype of the written weights: float32, float16 or bfloat16 (default float32)",
    )
    parser.add_argument(
        "--accumulate_dtype", default="float32", help="accumulation precision: float32 (default) or float64"
    )
    parser.add_argument("--plot", default=None, help="also write a PNG of the target and reconstructed profiles")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output folders")
    parser.add_argument(
        "--allow_inexact",
        action="store_true",
        help=(
            f"also reconstruct targets whose profile the snapshots reach only with more than {MAX_PROFILE_ERROR:.0%} "
            "relative error (refused otherwise, naming the reachable range); each is reported as a warning"
        ),
    )
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="print the coefficients and the expected profile error, write nothing",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.dry_run and args.output_dir is None:
        parser.error("--output_dir is required unless --dry-run is given")
    try:
        storage_dtype(args.dtype)
        snapshots = list_snapshots(args.snapshot_dir)
        if not snapshots:
            raise ValueError(f"no snapshot files (phema-*.safetensors) in {args.snapshot_dir}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", InexactReconstructionWarning)
            plan = plan_reconstruction(snapshots, args.sigma_rel, args.target_step, allow_inexact=args.allow_inexact)
        inexact = [str(w.message) for w in caught if issubclass(w.category, InexactReconstructionWarning)]
        print(plan.describe())
        if args.plot:
            plot_reconstruction(plan, args.plot)
            print(f"wrote {args.plot}")
        if args.dry_run:
            _warn(parser, inexact)
            return 0
        folders = save_planned_models(
            plan,
            args.output_dir,
            dtype=args.dtype,
            accumulate_dtype=args.accumulate_dtype,
            progress=True,
            overwrite=args.overwrite,
        )
    except (ValueError, OSError, SafetensorError) as error:
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(error).split())}\n")
    for folder in folders:
        print(f"wrote {folder}")
    _warn(parser, inexact)
    return 0


def _warn(parser: argparse.ArgumentParser, messages: list[str]) -> None:
    """Each inexact target as a last, loud line on stderr."""
    for message in messages:
        print(f"{parser.prog}: WARNING: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
