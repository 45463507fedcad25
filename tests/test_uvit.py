"""U-ViT with ScaleLong: the official U-ViT/ScaleLong formulation written out independently, and diffusers use."""

import copy
import math

import pytest
import torch
from diffusers import DDPMPipeline, DDPMScheduler

from diffusers_scalelong.models import UViT2DModel

TINY = dict(sample_size=8, patch_size=2, in_channels=1, embed_dim=16, num_heads=2, mlp_ratio=2.0)


def _official_cs(kappa, depth):
    """Official code: the n-th out block (layer_cnt = n) pops the innermost remaining skip and scales it by
    kappa ** (depth // 2 - 1 - layer_cnt)."""
    return [kappa ** (depth // 2 - 1 - layer_cnt) for layer_cnt in range(depth // 2)]


def _official_gate(gate, skip):
    """Official Attentionlayer: sigmoid(layer2(relu(layer1(mean(skip, dim=-1))))).unsqueeze(-1)."""
    mean = torch.mean(skip, dim=-1)
    hidden = torch.relu(mean @ gate.fc1.weight.T + gate.fc1.bias)
    return torch.sigmoid(hidden @ gate.fc2.weight.T + gate.fc2.bias).unsqueeze(-1)


def _official_forward(model, x, timesteps, y=None):
    """The official U-ViT/ScaleLong forward loop on the model's own layers (brute-force unpatchify)."""
    config = model.config
    n_out = config.depth // 2
    tokens = model.patch_embed(x).flatten(2).transpose(1, 2)
    half = config.embed_dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = timesteps[:, None].float() * freqs[None]
    time_token = model.time_embed(torch.cat([torch.cos(args), torch.sin(args)], dim=-1)).unsqueeze(1)
    h = torch.cat((time_token, tokens), dim=1)
    if y is not None:
        h = torch.cat((model.class_embedding(y).unsqueeze(1), h), dim=1)
    h = h + model.pos_embed
    skips = []
    for block in model.in_blocks:
        h = block(h)
        skips.append(h)
    h = model.mid_block(h)
    method = config.lsc_method
    for layer_cnt, block in enumerate(model.out_blocks):
        skip = skips.pop()
        if method == "cs":
            skip = skip * config.lsc_kappa ** (n_out - 1 - layer_cnt)
        elif method == "ls":
            skip = skip * _official_gate(model.lsc.gates[0], skip)
        elif method == "ls_nonshared":  # one module per skip; ours are numbered outermost first
            skip = skip * _official_gate(model.lsc.gates[n_out - 1 - layer_cnt], skip)
        h = block(h, skip)
    h = model.decoder_pred(model.norm(h))[:, 2 if y is not None else 1 :]
    p, c, size = config.patch_size, config.in_channels, config.sample_size
    image = torch.zeros(x.shape[0], c, size, size)
    grid = size // p
    for index in range(grid * grid):
        row, col = divmod(index, grid)
        patch = h[:, index].reshape(x.shape[0], p, p, c).permute(0, 3, 1, 2)  # (p1 p2 C)
        image[:, :, row * p : (row + 1) * p, col * p : (col + 1) * p] = patch
    return model.final_layer(image)


@pytest.mark.parametrize("depth", [12, 16])
def test_cs_coefficients_follow_the_official_formula(depth):
    model = UViT2DModel(**TINY, depth=depth, lsc_method="cs", lsc_kappa=0.5).eval()
    expected = [0.5**5, 0.5**4, 0.5**3, 0.5**2, 0.5, 1.0] if depth == 12 else [0.5**k for k in range(7, -1, -1)]
    assert _official_cs(0.5, depth) == expected
    skips_in, skips_used = [], []
    for block in model.in_blocks:
        block.register_forward_hook(lambda m, a, out: skips_in.append(out))
    for block in model.out_blocks:
        block.register_forward_pre_hook(lambda m, args: skips_used.append(args[1]))
    with torch.no_grad():
        model(torch.randn(2, 1, 8, 8), torch.tensor([1.0, 900.0]))
    for layer_cnt, used in enumerate(skips_used):
        source = skips_in[depth // 2 - 1 - layer_cnt]
        assert torch.allclose(used, source * expected[layer_cnt], rtol=0, atol=0)


@pytest.mark.parametrize("depth", [12, 16])
@pytest.mark.parametrize("method", ["ls", "ls_nonshared"])
def test_ls_gate_shapes_follow_the_official_module(depth, method):
    model = UViT2DModel(**{**TINY, "sample_size": 16}, depth=depth, num_class_embeds=10, lsc_method=method).eval()
    num_tokens = 2 + 8 * 8  # class token + time token + patches
    assert len(model.lsc.gates) == (1 if method == "ls" else depth // 2)
    for gate in model.lsc.gates:
        assert (gate.fc1.in_features, gate.fc1.out_features) == (num_tokens, num_tokens // 16)
        assert (gate.fc2.in_features, gate.fc2.out_features) == (num_tokens // 16, num_tokens)
        skip = torch.randn(3, num_tokens, 16)
        gate_value = gate(skip)
        assert gate_value.shape == (3, num_tokens, 1)
        assert torch.equal(gate_value, _official_gate(gate, skip))  # the same operations
        assert ((gate_value > 0.2) & (gate_value < 0.8)).all()  # default Linear init: near 0.5


@pytest.mark.parametrize("method", ["none", "cs", "ls", "ls_nonshared"])
def test_forward_equals_the_official_loop(method):
    model = UViT2DModel(**TINY, depth=6, num_class_embeds=3, mlp_time_embed=True, lsc_method=method, lsc_kappa=0.6)
    model.eval()
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([5.0, 420.0]), torch.tensor([0, 2])
    with torch.no_grad():
        assert torch.equal(model(x, t, class_labels=y).sample, _official_forward(model, x, t, y))  # same ops


def test_kappa_one_is_bitwise_none():
    none = UViT2DModel(**TINY, depth=4).eval()
    cs = UViT2DModel(**TINY, depth=4, lsc_method="cs", lsc_kappa=1.0).eval()
    cs.load_state_dict(none.state_dict())
    x, t = torch.randn(2, 1, 8, 8), torch.tensor(7.0)
    with torch.no_grad():
        assert torch.equal(cs(x, t).sample, none(x, t).sample)


def test_save_load_and_old_checkpoint_into_ls(tmp_path):
    model = UViT2DModel(**TINY, depth=4, lsc_method="cs", lsc_kappa=0.7).eval()
    model.save_pretrained(tmp_path)
    reloaded = UViT2DModel.from_pretrained(tmp_path)
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([3.0, 4.0])
    with torch.no_grad():
        assert torch.equal(reloaded(x, t).sample, model(x, t).sample)
    ls, info = UViT2DModel.from_pretrained(tmp_path, lsc_method="ls", output_loading_info=True)
    assert info["missing_keys"] and all(k.startswith("lsc.gates.0.") for k in info["missing_keys"])
    assert not any(p.is_meta for p in ls.parameters())
    assert ls.lsc.gates[0].fc1.weight.std() > 0
    with torch.no_grad():
        assert torch.isfinite(ls(x, t).sample).all()


def test_gradient_checkpointing_equivalence():
    model = UViT2DModel(**TINY, depth=4, lsc_method="ls_nonshared").train()
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([3.0, 300.0])

    def loss_and_grads():
        model.zero_grad()
        loss = model(x, t).sample.pow(2).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = loss_and_grads()
    model.enable_gradient_checkpointing()
    loss_ckpt, grads_ckpt = loss_and_grads()
    assert torch.equal(loss, loss_ckpt)  # checkpointing recomputes the same forward
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ckpt[name]), name


def test_compile_fullgraph_and_deepcopy():
    model = UViT2DModel(**TINY, depth=4, lsc_method="ls").eval()
    clone = copy.deepcopy(model)
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([3.0, 300.0])
    torch._dynamo.reset()
    compiled = torch.compile(clone, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(x, t).sample, model(x, t).sample)  # the eager backend runs the same ops


def test_runs_in_ddpm_pipeline(tmp_path):
    model = UViT2DModel(**TINY, depth=4, lsc_method="cs")
    pipeline = DDPMPipeline(unet=model, scheduler=DDPMScheduler(num_train_timesteps=20))
    images = pipeline(batch_size=2, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np")
    assert images.images.shape == (2, 8, 8, 1)
    pipeline.save_pretrained(tmp_path)
    assert type(DDPMPipeline.from_pretrained(tmp_path).unet) is UViT2DModel


def test_bad_input_raises_value_errors():
    with pytest.raises(ValueError, match="lsc_method"):
        UViT2DModel(**TINY, depth=4, lsc_method="learned")
    with pytest.raises(ValueError, match="lsc_kappa"):
        UViT2DModel(**TINY, depth=4, lsc_method="cs", lsc_kappa=0.0)
    with pytest.raises(ValueError, match="depth"):
        UViT2DModel(**TINY, depth=5)
    model = UViT2DModel(**TINY, depth=4, lsc_method="ls")
    with pytest.raises(ValueError, match="sample_size"):
        model(torch.randn(1, 1, 16, 16), torch.tensor(1.0))
    with pytest.raises(ValueError, match="class_labels"):
        model(torch.randn(1, 1, 8, 8), torch.tensor(1.0), class_labels=torch.tensor([0]))
    with pytest.raises(ValueError, match="lsc_method LS token gate"):
        model.lsc.scale(0, torch.randn(1, 5, 16))
    with pytest.raises(ValueError, match="mismatched skip"):
        model.out_blocks[0](torch.randn(1, 17, 16), torch.randn(1, 5, 16))
