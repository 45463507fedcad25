"""Sample grids: a batch of images in [-1, 1] arranged into one PNG, written atomically, and sent to the trackers."""

import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from ..atomic import atomic_path


def save_image_atomic(image: Image.Image, path: str | os.PathLike) -> None:
    """Write a PNG through the shared atomic-write helper (temporary file in the same folder, then rename)."""
    with atomic_path(path) as temporary:
        image.save(temporary, format="PNG")


def images_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] (clamped) as uint8 pixels, same shape, on the CPU."""
    return ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def make_image_grid(images: torch.Tensor, nrow: int | None = None, padding: int = 2) -> Image.Image:
    """Tile ``images`` ([N, C, H, W], values in [-1, 1], C = 1 or 3) into a grid with ``nrow`` images per row."""
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"expected images of shape [N, 1|3, H, W], got {tuple(images.shape)}")
    count, channels, height, width = images.shape
    nrow = nrow or math.ceil(math.sqrt(count))
    rows = math.ceil(count / nrow)
    pixels = images_to_uint8(images)
    grid = np.zeros((rows * (height + padding) + padding, nrow * (width + padding) + padding, channels), np.uint8)
    for index in range(count):
        top = padding + (index // nrow) * (height + padding)
        left = padding + (index % nrow) * (width + padding)
        grid[top : top + height, left : left + width] = pixels[index].permute(1, 2, 0).numpy()
    return Image.fromarray(grid[..., 0] if channels == 1 else grid, mode="L" if channels == 1 else "RGB")


def save_image_grid(images: torch.Tensor, path: str | os.PathLike, nrow: int | None = None) -> Image.Image:
    """Write ``make_image_grid(images, nrow)`` to ``path`` atomically and return the grid."""
    grid = make_image_grid(images, nrow)
    save_image_atomic(grid, path)
    return grid


@dataclass
class SampleGrid:
    """The images of one sample grid and how they are shown.

    ``images``: [N, C, H, W] in [-1, 1]; ``nrow``: images per row (None: a square); ``captions``: one per image (or
    none) for the trackers; ``tag``: the trackers' name for them (diffusers' scripts: ``test_samples`` for
    unconditional models, ``validation`` for prompts).
    """

    images: torch.Tensor
    nrow: int | None = None
    captions: list[str] = field(default_factory=list)
    tag: str = "test_samples"

    @classmethod
    def from_rows(cls, rows: list[torch.Tensor], captions: list[str], tag: str) -> "SampleGrid":
        """One grid row per tensor of ``rows`` (equal sizes), each image captioned by its row's caption."""
        per_row = rows[0].shape[0]
        image_captions = [caption for caption in captions for _ in range(per_row)]
        return cls(torch.cat(rows), nrow=per_row, captions=image_captions, tag=tag)

    def uint8(self) -> np.ndarray:
        """The images as uint8 [N, H, W, C], as the PNG holds them."""
        return images_to_uint8(self.images).permute(0, 2, 3, 1).numpy()

    def save(self, path: str | os.PathLike) -> Image.Image:
        """Write the grid PNG atomically and return it."""
        return save_image_grid(self.images, path, self.nrow)

    def log(self, trackers: list, step: int) -> None:
        """Send the images to Accelerate's trackers as diffusers' example scripts do: TensorBoard ``add_images``
        (NHWC uint8) and wandb images with their captions, under ``tag``."""
        pixels = self.uint8()
        for tracker in trackers:
            if tracker.name == "tensorboard":
                tracker.writer.add_images(self.tag, pixels, step, dataformats="NHWC")
            elif tracker.name == "wandb":
                import wandb

                captions = self.captions or [None] * len(pixels)
                images = [wandb.Image(image, caption=caption) for image, caption in zip(pixels, captions, strict=True)]
                tracker.log({self.tag: images}, step=step)
