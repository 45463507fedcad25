"""Random streams of a training run that survive a resume exactly.

The noise, timesteps and dropout of each training step come from a private random stream (``TrainingRNG``) whose
state is saved in every checkpoint, so work outside the step that also draws from ``torch``'s global generator
(DataLoader set-up, prefetching, sampling grids) cannot shift it. Data augmentation draws from a generator seeded by
``(seed, epoch, index)`` for every image, so it does not depend on when a batch is loaded either.
"""

import contextlib
import os
from collections.abc import Iterator

import torch
from safetensors.torch import load_file, save_file


class TrainingRNG:
    """A private copy of ``torch``'s global RNG state (CPU, plus the current CUDA device when used)."""

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        with torch.random.fork_rng(devices=self._cuda_devices()):
            torch.manual_seed(seed)
            self.cpu_state = torch.get_rng_state()
            self.cuda_state = torch.cuda.get_rng_state(self.device) if self._cuda_devices() else None

    def _cuda_devices(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside the block the global generator continues this stream; outside, the global state is untouched."""
        with torch.random.fork_rng(devices=self._cuda_devices()):
            torch.set_rng_state(self.cpu_state)
            if self.cuda_state is not None:
                torch.cuda.set_rng_state(self.cuda_state, self.device)
            yield
            self.cpu_state = torch.get_rng_state()
            if self.cuda_state is not None:
                self.cuda_state = torch.cuda.get_rng_state(self.device)

    def save(self, folder: str | os.PathLike, rank: int) -> None:
        tensors = {"cpu": self.cpu_state}
        if self.cuda_state is not None:
            tensors["cuda"] = self.cuda_state
        save_file(tensors, os.path.join(folder, f"training_rng_{rank}.safetensors"))

    def load(self, folder: str | os.PathLike, rank: int) -> None:
        path = os.path.join(folder, f"training_rng_{rank}.safetensors")
        if not os.path.isfile(path):
            raise ValueError(f"{path!r} is missing: the checkpoint was written by a run with fewer processes")
        tensors = load_file(path)
        self.cpu_state = tensors["cpu"]
        if self.cuda_state is not None and "cuda" in tensors:
            self.cuda_state = tensors["cuda"]


def item_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator seeded from ``(seed, epoch, index)``: the augmentation of one image in one epoch."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 2_147_483_629 + index)
