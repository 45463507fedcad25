"""The README's main job (examples/demo.py) end to end, at a tiny size, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

from diffusers_scalelong.trainer.trainer import time_left

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def test_demo_plans_trains_samples_and_says_when_the_time_limit_cut_training(tmp_path):
    args = ["--output_dir", str(tmp_path), "--num_samples", "16", "--num_inference_steps", "2"]
    # 3 steps are wanted, but --train_minutes and --time_cap_minutes are 0.001: training stops after its first step.
    args += [
        "--min_train_steps",
        "3",
        "--max_train_steps",
        "3",
        "--train_minutes",
        "0.001",
        "--time_cap_minutes",
        "0.001",
    ]
    result = subprocess.run(
        [sys.executable, str(DEMO), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "[0/4] throughput" in out and "steps/s" in out and "plan: 0.0 min of training" in out, out
    assert "stopped training after 1 of the 3 steps wanted" in out, out
    # The training progress bar counts down the time instead of showing an ETA for steps it will never reach.
    assert "left=0:00" in result.stderr and "1/3" not in result.stderr, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["num_generated"] == 16 and metrics["FD-FMNISTNet"] > 0
    assert Image.open(tmp_path / "samples.png").size == (8 * 34 + 2, 8 * 34 + 2)  # 8x8 images of 32 px, 2 px gaps
    assert (tmp_path / "pipeline" / "model_index.json").is_file()


def test_time_left_is_the_time_limit_or_the_last_step_at_the_rate_so_far():
    assert time_left(elapsed_s=60, limit_s=300, steps_done=10, steps_left=1000) == "4:00"  # time ends first
    assert time_left(elapsed_s=60, limit_s=300, steps_done=100, steps_left=10) == "0:06"  # steps end first: 10 x 0.6 s
    assert time_left(elapsed_s=400, limit_s=300, steps_done=5, steps_left=5) == "0:00"  # over time: never negative
    assert time_left(elapsed_s=0, limit_s=90, steps_done=0, steps_left=5) == "1:30"  # no rate yet
