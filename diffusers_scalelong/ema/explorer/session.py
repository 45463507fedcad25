"""The explorer's engine: snapshots held in memory, one weighted sum per target (cached), a fixed-seed sample grid.

A target ``(T, sigma_rel)`` is ``theta = sum_i x_i theta_i`` over the snapshots with ``0 < t_i <= T`` and the
least-squares weights ``x`` of EDM2 Algorithm 3 (see :mod:`.source`). The sum is taken tensor by tensor in float32
in the order of :func:`~diffusers_scalelong.ema.reconstruct_ema`, so at a snapshot time it gives the same bits;
buffers come from the newest snapshot used. Each snapshot file is read once (its content checksum verified) and
kept in memory, so moving the slider costs one weighted sum and one sampling run.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time as clock
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from huggingface_hub import HfApi

from ...atomic import replace_path, staging_folder
from ...hub.access import hub_errors
from ...integrity import check_finite, load_verified
from ...pipelines import EDM2Pipeline
from ...schedulers import EDMHeunScheduler
from ..reconstruct import ReconstructionPlan, resolve_model_class, save_planned_models
from ..snapshots import METADATA_KEY, snapshot_filename
from .source import SnapshotSource


@dataclass
class Grid:
    """A sample grid (``uint8`` ``[H, W]`` or ``[H, W, 3]``), its target, and the seconds each stage took."""

    pixels: np.ndarray
    sigma_rel: float
    time: int
    profile_error: float
    seconds: dict[str, float] = field(default_factory=dict)


def image_grid(images: np.ndarray, nrow: int) -> np.ndarray:
    """Tile ``uint8`` images ``[N, H, W, C]`` row by row into ``nrow`` columns (blank cells stay black)."""
    n, h, w, c = images.shape
    rows = math.ceil(n / nrow)
    grid = np.zeros((rows * h, nrow * w, c), dtype=images.dtype)
    for index, image in enumerate(images):
        row, col = divmod(index, nrow)
        grid[row * h : (row + 1) * h, col * w : (col + 1) * w] = image
    return grid[..., 0] if c == 1 else grid


def to_pixels(images: np.ndarray) -> np.ndarray:
    """``uint8`` pixels of float images in ``[0, 1]``: ``round(255 x)``, as diffusers' ``numpy_to_pil`` does."""
    return (images * 255).round().astype(np.uint8)


