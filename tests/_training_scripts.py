"""Helpers for the training-script tests: run the scripts as real subprocesses with tiny settings."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
TRAIN_UNCONDITIONAL = ROOT / "training" / "train_unconditional.py"
TRAIN_TEXT_TO_IMAGE = ROOT / "training" / "train_text_to_image.py"

# A 0.16M-parameter ScaleLong UNet on 64 Fashion-MNIST images at 16x16: about 10 steps per second on one core.
TINY_UNET = [
    "--model", "scalelong_unet2d", "--lsc", "cs", "--kappa", "0.7",
    "--block_out_channels", "16", "32", "--attention_levels", "--norm_num_groups", "8", "--layers_per_block", "1",
    "--resolution", "16", "--max_train_samples", "64", "--train_batch_size", "8", "--report_to", "none",
    "--num_grid_images", "4", "--num_inference_steps", "4",
]  # fmt: skip


def script_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONHASHSEED="0", TQDM_DISABLE="1")
    return env


def run_script(
    script: Path, args: list, check: bool = True, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run a training script in a fresh Python process (``env`` adds variables); on failure show its output."""
    command = [sys.executable, str(script), *map(str, args)]
    full_env = {**script_env(), **(env or {})}
    result = subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def load_script_module(script: Path):
    """Import a training script as a module (to call its ``main`` in-process for fast failure checks)."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _without_run_id(metadata: dict[str, str] | None) -> dict:
    """Header metadata with JSON values parsed and their ``run_id`` removed (with the header checksum, which covers
    the run id)."""
    parsed = {}
    for key, value in (metadata or {}).items():
        try:
            value = json.loads(value)
        except ValueError:
            pass
        if isinstance(value, dict):
            value = {name: field for name, field in value.items() if name not in ("run_id", "header_sha256")}
        parsed[key] = value
    return parsed


def tensors_equal(file_a: Path, file_b: Path, same_run: bool = True) -> None:
    """Assert two safetensors files hold bit-identical tensors under the same names, with the same metadata
    (apart from the run id when ``same_run`` is False: two separate runs that must agree in everything else)."""
    with safe_open(str(file_a), "pt") as handle_a, safe_open(str(file_b), "pt") as handle_b:
        meta_a, meta_b = handle_a.metadata(), handle_b.metadata()
    if not same_run:
        meta_a, meta_b = _without_run_id(meta_a), _without_run_id(meta_b)
    assert meta_a == meta_b, f"{file_a} and {file_b} differ in metadata"
    a, b = load_file(file_a), load_file(file_b)
    assert a.keys() == b.keys(), f"{file_a} and {file_b} hold different keys"
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert (a[key] == b[key]).all(), f"{key} differs between {file_a} and {file_b}"


def write_image_folder(folder: Path, count: int, size: int, seed: int = 0, captions: bool = False) -> Path:
    """Random RGB PNGs (and a ``metadata.jsonl`` with captions) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for index in range(count):
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{index:03d}.png")
        lines.append(f'{{"file_name": "{index:03d}.png", "text": "a picture number {index}"}}')
    if captions:
        (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder
