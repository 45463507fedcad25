"""The EDM2 paper's configurations (Karras et al., arXiv 2312.02696, Table 3): network size plus training recipe."""

from dataclasses import dataclass

__all__ = ["EDM2_PRESETS", "EDM2Preset", "get_edm2_preset"]


@dataclass(frozen=True)
class EDM2Preset:
    """One of the paper's configurations: network width and dropout plus its training recipe."""

    model_channels: int
    dropout: float
    ref_lr: float
    t_ref: int
    P_mean: float
    P_std: float
    sample_size: int = 64
    in_channels: int = 4
    num_class_embeds: int = 1000
    batch_size: int = 2048
    warmup_images: int = 10_000_000


def _img512(channels: int, dropout: float, ref_lr: float) -> EDM2Preset:
    """ImageNet-512 presets work on SD-VAE latents: 64x64x4, 1000 classes."""
    return EDM2Preset(channels, dropout, ref_lr, t_ref=70_000, P_mean=-0.4, P_std=1.0)


def _img64(channels: int, dropout: float, ref_lr: float) -> EDM2Preset:
    """ImageNet-64 presets work on pixels: 64x64x3, 1000 classes (the paper trains S, M, L and XL)."""
    return EDM2Preset(channels, dropout, ref_lr, t_ref=35_000, P_mean=-0.8, P_std=1.6, in_channels=3)


_SIZES = {  # size: (model_channels, dropout, ref_lr)
    "XS": (128, 0.0, 0.0120),
    "S": (192, 0.0, 0.0100),
    "M": (256, 0.1, 0.0090),
    "L": (320, 0.1, 0.0080),
    "XL": (384, 0.1, 0.0070),
    "XXL": (448, 0.1, 0.0065),
}
EDM2_PRESETS: dict[str, dict[str, EDM2Preset]] = {
    "img512": {size: _img512(*values) for size, values in _SIZES.items()},
    "img64": {size: _img64(*values) for size, values in _SIZES.items()},
}
"""``EDM2_PRESETS[dataset][size]``; img64 XS and XXL use the same widths but were not trained in the paper."""


def get_edm2_preset(size: str, dataset: str = "img512") -> EDM2Preset:
    """The :class:`EDM2Preset` (architecture and training recipe) of ``size`` for ``dataset``."""
    if dataset not in EDM2_PRESETS:
        raise ValueError(f"unknown EDM2 preset dataset {dataset!r}; choose one of {', '.join(EDM2_PRESETS)}")
    presets = EDM2_PRESETS[dataset]
    if not isinstance(size, str) or size.upper() not in presets:
        raise ValueError(f"unknown EDM2 preset size {size!r}; choose one of {', '.join(presets)}")
    return presets[size.upper()]
