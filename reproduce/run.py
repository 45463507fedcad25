"""Run the whole reproduction study in priority order, resumably, on one CPU thread.

Each claim first gets a minimal complete table (one seed), then more seeds and the extended sweeps follow, so an
interrupted study still reports every claim. Finished runs are skipped on restart.

    OMP_NUM_THREADS=1 nice -n 10 python reproduce/run.py            # the study (about 2 h of one core)
    python reproduce/run.py --scale smoke --out /tmp/repro            # seconds: the smoke test's size
    python reproduce/report.py                                        # report + figures from the JSON lines
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import edm2_study  # noqa: E402
import scalelong_study as sl  # noqa: E402
from common import DEFAULT_OUT, ResultStore  # noqa: E402

SCALES = {
    "full": {
        "resolution": 16,
        "num_images": None,
        "width": 64,
        "conv_width": 16,
        "batch": 16,
        "depths": [12, 16],
        "lrs": [1e-3, 3e-3, 1e-2, 3e-2],
        "warmup": 100,
        "sweep_steps": 300,
        "compare_steps": 400,
        "record_every": 10,
        "num_samples": 300,
        "ddim_steps": 10,
        **edm2_study.FULL,
    },
    "smoke": {
        "resolution": 16,
        "num_images": 256,
        "width": 16,
        "conv_width": 8,
        "batch": 4,
        "depths": [2],
        "lrs": [1e-3, 1e-2],
        "warmup": 2,
        "sweep_steps": 12,
        "compare_steps": 12,
        "record_every": 3,
        "num_samples": 16,
        "ddim_steps": 2,
        **edm2_study.SMOKE,
    },
}


def stages(store: ResultStore, scale: dict, only: set[str] | None) -> list[tuple[str, callable]]:
    """(name, action) in priority order; every action skips runs already in the store."""

    def sweep(extended):
        return lambda: sl.run_configs(store, sl.SWEEP_TABLE, sl.sweep_configs(scale, extended), scale, False)

    def compare(regime, seeds, methods=sl.METHODS):
        return lambda: sl.run_configs(
            store, sl.COMPARE_TABLE, sl.compare_configs(store, scale, regime, seeds, methods), scale, True
        )

    core, more = sl.CORE_METHODS, [m for m in sl.METHODS if m not in sl.CORE_METHODS]
    plan = [
        ("sweep", sweep(False)),
        ("edm2_main", lambda: edm2_study.run_stage(store, scale, "main")),
        ("compare_core_seed0", lambda: (compare("unstable", [0], core)(), compare("stable", [0], core)())),
        ("edm2_recipe_seed0", lambda: edm2_study.run_stage(store, scale, "recipe0")),
        ("compare_core_stable_seeds12", compare("stable", [1, 2], core)),
        ("compare_core_unstable_seeds12", compare("unstable", [1, 2], core)),
        ("compare_more_unstable", compare("unstable", [0, 1, 2], more)),
        ("edm2_seed1", lambda: edm2_study.run_stage(store, scale, "seed1")),
        ("compare_more_stable", compare("stable", [0, 1, 2], [m for m in more if m != "ls_nonshared"])),
        ("compare_edge", compare("edge", [0, 1, 2])),
        ("sweep_extended", sweep(True)),
        ("edm2_lsc", lambda: edm2_study.run_stage(store, scale, "lsc")),
        (
            "conv_compare",
            lambda: sl.run_configs(store, sl.COMPARE_TABLE, sl.conv_compare_configs(scale, [0, 1]), scale, True),
        ),
    ]
    return [(name, action) for name, action in plan if only is None or name in only]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="full")
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder of the JSON lines (and of snapshots, ignored)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these stages")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    store = ResultStore(args.out)
    for name, action in stages(store, SCALES[args.scale], set(args.only) if args.only else None):
        print(f"== stage {name}", flush=True)
        action()


if __name__ == "__main__":
    main()
