"""ScaleLong long-skip scaling on diffusers conv UNets: invariants against the vanilla diffusers models."""

import copy
import inspect

import numpy as np
import pytest
import torch
from diffusers import DDIMPipeline, DDIMScheduler, DDPMPipeline, DDPMScheduler, UNet2DConditionModel, UNet2DModel
from torch import nn

from diffusers_scalelong.models import ScaleLongUNet2DConditionModel, ScaleLongUNet2DModel
from diffusers_scalelong.scalelong import ChannelGate, apply_lsc, lsc_coefficients, remove_lsc
from tests._exact import realign
from tests._tiny_models import TINY_ATTENTION_UNET, TINY_CONDITION_UNET

UNET_CONFIG = dict(TINY_ATTENTION_UNET, layers_per_block=2)
COND_CONFIG = dict(TINY_CONDITION_UNET, cross_attention_dim=8, attention_head_dim=2)
# Skips of UNET_CONFIG in production order (outermost first): conv_in, down0.resnet0, down0.resnet1,
# down0.downsampler, down1.resnet0, down1.resnet1. The outer up block (run last) receives the first three, the inner
# one the last three; coefficients per up block in run order, written out from kappa^(i-1) with kappa = 0.5.
EXPECTED_CS_HALF = [[0.125, 0.0625, 0.03125], [1.0, 0.5, 0.25]]
EXPECTED_CS_STAGE_HALF = [[1.0, 0.5, 0.25], [1.0, 0.5, 0.25]]
EXPECTED_INV_SQRT2 = [[2**-0.5] * 3, [2**-0.5] * 3]


def _inputs(channels=1, batch=2):
    generator = torch.Generator().manual_seed(1)
    sample = torch.randn(batch, channels, 8, 8, generator=generator)
    return sample, torch.tensor([3.0, 700.0])[:batch]


def _vanilla():
    return UNet2DModel(**UNET_CONFIG).eval()


def _scalelong_from(vanilla, cls=ScaleLongUNet2DModel, config=UNET_CONFIG, **lsc):
    model = cls(**config, **lsc).eval()
    missing, unexpected = model.load_state_dict(vanilla.state_dict(), strict=False)
    assert not unexpected and all(key.startswith("lsc.") for key in missing)
    return model


def _scale_skips_by_wrapping(unet, coefficients_per_up_block):
    """Independent reference: wrap each vanilla up block's forward so its skip tensors are multiplied."""
    for block, coefficients in zip(unet.up_blocks, coefficients_per_up_block, strict=True):

        def forward(*args, _original=block.forward, _coefficients=coefficients, **kwargs):
            def scale(skips):
                assert len(skips) == len(_coefficients)
                return tuple(skip * c for skip, c in zip(skips, _coefficients, strict=True))

            if "res_hidden_states_tuple" in kwargs:
                kwargs["res_hidden_states_tuple"] = scale(kwargs["res_hidden_states_tuple"])
            else:
                args = (args[0], scale(args[1]), *args[2:])
            return _original(*args, **kwargs)

        block.forward = forward
    return unet


@pytest.mark.parametrize(
    "parent, child", [(UNet2DModel, ScaleLongUNet2DModel), (UNet2DConditionModel, ScaleLongUNet2DConditionModel)]
)
def test_signature_lists_every_parent_parameter(parent, child):
    parent_params = inspect.signature(parent.__init__).parameters
    child_params = inspect.signature(child.__init__).parameters
    assert set(parent_params) <= set(child_params)
    for name, param in parent_params.items():
        assert child_params[name].default == param.default, name
        assert child_params[name].kind != inspect.Parameter.VAR_KEYWORD
    assert child_params["lsc_method"].default == "none" and child_params["lsc_kappa"].default == 0.5


@pytest.mark.parametrize("lsc", [dict(lsc_method="none"), dict(lsc_method="cs", lsc_kappa=1.0)])
def test_identity_methods_are_bitwise_vanilla(lsc):
    vanilla = _vanilla()
    model = _scalelong_from(vanilla, **lsc)
    sample, timestep = _inputs()
    with torch.no_grad():
        assert torch.equal(model(sample, timestep).sample, vanilla(sample, timestep).sample)


@pytest.mark.parametrize(
    "method, expected",
    [("cs", EXPECTED_CS_HALF), ("cs_stage", EXPECTED_CS_STAGE_HALF), ("inv_sqrt2", EXPECTED_INV_SQRT2)],
)
def test_constant_scaling_equals_scaled_skips_of_vanilla(method, expected):
    vanilla = _vanilla()
    model = _scalelong_from(vanilla, lsc_method=method, lsc_kappa=0.5)
    reference = _scale_skips_by_wrapping(copy.deepcopy(vanilla), expected)
    sample, timestep = _inputs()
    with torch.no_grad():
        out = model(sample, timestep).sample
        assert torch.equal(out, reference(sample, timestep).sample)
        assert not torch.allclose(out, vanilla(sample, timestep).sample)


