"""Console scripts ``scalelong-convert-edm2`` and ``scalelong-convert-uvit``.

A refused input (a bad option, a file this package will not read, an existing output folder) prints one line
``<command>: <reason>`` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .edm2_official import convert_edm2_pickle, push_converted_edm2
from .edm2_snapshots import convert_edm2_snapshots
from .uvit_official import OFFICIAL_LSC_METHODS, convert_uvit_checkpoint


class CommandRefused(SystemExit):
    """Exit status 2; ``str()`` is the one-line message the command printed on stderr."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _refuse(prog: str, error: object) -> NoReturn:
    message = f"{prog}: " + " ".join(str(error).split())
    print(message, file=sys.stderr)
    raise CommandRefused(message)


def edm2_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalelong-convert-edm2",
        description="Convert an official EDM2 network pickle (read safely: no code from it runs) into an "
        "EDM2Pipeline folder that also loads as an EDMPreconditioner for fine-tuning; or a folder of official raw "
        "post-hoc EMA snapshots into phema-*.safetensors snapshot files for scalelong-reconstruct-ema. The "
        "released models are licensed CC BY-NC-SA 4.0 by NVIDIA; the converted files stay under that license.",
    )
    parser.add_argument(
        "network",
        help="official network pickle (e.g. edm2-img512-xs-2147483-0.135.pkl), or a folder of raw snapshot "
        "pickles <prefix>-<kimg>-<sigma_rel>.pkl (e.g. raw-snapshots/edm2-img512-xs)",
    )
    parser.add_argument("--output_dir", required=True, help="folder to write the pipeline or the snapshots into")
    parser.add_argument("--prefix", default=None, help="snapshot folders: the run's file name prefix to convert")
    parser.add_argument(
        "--sigma_rel", type=float, nargs="+", default=None, help="snapshot folders: convert only these profiles"
    )
    parser.add_argument(
        "--vae",
        default=None,
        help="latent (img512) models: local folder or Hub id of the VAE the pickle names (stabilityai/sd-vae-ft-mse)",
    )
    parser.add_argument("--guide", default=None, help="guiding network pickle (unconditional or smaller network)")
    parser.add_argument("--guidance", type=float, default=None, help="default guidance weight w (needs --guide)")
    parser.add_argument("--push_to_hub", default=None, metavar="REPO_ID", help="also push to this Hub repository")
    parser.add_argument("--hub_endpoint", default=None, help="Hub URL (default: HF_ENDPOINT or the public Hub)")
    parser.add_argument("--private", action="store_true", help="create the Hub repository as private")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="network pickles: replace a non-empty --output_dir as a whole; snapshot folders: convert again the "
        "snapshots already there",
    )
    return parser


def edm2_main(argv: Sequence[str] | None = None) -> int:
    args = edm2_parser().parse_args(argv)
    if Path(args.network).is_dir():
        return _convert_snapshots(args)
    try:
        pipeline = convert_edm2_pickle(
            args.network, args.output_dir, args.vae, args.guide, args.guidance, overwrite=args.overwrite
        )
    except (ValueError, OSError) as error:
        _refuse("scalelong-convert-edm2", error)
    print(f"wrote {args.output_dir}")
    if args.push_to_hub:
        url = push_converted_edm2(
            args.output_dir, args.push_to_hub, pipeline, endpoint=args.hub_endpoint, private=args.private or None
        )
        print(f"pushed to {url}")
    return 0


def _convert_snapshots(args: argparse.Namespace) -> int:
    for option in ("vae", "guide", "guidance", "push_to_hub"):
        if getattr(args, option) is not None:
            _refuse("scalelong-convert-edm2", f"--{option} applies to a network pickle, not a snapshot folder")
    try:
        paths = convert_edm2_snapshots(args.network, args.output_dir, args.prefix, args.sigma_rel, args.overwrite)
    except (ValueError, OSError) as error:
        _refuse("scalelong-convert-edm2", error)
    print(f"wrote {len(paths)} snapshots to {args.output_dir} (existing ones kept unless --overwrite)")
    return 0


def uvit_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalelong-convert-uvit",
        description="Convert an official U-ViT / ScaleLong checkpoint (a torch state dict such as nnet_ema.pth, "
        "read as plain data, nothing in it runs) into a UViT2DModel folder with a DDPMScheduler matching the official "
        "VP-SDE timestep convention (timestep = 999 t).",
    )
    parser.add_argument("checkpoint", help="official state dict file, e.g. nnet_ema.pth")
    parser.add_argument("--output_dir", required=True, help="folder to write the model into")
    parser.add_argument("--num_heads", type=int, required=True, help="attention heads (the state dict lacks them)")
    parser.add_argument(
        "--lsc",
        default=None,
        help=f"ScaleLong method: {', '.join(OFFICIAL_LSC_METHODS)}, or the official scalelong index 0-4 "
        "(default: the LS variant the se.* keys show, else none)",
    )
    parser.add_argument("--kappa", type=float, default=0.5, help="ScaleLong kappa (used by cs; default 0.5)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output_dir as a whole")
    return parser


def uvit_main(argv: Sequence[str] | None = None) -> int:
    args = uvit_parser().parse_args(argv)
    try:
        convert_uvit_checkpoint(
            args.checkpoint, args.output_dir, args.num_heads, args.lsc, args.kappa, overwrite=args.overwrite
        )
    except (ValueError, OSError) as error:
        _refuse("scalelong-convert-uvit", error)
    print(f"wrote {args.output_dir}")
    return 0
