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

from torch import nn

from .scaling import LongSkipScaling
from .skips import conv_long_skip_layout, conv_up_block_skip_counts


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
    try:
        layout = conv_long_skip_layout(unet)
    except ValueError as error:
        raise ValueError(f"lsc_method: {error}") from None
    scaling = LongSkipScaling(method, kappa, layout.widths, layout.stage_ids, "channel", reduction)
    reference = next(unet.parameters(), None)
    if reference is not None and not reference.is_meta:
        scaling.to(device=reference.device, dtype=reference.dtype)
    _remove_hooks(unet)
    unet.lsc = scaling
    end = scaling.num_skips
    for block, count in zip(unet.up_blocks, conv_up_block_skip_counts(unet), strict=True):
        end -= count  # each up block consumes the slice just outside the previous one's
        block.register_forward_pre_hook(UpBlockSkipHook(scaling, end, count), with_kwargs=True)
    return scaling


def apply_lsc(unet: nn.Module, method: str, kappa: float = 0.5, reduction: int = 16) -> nn.Module:
    """Scale the long skips of an existing diffusers UNet (e.g. one from ``from_pretrained``) in place.

    Replaces any scaling installed before. The LS gates are new parameters named ``lsc.gates.*``; a plain
    ``UNet2DModel`` does not record the method in its config (use the ``ScaleLong*`` classes for that), while a
    ScaleLong model's config is updated so that ``save_pretrained`` keeps the new method.

    Examples:
        >>> import torch
        >>> from diffusers import UNet2DModel
        >>> from diffusers_scalelong import apply_lsc, remove_lsc
        >>> unet = UNet2DModel(
        ...     sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16), layers_per_block=1,
        ...     down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
        ...     norm_num_groups=4,
        ... )
        >>> x, t = torch.randn(1, 1, 8, 8, generator=torch.manual_seed(0)), torch.tensor([10])
        >>> with torch.no_grad():
        ...     plain = unet(x, t).sample
        >>> _ = apply_lsc(unet, "cs", kappa=0.5)  # skip i is multiplied by 0.5 ** (i - 1)
        >>> with torch.no_grad():
        ...     torch.equal(unet(x, t).sample, plain)
        False
        >>> _ = remove_lsc(unet)
        >>> with torch.no_grad():
        ...     torch.equal(unet(x, t).sample, plain)
        True
    """
    install_conv_lsc(unet, method, kappa, reduction)
    if "lsc_method" in getattr(unet, "config", {}):
        unet.register_to_config(lsc_method=method, lsc_kappa=float(kappa), lsc_reduction=reduction)
    return unet


def remove_lsc(unet: nn.Module) -> nn.Module:
    """Remove the skip scaling (and any LS gates) from ``unet``; it then computes the vanilla forward."""
    _remove_hooks(unet)
    if isinstance(getattr(unet, "lsc", None), LongSkipScaling):
        del unet.lsc
    if "lsc_method" in getattr(unet, "config", {}):
        unet.register_to_config(lsc_method="none")
    return unet
