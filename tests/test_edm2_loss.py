"""EDM preconditioning, EDM2Loss with learned uncertainty and the inverse-sqrt lr schedule, against the equations."""

import math

import pytest
import torch
from diffusers import EDMDPMSolverMultistepScheduler

from diffusers_scalelong.edm2 import EDM2Loss, EDMPreconditioner, LearnedUncertainty, inverse_sqrt_lr_lambda
from diffusers_scalelong.models import EDM2UNet2DModel


def tiny_denoiser(uncertainty: bool = True) -> EDMPreconditioner:
    unet = EDM2UNet2DModel(sample_size=8, in_channels=2, model_channels=8, channel_mult=(1, 2), layers_per_block=1,
                           attention_resolutions=(), channels_per_head=8, num_class_embeds=3)  # fmt: skip
    with torch.no_grad():
        unet.out_gain.fill_(0.7)
    return EDMPreconditioner(unet, LearnedUncertainty(16) if uncertainty else None)


def test_preconditioning_matches_the_edm_equations_and_dpm_solver_helpers():
    denoiser = tiny_denoiser().eval()
    x, sigma, labels = torch.randn(3, 2, 8, 8), torch.tensor([0.01, 0.5, 20.0]), torch.tensor([0, 1, 2])
    s, sd = sigma.reshape(-1, 1, 1, 1), 0.5
    c_in, c_skip, c_out = 1 / (s**2 + sd**2).sqrt(), sd**2 / (s**2 + sd**2), s * sd / (s**2 + sd**2).sqrt()
    with torch.no_grad():
        raw = denoiser.unet(c_in * x, sigma.log() / 4, labels).sample
        denoised = denoiser(x, sigma, labels)
        # exact: the same correctly rounded float32 element-wise operations and the same network call
        torch.testing.assert_close(denoised, c_skip * x + c_out * raw, atol=0, rtol=0)
        # The other diffusers EDM scheduler agrees as well.
        dpm = EDMDPMSolverMultistepScheduler(sigma_data=sd)
        model_input = dpm.precondition_inputs(x, s)
        raw = denoiser.unet(model_input, dpm.precondition_noise(sigma), labels).sample
        torch.testing.assert_close(denoised, dpm.precondition_outputs(x, raw, s), atol=0, rtol=0)
    assert denoised.dtype == torch.float32


def test_loss_matches_a_direct_computation_of_the_formula():
    denoiser = tiny_denoiser()
    images, labels, sigma = torch.randn(4, 2, 8, 8) * 0.5, torch.tensor([0, 1, 2, 0]), torch.tensor([0.1, 0.5, 1, 4.0])
    result = EDM2Loss()(denoiser, images, labels, sigma=sigma, generator=torch.Generator().manual_seed(7))
    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(7))
    s = sigma.reshape(-1, 1, 1, 1)
    weight = (s**2 + 0.25) / (s * 0.5) ** 2
    denoised = denoiser(images + s * noise, sigma, labels)
    logvar = denoiser.uncertainty.linear(denoiser.uncertainty.fourier(sigma.log() / 4)).reshape(-1, 1, 1, 1)
    per_element = weight / logvar.exp() * (denoised - images) ** 2 + logvar
    # float32 defaults (rtol 1.3e-6): sums over 128 pixels reduced in another order (1.4e-7 relative measured), and
    # each training-mode forward re-projects the stored weights, idempotent up to an ulp (1.1e-6 relative on logvar
    # near 0 with ATEN_CPU_CAPABILITY=default)
    torch.testing.assert_close(result.per_sample_loss, per_element.sum(dim=(1, 2, 3)))
    torch.testing.assert_close(result.loss, per_element.sum(dim=(1, 2, 3)).mean())
    torch.testing.assert_close(result.weighted_error, (weight * (denoised - images) ** 2).mean(dim=(1, 2, 3)))
    torch.testing.assert_close(result.logvar, logvar.flatten())
    result.loss.backward()
    assert denoiser.uncertainty.linear.weight.grad is not None and denoiser.unet.out_gain.grad is not None