def test_coefficients_of_twelve_skips():
    """A 4-level UNet with 2 layers per block has 12 skips: CS scales the innermost by kappa^11."""
    coefficients = lsc_coefficients("cs", 12, 0.5)
    assert coefficients[0] == 1.0 and coefficients[-1] == 0.5**11
    stage = lsc_coefficients("cs_stage", 12, 0.5, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    assert stage == [1.0, 0.5, 0.25] * 4


def test_state_dict_keys():
    vanilla_keys = set(_vanilla().state_dict())
    for method in ("none", "inv_sqrt2", "cs", "cs_stage"):
        assert set(ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method=method).state_dict()) == vanilla_keys
    for method, num_gates in (("ls", 2), ("ls_nonshared", 6)):
        keys = set(ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method=method).state_dict())
        extra = keys - vanilla_keys
        assert vanilla_keys <= keys
        assert extra == {
            f"lsc.gates.{g}.{layer}.{p}"
            for g in range(num_gates)
            for layer in ("fc1", "fc2")
            for p in ("weight", "bias")
        }


def test_checkpoints_cross_load_both_ways(tmp_path):
    vanilla = _vanilla()
    vanilla.save_pretrained(tmp_path / "vanilla")
    model = ScaleLongUNet2DModel.from_pretrained(tmp_path / "vanilla", lsc_method="cs", lsc_kappa=0.5)
    assert model.config.lsc_method == "cs" and model.config.lsc_kappa == 0.5
    reference = _scale_skips_by_wrapping(copy.deepcopy(vanilla), EXPECTED_CS_HALF)
    sample, timestep = _inputs()
    with torch.no_grad():
        assert torch.equal(model(sample, timestep).sample, reference(sample, timestep).sample)

    model.save_pretrained(tmp_path / "cs")
    reloaded = ScaleLongUNet2DModel.from_pretrained(tmp_path / "cs")
    assert (reloaded.config.lsc_method, reloaded.config.lsc_kappa) == ("cs", 0.5)
    back = UNet2DModel.from_pretrained(tmp_path / "cs")
    with torch.no_grad():
        assert torch.equal(reloaded(sample, timestep).sample, model(sample, timestep).sample)
        assert torch.equal(back(sample, timestep).sample, vanilla(sample, timestep).sample)


@pytest.mark.parametrize("low_cpu_mem_usage", [True, False])
def test_ls_loads_vanilla_checkpoint_with_initialised_gates(tmp_path, low_cpu_mem_usage):
    _vanilla().save_pretrained(tmp_path)
    model, info = ScaleLongUNet2DModel.from_pretrained(
        tmp_path, lsc_method="ls_nonshared", low_cpu_mem_usage=low_cpu_mem_usage, output_loading_info=True
    )
    assert info["missing_keys"] and all(key.startswith("lsc.gates.") for key in info["missing_keys"])
    for name, param in model.named_parameters():
        assert not param.is_meta, name
        assert torch.isfinite(param).all(), name
    for gate in model.lsc.gates:
        # default nn.Linear init: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), not zeros or garbage
        bound = gate.fc1.in_features**-0.5
        assert 0 < gate.fc1.weight.abs().max() <= bound and gate.fc1.weight.std() > 0
    sample, timestep = _inputs()
    with torch.no_grad():
        gates = [gate(torch.randn(2, gate.num_channels, 4, 4)) for gate in model.lsc.gates]
        assert torch.isfinite(model(sample, timestep).sample).all()
    assert all(((g > 0.2) & (g < 0.8)).all() for g in gates)  # near sigmoid(0) = 0.5 at initialisation


def test_ls_round_trip_keeps_gates(tmp_path):
    model = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method="ls").eval()
    model.save_pretrained(tmp_path)
    reloaded = ScaleLongUNet2DModel.from_pretrained(tmp_path)
    sample, timestep = _inputs()
    with torch.no_grad():
        assert torch.equal(realign(reloaded)(sample, timestep).sample, model(sample, timestep).sample)


def test_ls_channel_gate_is_squeeze_excitation():
    gate = ChannelGate(32, reduction=16)
    skip = torch.randn(3, 32, 5, 7)
    hidden = torch.relu(skip.mean(dim=(2, 3)) @ gate.fc1.weight.T + gate.fc1.bias)
    expected = torch.sigmoid(hidden @ gate.fc2.weight.T + gate.fc2.bias)
    assert gate.fc1.out_features == 2
    assert torch.equal(gate(skip), expected[:, :, None, None])  # the same operations


