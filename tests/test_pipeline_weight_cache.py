"""EDM2Pipeline normalises each MPConv weight once per call (not per network evaluation), with the same images."""

from contextlib import nullcontext

import torch

import diffusers_scalelong.pipelines.edm2_pipeline as edm2_pipeline
from diffusers_scalelong.layers import MPConv
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._tiny_models import TINY_EDM2_UNET


def sample_counting_normalisations(monkeypatch, pipe: EDM2Pipeline) -> tuple[torch.Tensor, int]:
    calls = []
    unit_weight = MPConv._unit_weight
    monkeypatch.setattr(MPConv, "_unit_weight", lambda self, *args: calls.append(self) or unit_weight(self, *args))
    images = pipe(batch_size=2, num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="pt")
    monkeypatch.undo()
    return images[0], len(calls)


def test_weights_are_normalised_once_per_call_and_the_images_do_not_change(monkeypatch):
    torch.manual_seed(0)
    unet = EDM2UNet2DModel(**TINY_EDM2_UNET).eval()
    with torch.no_grad():
        unet.out_gain.fill_(0.5)  # non-zero output gain: the images depend on every layer
    pipe = EDM2Pipeline(unet=unet, scheduler=EDMHeunScheduler())
    pipe.set_progress_bar_config(disable=True)
    layers = sum(isinstance(m, MPConv) for m in unet.modules())

    cached_images, cached_count = sample_counting_normalisations(monkeypatch, pipe)
    assert cached_count == layers  # 5 Heun evaluations, one normalisation per layer
    assert all(m._cached_weight is None for m in unet.modules() if isinstance(m, MPConv))  # dropped after the call

    monkeypatch.setattr(edm2_pipeline, "cached_weight_normalization", lambda module: nullcontext())
    plain_images, plain_count = sample_counting_normalisations(monkeypatch, pipe)
    assert plain_count == 5 * layers
    assert torch.equal(cached_images, plain_images)
