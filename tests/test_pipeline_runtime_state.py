"""EDM2Pipeline's runtime state behaves as in diffusers' own pipelines (StableDiffusionPipeline is the reference).

The same callbacks run on a tiny StableDiffusionPipeline and on EDM2Pipeline; network evaluations are counted with
forward hooks: guidance is read from ``pipeline._guidance_scale`` at every step and the guide runs only while the
current scale needs it, ``pipeline._interrupt`` skips the remaining steps, ``num_timesteps`` is set, and a
``PipelineCallback`` receives the tensors its ``tensor_inputs`` name.
"""

import pytest
import torch
from diffusers import AutoencoderKL, DDIMScheduler, EDMEulerScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.callbacks import PipelineCallback, SDCFGCutoffCallback

from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from tests._tiny_models import TINY_CONDITION_UNET, TINY_EDM2_UNET

STEPS = 5


class StopAfter(PipelineCallback):
    """Sets ``pipeline._interrupt`` after step ``cutoff_step_index`` (diffusers' documented interrupt pattern)."""

    tensor_inputs = ["latents"]

    def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
        if step_index == self.config.cutoff_step_index:
            pipeline._interrupt = True
        return callback_kwargs


class GuidanceOffAfter(PipelineCallback):
    """Sets ``pipeline._guidance_scale = 1.0`` after step ``cutoff_step_index`` (EDM2's "no guidance" weight)."""

    tensor_inputs = ["latents"]

    def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
        if step_index == self.config.cutoff_step_index:
            pipeline._guidance_scale = 1.0
        return callback_kwargs


def recorder(names: list[str], received: list[list[str]]) -> PipelineCallback:
    """A callback whose ``tensor_inputs`` are ``names``; it records the keys it is given at every step."""

    class Record(PipelineCallback):
        tensor_inputs = names

        def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
            received.append(sorted(callback_kwargs))
            return callback_kwargs

    return Record()


def count_calls(module: torch.nn.Module) -> list[int]:
    """Batch sizes of the module's forward calls, appended as they happen."""
    batches: list[int] = []
    module.register_forward_hook(lambda mod, args, kwargs, out: batches.append(args[0].shape[0]), with_kwargs=True)
    return batches


def edm2_pipeline(**overrides) -> EDM2Pipeline:
    torch.manual_seed(0)
    unet = EDM2UNet2DModel(**TINY_EDM2_UNET, num_class_embeds=3).eval()
    guide = EDM2UNet2DModel(**TINY_EDM2_UNET).eval()  # unconditional: classifier-free guidance
    for model in (unet, guide):
        with torch.no_grad():
            model.out_gain.fill_(1.0)
    return EDM2Pipeline(unet=unet, scheduler=EDMEulerScheduler(), guide_unet=guide, **overrides)


