"""diffusers' memory features act on MPConv: layerwise casting, group offloading, model CPU offload.

Layerwise casting is checked against an independent reference: the same model with the cast weights rounded to the
storage dtype by hand. Offloading can only move weights between devices on an accelerator; on CPU the tests check
that every weight belongs to an offloading group and that outputs are unchanged.
"""

import copy

import pytest
import torch
from diffusers import EDMEulerScheduler
from diffusers.hooks import HookRegistry

from diffusers_scalelong.edm2 import LearnedUncertainty
from diffusers_scalelong.layers import MPConv
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from tests._tiny_models import TINY_EDM2_UNET

FLOAT8 = torch.float8_e4m3fn


def tiny_unet(**overrides) -> EDM2UNet2DModel:
    torch.manual_seed(0)
    model = EDM2UNet2DModel(**{**TINY_EDM2_UNET, "num_class_embeds": 3, **overrides}).eval()
    with torch.no_grad():
        model.out_gain.fill_(1.0)  # F = 0 at initialisation would hide the weights
    return model


def inputs():
    return torch.randn(2, 1, 8, 8), torch.tensor([-0.5, 0.5]), torch.tensor([0, 2])


def layer_weights(model: torch.nn.Module) -> set[str]:
    """Names of the parameters of the model's layers (MPConv, and nn.Linear in LS gates); the scalar gains
    (``out_gain``, ``emb_gain``) are bare parameters of blocks, which layerwise casting leaves alone."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MPConv | torch.nn.Linear)]
    return {f"{name}.{p}" for name, m in layers for p, _ in m.named_parameters()}


def footprint_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers as they are stored now."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("lsc_method", ["none", "ls"])
def test_layerwise_casting_stores_mpconv_weights_in_float8(lsc_method):
    model = tiny_unet(lsc_method=lsc_method)
    x, t, labels = inputs()
    with torch.no_grad():
        full = model(x, t, labels).sample
    # Independent reference: every weight of a hooked layer rounded to float8 by hand, computed in float32.
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if name in layer_weights(model):
                param.copy_(param.to(FLOAT8).to(torch.float32))
    before = model.get_memory_footprint()
    assert before == footprint_bytes(model)

    model.enable_layerwise_casting(storage_dtype=FLOAT8, compute_dtype=torch.float32)
    cast = {name for name, p in model.named_parameters() if p.dtype == FLOAT8}
    mp_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, MPConv)}
    assert mp_weights <= cast and cast == layer_weights(model)
    saved = 3 * sum(p.numel() for name, p in model.named_parameters() if name in cast)  # 4 -> 1 byte each
    assert model.get_memory_footprint() == footprint_bytes(model) == before - saved < before / 3
    with torch.no_grad():
        out = model(x, t, labels).sample
        assert torch.equal(out, rounded(x, t, labels).sample)
    assert all(p.dtype == FLOAT8 for name, p in model.named_parameters() if name in cast)  # stored again
    # float8 e4m3 keeps 3 mantissa bits: each weight is off by up to 2^-4 relative; measured 5 % over this net.
    assert (out - full).norm() / full.norm() < 0.15


def stored_bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's bytes as stored (float8 has no equality of its own)."""
    return {name: p.detach().reshape(-1).clone().view(torch.uint8) for name, p in model.named_parameters()}


# diffusers' test_layerwise_casting_training runs these (storage, compute) pairs; bfloat16 storage is added.
TRAINING_DTYPES = [
    (torch.float16, torch.float32),
    (FLOAT8, torch.float32),
    (torch.float8_e5m2, torch.float32),
    (torch.bfloat16, torch.float32),
    (FLOAT8, torch.bfloat16),
]