class Explorer:
    """Reconstructs, samples and saves targets ``(sigma_rel, time)`` of one :class:`SnapshotSource`.

    ``num_images`` images are sampled per grid from ``torch.Generator().manual_seed(seed)`` with
    :class:`~diffusers_scalelong.pipelines.EDM2Pipeline` and the EDM Heun sampler; the last ``cache_size``
    reconstructed targets are kept. Calls are serialised (one network is shared).
    """

    def __init__(self, source: SnapshotSource, *, num_images: int = 16, seed: int = 0, cache_size: int = 8) -> None:
        if source.model_class is None:
            raise ValueError(f"the snapshots in {source.description} record no diffusers model class to sample from")
        if not (isinstance(num_images, int) and 1 <= num_images <= 256):
            raise ValueError(f"num_images must be an integer in [1, 256], got {num_images!r}")
        self.source, self.num_images, self.seed, self.cache_size = source, num_images, int(seed), cache_size
        self.unet = resolve_model_class(source.model_class).from_config(source.model_config).eval()
        self.pipeline = EDM2Pipeline(unet=self.unet, scheduler=EDMHeunScheduler())
        self.pipeline.set_progress_bar_config(disable=True)
        self.num_classes: int | None = self.pipeline.num_classes
        self._tensors: dict[Path, dict[str, torch.Tensor]] = {}
        self._states: OrderedDict[tuple[int, float], dict[str, torch.Tensor]] = OrderedDict()
        self._loaded: tuple[int, float] | None = None
        self.lock = threading.RLock()

    def plan(self, sigma_rel: float, time: int) -> ReconstructionPlan:
        """The target's plan over the local snapshot files (downloading them from the Hub the first time)."""
        self.source.plan(sigma_rel, time)  # refuses an unreachable target before anything is downloaded
        local = [info for info in self.source.local_snapshots(time) if info.time <= time]
        return self.source.plan(sigma_rel, time, snapshots=local)

    def state_dict(self, sigma_rel: float, time: int) -> dict[str, torch.Tensor]:
        """``theta = sum_i x_i theta_i`` for the target, from the snapshots in memory (cached per target)."""
        key = (int(time), float(sigma_rel))
        with self.lock:
            if key in self._states:
                self._states.move_to_end(key)
                return self._states[key]
            plan = self.plan(sigma_rel, time)
            last = plan.snapshots[-1]
            copied = set(last.copied_keys)
            state = {k: torch.zeros(shape, dtype=torch.float32) for k, shape in last.shapes.items() if k not in copied}
            for info, (weight,) in zip(plan.snapshots, plan.coefficients.tolist(), strict=True):
                tensors = self._snapshot_tensors(info.path)
                for name, output in state.items():
                    output.add_(tensors[name], alpha=weight)
            newest = self._snapshot_tensors(last.path)
            state = {k: state[k] if k in state else newest[k].clone() for k in last.shapes}
            check_finite(state, f"the reconstruction for sigma_rel={sigma_rel} at time {time}")
            self._states[key] = state
            while len(self._states) > self.cache_size:
                self._states.popitem(last=False)
            return state

    def _snapshot_tensors(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._tensors:
            self._tensors[path], _ = load_verified(path, METADATA_KEY)
        return self._tensors[path]

    def class_labels(self, class_label: int | None) -> list[int] | None:
        """One label per image: ``class_label`` for all, or the classes in turn when it is ``None``."""
        if self.num_classes is None:
            return None
        if class_label is None:
            return [i % self.num_classes for i in range(self.num_images)]
        if not 0 <= int(class_label) < self.num_classes:
            raise ValueError(f"class_label must be in [0, {self.num_classes - 1}], got {class_label!r}")
        return [int(class_label)] * self.num_images

    def sample(self, sigma_rel: float, time: int, num_inference_steps: int = 8, class_label: int | None = None) -> Grid:
        """The fixed-seed grid of the target: ``num_images`` images, ``ceil(sqrt(num_images))`` per row."""
        if not (isinstance(num_inference_steps, int) and 1 <= num_inference_steps <= 256):
            raise ValueError(f"num_inference_steps must be an integer in [1, 256], got {num_inference_steps!r}")
        labels = self.class_labels(class_label)
        with self.lock:
            started = clock.perf_counter()
            state = self.state_dict(sigma_rel, time)
            if self._loaded != (int(time), float(sigma_rel)):
                self.unet.load_state_dict(state, strict=True)
                self._loaded = (int(time), float(sigma_rel))
            reconstructed = clock.perf_counter()
            images = self.pipeline(
                batch_size=self.num_images,
                class_labels=labels,
                num_inference_steps=num_inference_steps,
                generator=torch.Generator().manual_seed(self.seed),
                output_type="np",
            ).images
            sampled = clock.perf_counter()
        pixels = image_grid(to_pixels(images), math.ceil(math.sqrt(self.num_images)))
        error = float(self.source.plan(sigma_rel, time).relative_errors[0])
        seconds = {"reconstruct": reconstructed - started, "sample": sampled - reconstructed}
        return Grid(pixels, float(sigma_rel), int(time), error, seconds)

    def save(
        self,
        sigma_rel: float,
        time: int,
        output_dir: str | os.PathLike,
        *,
        overwrite: bool = False,
        push_to: str | None = None,
    ) -> Path:
        """Write the target as an ``EDM2Pipeline`` folder ``output_dir/phema-<time>-<sigma_rel>``; returns it.

        ``unet/`` holds exactly what ``scalelong-reconstruct-ema`` writes (the model, its config and ``phema.json``);
        ``scheduler/`` and ``model_index.json`` make it a pipeline. The folder appears at once (renamed from a
        temporary one). ``push_to``: a Hub repo id to upload the folder to afterwards (``endpoint`` and ``token`` of the
        source).
        """
        plan = self.plan(sigma_rel, time)
        output_dir = Path(output_dir)
        destination = output_dir / snapshot_filename(time, sigma_rel).removesuffix(".safetensors")
        if output_dir.exists() and not output_dir.is_dir():
            raise ValueError(f"output_dir {output_dir} exists and is not a folder")
        if destination.exists() and not overwrite:
            raise ValueError(f"{destination} already exists (choose another folder, or overwrite)")
        output_dir.mkdir(parents=True, exist_ok=True)
        stage = staging_folder(output_dir, destination.name)
        try:
            (unet_folder,) = save_planned_models(plan, stage / "models")
            os.replace(unet_folder, stage / "unet")
            (stage / "models").rmdir()
            pipeline = EDM2Pipeline(unet=self.unet, scheduler=EDMHeunScheduler())
            pipeline.save_config(stage)  # model_index.json
            pipeline.scheduler.save_pretrained(stage / "scheduler")
            replace_path(stage, destination)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        if push_to:
            self.push(destination, push_to)
        return destination

    def push(self, folder: str | os.PathLike, repo_id: str) -> None:
        """Upload a saved pipeline folder to ``repo_id`` (created if missing) through the source's endpoint."""
        endpoint = self.source.hub_options["endpoint"]
        with hub_errors(endpoint):  # an unreachable Hub: one line naming it
            api = HfApi(endpoint=endpoint, token=self.source.hub_options["token"])
            api.create_repo(repo_id, exist_ok=True)
            api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=f"Add {Path(folder).name}")