def sd_pipeline() -> StableDiffusionPipeline:
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**TINY_CONDITION_UNET, cross_attention_dim=8, attention_head_dim=4)
    vae = AutoencoderKL(
        block_out_channels=(8,), norm_num_groups=4, latent_channels=4, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
    )  # fmt: skip
    return StableDiffusionPipeline(
        vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=DDIMScheduler(), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


def run_sd(pipe: StableDiffusionPipeline, callback, guidance_scale: float = 5.0):
    return pipe(
        prompt_embeds=torch.randn(1, 3, 8), negative_prompt_embeds=torch.randn(1, 3, 8), height=8, width=8,
        num_inference_steps=STEPS, guidance_scale=guidance_scale, output_type="latent", callback_on_step_end=callback,
    )  # fmt: skip


def run_edm2(pipe: EDM2Pipeline, callback, guidance_scale: float = 2.0):
    return pipe(
        class_labels=1, num_inference_steps=STEPS, guidance_scale=guidance_scale, output_type="latent",
        callback_on_step_end=callback,
    )  # fmt: skip


def test_guidance_scale_changed_by_a_callback_stops_guide_evaluations():
    sd = sd_pipeline()
    sd_batches = count_calls(sd.unet)
    run_sd(sd, SDCFGCutoffCallback(cutoff_step_ratio=None, cutoff_step_index=0))
    assert sd_batches == [2] + [1] * (STEPS - 1)  # diffusers: the batched guidance pass only at step 0

    pipe = edm2_pipeline()
    unet_calls, guide_calls = count_calls(pipe.unet), count_calls(pipe.guide_unet)
    run_edm2(pipe, GuidanceOffAfter(cutoff_step_ratio=None, cutoff_step_index=0))
    assert (len(unet_calls), len(guide_calls)) == (STEPS, 1)
    assert pipe.guidance_scale == 1.0 and pipe.num_timesteps == STEPS


def test_guidance_cut_off_equals_guidance_then_plain_sampling():
    """After the cut-off the steps are exactly those of an unguided call continued from the same latents."""
    pipe = edm2_pipeline()
    seen = {}

    def cut_and_record(pipeline, i, t, kwargs):
        if i == 0:
            pipeline._guidance_scale = 1.0
            seen["after_step_0"] = kwargs["latents"].clone()
        return kwargs

    cut = run_edm2(pipe, cut_and_record).images
    pipe.scheduler.set_timesteps(STEPS)
    latents = seen["after_step_0"]
    for t in pipe.scheduler.timesteps[1:]:
        model_input = pipe.scheduler.scale_model_input(latents, t)
        output = pipe.unet(model_input, t.expand(1), class_labels=torch.tensor([1])).sample
        latents = pipe.scheduler.step(output, t, latents).prev_sample
    assert torch.equal(cut, latents)


def test_guidance_raised_mid_call_without_guide_is_an_error():
    pipe = EDM2Pipeline(unet=edm2_pipeline().unet, scheduler=EDMEulerScheduler())

    def raise_guidance(pipeline, i, t, kwargs):
        pipeline._guidance_scale = 3.0
        return kwargs

    with pytest.raises(ValueError, match="needs a guide_unet"):
        run_edm2(pipe, raise_guidance, guidance_scale=1.0)


def test_interrupt_skips_the_remaining_steps_like_diffusers():
    sd = sd_pipeline()
    sd_batches = count_calls(sd.unet)
    run_sd(sd, StopAfter(cutoff_step_ratio=None, cutoff_step_index=1))
    pipe = edm2_pipeline()
    unet_calls, guide_calls = count_calls(pipe.unet), count_calls(pipe.guide_unet)
    run_edm2(pipe, StopAfter(cutoff_step_ratio=None, cutoff_step_index=1))
    assert len(sd_batches) == len(unet_calls) == len(guide_calls) == 2
    assert pipe.interrupt and pipe.num_timesteps == STEPS
    run_edm2(pipe, None)  # a new call starts uninterrupted
    assert not pipe.interrupt and len(unet_calls) == 2 + STEPS


def test_callback_tensor_inputs_come_from_the_callback_like_diffusers():
    sd_received: list[list[str]] = []
    run_sd(sd_pipeline(), recorder(["latents", "prompt_embeds"], sd_received))
    received: list[list[str]] = []
    run_edm2(edm2_pipeline(), recorder(["latents", "class_labels"], received))
    assert sd_received == [["latents", "prompt_embeds"]] * STEPS
    assert received == [["class_labels", "latents"]] * STEPS


def test_callback_may_replace_class_labels():
    pipe = edm2_pipeline()
    labels_seen = []

    def switch_class(pipeline, i, t, kwargs):
        labels_seen.append(kwargs["class_labels"].tolist())
        return {"class_labels": torch.full_like(kwargs["class_labels"], 2)}

    pipe(
        class_labels=1, num_inference_steps=STEPS, output_type="latent", callback_on_step_end=switch_class,
        callback_on_step_end_tensor_inputs=["latents", "class_labels"],
    )  # fmt: skip
    assert labels_seen == [[1]] + [[2]] * (STEPS - 1)
    with pytest.raises(ValueError, match="callback_on_step_end_tensor_inputs"):
        run_edm2(pipe, recorder(["noise_pred"], []))