def test_edm_weight_is_the_inverse_squared_output_scale_so_the_init_loss_is_one_per_pixel():
    """At init F = 0, D = c_skip (y + n) and w E[(D - y)^2] = 1 for data of std sigma_data."""
    denoiser = tiny_denoiser(uncertainty=False)
    with torch.no_grad():
        denoiser.unet.out_gain.zero_()
        images = torch.randn(512, 2, 8, 8) * 0.5
        result = EDM2Loss()(denoiser, images, torch.zeros(512, dtype=torch.long))
    assert torch.count_nonzero(result.logvar) == 0
    # w (D - y)^2 is chi-square(1) per element (variance 2) whatever sigma: the mean of 512 x 128 has std 5.5e-3,
    # so 0.03 (and rel 0.03 on the sum over 128 pixels) is 5.4 std.
    assert result.weighted_error.mean().item() == pytest.approx(1.0, abs=0.03)
    assert result.loss.item() == pytest.approx(128.0, rel=0.03)


def test_sigma_is_log_normal_with_p_mean_and_p_std():
    log_sigma = EDM2Loss(P_mean=-0.8, P_std=1.6).sample_sigma(200_000, generator=torch.Generator().manual_seed(0)).log()
    assert log_sigma.mean().item() == pytest.approx(-0.8, abs=0.02)  # 2e5 samples: std 1.6 / sqrt(2e5) = 3.6e-3
    assert log_sigma.std().item() == pytest.approx(1.6, abs=0.02)  # 2e5 samples: std 1.6 / sqrt(4e5) = 2.5e-3
    with pytest.raises(ValueError, match="P_std"):
        EDM2Loss(P_std=0)


def test_sigma_data_from_the_loss_for_a_wrapped_denoiser():
    # Eval mode: a training-mode forward re-normalises the MP weights in place (forced weight normalisation), so a
    # second call would see weights an ulp away from the first's on some CPU kernel paths.
    denoiser = tiny_denoiser().eval()
    wrapped = torch.nn.Sequential()  # stands in for a data-parallel wrapper: no .sigma_data attribute
    wrapped.forward = denoiser.forward
    images, labels, sigma = torch.randn(2, 2, 8, 8), torch.tensor([0, 1]), torch.tensor([0.3, 3.0])
    expected = EDM2Loss()(denoiser, images, labels, sigma=sigma, generator=torch.Generator().manual_seed(0))
    actual = EDM2Loss(sigma_data=0.5)(wrapped, images, labels, sigma=sigma, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(actual.loss, expected.loss, atol=0, rtol=0)  # the same computation
    with pytest.raises(ValueError, match="needs sigma_data"):
        EDM2Loss()(wrapped, images, labels)
    with pytest.raises(ValueError, match="differs"):
        EDM2Loss(sigma_data=1.0)(denoiser, images, labels)


def test_inverse_sqrt_lr_follows_the_equation_with_lambda_lr():
    lr_lambda = inverse_sqrt_lr_lambda(t_ref=100, warmup_steps=10)
    for step in [0, 5, 10, 50, 100, 400, 10_000]:
        expected = min(step / 10, 1) / math.sqrt(max(step / 100, 1))
        assert lr_lambda(step) == pytest.approx(expected)  # float64, the same equation in another order: an ulp
    assert inverse_sqrt_lr_lambda(t_ref=100)(0) == 1.0
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_lr_lambda(t_ref=4, warmup_steps=2))
    lrs = []
    for _ in range(8):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx(  # float64: base lr times the factor against base / sqrt(...), an ulp apart
        [0, 0.005, 0.01, 0.01, 0.01, 0.01 / math.sqrt(5 / 4), 0.01 / math.sqrt(6 / 4), 0.01 / math.sqrt(7 / 4)]
    )
    with pytest.raises(ValueError, match="t_ref"):
        inverse_sqrt_lr_lambda(t_ref=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        inverse_sqrt_lr_lambda(warmup_steps=-1)
