"""Learnable long-skip calibration gates of ScaleLong's LS method.

Both gates map a skip tensor to a multiplicative gate in (0, 1) computed from the skip itself
(``skip * gate(skip)``). Their last layers keep PyTorch's default ``nn.Linear`` initialisation, so at
initialisation the gates sit near ``sigmoid(0) = 0.5``, as in the official U-ViT code (which creates the
module after the network's own weight initialisation).
"""

import torch
from torch import nn

from .coefficients import check_reduction


def _hidden_width(width: int, reduction: int) -> int:
    check_reduction(reduction)
    return max(width // reduction, 1)


class TokenGate(nn.Module):
    """Token-wise gate of the official U-ViT ScaleLong code (LS).

    ``g = sigmoid(W2 relu(W1 mean_c(x) + b1) + b2)`` with ``x`` of shape [B, L, D], ``mean_c`` the mean over the
    D channels, ``W1: L -> L // r`` and ``W2: L // r -> L``; returns ``g`` of shape [B, L, 1].
    """

    def __init__(self, num_tokens: int, reduction: int = 16):
        super().__init__()
        self.num_tokens = num_tokens
        self.fc1 = nn.Linear(num_tokens, _hidden_width(num_tokens, reduction))
        self.fc2 = nn.Linear(_hidden_width(num_tokens, reduction), num_tokens)

    def forward(self, skip: torch.Tensor) -> torch.Tensor:
        if skip.ndim != 3 or skip.shape[1] != self.num_tokens:
            raise ValueError(
                f"lsc_method LS token gate expects skips of shape [B, {self.num_tokens}, D], got {tuple(skip.shape)}"
            )
        squeezed = skip.mean(dim=-1)
        return torch.sigmoid(self.fc2(torch.relu(self.fc1(squeezed)))).unsqueeze(-1)

    def reset_parameters(self) -> None:
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()


class ChannelGate(nn.Module):
    """Squeeze-excitation gate per channel for convolutional skips (LS for conv UNets; no official code).

    ``g = sigmoid(W2 relu(W1 mean_hw(x) + b1) + b2)`` with ``x`` of shape [B, C, H, W], ``W1: C -> C // r`` and
    ``W2: C // r -> C``; returns ``g`` of shape [B, C, 1, 1]. This is the U-ViT token gate transposed to conv
    features: U-ViT squeezes channels and gates tokens (a fixed token count), a conv UNet's skips have a fixed
    channel count but any spatial size, so the channels are gated and space is squeezed.
    """

    def __init__(self, num_channels: int, reduction: int = 16):
        super().__init__()
        self.num_channels = num_channels
        self.fc1 = nn.Linear(num_channels, _hidden_width(num_channels, reduction))
        self.fc2 = nn.Linear(_hidden_width(num_channels, reduction), num_channels)

    def forward(self, skip: torch.Tensor) -> torch.Tensor:
        if skip.ndim != 4 or skip.shape[1] != self.num_channels:
            raise ValueError(
                f"lsc_method LS channel gate expects skips of shape [B, {self.num_channels}, H, W], "
                f"got {tuple(skip.shape)}"
            )
        squeezed = skip.mean(dim=(2, 3))
        gate = torch.sigmoid(self.fc2(torch.relu(self.fc1(squeezed))))
        return gate[:, :, None, None]

    def reset_parameters(self) -> None:
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()