@pytest.mark.parametrize("method", ["cs", "ls"])
def test_gradient_checkpointing_equivalence(method):
    model = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method=method).train()
    sample, timestep = _inputs()

    def loss_and_grads():
        model.zero_grad()
        loss = model(sample, timestep).sample.pow(2).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads()
    model.enable_gradient_checkpointing()
    loss_ckpt, grads_ckpt = loss_and_grads()
    assert torch.equal(loss, loss_ckpt)  # checkpointing recomputes the same forward
    assert grads.keys() == grads_ckpt.keys()
    if method == "ls":
        assert any(name.startswith("lsc.") for name in grads)
    for name in grads:
        assert torch.equal(grads[name], grads_ckpt[name]), name


@pytest.mark.parametrize("method", ["cs", "ls"])
def test_deepcopy_keeps_scaling_on_the_copy(method):
    model = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method=method).eval()
    clone = copy.deepcopy(model)
    for block in clone.up_blocks:
        hooks = list(block._forward_pre_hooks.values())
        assert len(hooks) == 1 and hooks[0].scaling is clone.lsc
    sample, timestep = _inputs()
    with torch.no_grad():
        assert torch.equal(clone(sample, timestep).sample, model(sample, timestep).sample)
        remove_lsc(clone)  # removing the copy's scaling leaves the original scaled
        assert not torch.allclose(clone(sample, timestep).sample, model(sample, timestep).sample)
        vanilla = UNet2DModel(**UNET_CONFIG).eval()
        vanilla.load_state_dict(clone.state_dict())
        assert torch.equal(clone(sample, timestep).sample, vanilla(sample, timestep).sample)


def test_apply_and_remove_on_a_loaded_vanilla_unet(tmp_path):
    _vanilla().save_pretrained(tmp_path)
    unet = UNet2DModel.from_pretrained(tmp_path).eval()
    keys = set(unet.state_dict())
    sample, timestep = _inputs()
    with torch.no_grad():
        before = unet(sample, timestep).sample
        reference = _scale_skips_by_wrapping(UNet2DModel.from_pretrained(tmp_path).eval(), EXPECTED_CS_HALF)
        apply_lsc(unet, "cs", 0.5)
        assert set(unet.state_dict()) == keys
        assert torch.equal(unet(sample, timestep).sample, reference(sample, timestep).sample)
        apply_lsc(unet, "ls")  # replaces the CS hooks rather than stacking on them
        assert sum(len(b._forward_pre_hooks) for b in unet.up_blocks) == len(unet.up_blocks)
        assert any(k.startswith("lsc.") for k in unet.state_dict())
        remove_lsc(unet)
        assert set(unet.state_dict()) == keys
        assert torch.equal(unet(sample, timestep).sample, before)


def test_apply_lsc_updates_a_scalelong_config():
    model = ScaleLongUNet2DModel(**UNET_CONFIG)
    apply_lsc(model, "cs_stage", 0.8)
    assert (model.config.lsc_method, model.config.lsc_kappa) == ("cs_stage", 0.8)
    remove_lsc(model)
    assert model.config.lsc_method == "none"


def test_compile_fullgraph_without_graph_breaks():
    model = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method="ls").eval()
    sample, timestep = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(sample, timestep).sample, model(sample, timestep).sample)  # eager: same ops


@pytest.mark.slow
@pytest.mark.parametrize("method", ["cs", "ls"])
def test_compile_fullgraph_inductor(method):
    model = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method=method).eval()
    sample, timestep = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        # inductor fuses the element-wise operations and reorders their float32 rounding (outputs ~1)
        assert torch.allclose(compiled(sample, timestep).sample, model(sample, timestep).sample, atol=1e-5)
        compiled(sample + 1, timestep)


