"""The EDM c-functions: one definition, equal to diffusers' EDMEulerScheduler, traced by dynamo without breaks."""

import pytest
import torch
from diffusers import EDMEulerScheduler

from diffusers_scalelong.edm2 import EDMPreconditioner, LearnedUncertainty, edm_precondition
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.schedulers import EDMHeunScheduler
from diffusers_scalelong.schedulers.edm_preconditioning import edm_c_in, edm_c_noise, edm_c_out, edm_c_skip

SIGMAS = torch.tensor([0.002, 0.05, 0.5, 1.0, 7.3, 80.0])


@pytest.mark.parametrize("sigma_data", [0.5, 1.0])
def test_c_functions_equal_diffusers_edm_euler(sigma_data):
    """Exact: the same float32 operations as diffusers' scheduler, so the same floats."""
    reference = EDMEulerScheduler(sigma_data=sigma_data, prediction_type="epsilon")
    sample, output = torch.randn(2, len(SIGMAS)), torch.randn(2, len(SIGMAS))
    assert torch.equal(edm_c_in(SIGMAS, sigma_data), reference._get_conditioning_c_in(SIGMAS))
    assert torch.equal(edm_c_noise(SIGMAS), reference.precondition_noise(SIGMAS))
    denoised = edm_c_skip(SIGMAS, sigma_data) * sample + edm_c_out(SIGMAS, sigma_data) * output
    assert torch.equal(denoised, reference.precondition_outputs(sample, output, SIGMAS))


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_heun_scheduler_preconditions_as_diffusers(prediction_type):
    ours = EDMHeunScheduler(sigma_data=0.7, prediction_type=prediction_type)
    reference = EDMEulerScheduler(sigma_data=0.7, prediction_type=prediction_type)
    sample, output = torch.randn(len(SIGMAS), 3), torch.randn(len(SIGMAS), 3)
    sigma = SIGMAS[:, None]
    assert torch.equal(ours.precondition_inputs(sample, sigma), reference.precondition_inputs(sample, sigma))
    assert torch.equal(ours.precondition_noise(SIGMAS), reference.precondition_noise(SIGMAS))
    assert torch.equal(ours.precondition_noise(2.0), reference.precondition_noise(2.0))
    assert torch.equal(
        ours.precondition_outputs(sample, output, sigma), reference.precondition_outputs(sample, output, sigma)
    )


def _tiny_unet(**overrides) -> EDM2UNet2DModel:
    config = dict(
        sample_size=8, in_channels=3, model_channels=16, channel_mult=(1,), layers_per_block=1,
        attention_resolutions=(), channels_per_head=8, num_class_embeds=4,
    )  # fmt: skip
    return EDM2UNet2DModel(**{**config, **overrides})


def test_preconditioner_equals_diffusers_preconditioning():
    unet = _tiny_unet().eval()
    with torch.no_grad():
        unet.out_gain.fill_(1.0)  # F = 0 at initialisation would hide c_out
    x, sigma, labels = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 4.0]), torch.tensor([1, 2])
    reference = EDMEulerScheduler(sigma_data=0.5, prediction_type="epsilon")
    s = sigma.reshape(-1, 1, 1, 1)
    with torch.no_grad():
        output = unet(reference.precondition_inputs(x, s), reference.precondition_noise(sigma), labels).sample
        expected = reference.precondition_outputs(x, output, s)
        assert torch.equal(edm_precondition(unet, x, sigma, labels), expected)
        assert torch.equal(EDMPreconditioner(unet)(x, sigma, labels), expected)


def test_preconditioner_traces_to_one_graph_in_training_mode():
    """The EDM2 training module (UNet, preconditioning, learned uncertainty) compiles without graph breaks."""
    model = EDMPreconditioner(_tiny_unet(), LearnedUncertainty(16)).train()
    x, sigma, labels = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 2.0]), torch.tensor([0, 3])
    explanation = torch._dynamo.explain(model)(x, sigma, labels, return_logvar=True)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
