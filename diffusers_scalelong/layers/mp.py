"""Magnitude-preserving (MP) layers of EDM2 (Karras et al., arXiv 2312.02696), NCHW tensors.

Every primitive keeps unit-variance, uncorrelated inputs at unit RMS output, so that activation
magnitudes neither grow nor shrink through a deep network. The functions and modules are independent
of the EDM2 UNet and can be used in any ``torch.nn.Module``.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.hooks import RemovableHandle

MP_SILU_SCALE = 0.596
"""RMS of silu(z) for z ~ N(0, 1) (0.5955...), the divisor of :func:`mp_silu`."""


class _Normalize(torch.autograd.Function):
    """``y = x / ((eps + n * sqrt(n_norm / n_x)) * scale)`` with ``n = ||x||`` over ``dim``; one norm, two passes.

    Backward from the saved output (no copy of ``x``): with ``d = eps + a n``, ``a = sqrt(n_norm / n_x)``,
    ``dL/dx = g / (d scale) - y <g, y> a scale / n`` (``<g, y>`` summed over ``dim``; the second term is 0 where
    ``n = 0``, like autograd's norm derivative). ``norm`` may be given when it is known (the forced weight
    normalisation computes it), then no norm is computed at all.
    """

    @staticmethod
    def forward(ctx, x, dim, eps, scale, norm):
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        if norm is None:
            norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=compute_dtype)
        alpha = math.sqrt(norm.numel() / x.numel())
        denom = torch.add(eps, norm, alpha=alpha)
        if scale != 1:
            denom = denom * scale
        y = x / denom.to(x.dtype)
        ctx.save_for_backward(y, denom, norm)
        ctx.dim, ctx.alpha_scale = dim, alpha * scale
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, denom, norm = ctx.saved_tensors
        dot = (grad * y).sum(dim=ctx.dim, keepdim=True, dtype=denom.dtype)
        coef = dot * ctx.alpha_scale / norm.clamp_min(torch.finfo(norm.dtype).tiny)
        grad_x = torch.addcmul(grad / denom.to(grad.dtype), y, coef.to(grad.dtype), value=-1)
        return grad_x, None, None, None, None


class _StraightThrough(torch.autograd.Function):
    """``y = projected`` in the forward, ``dL/dx = dL/dy`` in the backward: a projection of ``x`` computed without
    autograd whose gradient is handed to ``x`` unchanged, as if ``x`` had been overwritten by it."""

    @staticmethod
    def forward(ctx, x, projected):
        return projected

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _reduction_dims(x: torch.Tensor, dim: int | tuple[int, ...] | None) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(1, x.ndim))
    return (dim,) if isinstance(dim, int) else tuple(dim)


def normalize(x: torch.Tensor, dim: int | tuple[int, ...] | None = None, eps: float = 1e-4) -> torch.Tensor:
    """Scale every slice of ``x`` to unit RMS: ``x / (eps + ||x|| * sqrt(n_norm / n_x))``.

    The L2 norm is taken over ``dim`` (default: all dims but 0), in float32 (float64 for float64 input);
    ``n_norm / n_x`` is 1 / (number of elements per slice), so ``||x|| * sqrt(n_norm / n_x)`` is the slice's RMS.
    For a weight [O, I, k, k] each output row ``w_o`` becomes ``w_o / (eps + ||w_o|| / sqrt(I k k))``.
    Forward and backward are fused (:class:`_Normalize`): one norm, and nothing but the output saved for backward.
    """
    return _Normalize.apply(x, _reduction_dims(x, dim), eps, 1.0, None)


def pixel_norm(x: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Unit RMS over channels at every pixel: ``normalize(x, dim=1)``."""
    return normalize(x, dim=1, eps=eps)


def mp_silu(x: torch.Tensor) -> torch.Tensor:
    """Magnitude-preserving SiLU: ``silu(x) / 0.596`` (paper Eq. 81).

    The division runs in place on silu's output (silu's backward needs only its input): one allocation, not two.
    """
    return F.silu(x).div_(MP_SILU_SCALE)


def mp_sum(a: torch.Tensor, b: torch.Tensor, t: float = 0.5) -> torch.Tensor:
    """Magnitude-preserving weighted sum (Eq. 88): ``((1 - t) a + t b) / sqrt((1 - t)^2 + t^2)``.

    ``t`` is the weight of the *second* argument; for uncorrelated unit-RMS ``a`` and ``b`` the output has unit RMS.
    Computed as ``a wa + wb b`` with the weights folded into two scalars: two passes over the activations, not four.
    """
    norm = math.sqrt((1 - t) ** 2 + t**2)
    return torch.add(a * ((1 - t) / norm), b, alpha=t / norm)


