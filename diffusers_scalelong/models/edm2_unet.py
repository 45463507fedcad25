"""The EDM2 UNet ("config G" of Karras et al., arXiv 2312.02696) as a diffusers model.

``EDM2UNet2DModel`` is the *raw* network ``F(c_in x, c_noise, class_labels)``. Its ``timestep`` input is
``c_noise = ln(sigma) / 4`` - the values diffusers' ``EDMEulerScheduler`` / ``EDMDPMSolverMultistepScheduler``
store in ``scheduler.timesteps`` - so the model works with those schedulers unchanged (there
``prediction_type="epsilon"`` means "F-prediction": ``D = c_skip x + c_out F``). For training with the EDM2 loss,
wrap it in :class:`diffusers_scalelong.edm2.EDMPreconditioner`.
"""

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.unets.unet_2d import UNet2DOutput
from torch import nn

from ..layers.legacy_config import LegacyAutoMapMixin
from ..layers.mp import Block, MPConv, MPFourier, mp_cat, mp_silu, mp_sum
from ..layers.mp_casting import MPLayerwiseCastingMixin
from ..scalelong.loading import LongSkipScalingLoaderMixin
from ..scalelong.scaling import LongSkipScaling
from ..scalelong.skips import LongSkip, LongSkipLayout
from ..validation import check_number, check_optional_count
from .config_checks import check_edm2_unet_config
from .edm2_presets import EDM2_PRESETS, EDM2Preset, get_edm2_preset

__all__ = ["EDM2_PRESETS", "EDM2Preset", "EDM2UNet2DModel"]


