"""``compute_fd_kid``: Frechet distance and KID between generated images and real reference images."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from PIL import Image

from ..data import ImageTransform, load_fashion_mnist_arrays
from .features import get_feature_extractor
from .frechet import frechet_distance, gaussian_stats
from .kid import kernel_distance

REFERENCES = ("fashion-mnist-test", "fashion-mnist-train")


def load_reference_images(
    reference: str = "fashion-mnist-test", num_images: int | None = None, seed: int = 0, resolution: int = 28
) -> torch.Tensor:
    """Real Fashion-MNIST images as float ``[N, 1, resolution, resolution]`` in ``[-1, 1]``.

    ``"fashion-mnist-test"`` is the embedded test split; ``"fashion-mnist-train"`` reads the train IDX files
    (see :func:`diffusers_scalelong.data.load_fashion_mnist`). ``num_images`` (default: all) are drawn without
    replacement with a generator seeded by ``seed``. Other resolutions are made by
    :class:`diffusers_scalelong.data.ImageTransform`, exactly as training images are prepared.
    """
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES} or an image tensor, got {reference!r}")
    split = reference.rsplit("-", 1)[1]
    images, _ = load_fashion_mnist_arrays(split=split, embedded=split == "test")
    if num_images is not None:
        if not 2 <= num_images <= len(images):
            raise ValueError(f"num_reference must be between 2 and {len(images)} for {reference!r}, got {num_images}")
        index = np.sort(np.random.default_rng(seed).choice(len(images), num_images, replace=False))
        images = images[index]
    if resolution == images.shape[-1]:
        return torch.from_numpy(np.ascontiguousarray(images)).float().div(127.5).sub(1).unsqueeze(1)
    transform = ImageTransform(resolution, center_crop=True)
    return torch.stack([transform(Image.fromarray(image)) for image in images])


@functools.lru_cache(maxsize=8)
def _reference_features(
    feature_space: str, reference: str, num_reference: int | None, seed: int, resolution: int
) -> torch.Tensor:
    images = load_reference_images(reference, num_reference, seed, resolution)
    return get_feature_extractor(feature_space)(images)


def compute_fd_kid(
    images: torch.Tensor,
    reference: str | torch.Tensor = "fashion-mnist-test",
    num_reference: int | None = None,
    feature_space: str = "fmnist-classifier",
    seed: int = 0,
    kid_subsets: int = 100,
    kid_subset_size: int = 1000,
    value_range: tuple[float, float] = (-1.0, 1.0),
) -> dict[str, float | int | str]:
    """Frechet distance and KID between ``images`` and real reference images in a classifier's feature space.

    ``images``: float ``[N, C, H, W]`` in ``value_range`` (C = 1 or 3, any size; resized inside the extractor);
    pass ``value_range=(0, 1)`` for what ``EDM2Pipeline(output_type="pt")`` returns. Integer, non-finite or
    out-of-range images raise ``ValueError``, as do ``[-1, 1]`` images that are all in ``[0, 1]`` (a range mix-up).
    ``reference``: ``"fashion-mnist-test"`` (embedded), ``"fashion-mnist-train"`` (IDX files), or an image tensor
    like ``images``. Named references are first brought to the generated images' resolution (bicubic, as the
    training transform does) so that a model that reproduces its training data exactly scores ~0; their features
    are cached per process. ``num_reference`` real images (default: all) and the KID subsets are drawn with ``seed``.

    Returns ``{"FD-<net>": ..., "KID-<net>": ..., "KID-<net>-std": ..., "num_generated", "num_reference",
    "feature_space", "reference"}``, e.g. ``FD-FMNISTNet``: numbers comparable only at equal sample counts and
    never with published Inception FIDs.
    """
    extractor = get_feature_extractor(feature_space)
    generated = extractor(_to_unit_range("images", images, value_range))
    if isinstance(reference, torch.Tensor):
        real = extractor(_to_unit_range("reference", reference, value_range))
        reference_name = f"tensor[{len(reference)}]"
    else:
        square = images.shape[-1] == images.shape[-2]
        resolution = int(images.shape[-1]) if square else 28
        real = _reference_features(feature_space, reference, num_reference, seed, resolution)
        reference_name = reference
    return {
        **fd_kid_from_features(generated, real, extractor.name, seed, kid_subsets, kid_subset_size),
        "feature_space": feature_space,
        "reference": reference_name,
    }


# Values past the range by less than this are float rounding (e.g. x * 2 - 1 of a [0, 1] float32 image).
_RANGE_SLACK = 1e-4


def _to_unit_range(name: str, images: torch.Tensor, value_range: tuple[float, float]) -> torch.Tensor:
    """Check ``images`` (float ``[N, C, H, W]``, finite, inside ``value_range``) and map them to ``[-1, 1]``."""
    low, high = (float(v) for v in value_range)
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"value_range must be two finite numbers (low, high) with low < high, got {value_range}")
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or not images.is_floating_point():
        described = (
            f"{images.dtype} tensor of shape {tuple(images.shape)}"
            if isinstance(images, torch.Tensor)
            else type(images).__name__
        )
        raise ValueError(
            f"{name} must be a float tensor [N, C, H, W] with values in {list(value_range)}, got a {described} "
            "(uint8 pixels: pass pixels.float() / 127.5 - 1)"
        )
    bad = int((~torch.isfinite(images)).sum())
    if bad:
        raise ValueError(f"{name} hold {bad} non-finite values (NaN or inf); the metric needs finite images")
    lowest, highest = float(images.min()), float(images.max())
    if lowest < low - _RANGE_SLACK or highest > high + _RANGE_SLACK:
        raise ValueError(
            f"{name} must lie in {list(value_range)}, got values in [{lowest:.4g}, {highest:.4g}]; "
            "pass value_range=(low, high) for other ranges"
        )
    if (low, high) == (-1.0, 1.0) and lowest >= 0.0:
        raise ValueError(
            f"{name} are all in [0, 1] although value_range is [-1, 1]: images from EDM2Pipeline(output_type='pt') "
            "are in [0, 1]; pass value_range=(0, 1) or images * 2 - 1"
        )
    return ((images - low) / (high - low) * 2 - 1).clamp(-1, 1)


def fd_kid_from_features(
    generated: torch.Tensor,
    real: torch.Tensor,
    name: str,
    seed: int = 0,
    kid_subsets: int = 100,
    kid_subset_size: int = 1000,
) -> dict[str, float | int]:
    """``FD-<name>``, ``KID-<name>``, ``KID-<name>-std`` and the sample counts from precomputed features ``[N, D]``."""
    if len(generated) < 2:
        raise ValueError(f"need at least 2 generated images, got {len(generated)}")
    fd = frechet_distance(*gaussian_stats(generated), *gaussian_stats(real))
    kid_mean, kid_std = kernel_distance(generated, real, kid_subsets, kid_subset_size, seed)
    return {
        f"FD-{name}": fd,
        f"KID-{name}": kid_mean,
        f"KID-{name}-std": kid_std,
        "num_generated": len(generated),
        "num_reference": len(real),
    }
