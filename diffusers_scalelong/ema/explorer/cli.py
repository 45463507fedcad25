"""Command line: ``scalelong-ema-explorer SOURCE`` serves the explorer; ``--write_space DIR`` writes a Space."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .source import add_source_arguments, source_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalelong-ema-explorer",
        description="Choose the post-hoc EMA length by looking: a web page with a sigma_rel slider, a fixed-seed "
        'sample grid of the reconstructed EMA, its profile fit and "save this EMA" (needs the explorer extra).',
    )
    add_source_arguments(parser)
    parser.add_argument("--sigma_rel", type=float, default=None, help="initial sigma_rel (default 0.1 or nearest)")
    parser.add_argument("--time", type=int, default=None, help="initial training time (default: newest snapshot)")
    parser.add_argument("--sweep", default=None, help="a sweep.jsonl of scalelong-sweep-ema to plot beside")
    parser.add_argument("--save_dir", default="phema-explorer", help="default folder for 'save this EMA'")
    parser.add_argument("--num_images", type=int, default=16, help="images in the grid")
    parser.add_argument("--num_inference_steps", type=int, default=8, help="initial EDM Heun steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the grid")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7860, help="port to serve on")
    space = parser.add_argument_group("Space")
    space.add_argument("--write_space", default=None, metavar="DIR", help="write a Space folder and exit")
    space.add_argument("--repo_id", default=None, help="the Hub repo of snapshots the Space shows (default SOURCE)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.write_space:
            from ..space import write_space

            repo_id = args.repo_id or args.source
            if not repo_id:
                raise ValueError("--write_space needs --repo_id (or SOURCE): the Hub repo of snapshots")
            folder = write_space(
                args.write_space, repo_id, path_in_repo=args.path_in_repo, revision=args.revision,
                endpoint=args.endpoint,
            )  # fmt: skip
            print(f"wrote {folder / 'app.py'}, requirements.txt and README.md")
            return 0
        source = source_from_args(args)
        if args.sigma_rel is not None:  # an unreachable start is reported before the web server is imported
            source.plan(args.sigma_rel, source.times[-1] if args.time is None else args.time)
        try:
            from .app import launch
        except ImportError as error:
            raise ValueError(
                f"the explorer needs gradio ({error}): pip install 'diffusers-scalelong[explorer]'"
            ) from None
        launch(
            source, host=args.host, port=args.port, sweep=args.sweep, save_dir=args.save_dir,
            num_images=args.num_images, num_inference_steps=args.num_inference_steps, seed=args.seed,
            sigma_rel=args.sigma_rel, time=args.time,
        )  # fmt: skip
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
