"""Official U-ViT / ScaleLong state dicts -> UViT2DModel, checked against a functional forward written here.

The reference works on a dict with the official key names (``libs/uvit.py`` of U-ViT and ScaleLong) and follows
the official forward step by step: patch embedding, sinusoidal time token (cos first), class token in front,
``depth // 2`` in blocks pushing skips, a mid block, out blocks popping skips innermost first with ScaleLong's
``scalelong`` switch (0 none, 1 1/sqrt(2), 2 kappa ** (N - 1 - layer_cnt), 3 shared ``se``, 4 ``se[layer_cnt]``),
then norm, linear decoder, unpatchify and the 3x3 output conv. It shares no code with the model.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from diffusers import DDPMPipeline, DDPMScheduler

from diffusers_scalelong import UViT2DModel
from diffusers_scalelong.convert.cli import uvit_main
from diffusers_scalelong.convert.uvit_official import (
    convert_uvit_state_dict,
    official_vpsde_scheduler,
    uvit_from_official,
)

IMG, PATCH, CH, DIM, DEPTH, HEADS, MLP = 8, 2, 3, 32, 4, 4, 2
KAPPA = 0.7


def official_state_dict(scalelong: int, num_classes: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with the official names and shapes (gates with the official hidden width tokens // 16)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, scale=0.2: torch.randn(*shape, generator=g) * scale  # noqa: E731
    tokens = (2 if num_classes else 1) + (IMG // PATCH) ** 2
    sd = {"patch_embed.proj.weight": rand(DIM, CH, PATCH, PATCH), "patch_embed.proj.bias": rand(DIM)}
    sd["time_embed.0.weight"], sd["time_embed.0.bias"] = rand(4 * DIM, DIM), rand(4 * DIM)
    sd["time_embed.2.weight"], sd["time_embed.2.bias"] = rand(DIM, 4 * DIM), rand(DIM)
    if num_classes:
        sd["label_emb.weight"] = rand(num_classes, DIM, scale=1.0)
    sd["pos_embed"] = rand(1, tokens, DIM)

    def block(prefix, skip):
        if skip:
            sd[f"{prefix}.skip_linear.weight"], sd[f"{prefix}.skip_linear.bias"] = rand(DIM, 2 * DIM), rand(DIM)
        for norm in ("norm1", "norm2"):
            sd[f"{prefix}.{norm}.weight"], sd[f"{prefix}.{norm}.bias"] = 1 + rand(DIM), rand(DIM)
        sd[f"{prefix}.attn.qkv.weight"] = rand(3 * DIM, DIM)
        sd[f"{prefix}.attn.proj.weight"], sd[f"{prefix}.attn.proj.bias"] = rand(DIM, DIM), rand(DIM)
        sd[f"{prefix}.mlp.fc1.weight"], sd[f"{prefix}.mlp.fc1.bias"] = rand(MLP * DIM, DIM), rand(MLP * DIM)
        sd[f"{prefix}.mlp.fc2.weight"], sd[f"{prefix}.mlp.fc2.bias"] = rand(DIM, MLP * DIM), rand(DIM)

    for i in range(DEPTH // 2):
        block(f"in_blocks.{i}", False)
        block(f"out_blocks.{i}", True)
    block("mid_block", False)
    sd["norm.weight"], sd["norm.bias"] = 1 + rand(DIM), rand(DIM)
    sd["decoder_pred.weight"], sd["decoder_pred.bias"] = rand(PATCH**2 * CH, DIM), rand(PATCH**2 * CH)
    sd["final_layer.weight"], sd["final_layer.bias"] = rand(CH, CH, 3, 3), rand(CH)
    hidden = tokens // 16
    gates = {3: ["se."], 4: [f"se.{k}." for k in range(DEPTH // 2)]}.get(scalelong, [])
    for prefix in gates:  # large weights so that each gate is far from sigmoid(0) and differs between skips
        sd[f"{prefix}layer1.weight"], sd[f"{prefix}layer1.bias"] = rand(hidden, tokens, scale=3.0), rand(hidden)
        sd[f"{prefix}layer2.weight"], sd[f"{prefix}layer2.bias"] = rand(tokens, hidden, scale=3.0), rand(tokens)
    return sd


# ---- the reference, from the official forward ---------------------------------------------------------------
def linear(p, name, x):
    return x @ p[f"{name}.weight"].T + (p[f"{name}.bias"] if f"{name}.bias" in p else 0)


def ref_block(p, name, x, skip=None):
    if skip is not None:
        x = linear(p, f"{name}.skip_linear", torch.cat([x, skip], dim=-1))
    h = F.layer_norm(x, (DIM,), p[f"{name}.norm1.weight"], p[f"{name}.norm1.bias"])
    b, n, _ = h.shape
    qkv = linear(p, f"{name}.attn.qkv", h).reshape(b, n, 3, HEADS, DIM // HEADS)  # 'B L (K H D)'
    q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))
    attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS), dim=-1)
    x = x + linear(p, f"{name}.attn.proj", (attn @ v).transpose(1, 2).reshape(b, n, DIM))
    h = F.layer_norm(x, (DIM,), p[f"{name}.norm2.weight"], p[f"{name}.norm2.bias"])
    return x + linear(p, f"{name}.mlp.fc2", F.gelu(linear(p, f"{name}.mlp.fc1", h)))


def gate(p, prefix, skip):
    squeezed = skip.mean(dim=-1)
    hidden = torch.relu(linear(p, f"{prefix}layer1", squeezed))
    return torch.sigmoid(linear(p, f"{prefix}layer2", hidden)).unsqueeze(-1)


def reference_forward(p, x, timesteps, scalelong, kappa, labels=None):
    b = x.shape[0]
    tokens = F.conv2d(x, p["patch_embed.proj.weight"], p["patch_embed.proj.bias"], stride=PATCH)
    tokens = tokens.flatten(2).transpose(1, 2)
    half = DIM // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = timesteps[:, None].float() * freqs[None]
    t_emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    t_emb = linear(p, "time_embed.2", F.silu(linear(p, "time_embed.0", t_emb)))
    x = torch.cat([t_emb[:, None], tokens], dim=1)
    if labels is not None:
        x = torch.cat([p["label_emb.weight"][labels][:, None], x], dim=1)
    x = x + p["pos_embed"]
    skips = []
    for i in range(DEPTH // 2):
        x = ref_block(p, f"in_blocks.{i}", x)
        skips.append(x)
    x = ref_block(p, "mid_block", x)
    n = DEPTH // 2
    for layer_cnt in range(n):
        skip = skips.pop()
        if scalelong == 1:
            skip = skip * 2**-0.5
        elif scalelong == 2:
            skip = skip * kappa ** (n - 1 - layer_cnt)
        elif scalelong == 3:
            skip = skip * gate(p, "se.", skip)
        elif scalelong == 4:
            skip = skip * gate(p, f"se.{layer_cnt}.", skip)
        x = ref_block(p, f"out_blocks.{layer_cnt}", x, skip)
    x = linear(p, "decoder_pred", F.layer_norm(x, (DIM,), p["norm.weight"], p["norm.bias"]))
    x = x[:, -((IMG // PATCH) ** 2) :]
    grid = IMG // PATCH
    x = x.reshape(b, grid, grid, PATCH, PATCH, CH).permute(0, 5, 1, 3, 2, 4).reshape(b, CH, IMG, IMG)
    return F.conv2d(x, p["final_layer.weight"], p["final_layer.bias"], padding=1)


# ---- tests --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scalelong", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("num_classes", [0, 5])
def test_converted_model_matches_the_official_forward_for_every_scalelong_method(tmp_path, scalelong, num_classes):
    official = official_state_dict(scalelong, num_classes)
    path = tmp_path / "nnet_ema.pth"
    torch.save(official, path)
    model = uvit_from_official(path, num_heads=HEADS, lsc_method=scalelong, lsc_kappa=KAPPA)
    expected_method = ("none", "inv_sqrt2", "cs", "ls", "ls_nonshared")[scalelong]
    assert model.config.lsc_method == expected_method and model.config.mlp_ratio == MLP
    assert model.config.num_class_embeds == (num_classes or None) and model.config.sample_size == IMG

    x = torch.randn(3, CH, IMG, IMG, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.999, 400.0, 998.0])  # the official timestep input 999 t
    labels = torch.tensor([0, 4, 2]) if num_classes else None
    with torch.no_grad():
        expected = reference_forward(official, x, t, scalelong, KAPPA, labels)
        actual = model(x, t, class_labels=labels).sample
        plain = reference_forward(official, x, t, 0, KAPPA, labels)
    # float32, fused SDPA vs explicit softmax attention: ~1e-6 differences.
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
    if scalelong:
        assert (expected - plain).abs().max() > 1e-2  # the method changes the output
    if scalelong == 4:  # the gates sit in reversed order: using them in the official order gives another output
        swapped = dict(official)
        for name in ("layer1.weight", "layer1.bias", "layer2.weight", "layer2.bias"):
            swapped[f"se.0.{name}"], swapped[f"se.1.{name}"] = official[f"se.1.{name}"], official[f"se.0.{name}"]
        with torch.no_grad():
            assert (reference_forward(swapped, x, t, 4, KAPPA, labels) - expected).abs().max() > 1e-3


def test_converter_reads_the_method_from_the_gates_and_rejects_conflicts():
    state, config = convert_uvit_state_dict(official_state_dict(4), num_heads=HEADS)
    assert config["lsc_method"] == "ls_nonshared" and config["lsc_reduction"] == 16
    assert "lsc.gates.1.fc1.weight" in state and not any(k.startswith("se.") for k in state)
    # official se.0 gates the innermost skip; ours index 0 is the outermost
    assert torch.equal(state["lsc.gates.1.fc1.weight"], official_state_dict(4)["se.0.layer1.weight"])  # copied
    with pytest.raises(ValueError, match="carries ls_nonshared gates"):
        convert_uvit_state_dict(official_state_dict(4), num_heads=HEADS, lsc_method="cs")
    with pytest.raises(ValueError, match="needs the official se gate weights of ls"):
        convert_uvit_state_dict(official_state_dict(0), num_heads=HEADS, lsc_method=3)
    with pytest.raises(ValueError, match="--lsc index must lie in"):
        convert_uvit_state_dict(official_state_dict(0), num_heads=HEADS, lsc_method=7)
    with pytest.raises(ValueError, match="--num_heads must divide embed_dim=32"):
        convert_uvit_state_dict(official_state_dict(0), num_heads=5)
    broken = official_state_dict(0)
    del broken["out_blocks.1.skip_linear.bias"]
    with pytest.raises(ValueError, match="missing keys"):
        convert_uvit_state_dict(broken, num_heads=HEADS)
    wrapped = {f"module.{k}": v for k, v in official_state_dict(2).items()}  # saved from a DataParallel wrapper
    assert convert_uvit_state_dict(wrapped, num_heads=HEADS, lsc_method="cs")[1]["lsc_method"] == "cs"


def test_vpsde_scheduler_matches_the_official_process_at_its_timesteps():
    scheduler = official_vpsde_scheduler()
    i = torch.tensor([1, 10, 500, 998, 999])
    t = i.double() / 999  # the network input is 999 t
    abar = torch.exp(-(0.1 * t + 0.5 * (20 - 0.1) * t**2))  # log-mean coefficient of the VP SDE, squared
    torch.testing.assert_close(scheduler.alphas_cumprod[i].double(), abar, rtol=1e-5, atol=0)  # float32 storage
    assert scheduler.alphas_cumprod[0] < 1 and scheduler.config.clip_sample is False


def test_cli_writes_a_ddpm_pipeline_that_samples(tmp_path):
    path = tmp_path / "nnet_ema.pth"
    torch.save(official_state_dict(3), path)
    out = tmp_path / "converted"
    assert uvit_main([str(path), "--output_dir", str(out), "--num_heads", str(HEADS)]) == 0
    pipe = DDPMPipeline.from_pretrained(out)
    assert isinstance(pipe.unet, UViT2DModel) and isinstance(pipe.scheduler, DDPMScheduler)
    assert pipe.unet.config.lsc_method == "ls"
    images = pipe(batch_size=2, num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="np")
    assert images.images.shape == (2, IMG, IMG, CH)
    metadata = json.loads((out / "uvit_source.json").read_text())
    assert metadata["official_scalelong_index"] == 3 and "999 t" in metadata["timestep_convention"]

    torch.save(official_state_dict(0, num_classes=5), path)
    conditional = tmp_path / "conditional"
    uvit_main([str(path), "--output_dir", str(conditional), "--num_heads", str(HEADS), "--lsc", "cs", "--kappa", "0.6"])
    model = UViT2DModel.from_pretrained(conditional / "unet")
    assert model.config.num_class_embeds == 5 and model.config.lsc_kappa == 0.6
    assert (conditional / "scheduler" / "scheduler_config.json").is_file()
    with pytest.raises(SystemExit, match="--num_heads"):
        uvit_main([str(path), "--output_dir", str(tmp_path / "x"), "--num_heads", "3"])
