"""The README's main job (examples/demo.py) end to end, at a tiny size, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def test_demo_plans_trains_samples_and_says_when_the_safety_net_cut_training(tmp_path):
    args = ["--output_dir", str(tmp_path), "--num_samples", "16", "--num_inference_steps", "2"]
    # A plan of 3 steps, but a safety net of 0.001 minutes: training stops after its first step.
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
    assert "[0/4] throughput" in out and "steps/s" in out and "plan: 3 steps" in out, out
    assert "stopped training after 1 of 3 steps" in out, out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["num_generated"] == 16 and metrics["FD-FMNISTNet"] > 0
    assert Image.open(tmp_path / "samples.png").size == (8 * 30 + 2, 8 * 30 + 2)  # 8x8 images of 28 px, 2 px gaps
    assert (tmp_path / "pipeline" / "model_index.json").is_file()
