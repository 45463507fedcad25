"""The long-skip protocol: which long skips a network has, their widths and stages, and where each scaled skip
meets the decoder input.

Every model family of the package implements ``long_skip_layout() -> LongSkipLayout``; the scaling
(:class:`~diffusers_scalelong.scalelong.scaling.LongSkipScaling`), the stability diagnostics and the tests read
the layout instead of a family's private attributes. A vanilla diffusers ``UNet2DModel`` / ``UNet2DConditionModel``
has no such method; :func:`long_skip_layout` derives its layout from its modules.

Skips are numbered as in the paper from the outermost (index 0 here, ``i = 1`` there: the first encoder output,
consumed by the last decoder block) to the innermost.
"""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class LongSkip:
    """One long skip.

    Attributes:
        index: position from the outermost skip (0) inwards.
        width: channel count (conv) or token count (U-ViT) of the skip; ``None`` where a block does not expose it.
        stage: resolution stage of the skip (skips of one stage share it).
        consumer: the module whose input is where the scaled skip meets the decoder input.
        joined: ``True`` when the consumer's first input is ``cat([decoder input, scaled skip], dim=1)`` (the skip
            is its last ``width`` channels); ``False`` when the consumer is called as ``(decoder input, scaled skip)``.
    """

    index: int
    width: int | None
    stage: int
    consumer: nn.Module
    joined: bool = True

    def split(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(decoder input, scaled skip)`` from the consumer's call arguments; ``None`` if the width is unknown."""
        if not self.joined:
            return args[0], args[1]
        if self.width is None:
            return None
        joined = args[0] if args else kwargs["input_tensor"]
        return joined[:, : -self.width], joined[:, -self.width :]


@dataclass(frozen=True, eq=False)
class LongSkipLayout:
    """A network's long skips (outermost first) and its blocks from input to output, each with a short name."""

    skips: tuple[LongSkip, ...]
    blocks: tuple[tuple[str, nn.Module], ...]

    @property
    def widths(self) -> tuple[int | None, ...]:
        return tuple(skip.width for skip in self.skips)

    @property
    def stage_ids(self) -> tuple[int, ...]:
        return tuple(skip.stage for skip in self.skips)


@runtime_checkable
class HasLongSkips(Protocol):
    """What a model family implements: its scaling module and its long-skip layout."""

    lsc: nn.Module

    def long_skip_layout(self) -> LongSkipLayout: ...


def conv_up_block_skip_counts(unet: nn.Module) -> list[int]:
    """How many skips each up block of a diffusers conv UNet consumes (one per resnet), in run order."""
    counts = []
    for block in unet.up_blocks:
        if not hasattr(block, "resnets"):
            raise ValueError(f"up block {type(block).__name__} has no resnets; its skip layout is unknown")
        counts.append(len(block.resnets))
    return counts


def conv_long_skip_layout(unet: nn.Module) -> LongSkipLayout:
    """The layout of a diffusers ``UNet2DModel``-style model, derived from its modules.

    ``conv_in``'s output and every down-block resnet and downsampler output is a skip; up block ``b`` consumes a
    contiguous slice of them, innermost first: its resnet ``j`` receives ``cat([h, skip], dim=1)``.
    """
    for name in ("conv_in", "down_blocks", "up_blocks"):
        if not hasattr(unet, name):
            raise ValueError(
                f"{type(unet).__name__} has no {name!r}: it is not a diffusers UNet, U-ViT or EDM2 UNet, "
                "so its long skips are unknown"
            )
    widths: list[int | None] = [getattr(unet.conv_in, "out_channels", None)]
    for block in unet.down_blocks:
        for resnet in getattr(block, "resnets", ()):
            widths.append(getattr(resnet, "out_channels", None))
        for downsampler in getattr(block, "downsamplers", None) or ():
            widths.append(getattr(downsampler, "out_channels", None))
    counts = conv_up_block_skip_counts(unet)
    if sum(counts) != len(widths):
        raise ValueError(
            f"the up blocks consume {sum(counts)} skips but the down path produces {len(widths)}; "
            "mismatched skip layout"
        )
    skips: list[LongSkip] = []
    end = len(widths)
    for up_index, block in enumerate(unet.up_blocks):
        start = end - counts[up_index]
        stage = len(counts) - 1 - up_index
        for j, resnet in enumerate(block.resnets):  # resnet j consumes the j-th skip from the end of the slice
            index = end - 1 - j
            skips.append(LongSkip(index, widths[index], stage, resnet))
        end = start
    blocks = [(f"down{k}", block) for k, block in enumerate(unet.down_blocks)]
    if getattr(unet, "mid_block", None) is not None:
        blocks.append(("mid", unet.mid_block))
    blocks += [(f"up{k}", block) for k, block in enumerate(unet.up_blocks)]
    return LongSkipLayout(tuple(sorted(skips, key=lambda skip: skip.index)), tuple(blocks))


def long_skip_layout(model: nn.Module) -> LongSkipLayout:
    """``model.long_skip_layout()`` for the package's models; derived from the modules of a vanilla diffusers UNet."""
    if isinstance(model, HasLongSkips):
        return model.long_skip_layout()
    return conv_long_skip_layout(model)
