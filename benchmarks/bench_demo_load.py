#!/usr/bin/env python
"""The README's main job (``examples/demo.py``) on an idle machine and on one busy with other CPU-bound work.

Starts ``--busy`` background processes that spin (``python -c "while True: pass"``, each in its own session, as
jobs from other terminals would be), runs the demo with its defaults, stops the spinners and prints one JSON line:
wall time, the demo's thread choice and plan, steps trained, FD/KID. The grid is copied beside ``--record`` when given.

    python benchmarks/bench_demo_load.py --output_dir /tmp/demo_idle
    python benchmarks/bench_demo_load.py --output_dir /tmp/demo_busy --busy 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffusers_scalelong.ema import list_snapshots  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True, help="the demo's --output_dir (must not hold a finished run)")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound background processes during the demo")
    parser.add_argument("--record", default=None, help="append the JSON line to this file, the grid beside it")
    parser.add_argument("demo_args", nargs="*", help="extra arguments for examples/demo.py (after --)")
    args = parser.parse_args()
    if (Path(args.output_dir) / "train").exists():
        parser.error(f"{args.output_dir} already holds a training run: choose a fresh folder")

    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(args.busy)
    ]
    try:
        time.sleep(2 if spinners else 0)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "demo.py"), "--output_dir", args.output_dir, *args.demo_args],
            capture_output=True,
            text=True,
        )
        wall = time.monotonic() - started
        load = os.getloadavg()[0]
    finally:
        for spinner in spinners:
            spinner.kill()
    sys.stdout.write(result.stdout)
    if result.returncode != 0:
        sys.exit(f"the demo failed with exit code {result.returncode}:\n{result.stderr[-3000:]}")

    metrics = json.loads((Path(args.output_dir) / "metrics.json").read_text())
    snapshots = list_snapshots(Path(args.output_dir) / "train" / "ema_snapshots")
    probe = re.search(r"throughput \((.*?)\): (.*?); using (\d+) thread", result.stdout)
    plan = re.search(r"plan: ([\d.]+) min of training", result.stdout)
    row = {
        "busy_processes": args.busy,
        "wall_s": round(wall),
        "probe": probe.group(2) if probe else None,
        "load_at_probe": probe.group(1) if probe else None,
        "threads": int(probe.group(3)) if probe else None,
        "planned_train_minutes": float(plan.group(1)) if plan else None,
        "steps_trained": max(info.time for info in snapshots),
        "fd": round(metrics["FD-FMNISTNet"], 2),
        "kid": round(metrics["KID-FMNISTNet"], 2),
        "kid_std": round(metrics["KID-FMNISTNet-std"], 2),
        "load_at_end": round(load, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    print(json.dumps(row))
    if args.record:
        record = Path(args.record)
        with record.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        name = "demo_samples_busy.png" if args.busy else "demo_samples_idle.png"
        shutil.copy(Path(args.output_dir) / "samples.png", record.parent / name)


if __name__ == "__main__":
    main()
