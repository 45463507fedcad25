"""U-ViT (Bao et al., "All are Worth Words", the backbone of the official ScaleLong code) as a diffusers model.

Images are cut into ``patch_size`` patches and embedded as tokens; a time token (and, with ``num_class_embeds``,
a class token in front of it) is prepended; ``depth // 2`` "in" transformer blocks push their outputs as long
skips, a "mid" block follows, and ``depth // 2`` "out" blocks each pop a skip (innermost first) and fuse it as
``Linear(2D, D)([x, s(skip)])`` before attention. ScaleLong's ``s`` (``lsc_method``) follows the official code:

- ``cs``: ``s(skip) = kappa ** (N - 1 - n) * skip`` for the n-th out block (n = 0 consumes the innermost skip),
  i.e. ``kappa ** (i - 1)`` with i = 1 the outermost skip;
- ``ls`` / ``ls_nonshared``: ``s(skip) = skip * TokenGate(skip)``, the token-wise gate of shape [B, L, 1]
  (L = all tokens, time/class tokens included), shared by all skips or one per skip;
- ``inv_sqrt2``: ``2 ** -0.5 * skip``; ``cs_stage`` equals ``cs`` here (all skips share one resolution).
"""

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.embeddings import Timesteps
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.unets.unet_2d import UNet2DOutput
from torch import nn

from ..layers.legacy_config import LegacyAutoMapMixin
from ..scalelong.loading import LongSkipScalingLoaderMixin
from ..scalelong.scaling import LongSkipScaling
from ..scalelong.skips import LongSkip, LongSkipLayout
from .config_checks import check_uvit_config

__all__ = ["ModelMixin", "UViT2DModel", "UViTBlock"]


