"""Converter from the official EDM2 naming, checked against an independent functional reference forward.

The reference below is written from the paper's equations and works directly on a dict with the official key
names; it shares no code with ``diffusers_scalelong.layers`` or the model.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from diffusers_scalelong.convert import convert_edm2_state_dict, preconditioner_from_edm2_state_dict
from diffusers_scalelong.models import EDM2UNet2DModel

# A small config G: 16x16x3, widths 16/32/48, 2 blocks per level, attention at 8 and 4, 5 classes, 8-wide heads.
RES, IMG_CH, WIDTHS, BLOCKS, ATTN, CLASSES, HEAD = 16, 3, (16, 32, 48), 2, (8, 4), 5, 8
EMB = max(WIDTHS)


def official_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with the official names and shapes (gains non-zero, as in a trained network)."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def block(name, cin, cout, flavor, attention):
        sd[f"unet.{name}.emb_gain"] = torch.rand([], generator=g) + 0.5
        sd[f"unet.{name}.conv_res0.weight"] = torch.randn(cout, cout if flavor == "enc" else cin, 3, 3, generator=g)
        sd[f"unet.{name}.emb_linear.weight"] = torch.randn(cout, EMB, generator=g)
        sd[f"unet.{name}.conv_res1.weight"] = torch.randn(cout, cout, 3, 3, generator=g)
        if cin != cout:
            sd[f"unet.{name}.conv_skip.weight"] = torch.randn(cout, cin, 1, 1, generator=g)
        if attention:
            sd[f"unet.{name}.attn_qkv.weight"] = torch.randn(cout * 3, cout, 1, 1, generator=g)
            sd[f"unet.{name}.attn_proj.weight"] = torch.randn(cout, cout, 1, 1, generator=g)

    sd["unet.emb_fourier.freqs"] = 2 * math.pi * torch.randn(WIDTHS[0], generator=g)
    sd["unet.emb_fourier.phases"] = 2 * math.pi * torch.rand(WIDTHS[0], generator=g)
    sd["unet.emb_noise.weight"] = torch.randn(EMB, WIDTHS[0], generator=g)
    sd["unet.emb_label.weight"] = torch.randn(EMB, CLASSES, generator=g)
    skips, cout = [], IMG_CH + 1
    for level, width in enumerate(WIDTHS):
        r = RES >> level
        if level == 0:
            sd[f"unet.enc.{r}x{r}_conv.weight"] = torch.randn(width, cout, 3, 3, generator=g)
            cout = width
        else:
            block(f"enc.{r}x{r}_down", cout, cout, "enc", False)
        skips.append(cout)
        for i in range(BLOCKS):
            block(f"enc.{r}x{r}_block{i}", cout, width, "enc", r in ATTN)
            cout = width
            skips.append(cout)
    for level in reversed(range(len(WIDTHS))):
        r = RES >> level
        if level == len(WIDTHS) - 1:
            block(f"dec.{r}x{r}_in0", cout, cout, "dec", True)
            block(f"dec.{r}x{r}_in1", cout, cout, "dec", False)
        else:
            block(f"dec.{r}x{r}_up", cout, cout, "dec", False)
        for i in range(BLOCKS + 1):
            block(f"dec.{r}x{r}_block{i}", cout + skips.pop(), WIDTHS[level], "dec", r in ATTN)
            cout = WIDTHS[level]
    sd["unet.out_conv.weight"] = torch.randn(IMG_CH, cout, 3, 3, generator=g)
    sd["unet.out_gain"] = torch.tensor(0.8)
    sd["logvar_fourier.freqs"] = 2 * math.pi * torch.randn(128, generator=g)
    sd["logvar_fourier.phases"] = 2 * math.pi * torch.rand(128, generator=g)
    sd["logvar_linear.weight"] = torch.randn(1, 128, generator=g)
    return sd


# ---- the reference, from the equations -------------------------------------------------------------------------
def unit_rms(x, dims):
    return x / (1e-4 + x.pow(2).mean(dim=dims, keepdim=True).sqrt())


def wconv(x, w, gain=1.0):
    """Magnitude-preserving conv/linear: weight rows scaled to unit RMS, then by gain / sqrt(fan_in)."""
    fan_in = w[0].numel()
    w = unit_rms(w, tuple(range(1, w.ndim))) * gain / math.sqrt(fan_in)
    return x @ w.T if w.ndim == 2 else F.conv2d(x, w, padding=w.shape[-1] // 2)


def silu_mp(x):
    return F.silu(x) / 0.596


def sum_mp(a, b, t):
    return ((1 - t) * a + t * b) / math.sqrt((1 - t) ** 2 + t**2)


def cat_mp(a, b, t=0.5):
    na, nb = a.shape[1], b.shape[1]
    scale = math.sqrt((na + nb) / ((1 - t) ** 2 + t**2))
    return torch.cat([a * scale * (1 - t) / math.sqrt(na), b * scale * t / math.sqrt(nb)], dim=1)


def ref_block(p, name, x, emb, flavor, mode):
    get = lambda key: p.get(f"unet.{name}.{key}")  # noqa: E731
    if mode == "down":
        x = F.avg_pool2d(x, 2)
    elif mode == "up":
        x = x.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
    if flavor == "enc":
        if get("conv_skip.weight") is not None:
            x = wconv(x, get("conv_skip.weight"))
        x = unit_rms(x, (1,))
    y = wconv(silu_mp(x), get("conv_res0.weight"))
    y = silu_mp(y * (wconv(emb, get("emb_linear.weight"), get("emb_gain")) + 1)[:, :, None, None])
    y = wconv(y, get("conv_res1.weight"))
    if flavor == "dec" and get("conv_skip.weight") is not None:
        x = wconv(x, get("conv_skip.weight"))
    x = sum_mp(x, y, 0.3)
    if get("attn_qkv.weight") is not None:
        n, c, h, w = x.shape
        heads = c // HEAD
        qkv = wconv(x, get("attn_qkv.weight")).reshape(n, heads, HEAD, 3, h * w)
        q, k, v = (unit_rms(qkv[:, :, :, j], (2,)) for j in range(3))  # [n, heads, d, pixels]
        attn = torch.softmax(q.transpose(2, 3) @ k / math.sqrt(HEAD), dim=-1)  # [n, heads, queries, keys]
        y = (v @ attn.transpose(2, 3)).reshape(n, c, h, w)
        x = sum_mp(x, wconv(y, get("attn_proj.weight")), 0.3)
    return x.clamp(-256, 256)


def reference_denoiser(p, x, sigma, labels):
    """D(x; sigma) and u(sigma) of the official preconditioned network, from the equations."""
    sd, s = 0.5, sigma.reshape(-1, 1, 1, 1)
    c_noise = sigma.log() / 4
    fourier = lambda prefix: math.sqrt(2) * torch.cos(c_noise[:, None] * p[f"{prefix}.freqs"] + p[f"{prefix}.phases"])  # noqa: E731
    emb = wconv(fourier("unet.emb_fourier"), p["unet.emb_noise.weight"])
    one_hot = F.one_hot(labels, CLASSES).float() * math.sqrt(CLASSES)
    emb = silu_mp(sum_mp(emb, wconv(one_hot, p["unet.emb_label.weight"]), 0.5))
    h = x / (s**2 + sd**2).sqrt()
    h = torch.cat([h, torch.ones_like(h[:, :1])], dim=1)
    skips = []
    for level in range(len(WIDTHS)):
        r = RES >> level
        if level == 0:
            h = wconv(h, p[f"unet.enc.{r}x{r}_conv.weight"])
        else:
            h = ref_block(p, f"enc.{r}x{r}_down", h, emb, "enc", "down")
        skips.append(h)
        for i in range(BLOCKS):
            h = ref_block(p, f"enc.{r}x{r}_block{i}", h, emb, "enc", "keep")
            skips.append(h)
    for level in reversed(range(len(WIDTHS))):
        r = RES >> level
        if level == len(WIDTHS) - 1:
            h = ref_block(p, f"dec.{r}x{r}_in0", h, emb, "dec", "keep")
            h = ref_block(p, f"dec.{r}x{r}_in1", h, emb, "dec", "keep")
        else:
            h = ref_block(p, f"dec.{r}x{r}_up", h, emb, "dec", "up")
        for i in range(BLOCKS + 1):
            h = ref_block(p, f"dec.{r}x{r}_block{i}", cat_mp(h, skips.pop()), emb, "dec", "keep")
    out = wconv(h, p["unet.out_conv.weight"], p["unet.out_gain"])
    denoised = sd**2 / (s**2 + sd**2) * x + s * sd / (s**2 + sd**2).sqrt() * out
    logvar = wconv(fourier("logvar_fourier"), p["logvar_linear.weight"])
    return denoised, logvar.reshape(-1, 1, 1, 1)


# ---- tests --------------------------------------------------------------------------------------------------------
def test_converter_infers_the_config_and_maps_every_tensor():
    unet_state, logvar_state, config = convert_edm2_state_dict(official_state_dict(), channels_per_head=HEAD)
    assert config["sample_size"] == RES and config["in_channels"] == IMG_CH and config["out_channels"] == IMG_CH
    assert config["model_channels"] == 16 and config["channel_mult"] == [1, 2, 3]
    assert config["layers_per_block"] == BLOCKS and config["attention_resolutions"] == [8, 4]
    assert config["num_class_embeds"] == CLASSES and config["channels_per_head"] == HEAD
    assert set(logvar_state) == {"fourier.freqs", "fourier.phases", "linear.weight"}
    model = EDM2UNet2DModel(**config)
    model.load_state_dict(unet_state, strict=True)
    assert len(unet_state) == len(model.state_dict())


def test_converted_network_reproduces_the_reference_forward():
    official = official_state_dict()
    denoiser = preconditioner_from_edm2_state_dict(official, channels_per_head=HEAD).eval()
    x = torch.randn(3, IMG_CH, RES, RES)
    sigma, labels = torch.tensor([0.05, 0.8, 12.0]), torch.tensor([0, 3, 4])
    with torch.no_grad():
        expected, expected_logvar = reference_denoiser(official, x, sigma, labels)
        actual, logvar = denoiser(x, sigma, labels, return_logvar=True)
    assert (expected - 0.25 / (sigma.reshape(-1, 1, 1, 1) ** 2 + 0.25) * x).abs().max() > 0.1  # F really contributes
    # same float32 weights; fused SDPA and cached weight normalisation against the reference's explicit operations
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logvar, expected_logvar, atol=1e-5, rtol=1e-5)  # no attention: normalisation only


def test_converter_accepts_a_bare_unet_state_dict_and_rejects_foreign_keys():
    bare = {k.removeprefix("unet."): v for k, v in official_state_dict().items() if k.startswith("unet.")}
    unet_state, logvar_state, _ = convert_edm2_state_dict(bare, channels_per_head=HEAD)
    assert logvar_state == {} and "conv_in.weight" in unet_state
    with pytest.raises(ValueError, match="not part of the EDM2 UNet"):
        convert_edm2_state_dict({**bare, "enc.16x16_block0.extra.weight": torch.zeros(1)}, channels_per_head=HEAD)
    incomplete = dict(bare)
    del incomplete["dec.16x16_block2.conv_res1.weight"]
    with pytest.raises(ValueError, match="lacks tensors"):
        convert_edm2_state_dict(incomplete, channels_per_head=HEAD)
    with pytest.raises(ValueError, match="official EDM2 naming"):
        convert_edm2_state_dict({"conv_in.weight": torch.zeros(1)})