@pytest.mark.parametrize("pipeline_cls, scheduler_cls", [(DDPMPipeline, DDPMScheduler), (DDIMPipeline, DDIMScheduler)])
def test_runs_in_unconditional_pipelines(tmp_path, pipeline_cls, scheduler_cls):
    model = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method="cs", lsc_kappa=0.7).eval()  # as from_pretrained returns it
    pipeline = pipeline_cls(unet=model, scheduler=scheduler_cls(num_train_timesteps=50))
    kwargs = dict(batch_size=2, num_inference_steps=2, output_type="np")
    images = pipeline(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert images.shape == (2, 8, 8, 1)
    pipeline.save_pretrained(tmp_path)
    reloaded = pipeline_cls.from_pretrained(tmp_path)
    assert type(reloaded.unet) is ScaleLongUNet2DModel and reloaded.unet.config.lsc_kappa == 0.7
    again = realign(reloaded)(generator=torch.Generator().manual_seed(0), **kwargs).images
    np.testing.assert_array_equal(again, images)  # bit-identical once realigned, see tests/_exact.py


def _controlnet_residuals(unet, sample, timestep, text):
    """Residuals shaped like the UNet's skips and mid output (as a ControlNet would produce)."""
    shapes = []
    handles = [
        block.register_forward_pre_hook(
            lambda m, a, k: shapes.extend(s.shape for s in reversed(k["res_hidden_states_tuple"])), with_kwargs=True
        )
        for block in unet.up_blocks
    ]
    mid_shape = []
    handles.append(unet.mid_block.register_forward_hook(lambda m, a, out: mid_shape.append(out.shape)))
    with torch.no_grad():
        unet(sample, timestep, encoder_hidden_states=text)
    for handle in handles:
        handle.remove()
    generator = torch.Generator().manual_seed(2)
    down = tuple(torch.randn(shape, generator=generator) for shape in reversed(shapes))
    return down, torch.randn(mid_shape[0], generator=generator)


def test_condition_unet_with_cross_attention_and_controlnet_residuals():
    vanilla = UNet2DConditionModel(**COND_CONFIG).eval()
    model = _scalelong_from(vanilla, ScaleLongUNet2DConditionModel, COND_CONFIG, lsc_method="cs", lsc_kappa=0.5)
    # 4 skips: conv_in, down0.resnet0, down0.downsampler, down1.resnet0; inner up block first
    reference = _scale_skips_by_wrapping(copy.deepcopy(vanilla), [[0.25, 0.125], [1.0, 0.5]])
    sample, timestep = _inputs(channels=4)
    text = torch.randn(2, 5, 8)
    down, mid = _controlnet_residuals(vanilla, sample, timestep, text)
    kwargs = dict(encoder_hidden_states=text, down_block_additional_residuals=down, mid_block_additional_residual=mid)
    with torch.no_grad():
        out = model(sample, timestep, **kwargs).sample
        assert torch.equal(out, reference(sample, timestep, **kwargs).sample)
        assert not torch.allclose(out, model(sample, timestep, encoder_hidden_states=text).sample)
        vanilla_out = vanilla(sample, timestep, **kwargs).sample
        none = _scalelong_from(vanilla, ScaleLongUNet2DConditionModel, COND_CONFIG, lsc_method="none")
        assert torch.equal(none(sample, timestep, **kwargs).sample, vanilla_out)
        ls = ScaleLongUNet2DConditionModel(**COND_CONFIG, lsc_method="ls").eval()
        assert ls(sample, timestep, **kwargs).sample.shape == sample.shape


def test_bad_options_raise_value_errors_naming_the_option():
    with pytest.raises(ValueError, match="lsc_method"):
        ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method="constant")
    for kappa in (0, -0.5):
        with pytest.raises(ValueError, match="lsc_kappa"):
            ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method="cs", lsc_kappa=kappa)
    with pytest.raises(ValueError, match="lsc_method"):
        apply_lsc(nn.Sequential(nn.Linear(2, 2)), "ls")


def test_ls_on_a_layout_without_skip_widths_raises():
    unet = _vanilla()
    unet.down_blocks[0].resnets[0] = nn.Identity()  # hides its out_channels: the layout is unknown for LS
    with pytest.raises(ValueError, match="lsc_method='ls'"):
        apply_lsc(unet, "ls")
    apply_lsc(unet, "cs")  # constant scaling only needs the skip count


def test_mismatched_skips_raise_value_errors():
    model = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method="ls")
    hidden = torch.randn(1, 16, 4, 4)
    temb = torch.randn(1, 32)
    with pytest.raises(ValueError, match="mismatched skip"):
        model.up_blocks[0](hidden, (torch.randn(1, 16, 4, 4),), temb)
    wrong_width = tuple(torch.randn(1, 4, 4, 4) for _ in range(3))
    with pytest.raises(ValueError, match="lsc_method LS channel gate"):
        model.up_blocks[0](hidden, wrong_width, temb)


def test_condition_unet_checkpoints_cross_load_both_ways(tmp_path):
    vanilla = UNet2DConditionModel(**COND_CONFIG).eval()
    vanilla.save_pretrained(tmp_path / "vanilla")
    model = ScaleLongUNet2DConditionModel.from_pretrained(tmp_path / "vanilla", lsc_method="inv_sqrt2")
    reference = _scale_skips_by_wrapping(copy.deepcopy(vanilla), [[2**-0.5] * 2] * 2)
    sample, timestep = _inputs(channels=4)
    text = torch.randn(2, 5, 8)
    model.save_pretrained(tmp_path / "scalelong")
    back = UNet2DConditionModel.from_pretrained(tmp_path / "scalelong")
    with torch.no_grad():
        out = model(sample, timestep, encoder_hidden_states=text).sample
        assert torch.equal(out, reference(sample, timestep, encoder_hidden_states=text).sample)
        assert torch.equal(
            back(sample, timestep, encoder_hidden_states=text).sample,
            vanilla(sample, timestep, encoder_hidden_states=text).sample,
        )