class EDM2UNet2DModel(LegacyAutoMapMixin, LongSkipScalingLoaderMixin, MPLayerwiseCastingMixin, ModelMixin, ConfigMixin):
    """EDM2 magnitude-preserving UNet, the raw network ``F(c_in x, c_noise, class_labels) -> UNet2DOutput``.

    Args:
        sample_size: input height and width; must be divisible by ``2 ** (len(channel_mult) - 1)``.
        in_channels / out_channels: image (latent) channels; ``out_channels`` defaults to ``in_channels``.
        model_channels, channel_mult: widths of the resolution levels are ``model_channels * channel_mult[i]``.
        channel_mult_noise / channel_mult_emb: width of the Fourier noise features / of the embedding as a multiple
            of ``model_channels`` (default: the first level's width / the largest width).
        layers_per_block: blocks per encoder level (decoder levels have one more).
        attention_resolutions: resolutions whose blocks use self-attention (the innermost decoder block always does).
        num_class_embeds: number of classes of a class-conditional model; ``None`` or 0: unconditional.
        dropout: dropout inside the residual branch (training only).
        label_balance, concat_balance, res_balance, attn_balance: ``t`` of the mp_sum / mp_cat joining the label
            embedding, the long skips, the residual branch and the attention branch.
        channels_per_head: attention head width; clip_act: activations are clipped to [-clip_act, clip_act].
        lsc_method, lsc_kappa, lsc_reduction: ScaleLong long-skip scaling (``none, inv_sqrt2, cs, cs_stage, ls,
            ls_nonshared``). The coefficient ``kappa_i`` of skip i (a constant, or for LS a per-channel gate
            ``ChannelGate(skip)`` in (0, 1) with reduction ``lsc_reduction``) multiplies the skip's weight inside
            ``mp_cat`` before its joint normalisation: ``mp_cat(x, skip, t=concat_balance, b_scale=kappa_i)``, so
            the decoder input keeps unit magnitude while the skip's share shrinks. ``"none"`` is exactly EDM2.

    Examples:
        >>> import torch
        >>> from diffusers_scalelong import EDM2UNet2DModel
        >>> unet = EDM2UNet2DModel(
        ...     sample_size=8, in_channels=1, model_channels=8, channel_mult=(1, 2), layers_per_block=1,
        ...     num_class_embeds=3, channels_per_head=8, lsc_method="cs", lsc_kappa=0.7,
        ... )
        >>> x = torch.randn(2, 1, 8, 8, generator=torch.manual_seed(0))
        >>> c_noise = torch.log(torch.tensor([0.5, 2.0])) / 4  # EDM's c_noise = ln(sigma) / 4
        >>> unet(x, c_noise, class_labels=torch.tensor([0, 2])).sample.shape
        torch.Size([2, 1, 8, 8])
    """

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        sample_size: int = 64,
        in_channels: int = 4,
        out_channels: int | None = None,
        model_channels: int = 192,
        channel_mult: tuple[int, ...] = (1, 2, 3, 4),
        channel_mult_noise: int | None = None,
        channel_mult_emb: int | None = None,
        layers_per_block: int = 3,
        attention_resolutions: tuple[int, ...] = (16, 8),
        num_class_embeds: int | None = None,
        dropout: float = 0.0,
        label_balance: float = 0.5,
        concat_balance: float = 0.5,
        res_balance: float = 0.3,
        attn_balance: float = 0.3,
        channels_per_head: int = 64,
        clip_act: float | None = 256,
        lsc_method: str = "none",
        lsc_kappa: float = 0.5,
        lsc_reduction: int = 16,
    ):
        super().__init__()
        check_edm2_unet_config(
            sample_size=sample_size,
            in_channels=in_channels,
            out_channels=out_channels,
            model_channels=model_channels,
            channel_mult=channel_mult,
            channel_mult_noise=channel_mult_noise,
            channel_mult_emb=channel_mult_emb,
            layers_per_block=layers_per_block,
            attention_resolutions=attention_resolutions,
            channels_per_head=channels_per_head,
            clip_act=clip_act,
            num_class_embeds=num_class_embeds,
        )
        num_levels = len(channel_mult)
        for name, value in [
            ("label_balance", label_balance),
            ("concat_balance", concat_balance),
            ("res_balance", res_balance),
            ("attn_balance", attn_balance),
        ]:
            check_number(name, value, 0.0, 1.0)
        check_number("dropout", dropout, 0.0, 1.0, high_inclusive=False)
        check_optional_count("num_class_embeds", num_class_embeds)

        out_channels = in_channels if out_channels is None else out_channels
        widths = [model_channels * m for m in channel_mult]
        noise_channels = model_channels * channel_mult_noise if channel_mult_noise else widths[0]
        emb_channels = model_channels * channel_mult_emb if channel_mult_emb else max(widths)
        block_kwargs = dict(
            emb_channels=emb_channels,
            channels_per_head=channels_per_head,
            dropout=dropout,
            res_balance=res_balance,
            attn_balance=attn_balance,
            clip_act=clip_act,
        )

        self.noise_fourier = MPFourier(noise_channels)
        self.noise_embedding = MPConv(noise_channels, emb_channels)
        self.class_embedding = MPConv(num_class_embeds, emb_channels) if num_class_embeds else None

        # Encoder: level 0 starts with a 3x3 conv (input + a constant ones channel), the others with a down block.
        self.conv_in = MPConv(in_channels + 1, widths[0], kernel=(3, 3))
        self.encoder_blocks = nn.ModuleList()
        skip_widths, skip_levels = [widths[0]], [0]
        width = widths[0]
        for level, level_width in enumerate(widths):
            resolution = sample_size >> level
            if level > 0:
                self.encoder_blocks.append(Block(width, width, flavor="enc", resample_mode="down", **block_kwargs))
                skip_widths.append(width)
                skip_levels.append(level)
            for _ in range(layers_per_block):
                attention = resolution in attention_resolutions
                self.encoder_blocks.append(Block(width, level_width, flavor="enc", attention=attention, **block_kwargs))
                width = level_width
                skip_widths.append(width)
                skip_levels.append(level)

        # ScaleLong coefficients and LS gates, outermost skip (the first pushed, the last consumed) first.
        self.lsc = LongSkipScaling(lsc_method, lsc_kappa, skip_widths, skip_levels, "channel", lsc_reduction)

        # Decoder: the innermost level starts with two blocks (attention in the first), the others with an up block;
        # each of the layers_per_block + 1 blocks that follow takes one skip through mp_cat.
        self.decoder_blocks = nn.ModuleList()
        self._skip_index: list[int | None] = []  # the skip each decoder block takes (None: no skip)
        for level in reversed(range(num_levels)):
            resolution = sample_size >> level
            if level == num_levels - 1:
                self.decoder_blocks.append(Block(width, width, flavor="dec", attention=True, **block_kwargs))
                self.decoder_blocks.append(Block(width, width, flavor="dec", **block_kwargs))
                self._skip_index += [None, None]
            else:
                self.decoder_blocks.append(Block(width, width, flavor="dec", resample_mode="up", **block_kwargs))
                self._skip_index.append(None)
            for _ in range(layers_per_block + 1):
                attention = resolution in attention_resolutions
                skip_width = skip_widths.pop()
                self.decoder_blocks.append(
                    Block(width + skip_width, widths[level], flavor="dec", attention=attention, **block_kwargs)
                )
                self._skip_index.append(len(skip_widths))
                width = widths[level]

        self.conv_out = MPConv(width, out_channels, kernel=(3, 3))
        self.out_gain = nn.Parameter(torch.zeros([]))
        self.gradient_checkpointing = False

    @classmethod
    def from_preset(cls, size: str, dataset: str = "img512", **overrides) -> "EDM2UNet2DModel":
        """Build the paper's ``size`` (XS, S, M, L, XL, XXL) for ``dataset`` (img512 latents or img64 pixels).

        Keyword ``overrides`` replace config entries (e.g. ``num_class_embeds=None`` for an unconditional model).
        """
        preset = cls.get_preset(size, dataset)
        config = dict(
            sample_size=preset.sample_size,
            in_channels=preset.in_channels,
            model_channels=preset.model_channels,
            num_class_embeds=preset.num_class_embeds,
            dropout=preset.dropout,
        )
        config.update(overrides)
        return cls(**config)

    @staticmethod
    def get_preset(size: str, dataset: str = "img512") -> EDM2Preset:
        """The :class:`EDM2Preset` (architecture and training recipe) of ``size`` for ``dataset``."""
        return get_edm2_preset(size, dataset)

    def long_skip_layout(self) -> LongSkipLayout:
        """The long-skip protocol: decoder block ``j`` taking skip ``i`` receives ``mp_cat(x, kappa_i skip)``."""
        skips = [
            LongSkip(index, self.lsc.widths[index], self.lsc.stage_ids[index], block)
            for block, index in zip(self.decoder_blocks, self._skip_index, strict=True)
            if index is not None
        ]
        blocks = [
            *((f"enc{k}", block) for k, block in enumerate(self.encoder_blocks)),
            *((f"dec{k}", block) for k, block in enumerate(self.decoder_blocks)),
        ]
        return LongSkipLayout(tuple(sorted(skips, key=lambda skip: skip.index)), tuple(blocks))

    def _noise_labels(self, timestep: torch.Tensor | float, batch_size: int, device: torch.device) -> torch.Tensor:
        """``c_noise`` as a float32 vector of length ``batch_size`` (a scalar is broadcast)."""
        c_noise = torch.as_tensor(timestep, device=device)
        if not torch.is_floating_point(c_noise):
            raise ValueError(
                "timestep must be a float c_noise = ln(sigma) / 4, got an integer tensor; "
                "use the timesteps of an EDM scheduler"
            )
        c_noise = c_noise.to(torch.float32).flatten()
        if c_noise.numel() == 1:
            return c_noise.expand(batch_size)
        if c_noise.numel() != batch_size:
            raise ValueError(f"timestep has {c_noise.numel()} values for a batch of {batch_size}")
        return c_noise

    def _one_hot_labels(self, class_labels: torch.Tensor | None, batch_size: int) -> torch.Tensor:
        """Class labels as a float32 [B, num_class_embeds] matrix, from integer labels [B] or one-hot rows."""
        num_classes = self.config.num_class_embeds
        if class_labels is None:
            raise ValueError(f"this model is class-conditional (num_class_embeds={num_classes}): pass class_labels")
        if class_labels.shape[0] != batch_size:
            raise ValueError(f"class_labels has batch size {class_labels.shape[0]}, the sample {batch_size}")
        if torch.is_floating_point(class_labels):
            if class_labels.shape != (batch_size, num_classes):
                raise ValueError(
                    f"float class_labels must be one-hot rows of shape [{batch_size}, {num_classes}], "
                    f"got {list(class_labels.shape)}"
                )
            return class_labels.to(torch.float32)
        if class_labels.ndim != 1:
            raise ValueError(f"integer class_labels must have shape [batch], got {list(class_labels.shape)}")
        if not torch.compiler.is_compiling() and (
            class_labels.min().item() < 0 or class_labels.max().item() >= num_classes
        ):
            raise ValueError(f"class_labels must lie in [0, {num_classes - 1}]")
        classes = torch.arange(num_classes, device=class_labels.device)
        return (class_labels[:, None] == classes).to(torch.float32)

    def _check_sample(self, sample: torch.Tensor) -> None:
        if sample.ndim != 4:
            raise ValueError(f"sample must have shape [B, C, H, W], got {list(sample.shape)}")
        if sample.shape[1] != self.config.in_channels:
            raise ValueError(
                f"sample has {sample.shape[1]} channels, the model expects in_channels={self.config.in_channels}"
            )
        factor = 2 ** (len(self.config.channel_mult) - 1)
        if sample.shape[2] % factor or sample.shape[3] % factor:
            raise ValueError(
                f"sample resolution {sample.shape[2]}x{sample.shape[3]} is not divisible by {factor} "
                f"(the model down-samples {len(self.config.channel_mult) - 1} times)"
            )

    def _join_skip(self, x: torch.Tensor, skip: torch.Tensor, index: int) -> torch.Tensor:
        """``mp_cat(x, skip, t=concat_balance, b_scale=kappa_index)``; kappa is the LS gate of the skip for LS."""
        return mp_cat(x, skip, t=self.config.concat_balance, b_scale=self.lsc.factor(index, skip))

    def _run_block(self, block: Block, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            return self._gradient_checkpointing_func(block, x, emb)
        return block(x, emb)

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float,
        class_labels: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> UNet2DOutput | tuple[torch.Tensor]:
        """``F(sample, c_noise, class_labels)``.

        Args:
            sample: the preconditioned input ``c_in x``, [B, in_channels, H, W].
            timestep: ``c_noise = ln(sigma) / 4``, a float scalar or a [B] tensor.
            class_labels: integer labels [B] or one-hot rows [B, num_class_embeds] (required iff conditional).
        """
        self._check_sample(sample)
        batch_size = sample.shape[0]
        emb = self.noise_embedding(self.noise_fourier(self._noise_labels(timestep, batch_size, sample.device)))
        if self.class_embedding is not None:
            labels = self._one_hot_labels(class_labels, batch_size).to(emb.device)
            labels = labels * math.sqrt(labels.shape[1])
            emb = mp_sum(emb, self.class_embedding(labels), t=self.config.label_balance)
        elif class_labels is not None:
            raise ValueError("class_labels were given, but the model is unconditional (num_class_embeds is None)")
        emb = mp_silu(emb)

        x = torch.cat([sample, torch.ones_like(sample[:, :1])], dim=1)
        x = self.conv_in(x)
        skips = [x]
        for block in self.encoder_blocks:
            x = self._run_block(block, x, emb)
            skips.append(x)
        for block, skip_index in zip(self.decoder_blocks, self._skip_index, strict=True):
            if skip_index is not None:
                x = self._join_skip(x, skips.pop(), skip_index)
            x = self._run_block(block, x, emb)
        x = self.conv_out(x, gain=self.out_gain)

        if not return_dict:
            return (x,)
        return UNet2DOutput(sample=x)