@pytest.mark.parametrize("storage_dtype, compute_dtype", TRAINING_DTYPES, ids=str)
def test_layerwise_casting_training(storage_dtype, compute_dtype):
    """diffusers' test, our version: a training forward and backward under layerwise casting, inputs in the compute
    dtype, the loss under autocast; every weight gets a finite gradient (non-zero for MPConv weights) and keeps its stored bits."""
    model = tiny_unet(lsc_method="ls")
    with torch.no_grad():  # emb_gain = 0 at initialisation would leave the embedding projections without gradient
        for block in [*model.encoder_blocks, *model.decoder_blocks]:
            block.emb_gain.fill_(0.5)
    model = model.to(compute_dtype)
    model.enable_layerwise_casting(storage_dtype=storage_dtype, compute_dtype=compute_dtype)
    model.train()
    before = stored_bits(model)
    x, t, labels = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype == torch.bfloat16):
        out = model(x.to(compute_dtype), t, labels).sample
        loss = torch.nn.functional.mse_loss(out, torch.randn(out.shape, generator=torch.manual_seed(1)).to(out))
    loss.backward()
    assert out.dtype == compute_dtype and torch.isfinite(loss)
    mp_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, MPConv)}
    for name, param in model.named_parameters():
        assert torch.equal(param.detach().reshape(-1).view(torch.uint8), before[name]), name
        assert param.grad is not None and torch.isfinite(param.grad.float()).all(), name
        if name in layer_weights(model):  # MPConv weights and the LS gates' nn.Linear
            assert param.dtype == storage_dtype, name
        if name in mp_weights:
            assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "storage_dtype, checkpointing", [(torch.bfloat16, False), (torch.float16, False), (FLOAT8, False), (FLOAT8, True)]
)
def test_layerwise_casting_training_equals_full_precision_training_of_the_stored_values(storage_dtype, checkpointing):
    """Independent reference: a float32 model holding the same (rounded) weights, trained the ordinary way (the
    forced weight normalisation projects its stored weights in place). Outputs and every gradient are equal bit for
    bit: the functional projection computes the same float32 values, and the gradient passes through it unchanged."""
    model = tiny_unet(lsc_method="ls").train()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in layer_weights(model):
                param.copy_(param.to(storage_dtype).to(torch.float32))
    model.enable_layerwise_casting(storage_dtype=storage_dtype, compute_dtype=torch.float32)
    if checkpointing:  # the backward recomputes each block's forward, hooks and functional projection included
        model.enable_gradient_checkpointing()
    before = stored_bits(model)
    x, t, labels = inputs()
    outputs = []
    for network in (model, reference):
        out = network(x, t, labels).sample
        out.square().mean().backward()
        outputs.append(out)
    assert torch.equal(*outputs)
    grads = {name: p.grad for name, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, grads[name]), name
    assert all(torch.equal(p.detach().reshape(-1).view(torch.uint8), before[n]) for n, p in model.named_parameters())
    # the reference did project its stored rows (unit RMS), the cast model left its own as they were
    assert not torch.equal(reference.conv_in.weight, model.conv_in.weight.to(torch.float32))


def test_learned_uncertainty_trains_under_layerwise_casting():
    head = LearnedUncertainty(16).train()
    reference = copy.deepcopy(head)
    with torch.no_grad():
        reference.linear.weight.copy_(reference.linear.weight.to(FLOAT8).to(torch.float32))
    head.enable_layerwise_casting(storage_dtype=FLOAT8, compute_dtype=torch.float32)
    c_noise = torch.linspace(-1, 1, 5)
    head(c_noise).sum().backward()
    reference(c_noise).sum().backward()
    assert head.linear.weight.dtype == FLOAT8
    assert torch.equal(head.linear.weight.grad, reference.linear.weight.grad)
    assert head.linear.weight.grad.abs().sum() > 0


def test_layerwise_casting_keeps_skip_patterns():
    model = tiny_unet()
    model.enable_layerwise_casting(storage_dtype=FLOAT8, compute_dtype=torch.float32, skip_modules_pattern=("conv_",))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    skipped = {name for name in dtypes if "conv_" in name}  # conv_in, conv_out, the blocks' conv_shortcut
    assert {dtypes[name] for name in skipped} == {torch.float32}
    assert dtypes["encoder_blocks.0.conv1.weight"] == dtypes["noise_embedding.weight"] == FLOAT8


def test_learned_uncertainty_casts_its_mpconv():
    head = LearnedUncertainty(16).eval()
    before = head.get_memory_footprint()
    head.enable_layerwise_casting(storage_dtype=FLOAT8, compute_dtype=torch.float32)
    assert head.linear.weight.dtype == FLOAT8
    assert before - head.get_memory_footprint() == 3 * head.linear.weight.numel()


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offloading_covers_every_mpconv_weight(offload_type):
    model, reference = tiny_unet(), tiny_unet()
    kwargs = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    cpu = torch.device("cpu")
    model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type=offload_type, **kwargs)
    grouped = set()
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook("group_offloading") if isinstance(registry, HookRegistry) else None
        if hook is not None:
            group = hook.group
            grouped |= {id(p) for m in group.modules or () for p in m.parameters()}
            grouped |= {id(p) for p in group.parameters or ()}
    assert {id(p) for p in model.parameters()} <= grouped
    x, t, labels = inputs()
    with torch.no_grad():
        assert torch.equal(model(x, t, labels).sample, reference(x, t, labels).sample)


def test_model_cpu_offload_hooks_every_network_and_keeps_samples():
    def pipeline():
        guide = tiny_unet(num_class_embeds=None)
        return EDM2Pipeline(unet=tiny_unet(), scheduler=EDMEulerScheduler(), guide_unet=guide)

    def sample(pipe):
        generator = torch.Generator().manual_seed(0)
        return pipe(class_labels=1, num_inference_steps=2, guidance_scale=2.0, output_type="latent",
                    generator=generator).images  # fmt: skip

    offloaded = pipeline()
    assert offloaded.model_cpu_offload_seq.split("->") == ["guide_unet", "unet", "vae"]
    offloaded.enable_model_cpu_offload(device="cpu")
    assert hasattr(offloaded.unet, "_hf_hook") and hasattr(offloaded.guide_unet, "_hf_hook")
    assert torch.equal(sample(offloaded), sample(pipeline()))
