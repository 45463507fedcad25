"""The built wheel works without the source tree: a fresh virtual environment (no system site-packages) installs it
with its dependencies, its console scripts run, and ``scalelong-train`` trains 3 steps on the data the package
embeds, started from a folder outside any checkout.

Slow: it builds from a clean ``git clone`` (committed files only) and installs the dependencies with pip; set
``PIP_FIND_LINKS`` to a folder of local wheels (e.g. a CPU build of torch) to keep pip from downloading them.
"""

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from diffusers_scalelong.hub.cards import INSTALL, PROJECT_URL

ROOT = Path(__file__).resolve().parent.parent


def run(command: list, cwd: Path, timeout: float) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


@pytest.mark.slow
def test_wheel_installs_and_trains_outside_the_checkout(tmp_path):
    source, dist, environment, work = (tmp_path / name for name in ("source", "dist", "venv", "work"))
    run(["git", "clone", "--quiet", ROOT, source], tmp_path, 300)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, source], tmp_path, 600)
    (wheel,) = dist.glob("diffusers_scalelong-*.whl")
    metadata = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info/METADATA")
    assert f"Name: {INSTALL.split()[-1]}" in metadata.decode()  # the cards' install line names this distribution
    assert f"Project-URL: Homepage, {PROJECT_URL}" in metadata.decode()  # and the cards' project URL is its own
    venv.create(environment, with_pip=True, system_site_packages=False)
    bin_dir = environment / "bin"
    local_torch = sorted(Path(os.environ.get("PIP_FIND_LINKS", "/nonexistent")).glob("torch-*.whl"))
    if local_torch:  # a local torch build first (its dependencies from the index), so pip keeps it
        run([bin_dir / "pip", "install", "--quiet", local_torch[-1]], tmp_path, 1800)
    run([bin_dir / "pip", "install", "--quiet", wheel], tmp_path, 1800)
    work.mkdir()
    assert run([bin_dir / "scalelong-train", "--help"], work, 300).startswith("usage:")
    for script in ("scalelong-train-text-to-image", "scalelong-reconstruct-ema", "scalelong-convert-edm2"):
        assert "usage:" in run([bin_dir / script, "--help"], work, 300)
    output = run(
        [bin_dir / "scalelong-train", "--output_dir", work / "run", "--model", "scalelong_unet2d", "--lsc", "cs",
         "--block_out_channels", "16", "32", "--attention_levels", "--norm_num_groups", "8", "--layers_per_block", "1",
         "--resolution", "16", "--max_train_samples", "32", "--train_batch_size", "8", "--max_train_steps", "3",
         "--report_to", "none", "--num_grid_images", "4", "--num_inference_steps", "2"],
        work, 900,
    )  # fmt: skip
    print(output[-2000:])
    assert (work / "run" / "model_index.json").is_file() or any((work / "run").rglob("model_index.json"))
    location = run([bin_dir / "python", "-c", "import diffusers_scalelong; print(diffusers_scalelong.__file__)"],
                   work, 300)  # fmt: skip
    assert str(environment) in location and str(source) not in location
