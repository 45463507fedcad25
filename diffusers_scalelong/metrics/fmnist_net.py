"""FMNISTNet: the small Fashion-MNIST classifier whose penultimate layer is the metric's feature space.

Weights are trained by ``training/train_metric_classifier.py`` (fixed seed, CPU) and shipped in
``diffusers_scalelong/assets/fmnist_net.safetensors`` with a JSON record (test accuracy, command, sha256).
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

WEIGHTS_NAME = "fmnist_net.safetensors"
RECORD_NAME = "fmnist_net.json"
FEATURE_DIM = 128
NUM_CLASSES = 10


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class FMNISTNet(nn.Module):
    """Three conv blocks (32, 64, 128 channels; 28 -> 14 -> 7 -> 3 px), a 128-d embedding and a linear classifier.

    Input: greyscale images ``[N, 1, 28, 28]`` in ``[-1, 1]``. :meth:`features` returns the 128-d embedding
    (the penultimate layer, before its ReLU), which the Frechet distance and KID compare.
    """

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(_conv_block(1, 32), _conv_block(32, 64), _conv_block(64, 128), nn.Flatten())
        self.embed = nn.Linear(128 * 3 * 3, FEATURE_DIM)
        self.head = nn.Sequential(nn.ReLU(), nn.Dropout(0.3), nn.Linear(FEATURE_DIM, NUM_CLASSES))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(self.body(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_record() -> dict:
    """The JSON record shipped with the weights: test accuracy, training command, sha256 of the weights."""
    return json.loads(resources.files("diffusers_scalelong").joinpath("assets", RECORD_NAME).read_text())


def load_fmnist_net(weights_path: str | os.PathLike | None = None) -> FMNISTNet:
    """The classifier in eval mode, from the packaged weights (or ``weights_path``).

    The file's sha256 must equal the one in the packaged JSON record, else ``ValueError`` (corrupt or foreign file).
    """
    expected = load_record()["weights_sha256"]
    packaged = resources.files("diffusers_scalelong").joinpath("assets", WEIGHTS_NAME)
    with resources.as_file(packaged) as default_path:
        path = Path(weights_path) if weights_path is not None else default_path
        actual = sha256_bytes(path.read_bytes())
        if actual != expected:
            raise ValueError(f"{path}: sha256 {actual} does not match the recorded {expected}; the file is corrupt")
        state = load_file(path)
    model = FMNISTNet()
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)
