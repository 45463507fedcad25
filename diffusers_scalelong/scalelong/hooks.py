"""Scaling of the long skip connections of diffusers conv UNets through forward pre-hooks.

A diffusers ``UNet2DModel`` / ``UNet2DConditionModel`` pushes ``conv_in``'s output and every down-block resnet and
downsampler output onto ``down_block_res_samples``; each up block receives its slice as ``res_hidden_states_tuple``.
A forward pre-hook on every up block replaces that tuple with the scaled skips, so the UNet's own forward is not
copied, state-dict keys stay those of the vanilla model for the constant methods, and the scaling survives gradient
checkpointing, ``torch.compile(fullgraph=True)`` and ``copy.deepcopy`` (the hooks are callable objects, not closures,
so a deep copy points them at the copied modules).

Skip numbering follows the paper: ``i = 1`` is the outermost skip (``conv_in``'s output, consumed by the last up
block), ``i = N`` the innermost.

Caveat (GroupNorm): in diffusers resnets the concatenation ``[h, kappa * skip]`` is normalised by a GroupNorm first;
in groups holding only skip channels a constant ``kappa`` is cancelled by the normalisation (up to ``eps``), so CS
acts through the mixed groups and the resnet's 1x1 ``conv_shortcut``, which sees the unnormalised concatenation.
In the default ``UNet2DModel`` / ``UNet2DConditionModel`` configurations 166 / 168 of the 384 up-block ``norm1``
groups hold only skip channels, 6 / 4 are mixed and every up-block resnet has a ``conv_shortcut``: CS there rescales
the skip's contribution to the shortcut path almost exclusively. The per-channel LS gates are not cancelled this
way (they vary across the channels of a group), only their common scale is.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .coefficients import LEARNABLE_METHODS, lsc_coefficients, validate_lsc_options
from .gates import ChannelGate, TokenGate


class LongSkipScaling(nn.Module):
    """Coefficients and (for LS) calibration gates of a model's long skips, outermost skip first.

    ``scale(i, skip)`` returns ``kappa_i * skip`` for the constant methods and ``skip * gate(skip)`` for LS.
    It holds parameters only for the learnable methods, so CS leaves a model's state dict unchanged.
    ``ls`` shares one gate among all skips of the same width (a conv UNet's skips differ in channel count;
    U-ViT skips all have the same token count, so there it is a single gate), ``ls_nonshared`` has one per skip.
    """

    def __init__(
        self,
        method: str,
        kappa: float,
        skip_widths: Sequence[int | None],
        stage_ids: Sequence[int],
        gate_type: str = "channel",
        reduction: int = 16,
    ):
        super().__init__()
        validate_lsc_options(method, kappa)
        self.method = method
        self.kappa = float(kappa)
        self.coefficients = tuple(lsc_coefficients(method, len(skip_widths), kappa, stage_ids))
        self.gates = nn.ModuleList()
        self.gate_index: tuple[int, ...] = ()
        if method in LEARNABLE_METHODS:
            if any(width is None for width in skip_widths):
                raise ValueError(
                    f"lsc_method={method!r} needs the width of every skip, but this block layout does not expose it"
                )
            gate_cls = {"channel": ChannelGate, "token": TokenGate}[gate_type]
            gate_of_width: dict[int, int] = {}
            index = []
            for width in skip_widths:
                if method == "ls_nonshared" or width not in gate_of_width:
                    gate_of_width[width] = len(self.gates)
                    self.gates.append(gate_cls(width, reduction))
                index.append(gate_of_width[width] if method == "ls" else len(self.gates) - 1)
            self.gate_index = tuple(index)

    @property
    def num_skips(self) -> int:
        return len(self.coefficients)

    def scale(self, index: int, skip: torch.Tensor) -> torch.Tensor:
        """Scaled skip ``index`` (0 = outermost)."""
        if self.gate_index:
            return skip * self.gates[self.gate_index[index]](skip)
        coefficient = self.coefficients[index]
        return skip if coefficient == 1.0 else skip * coefficient

    def reset_gates(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        """(Re)initialise the LS gates, materialising them on ``device`` if they sit on ``meta``."""
        for gate in self.gates:
            if any(p.is_meta for p in gate.parameters()):
                gate.to_empty(device=device or "cpu")
            gate.reset_parameters()
            if dtype is not None:
                gate.to(dtype)

    def extra_repr(self) -> str:
        return f"method={self.method!r}, kappa={self.kappa}, num_skips={self.num_skips}"


@dataclass(frozen=True)
class ConvSkipLayout:
    """Where a conv UNet's skips come from and go to (outermost skip first)."""

    widths: tuple[int | None, ...]  # channel count of each skip (None where the block does not expose it)
    stage_ids: tuple[int, ...]  # resolution stage (= consuming up block) of each skip
    up_block_slices: tuple[tuple[int, int], ...]  # (first skip index, skip count) for each up block, in run order