def mp_cat(
    a: torch.Tensor, b: torch.Tensor, dim: int = 1, t: float = 0.5, b_scale: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """Magnitude-preserving concatenation (Eq. 103) of ``a`` (Na channels) and ``b`` (Nb channels).

    ``C = sqrt((Na + Nb) / ((1 - t)^2 + t^2))``; output ``cat([C (1 - t) / sqrt(Na) a, C t / sqrt(Nb) b])``.
    Each part contributes in proportion to its weight, independent of its channel count; unit-RMS
    inputs give a unit-RMS output.

    ``b_scale`` (an extension for long-skip scaling, 1 = the paper) multiplies ``b``'s weight *before* the joint
    normalisation: ``t^2`` in ``C`` becomes ``t^2 mean_c(b_scale^2)``, so the output keeps unit RMS while ``b``'s
    share shrinks relative to ``a``. It is a number or a tensor broadcastable to ``b`` (e.g. a per-sample,
    per-channel gate [B, Nb, 1, 1]; then ``C`` is per sample).
    """
    na, nb = a.shape[dim], b.shape[dim]
    if isinstance(b_scale, torch.Tensor):
        b_energy = b_scale.square().mean(dim=dim, keepdim=True) if b_scale.ndim > dim else b_scale.square()
        c = ((na + nb) / ((1 - t) ** 2 + t**2 * b_energy)).sqrt()
    else:
        c = math.sqrt((na + nb) / ((1 - t) ** 2 + t**2 * b_scale**2))
    wa = c / math.sqrt(na) * (1 - t)
    wb = c / math.sqrt(nb) * t * b_scale
    return torch.cat([(wa * a).to(a.dtype), (wb * b).to(a.dtype)], dim=dim)


def resample(x: torch.Tensor, mode: Literal["keep", "down", "up"] = "keep") -> torch.Tensor:
    """Box-filter 2x down-sampling (2x2 average pooling), nearest-neighbour 2x up-sampling, or identity."""
    if mode == "keep":
        return x
    if mode == "down":
        return F.avg_pool2d(x, kernel_size=2, stride=2)
    if mode == "up":
        return F.interpolate(x, scale_factor=2, mode="nearest")
    raise ValueError(f"resample mode must be 'keep', 'down' or 'up', got {mode!r}")


class MPFourier(nn.Module):
    """Magnitude-preserving Fourier features (Eq. 75): ``y = sqrt(2) cos(2 pi (x f + p))``, computed in fp32.

    Frequencies ``f ~ N(0, bandwidth^2)`` and phases ``p ~ U(0, 1)`` are fixed buffers (stored pre-multiplied by
    2 pi); for any x the features have unit RMS over the channels in expectation.
    """

    def __init__(self, num_channels: int, bandwidth: float = 1.0):
        super().__init__()
        self.register_buffer("freqs", 2 * math.pi * torch.randn(num_channels) * bandwidth)
        self.register_buffer("phases", 2 * math.pi * torch.rand(num_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.outer(x.to(torch.float32).flatten(), self.freqs.to(torch.float32))
        y = y + self.phases.to(torch.float32)
        return (y.cos() * math.sqrt(2)).to(x.dtype)


class MPConv(nn.Module):
    """Magnitude-preserving convolution (``kernel=(k, k)``) or linear layer (``kernel=()``), no bias (Eq. 47/66).

    ``forward(x, gain)`` uses the weight ``gain * normalize(w) / sqrt(fan_in)``, so unit-RMS inputs give unit-RMS
    outputs (for ``gain = 1``) whatever the stored weight's scale. The normalisation is differentiable and runs in
    every forward, so averaged (EMA) weights are re-normalised as well.

    Forced weight normalisation: in training mode, before that, the *stored* weight is projected (under
    ``no_grad``) onto unit-RMS rows, ``w_o <- w_o / rms(w_o)``. The projection has no ``eps`` and is therefore
    idempotent: recomputing a forward (gradient checkpointing) leaves the stored weight as it is, and several
    training-mode forwards may precede one backward. In eval mode the stored weight is never modified - keep EMA
    copies in eval mode. With ``project_in_place = False`` (set by layerwise casting, whose storage dtype would round
    the write) a training-mode forward computes the projection functionally instead: it uses ``w / rms(w)`` as the
    stored weight and hands the gradient with respect to it to ``w`` unchanged (straight-through), so output and
    gradient equal those of the in-place projection of the same stored values, which stay untouched.

    Weight cache for sampling: inside :func:`cached_weight_normalization`, eval-mode forwards without autograd
    reuse ``normalize(w) / sqrt(fan_in)`` (float32) until the stored weight's version counter, storage, dtype or
    device changes. It is opt-in and scoped because writes through ``param.data`` (as some EMA helpers do) do not
    bump the version counter and would leave the cache stale.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel: tuple[int, ...] = ()):
        super().__init__()
        if len(kernel) not in (0, 2):
            raise ValueError(f"kernel must be () for a linear layer or (k, k) for a convolution, got {kernel!r}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, *kernel))
        self.weight_cache_enabled = False
        self.project_in_place = True
        self._cached_weight: torch.Tensor | None = None
        self._cached_key: tuple | None = None

    @torch.no_grad()
    def _row_projection(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``w`` (the stored weight in float32), its rows' L2 norms ``||w_o||`` and ``rms(w_o)`` (clamped above 0)."""
        w = self.weight.to(torch.float32)
        norm = torch.linalg.vector_norm(w, dim=tuple(range(1, w.ndim)), keepdim=True)
        rms = (norm / math.sqrt(math.prod(w.shape[1:]))).clamp_min(torch.finfo(torch.float32).tiny)
        return w, norm, rms

    @torch.no_grad()
    def force_weight_normalization(self) -> torch.Tensor | None:
        """Project the stored weight onto unit-RMS output rows (the forced weight normalisation).

        Returns the rows' L2 norms after the projection (float32, ``sqrt(fan_in)`` or 0 for an all-zero row) when
        the stored dtype holds the projected values exactly (float32, float64), else None.
        """
        w, norm, rms = self._row_projection()
        if self.weight.dtype == torch.float32:
            self.weight.div_(rms)  # the same rounding as w / rms, without a temporary
        else:
            self.weight.copy_(w / rms)
        return norm / rms if torch.finfo(self.weight.dtype).bits >= 32 else None

    def _projected_unit_weight(self) -> torch.Tensor:
        """``normalize(p) / sqrt(fan_in)`` of the projection ``p = w / rms(w)`` (float32, the stored weight left as
        it is); the gradient with respect to ``p`` reaches ``w`` unchanged."""
        w, norm, rms = self._row_projection()
        projected = _StraightThrough.apply(self.weight, w / rms)
        dims = tuple(range(1, w.ndim))
        return _Normalize.apply(projected, dims, 1e-4, math.sqrt(math.prod(w.shape[1:])), norm / rms)

    def _unit_weight(self, norm: torch.Tensor | None = None) -> torch.Tensor:
        """``normalize(w) / sqrt(fan_in)`` in float32 (``norm``: the rows' known L2 norms)."""
        w = self.weight.to(torch.float32)
        return _Normalize.apply(w, tuple(range(1, w.ndim)), 1e-4, math.sqrt(math.prod(w.shape[1:])), norm)

    def _scaled_unit_weight(self, norm: torch.Tensor | None = None) -> torch.Tensor:
        """``normalize(w) / sqrt(fan_in)`` in float32; cached in eval mode without autograd."""
        use_cache = (
            self.weight_cache_enabled
            and not self.training
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        )
        if not use_cache:
            self._cached_weight = self._cached_key = None
            # Saves only its output for backward, so a later training-mode forward (which projects the stored
            # weight in place) does not invalidate what this forward saved.
            return self._unit_weight(norm)
        key = (self.weight._version, self.weight.data_ptr(), self.weight.dtype, self.weight.device)
        if self._cached_key != key:
            self._cached_weight, self._cached_key = self._unit_weight(), key
        return self._cached_weight

    def forward(self, x: torch.Tensor, gain: float | torch.Tensor = 1.0) -> torch.Tensor:
        if self.training and not self.project_in_place:
            w = self._projected_unit_weight()
        else:
            w = self._scaled_unit_weight(self.force_weight_normalization() if self.training else None)
        if not (isinstance(gain, float | int) and gain == 1):
            w = w * gain
        w = w.to(x.dtype)
        if w.ndim == 2:
            return x @ w.t()
        return F.conv2d(x, w, padding=w.shape[-1] // 2)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel={tuple(self.weight.shape[2:])}"


@contextmanager
def cached_weight_normalization(module: nn.Module) -> Iterator[nn.Module]:
    """Within this context, every :class:`MPConv` in ``module`` caches its normalised weight for eval-mode,
    no-grad forwards (e.g. a sampling loop); the caches are dropped on exit."""
    layers = [m for m in module.modules() if isinstance(m, MPConv)]
    for layer in layers:
        layer.weight_cache_enabled = True
    try:
        yield module
    finally:
        for layer in layers:
            layer.weight_cache_enabled = False
            layer._cached_weight = layer._cached_key = None


def register_sharded_weight_projection(model: nn.Module) -> RemovableHandle:
    """Forced weight normalisation of a model whose parameters are sharded on dim 0 (FSDP2 ``fully_shard``).

    Under FSDP2 a forward sees all-gathered copies of the weights, so the in-place projection inside
    :meth:`MPConv.forward` lands in a copy that is discarded. This forward pre-hook on ``model`` (it runs before
    FSDP's own hooks) projects the stored shards in training mode: a dim-0 shard holds complete output rows, so the
    per-row projection ``w_o <- w_o / rms(w_o)`` needs no communication. Register it after ``fully_shard(model)``;
    the projection inside the forward then finds unit rows and changes them only by float rounding.
    """
    layers = [layer for layer in model.modules() if isinstance(layer, MPConv)]

    def project(module: nn.Module, args: tuple) -> None:
        if module.training:
            for layer in layers:
                layer.force_weight_normalization()

    return model.register_forward_pre_hook(project, prepend=True)


class Block(nn.Module):
    """EDM2 UNet block ("config G"), encoder (``flavor='enc'``) or decoder (``'dec'``) flavour.

    Forward, with ``emb`` the (already mp_silu-activated) embedding::

        x = resample(x)
        enc: x = pixel_norm(conv_shortcut(x))              # 1x1 only when the width changes
        y = conv1(mp_silu(x))
        y = mp_silu(y * (emb_proj(emb, gain=emb_gain) + 1)) # emb_gain initialised to 0
        y = conv2(dropout(y))
        dec: x = conv_shortcut(x)
        x = mp_sum(x, y, t=res_balance)
        attention (cosine): q, k, v = pixel_norm per head of to_qkv(x); y = to_out(softmax(q^T k / sqrt(d)) v)
                            x = mp_sum(x, y, t=attn_balance)
        x = clip(x, -clip_act, clip_act)
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        emb_channels: int,
        flavor: Literal["enc", "dec"] = "enc",
        resample_mode: Literal["keep", "up", "down"] = "keep",
        attention: bool = False,
        channels_per_head: int = 64,
        dropout: float = 0.0,
        res_balance: float = 0.3,
        attn_balance: float = 0.3,
        clip_act: float | None = 256,
    ):
        super().__init__()
        if flavor not in ("enc", "dec"):
            raise ValueError(f"flavor must be 'enc' or 'dec', got {flavor!r}")
        if resample_mode not in ("keep", "up", "down"):
            raise ValueError(f"resample_mode must be 'keep', 'up' or 'down', got {resample_mode!r}")
        if attention and out_channels % channels_per_head != 0:
            raise ValueError(f"out_channels={out_channels} is not divisible by channels_per_head={channels_per_head}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.flavor = flavor
        self.resample_mode = resample_mode
        self.num_heads = out_channels // channels_per_head if attention else 0
        self.dropout = dropout
        self.res_balance = res_balance
        self.attn_balance = attn_balance
        self.clip_act = clip_act
        self.emb_gain = nn.Parameter(torch.zeros([]))
        self.conv1 = MPConv(out_channels if flavor == "enc" else in_channels, out_channels, kernel=(3, 3))
        self.emb_proj = MPConv(emb_channels, out_channels)
        self.conv2 = MPConv(out_channels, out_channels, kernel=(3, 3))
        self.conv_shortcut = MPConv(in_channels, out_channels, kernel=(1, 1)) if in_channels != out_channels else None
        self.to_qkv = MPConv(out_channels, out_channels * 3, kernel=(1, 1)) if self.num_heads else None
        self.to_out = MPConv(out_channels, out_channels, kernel=(1, 1)) if self.num_heads else None

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Cosine self-attention ``to_out(softmax(q^T k / sqrt(d)) v)`` with q, k, v pixel-normalised per head.

        ``to_qkv`` channels are laid out as [head, channel, (q, k, v)]; the softmax runs in PyTorch's
        ``scaled_dot_product_attention`` (memory-efficient kernels where available).
        """
        n, c, h, w = x.shape
        qkv = self.to_qkv(x).reshape(n, self.num_heads, c // self.num_heads, 3, h * w)
        # Each [n, heads, pixels, d]; contiguous, so that the fused (flash / memory-efficient) kernels apply.
        q, k, v = (t.contiguous() for t in normalize(qkv, dim=2).transpose(2, 4).unbind(3))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(y.transpose(2, 3).reshape(n, c, h, w))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x = resample(x, self.resample_mode)
        if self.flavor == "enc":
            if self.conv_shortcut is not None:
                x = self.conv_shortcut(x)
            x = pixel_norm(x)
        y = self.conv1(mp_silu(x))
        scale = self.emb_proj(emb, gain=self.emb_gain) + 1
        y = mp_silu(y * scale[:, :, None, None].to(y.dtype))
        if self.training and self.dropout != 0:
            y = F.dropout(y, p=self.dropout)
        y = self.conv2(y)
        if self.flavor == "dec" and self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        x = mp_sum(x, y, t=self.res_balance)
        if self.num_heads:
            x = mp_sum(x, self.attention(x), t=self.attn_balance)
        if self.clip_act is not None:
            # hardtanh is clamp with a one-pass backward (it differs from clamp's only at exactly +-clip_act).
            x = F.hardtanh(x, -self.clip_act, self.clip_act)
        return x