class UViTAttention(nn.Module):
    """Multi-head self-attention ``softmax(Q K^T / sqrt(d_head)) V`` followed by an output projection."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim={dim} must be divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        qkv = self.qkv(x).reshape(batch, length, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(attended.transpose(1, 2).reshape(batch, length, dim))


class UViTBlock(nn.Module):
    """Pre-norm transformer block; with ``skip=True`` it first fuses a long skip: ``x = Linear(2D, D)([x, skip])``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False, skip: bool = False):
        super().__init__()
        self.skip_linear = nn.Linear(2 * dim, dim) if skip else None
        self.norm1 = nn.LayerNorm(dim)
        self.attn = UViTAttention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if self.skip_linear is not None:
            if skip is None or skip.shape != x.shape:
                raise ValueError(
                    f"lsc_method: long skip of shape {None if skip is None else tuple(skip.shape)} does not match "
                    f"the decoder input {tuple(x.shape)}; mismatched skip shapes"
                )
            x = self.skip_linear(torch.cat([x, skip], dim=-1))
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class UViT2DModel(LegacyAutoMapMixin, LongSkipScalingLoaderMixin, ModelMixin, ConfigMixin):
    """U-ViT noise-prediction network; ``forward(sample, timestep, class_labels)`` returns ``UNet2DOutput``.

    Defaults are the CIFAR-10 U-ViT-S/2 of the official ScaleLong recipe (embed 512, depth 12, 8 heads).
    ``timestep`` is a float tensor (scalar or one per sample), embedded sinusoidally (cos first, max period 1e4).
    """

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 3,
        out_channels: int | None = None,
        embed_dim: int = 512,
        depth: int = 12,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        mlp_time_embed: bool = False,
        num_class_embeds: int | None = None,
        conv_out: bool = True,
        lsc_method: str = "none",
        lsc_kappa: float = 0.5,
        lsc_reduction: int = 16,
    ):
        super().__init__()
        check_uvit_config(
            sample_size=sample_size,
            patch_size=patch_size,
            in_channels=in_channels,
            out_channels=out_channels,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            num_class_embeds=num_class_embeds,
        )
        out_channels = out_channels or in_channels
        self.gradient_checkpointing = False

        self.patch_embed = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.time_proj = Timesteps(embed_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embed = (
            nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.SiLU(), nn.Linear(4 * embed_dim, embed_dim))
            if mlp_time_embed
            else nn.Identity()
        )
        self.class_embedding = nn.Embedding(num_class_embeds, embed_dim) if num_class_embeds else None
        self.num_extra_tokens = 2 if num_class_embeds else 1
        self.num_tokens = self.num_extra_tokens + (sample_size // patch_size) ** 2
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, embed_dim))

        def block(skip: bool) -> UViTBlock:
            return UViTBlock(embed_dim, num_heads, mlp_ratio, qkv_bias, skip=skip)

        self.in_blocks = nn.ModuleList([block(False) for _ in range(depth // 2)])
        self.mid_block = block(False)
        self.out_blocks = nn.ModuleList([block(True) for _ in range(depth // 2)])
        self.norm = nn.LayerNorm(embed_dim)
        self.decoder_pred = nn.Linear(embed_dim, patch_size**2 * out_channels)
        self.final_layer = nn.Conv2d(out_channels, out_channels, 3, padding=1) if conv_out else nn.Identity()
        self._init_weights()
        # Created after the network's initialisation, as in the official code: default nn.Linear init for the gates.
        num_skips = depth // 2
        self.lsc = LongSkipScaling(
            lsc_method, lsc_kappa, [self.num_tokens] * num_skips, [0] * num_skips, "token", lsc_reduction
        )

    def long_skip_layout(self) -> LongSkipLayout:
        """The long-skip protocol: out block ``n`` is called as ``(x, kappa_i skip)`` with ``i = N - n``."""
        num_skips = len(self.out_blocks)
        skips = [
            LongSkip(num_skips - 1 - n, self.num_tokens, 0, block, joined=False)
            for n, block in enumerate(self.out_blocks)
        ]
        blocks = [
            *((f"in{k}", block) for k, block in enumerate(self.in_blocks)),
            ("mid", self.mid_block),
            *((f"out{k}", block) for k, block in enumerate(self.out_blocks)),
        ]
        return LongSkipLayout(tuple(reversed(skips)), tuple(blocks))

    def _init_weights(self) -> None:
        """Truncated normal (std 0.02) for ``pos_embed`` and linear weights, zero biases, unit LayerNorms."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def _run_block(self, block: UViTBlock, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            return self._gradient_checkpointing_func(block, x, skip)
        return block(x, skip)

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        class_labels: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> UNet2DOutput | tuple:
        batch, _, height, width = sample.shape
        size, patch = self.config.sample_size, self.config.patch_size
        if (height, width) != (size, size):
            raise ValueError(f"sample of size {height}x{width} does not match sample_size={size}")
        if (class_labels is None) != (self.class_embedding is None):
            raise ValueError("class_labels must be given exactly when the model has num_class_embeds")
        timesteps = torch.as_tensor(timestep, device=sample.device, dtype=torch.float32)
        timesteps = timesteps.reshape(-1).expand(batch) if timesteps.numel() == 1 else timesteps.reshape(batch)

        tokens = self.patch_embed(sample).flatten(2).transpose(1, 2)
        time_token = self.time_embed(self.time_proj(timesteps).to(tokens.dtype)).unsqueeze(1)
        extra = [time_token]
        if self.class_embedding is not None:
            extra.insert(0, self.class_embedding(class_labels).unsqueeze(1))
        x = torch.cat([*extra, tokens], dim=1) + self.pos_embed

        skips = []
        for block in self.in_blocks:
            x = self._run_block(block, x)
            skips.append(x)
        x = self._run_block(self.mid_block, x)
        for block in self.out_blocks:
            skip_index = len(skips) - 1  # 0 = outermost skip; the out blocks pop the innermost first
            x = self._run_block(block, x, self.lsc.scale(skip_index, skips.pop()))

        x = self.decoder_pred(self.norm(x))[:, self.num_extra_tokens :]
        grid = size // patch
        channels = self.decoder_pred.out_features // patch**2
        x = x.reshape(batch, grid, grid, patch, patch, channels).permute(0, 5, 1, 3, 2, 4)
        x = self.final_layer(x.reshape(batch, channels, size, size))
        if not return_dict:
            return (x,)
        return UNet2DOutput(sample=x)
