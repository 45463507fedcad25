"""Sample grids: a batch of images in [-1, 1] arranged into one PNG, written atomically."""

import math
import os

import numpy as np
import torch
from PIL import Image

from ..atomic import atomic_path


def save_image_atomic(image: Image.Image, path: str | os.PathLike) -> None:
    """Write a PNG through the shared atomic-write helper (temporary file in the same folder, then rename)."""
    with atomic_path(path) as temporary:
        image.save(temporary, format="PNG")


def make_image_grid(images: torch.Tensor, nrow: int | None = None, padding: int = 2) -> Image.Image:
    """Tile ``images`` ([N, C, H, W], values in [-1, 1], C = 1 or 3) into a grid with ``nrow`` images per row."""
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"expected images of shape [N, 1|3, H, W], got {tuple(images.shape)}")
    count, channels, height, width = images.shape
    nrow = nrow or math.ceil(math.sqrt(count))
    rows = math.ceil(count / nrow)
    pixels = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
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
