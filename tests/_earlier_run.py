"""A run's files in an output folder, written the way the training loop writes them, without training."""

import json
import os
import shutil
from pathlib import Path

import torch
from PIL import Image
from torch import nn

from diffusers_scalelong.ema import PowerFunctionEMA
from diffusers_scalelong.integrity import folder_manifest
from diffusers_scalelong.trainer.run_identity import LOCK_FILE


def write_checkpoint(output_dir: Path, step: int, run_id: str, staging: Path) -> Path:
    """A complete ``checkpoint-<step>`` (weights, record with checksums) built in ``staging``, renamed into place."""
    folder = staging / f"checkpoint-{step}"
    (folder / "unet").mkdir(parents=True)
    torch.manual_seed(step)
    torch.save({"step": torch.randn(4)}, folder / "optimizer.bin")  # content only; nothing here is loaded
    (folder / "unet" / "config.json").write_text(json.dumps({"step": step}))
    state = {"global_step": step, "num_processes": 1, "distributed_type": "ddp", "run_id": run_id}
    state["files"] = folder_manifest(folder)
    (folder / "training_state.json").write_text(json.dumps(state))
    os.replace(folder, output_dir / folder.name)
    return output_dir / folder.name


def write_snapshots(output_dir: Path, steps: range, run_id: str, seed: int) -> None:
    """Real post-hoc EMA snapshots of a small module at ``steps``, recording ``run_id``."""
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10), run_id=run_id)
    for step in range(1, steps.stop):
        with torch.no_grad():
            model.weight.add_(0.1)
        ema.update(model, step)
        if step in steps:
            ema.save_snapshots(str(output_dir / "ema_snapshots"), step, is_main_process=True)


def write_earlier_run(output_dir: Path, run_id: str = "a" * 32) -> None:
    """Checkpoints 2 and 4, snapshots at steps 2 and 4, a sample grid and a final pipeline index."""
    output_dir.mkdir(parents=True, exist_ok=True)
    staging = output_dir.parent / f"{output_dir.name}-staging"
    for step in (2, 4):
        write_checkpoint(output_dir, step, run_id, staging)
    shutil.rmtree(staging)
    write_snapshots(output_dir, range(2, 5, 2), run_id, seed=0)
    (output_dir / "samples").mkdir()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(output_dir / "samples" / "step-0000004.png")
    (output_dir / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline"}))


def tree(folder: Path) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file in ``folder`` but the lock file."""
    files = (path for path in folder.rglob("*") if path.is_file() and path.name != LOCK_FILE)
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in files}