def conv_skip_layout(unet: nn.Module) -> ConvSkipLayout:
    """Derive the long-skip layout of a diffusers ``UNet2DModel``-style model from its modules."""
    for name in ("conv_in", "down_blocks", "up_blocks"):
        if not hasattr(unet, name):
            raise ValueError(
                f"lsc_method: {type(unet).__name__} has no {name!r}; only diffusers-style UNets are supported"
            )
    widths: list[int | None] = [getattr(unet.conv_in, "out_channels", None)]
    for block in unet.down_blocks:
        for resnet in getattr(block, "resnets", ()):
            widths.append(getattr(resnet, "out_channels", None))
        for downsampler in getattr(block, "downsamplers", None) or ():
            widths.append(getattr(downsampler, "out_channels", None))
    counts = []
    for block in unet.up_blocks:
        if not hasattr(block, "resnets"):
            raise ValueError(f"lsc_method: up block {type(block).__name__} has no resnets; its skip layout is unknown")
        counts.append(len(block.resnets))
    if sum(counts) != len(widths):
        raise ValueError(
            f"lsc_method: the up blocks consume {sum(counts)} skips but the down path produces {len(widths)}; "
            "mismatched skip layout"
        )
    slices = []
    stage_ids = [0] * len(widths)
    end = len(widths)
    for up_index, count in enumerate(counts):
        start = end - count
        slices.append((start, count))
        for skip_index in range(start, end):
            stage_ids[skip_index] = len(counts) - 1 - up_index
        end = start
    return ConvSkipLayout(tuple(widths), tuple(stage_ids), tuple(slices))


class UpBlockSkipHook:
    """Forward pre-hook of one up block: scales its ``res_hidden_states_tuple`` (positional argument 1 or keyword)."""

    def __init__(self, scaling: LongSkipScaling, start: int, count: int):
        self.scaling = scaling
        self.start = start
        self.count = count

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if "res_hidden_states_tuple" in kwargs:
            skips = kwargs["res_hidden_states_tuple"]
        elif len(args) > 1:
            skips = args[1]
        else:
            raise ValueError(f"lsc_method: {type(module).__name__} was called without res_hidden_states_tuple")
        if len(skips) != self.count:
            raise ValueError(
                f"lsc_method: {type(module).__name__} received {len(skips)} skips, expected {self.count}; "
                "mismatched skip shapes"
            )
        scaled = tuple(self.scaling.scale(self.start + k, skip) for k, skip in enumerate(skips))
        if "res_hidden_states_tuple" in kwargs:
            return args, {**kwargs, "res_hidden_states_tuple": scaled}
        return (args[0], scaled, *args[2:]), kwargs


def _remove_hooks(unet: nn.Module) -> None:
    for block in getattr(unet, "up_blocks", ()):
        for hook_id, hook in list(block._forward_pre_hooks.items()):
            if isinstance(hook, UpBlockSkipHook):
                del block._forward_pre_hooks[hook_id]
                block._forward_pre_hooks_with_kwargs.pop(hook_id, None)


def install_conv_lsc(unet: nn.Module, method: str, kappa: float, reduction: int = 16) -> LongSkipScaling:
    """Attach ``unet.lsc`` and one pre-hook per up block (replacing earlier ones); returns the scaling module."""
    validate_lsc_options(method, kappa)
    layout = conv_skip_layout(unet)
    scaling = LongSkipScaling(method, kappa, layout.widths, layout.stage_ids, "channel", reduction)
    reference = next(unet.parameters(), None)
    if reference is not None and not reference.is_meta:
        scaling.to(device=reference.device, dtype=reference.dtype)
    _remove_hooks(unet)
    unet.lsc = scaling
    for block, (start, count) in zip(unet.up_blocks, layout.up_block_slices, strict=True):
        block.register_forward_pre_hook(UpBlockSkipHook(scaling, start, count), with_kwargs=True)
    return scaling


def apply_lsc(unet: nn.Module, method: str, kappa: float = 0.5, reduction: int = 16) -> nn.Module:
    """Scale the long skips of an existing diffusers UNet (e.g. one from ``from_pretrained``) in place.

    Replaces any scaling installed before. The LS gates are new parameters named ``lsc.gates.*``; a plain
    ``UNet2DModel`` does not record the method in its config (use the ``ScaleLong*`` classes for that), while a
    ScaleLong model's config is updated so that ``save_pretrained`` keeps the new method.
    """
    install_conv_lsc(unet, method, kappa, reduction)
    if "lsc_method" in getattr(unet, "config", {}):
        unet.register_to_config(lsc_method=method, lsc_kappa=float(kappa))
    return unet


def remove_lsc(unet: nn.Module) -> nn.Module:
    """Remove the skip scaling (and any LS gates) from ``unet``; it then computes the vanilla forward."""
    _remove_hooks(unet)
    if isinstance(getattr(unet, "lsc", None), LongSkipScaling):
        del unet.lsc
    if "lsc_method" in getattr(unet, "config", {}):
        unet.register_to_config(lsc_method="none")
    return unet
