"""EDM2Pipeline: diffusers' pipeline conformance checks, guidance, VAE latents and bad input."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    DiffusionPipeline,
    EDMDPMSolverMultistepScheduler,
    EDMEulerScheduler,
    ImagePipelineOutput,
)

from diffusers_scalelong.pipelines import EDM2Pipeline, set_edm2_latent_scaling
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._exact import REALIGN_SOURCE, one_thread, realign
from tests._gaussian_mixture import tiny_unet
from tests._tiny_models import TINY_EDM2_UNET

STEPS = 3


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def conditional_pipe():
    return EDM2Pipeline(unet=tiny_unet(num_class_embeds=4), scheduler=EDMHeunScheduler()).to("cpu")


@pytest.fixture
def unconditional_pipe():
    return EDM2Pipeline(unet=tiny_unet(), scheduler=EDMHeunScheduler())


def test_call_signature_has_diffusers_names():
    params = inspect.signature(EDM2Pipeline.__call__).parameters
    for name in (
        "batch_size",
        "class_labels",
        "num_inference_steps",
        "guidance_scale",
        "generator",
        "output_type",
        "return_dict",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "latents",
    ):
        assert name in params
    # guidance_scale=None means the pipeline's default_guidance_scale (1.0 unless set)
    assert params["num_inference_steps"].default == 32 and params["guidance_scale"].default is None
    assert set(inspect.signature(EDM2Pipeline.__init__).parameters) == {
        "self",
        "unet",
        "scheduler",
        "vae",
        "guide_unet",
        "default_guidance_scale",
        "vae_pixel_range",
    }
    assert inspect.signature(EDM2Pipeline.__init__).parameters["default_guidance_scale"].default == 1.0
    assert inspect.signature(EDM2Pipeline.__init__).parameters["vae_pixel_range"].default == "[-1, 1]"


@pytest.mark.parametrize(
    "output_type, kind, shape", [("np", np.ndarray, (2, 8, 8, 1)), ("pt", torch.Tensor, (2, 1, 8, 8))]
)
def test_output_types_and_range(unconditional_pipe, output_type, kind, shape):
    images = unconditional_pipe(
        batch_size=2, num_inference_steps=STEPS, generator=gen(), output_type=output_type
    ).images
    assert isinstance(images, kind) and tuple(images.shape) == shape
    assert images.min() >= 0 and images.max() <= 1
    pil = unconditional_pipe(batch_size=2, num_inference_steps=STEPS, generator=gen(), output_type="pil").images
    assert len(pil) == 2 and pil[0].size == (8, 8) and pil[0].mode == "L"
    # PIL images are round(255 x): half a grey level (0.49 / 255 measured), plus float32 slack
    np.testing.assert_allclose(np.asarray(pil[0]) / 255.0, np.asarray(images[0]).squeeze(), atol=0.5 / 255 + 1e-6)


def test_dict_and_tuple_outputs_identical(conditional_pipe):
    as_dict = conditional_pipe(class_labels=[1, 2], num_inference_steps=STEPS, generator=gen(), output_type="np")
    as_tuple = conditional_pipe(
        class_labels=[1, 2], num_inference_steps=STEPS, generator=gen(), output_type="np", return_dict=False
    )
    assert isinstance(as_dict, ImagePipelineOutput) and isinstance(as_tuple, tuple) and len(as_tuple) == 1
    np.testing.assert_array_equal(as_dict.images, as_tuple[0])


@pytest.mark.parametrize("scheduler_cls", [EDMHeunScheduler, EDMEulerScheduler, EDMDPMSolverMultistepScheduler])
def test_batch_equals_single_with_per_image_generators(scheduler_cls):
    churn = dict(S_churn=5.0) if scheduler_cls is EDMHeunScheduler else {}  # also exercises per-image churn noise
    pipe = EDM2Pipeline(unet=tiny_unet(num_class_embeds=4), scheduler=scheduler_cls(**churn))
    batch = pipe(
        class_labels=[3, 0, 2], num_inference_steps=STEPS, generator=[gen(s) for s in (5, 6, 7)], output_type="pt"
    ).images
    # Exact at equal batch shape: image k keeps its label, generator and place while its batchmates change.
    for k in range(3):
        labels, seeds = [1, 1, 1], [11, 12, 13]
        labels[k], seeds[k] = [3, 0, 2][k], (5, 6, 7)[k]
        mates = pipe(
            class_labels=labels, num_inference_steps=STEPS, generator=[gen(s) for s in seeds], output_type="pt"
        ).images
        assert torch.equal(mates[k], batch[k]) and not torch.equal(mates[k - 1], batch[k - 1])
    for k, (label, seed) in enumerate([(3, 5), (0, 6), (2, 7)]):
        single = pipe(class_labels=label, num_inference_steps=STEPS, generator=[gen(seed)], output_type="pt").images
        # a batch of one runs other conv kernels (chosen per batch shape, last-bit differences), amplified by the
        # sampler: 2.0e-5 measured with churn; diffusers' own tests use 1e-4
        torch.testing.assert_close(batch[k : k + 1], single, atol=1e-4, rtol=1e-4)


def test_class_label_int_applies_to_batch_and_labels_change_output(conditional_pipe):
    same = conditional_pipe(
        batch_size=2, class_labels=1, num_inference_steps=STEPS, generator=gen(), output_type="pt"
    ).images
    listed = conditional_pipe(class_labels=[1, 1], num_inference_steps=STEPS, generator=gen(), output_type="pt").images
    other = conditional_pipe(class_labels=[2, 2], num_inference_steps=STEPS, generator=gen(), output_type="pt").images
    assert torch.equal(same, listed)
    assert not torch.allclose(same, other)


def test_heun_pipeline_costs_2n_minus_1_evaluations(unconditional_pipe):
    calls = []
    unconditional_pipe.unet.register_forward_hook(lambda *args: calls.append(1))
    unconditional_pipe(num_inference_steps=5, generator=gen(), output_type="np")
    assert len(calls) == 9 == unconditional_pipe.num_timesteps


def test_callback_on_step_end_sees_and_replaces_latents(unconditional_pipe):
    seen = []

    def record(pipe, i, t, kwargs):
        seen.append((i, float(t), kwargs["latents"].clone()))
        return kwargs

    out = unconditional_pipe(
        num_inference_steps=STEPS, generator=gen(), output_type="latent", callback_on_step_end=record
    )
    assert [i for i, _, _ in seen] == list(range(2 * STEPS - 1))
    assert [t for _, t, _ in seen] == unconditional_pipe.scheduler.timesteps.tolist()
    assert torch.equal(seen[-1][2], out.images)

    def zero_at_end(pipe, i, t, kwargs):
        return {"latents": torch.zeros_like(kwargs["latents"])} if i == pipe.num_timesteps - 1 else {}

    zeroed = unconditional_pipe(
        num_inference_steps=STEPS, generator=gen(), output_type="pt", callback_on_step_end=zero_at_end
    ).images
    assert torch.equal(zeroed, torch.full_like(zeroed, 0.5))  # latent 0 -> image value 0 / 2 + 0.5, exactly
    with pytest.raises(ValueError, match="callback_on_step_end_tensor_inputs"):
        unconditional_pipe(
            num_inference_steps=STEPS, callback_on_step_end=record, callback_on_step_end_tensor_inputs=["noise_pred"]
        )


def test_to_dtype_float64_matches_float32(conditional_pipe):
    ref = conditional_pipe(class_labels=[0, 3], num_inference_steps=STEPS, generator=gen(), output_type="pt").images
    conditional_pipe.to(torch.float64)
    assert conditional_pipe.dtype == torch.float64 and conditional_pipe.unet.dtype == torch.float64
    got = conditional_pipe(class_labels=[0, 3], num_inference_steps=STEPS, generator=gen(), output_type="pt").images
    # the float32 run's rounding at |x| ~ 80 (an ulp is 7.6e-6) carried through the steps: 1.5e-5 measured
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    conditional_pipe.to(dtype=torch.bfloat16)
    low = conditional_pipe(class_labels=[0, 3], num_inference_steps=STEPS, generator=gen(), output_type="pt").images
    # bfloat16 (8 significant bits) through network and sampler: a coarse bound, 0.1 of the [0, 1] range
    assert torch.isfinite(low).all() and (low - ref).abs().mean() < 0.1


def test_save_load_local_roundtrip_with_optional_components(conditional_pipe, tmp_path):
    guide = tiny_unet(num_class_embeds=4, seed=1)
    pipe = EDM2Pipeline(unet=conditional_pipe.unet, scheduler=EDMHeunScheduler(S_churn=3.0), guide_unet=guide)
    kwargs = dict(class_labels=[2, 1], num_inference_steps=STEPS, guidance_scale=1.5, output_type="pt")
    ref = pipe(generator=gen(), **kwargs).images
    pipe.save_pretrained(tmp_path)
    for loader in (EDM2Pipeline, DiffusionPipeline):
        loaded = loader.from_pretrained(tmp_path)
        assert isinstance(loaded, EDM2Pipeline) and loaded.vae is None
        assert loaded.scheduler.config.S_churn == 3.0
        torch.testing.assert_close(realign(loaded)(generator=gen(), **kwargs).images, ref, rtol=0, atol=0)
    without_guide = tmp_path / "no_guide"
    conditional_pipe.save_pretrained(without_guide)
    assert DiffusionPipeline.from_pretrained(without_guide).guide_unet is None


def test_scheduler_swap_by_from_config(conditional_pipe):
    outputs = {}
    for cls in (EDMHeunScheduler, EDMEulerScheduler, EDMDPMSolverMultistepScheduler):
        conditional_pipe.scheduler = cls.from_config(conditional_pipe.scheduler.config)
        outputs[cls.__name__] = conditional_pipe(
            class_labels=0, num_inference_steps=4, generator=gen(), output_type="pt"
        ).images
        assert torch.isfinite(outputs[cls.__name__]).all()
    assert not torch.allclose(outputs["EDMHeunScheduler"], outputs["EDMEulerScheduler"])


def test_guidance_is_dg_plus_w_times_d_minus_dg():
    """One Euler step from sigma_max to 0 returns D itself, so the output must be linear in w: D_g + w (D - D_g)."""
    unet, guide = tiny_unet(num_class_embeds=4, seed=0), tiny_unet(num_class_embeds=4, seed=1)
    pipe = EDM2Pipeline(unet=unet, scheduler=EDMEulerScheduler(), guide_unet=guide)
    guide_only = EDM2Pipeline(unet=guide, scheduler=EDMEulerScheduler())
    run = dict(class_labels=[1, 3], num_inference_steps=1, output_type="latent")
    d = pipe(generator=gen(), guidance_scale=1.0, **run).images
    d_g = guide_only(generator=gen(), **run).images
    assert torch.equal(pipe(generator=gen(), guidance_scale=0.0, **run).images, d_g)  # D_g + 0 (D - D_g)
    guided = pipe(generator=gen(), guidance_scale=2.5, **run).images
    # each of d, d_g and guided carries float32 rounding at |x| ~ 80 (an ulp is 7.6e-6), weighted 2.5, 1.5 and 1
    # in the combination: up to ~5e-5 (3.8e-5 measured)
    torch.testing.assert_close(guided, d_g + 2.5 * (d - d_g), atol=1e-4, rtol=0)


def test_classifier_free_guidance_with_unconditional_guide():
    pipe = EDM2Pipeline(unet=tiny_unet(num_class_embeds=4), scheduler=EDMHeunScheduler(), guide_unet=tiny_unet(seed=2))
    images = pipe(
        class_labels=[0, 1], num_inference_steps=STEPS, guidance_scale=2.0, generator=gen(), output_type="np"
    ).images
    assert images.shape == (2, 8, 8, 1) and np.isfinite(images).all()


def tiny_vae(latent_channels: int = 4) -> AutoencoderKL:
    torch.manual_seed(3)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=16,
    ).eval()


def test_latent_pipeline_decodes_with_edm2_per_channel_scaling(tmp_path):
    vae = set_edm2_latent_scaling(tiny_vae())
    pipe = EDM2Pipeline(unet=tiny_unet(in_channels=4), scheduler=EDMHeunScheduler(), vae=vae)
    latents = pipe(batch_size=2, num_inference_steps=STEPS, generator=gen(), output_type="latent").images
    images = pipe(batch_size=2, num_inference_steps=STEPS, generator=gen(), output_type="pt").images
    assert images.shape == (2, 3, 16, 16)
    # EDM2's latent scaling: x = z * scale + bias with scale = 0.5 / raw_std, bias = -raw_mean * scale
    raw_mean = torch.tensor([5.81, 3.25, 0.12, -2.15]).reshape(1, 4, 1, 1)
    raw_std = torch.tensor([4.17, 4.62, 3.71, 3.28]).reshape(1, 4, 1, 1)
    scale = 0.5 / raw_std
    bias = -raw_mean * scale
    with torch.no_grad():
        expected = vae.decode((latents - bias) / scale).sample
    # the pipeline unscales with diffusers' latents_mean/std formula, another float32 rounding: 2.1e-7 measured
    torch.testing.assert_close(images, (expected / 2 + 0.5).clamp(0, 1), atol=1e-5, rtol=1e-5)
    pipe.save_pretrained(tmp_path)
    loaded = realign(DiffusionPipeline.from_pretrained(tmp_path))  # see tests/_exact.py
    assert list(loaded.vae.config.latents_std) == [4.17, 4.62, 3.71, 3.28] and loaded.vae.config.scaling_factor == 0.5
    torch.testing.assert_close(
        loaded(batch_size=2, num_inference_steps=STEPS, generator=gen(), output_type="pt").images,
        images,
        atol=0,
        rtol=0,
    )


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: EDM2Pipeline(unet=tiny_unet(), scheduler=DDPMScheduler()), "EDM-family scheduler"),
        (
            lambda: EDM2Pipeline(unet=tiny_unet(in_channels=1), scheduler=EDMHeunScheduler(), vae=tiny_vae(4)),
            "latent_channels",
        ),
        (
            lambda: EDM2Pipeline(unet=tiny_unet(), scheduler=EDMHeunScheduler(), guide_unet=tiny_unet(in_channels=2)),
            "guide_unet.config.in_channels",
        ),
        (lambda: set_edm2_latent_scaling(tiny_vae(2)), "latents_mean and latents_std need 2 values"),
    ],
)
def test_bad_components_raise(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), "class-conditional with 4 classes: pass class_labels"),
        (dict(class_labels=[0, 4]), r"class_labels must lie in \[0, 3\]"),
        (dict(class_labels=-1), r"class_labels must lie in \[0, 3\]"),
        (dict(class_labels=[0.5]), "must be integers"),
        (dict(class_labels=[0, 1], batch_size=3), "2 class_labels for batch_size=3"),
        (dict(class_labels=0, guidance_scale=2.0), "needs a guide network"),
        (dict(class_labels=0, output_type="jpeg"), "output_type"),
        (dict(class_labels=0, num_inference_steps=0), "num_inference_steps"),
        (dict(class_labels=[0, 1], generator=[gen()]), "1 generators for 2 images"),
        (dict(class_labels=0, latents=torch.zeros(1, 1, 4, 4)), "latents must have shape"),
    ],
)
def test_bad_call_input_raises(conditional_pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        conditional_pipe(**kwargs)


def test_class_labels_for_unconditional_unet_raise(unconditional_pipe):
    with pytest.raises(ValueError, match="unconditional"):
        unconditional_pipe(class_labels=[1])


def test_fresh_process_loads_plain_save_pretrained_folder(conditional_pipe, tmp_path):
    conditional_pipe.save_pretrained(tmp_path / "pipe")
    with one_thread():  # the subprocess runs with one thread: same reductions, so the comparison can be exact
        ref = conditional_pipe(class_labels=[2], num_inference_steps=STEPS, generator=gen(4), output_type="np").images
    np.save(tmp_path / "ref.npy", ref)
    script = REALIGN_SOURCE + textwrap.dedent(f"""
        import numpy as np, torch
        import diffusers_scalelong  # registers the plugin's classes for diffusers' loader
        from diffusers import DiffusionPipeline
        pipe = realign(DiffusionPipeline.from_pretrained({str(tmp_path / "pipe")!r}))  # see tests/_exact.py
        assert type(pipe).__name__ == "EDM2Pipeline", type(pipe)
        out = pipe(class_labels=[2], num_inference_steps={STEPS}, generator=torch.Generator().manual_seed(4),
                   output_type="np").images
        np.testing.assert_array_equal(out, np.load({str(tmp_path / "ref.npy")!r}))
        print("LOADED-OK")
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "LOADED-OK" in result.stdout, result.stderr[-3000:]


