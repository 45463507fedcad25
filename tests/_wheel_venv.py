"""Build the package's wheel from a clean clone (committed files only) and install it into a fresh virtual environment.

Used by the slow tests that check the installed package outside the source tree. pip installs the dependencies; set
``PIP_FIND_LINKS`` to a folder of local wheels (e.g. a CPU build of torch) to keep it from downloading them.
"""

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(command: list, cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``command`` without the source tree on ``PYTHONPATH``; on failure show the end of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})}
    env.pop("PYTHONPATH", None)
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


def build_wheel(folder: Path) -> Path:
    """``pip wheel`` of a ``git clone`` of the repository into ``folder / "dist"``; returns the wheel's path."""
    source, dist = folder / "source", folder / "dist"
    run(["git", "clone", "--quiet", ROOT, source], folder, 300)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, source], folder, 600)
    (wheel,) = dist.glob("diffusers_scalelong-*.whl")
    return wheel


def install_in_fresh_venv(wheel: Path, environment: Path) -> Path:
    """A new virtual environment (no system site-packages) with ``wheel`` and its dependencies; returns its bin."""
    venv.create(environment, with_pip=True, system_site_packages=False)
    bin_dir = environment / "bin"
    local_torch = sorted(Path(os.environ.get("PIP_FIND_LINKS", "/nonexistent")).glob("torch-*.whl"))
    if local_torch:  # a local torch build first (its dependencies from the index), so pip keeps it
        run([bin_dir / "pip", "install", "--quiet", local_torch[-1]], environment.parent, 1800)
    run([bin_dir / "pip", "install", "--quiet", wheel], environment.parent, 1800)
    return bin_dir