def tiny_edm2_unet(num_class_embeds=4):
    from diffusers_scalelong.models import EDM2UNet2DModel

    torch.manual_seed(0)
    return EDM2UNet2DModel(**TINY_EDM2_UNET, num_class_embeds=num_class_embeds).eval()


def test_edm2_unet_denoiser_matches_training_preconditioning():
    """One Heun step (a single Euler step to 0) returns D(x; sigma_max) as computed by the training-side wrapper."""
    from diffusers_scalelong.edm2 import edm_precondition

    unet = tiny_edm2_unet()
    pipe = EDM2Pipeline(unet=unet, scheduler=EDMHeunScheduler())
    noise = torch.randn(2, 1, 8, 8, generator=gen(3))
    got = pipe(class_labels=[1, 3], num_inference_steps=1, latents=noise, output_type="latent").images
    with torch.no_grad():
        expected = edm_precondition(unet, noise * 80.0, 80.0, class_labels=torch.tensor([1, 3]))
    # x + (0 - s)(x - D)/s at |x| ~ 80 in float32 (an ulp is 7.6e-6) cancels down to D: 1.7e-5 measured
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("scheduler_cls", [EDMHeunScheduler, EDMEulerScheduler, EDMDPMSolverMultistepScheduler])
def test_edm2_unet_samples_and_reloads_with_each_scheduler(scheduler_cls, tmp_path):
    pipe = EDM2Pipeline(unet=tiny_edm2_unet(), scheduler=scheduler_cls(), guide_unet=tiny_edm2_unet())
    kwargs = dict(class_labels=[0, 3], num_inference_steps=STEPS, guidance_scale=1.4, output_type="np")
    ref = pipe(generator=gen(), **kwargs).images
    pipe.save_pretrained(tmp_path)
    loaded = DiffusionPipeline.from_pretrained(tmp_path)
    assert type(loaded.unet).__name__ == "EDM2UNet2DModel" and isinstance(loaded.scheduler, scheduler_cls)
    np.testing.assert_array_equal(realign(loaded)(generator=gen(), **kwargs).images, ref)  # see tests/_exact.py
