"""EDMHeunScheduler against the EDM sampler equations, an exact ODE solution, and diffusers' EDM schedulers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import EDMDPMSolverMultistepScheduler, EDMEulerScheduler
from scipy.integrate import solve_ivp

from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._gaussian_mixture import GaussianMixture, MixtureNetwork, run_scheduler


def reference_edm_sampler(
    denoise,
    x0_noise,
    generator,
    num_steps,
    smin=0.002,
    smax=80.0,
    rho=7.0,
    S_churn=0.0,
    S_min=0.0,
    S_max=math.inf,
    S_noise=1.0,
):
    """EDM Algorithm 2 written out step by step (float64), with the denoiser D called directly."""
    i = np.arange(num_steps)
    t = (smax ** (1 / rho) + i / (num_steps - 1) * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho
    t = np.append(t, 0.0)
    x = x0_noise.double() * t[0]
    nfe = 0
    for n in range(num_steps):
        gamma = min(S_churn / num_steps, math.sqrt(2) - 1) if S_min <= t[n] <= S_max else 0.0
        t_hat = t[n] + gamma * t[n]
        if gamma > 0:
            eps = torch.randn(x.shape, generator=generator, dtype=torch.float32).double()
            x = x + math.sqrt(t_hat**2 - t[n] ** 2) * S_noise * eps
        d = (x - denoise(x, t_hat)) / t_hat
        nfe += 1
        x_next = x + (t[n + 1] - t_hat) * d
        if n < num_steps - 1:
            d_prime = (x_next - denoise(x_next, t[n + 1])) / t[n + 1]
            nfe += 1
            x_next = x + (t[n + 1] - t_hat) * (0.5 * d + 0.5 * d_prime)
        x = x_next
    return x, nfe


@pytest.fixture(scope="module")
def mixture():
    return GaussianMixture.default(dim=2)


def test_deterministic_sampler_equals_reference_equations(mixture):
    noise = torch.randn(64, 2, generator=torch.Generator().manual_seed(1))
    expected, nfe = reference_edm_sampler(mixture.denoise, noise, None, num_steps=12)
    scheduler = EDMHeunScheduler()
    network = MixtureNetwork(mixture)
    got = run_scheduler(scheduler, network, noise * scheduler.init_noise_sigma, 12)
    assert scheduler.init_noise_sigma == 80.0
    assert network.calls == nfe == 23 == len(scheduler.timesteps)
    # float32 sampler against the float64 equations: rounding at |x| ~ 80 (an ulp is 7.6e-6) is contracted as
    # sigma falls, 6.6e-7 measured at the end (values up to 1.5)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_churn_sampler_equals_reference_equations_under_fixed_generator(mixture):
    churn = dict(S_churn=40.0, S_min=0.05, S_max=50.0, S_noise=1.003)  # EDM's ImageNet-64 settings
    noise = torch.randn(64, 2, generator=torch.Generator().manual_seed(2))
    expected, _ = reference_edm_sampler(mixture.denoise, noise, torch.Generator().manual_seed(7), 16, **churn)
    scheduler = EDMHeunScheduler(**churn)
    got = run_scheduler(
        scheduler,
        MixtureNetwork(mixture),
        noise * scheduler.init_noise_sigma,
        16,
        generator=torch.Generator().manual_seed(7),
    )
    deterministic = run_scheduler(EDMHeunScheduler(), MixtureNetwork(mixture), noise * 80.0, 16)
    assert not torch.allclose(got, deterministic, atol=1e-3)  # the churn really acted
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)  # as above: 4.8e-7 measured


def test_churn_at_first_step_matches_reference_in_distribution(mixture):
    """With churn at t_0 the scheduler folds the first churn noise into the initial noise: same law as EDM's x̂_0."""
    churn = dict(S_churn=8.0, S_noise=1.2)
    n = 4000
    ref, _ = reference_edm_sampler(
        mixture.denoise,
        torch.randn(n, 2, generator=torch.Generator().manual_seed(3)),
        torch.Generator().manual_seed(4),
        6,
        **churn,
    )
    scheduler = EDMHeunScheduler(**churn)
    scheduler.set_timesteps(6)
    assert scheduler.init_noise_sigma > 80.0
    start = torch.randn(n, 2, generator=torch.Generator().manual_seed(5)) * scheduler.init_noise_sigma
    got = run_scheduler(scheduler, MixtureNetwork(mixture), start, 6, generator=torch.Generator().manual_seed(6))
    for dim in range(2):  # two-sample Kolmogorov-Smirnov statistic per coordinate
        a, b = np.sort(ref[:, dim].numpy()), np.sort(got[:, dim].double().numpy())
        grid = np.concatenate([a, b])
        ks = np.abs(np.searchsorted(a, grid, "right") / n - np.searchsorted(b, grid, "right") / n).max()
        assert ks < 0.05  # two samples of 4000: P(KS > 0.05) = 2 exp(-2 * 2.24^2) = 9e-5 under the same law


def exact_ode_solution(mixture, x_start, smax=80.0):
    """Probability-flow ODE dx/dsigma = (x - D(x; sigma)) / sigma from smax down to 0, solved very finely."""

    def rhs(sigma, flat):
        x = torch.from_numpy(flat).reshape(x_start.shape)
        return ((x - mixture.denoise(x, sigma)) / sigma).reshape(-1).numpy()

    # 1e-12: far below what it judges (the float32 samplers' rounding alone is ~1e-6)
    sol = solve_ivp(rhs, (smax, 1e-9), x_start.double().reshape(-1).numpy(), method="DOP853", rtol=1e-12, atol=1e-12)
    assert sol.success
    return torch.from_numpy(sol.y[:, -1]).reshape(x_start.shape)


def test_second_order_convergence_and_beats_euler_at_equal_evaluations(mixture):
    x_start = torch.randn(16, 2, generator=torch.Generator().manual_seed(8)) * 80.0
    exact = exact_ode_solution(mixture, x_start)
    steps = [32, 64, 128]  # asymptotic regime: below ~16 steps Euler at equal NFE is as good on this mixture
    heun_err, euler_err = [], []
    for n in steps:
        heun = run_scheduler(EDMHeunScheduler(), MixtureNetwork(mixture), x_start, n)
        euler = run_scheduler(EDMEulerScheduler(), MixtureNetwork(mixture), x_start, 2 * n - 1)  # same NFE
        heun_err.append((heun.double() - exact).abs().max().item())
        euler_err.append((euler.double() - exact).abs().max().item())
    slope = np.polyfit(np.log(steps), np.log(heun_err), 1)[0]
    assert -2.6 < slope < -1.6, (heun_err, slope)  # order 2, +-0.5 for the fit through three step counts
    euler_slope = np.polyfit(np.log(steps), np.log(euler_err), 1)[0]
    assert euler_slope > -1.4, (euler_err, euler_slope)  # first order
    assert all(h < e / 2 for h, e in zip(heun_err, euler_err, strict=True)), (heun_err, euler_err)


def test_schedule_and_preconditioning_match_diffusers_edm_euler():
    heun, euler = EDMHeunScheduler(sigma_max=20.0, rho=5.0), EDMEulerScheduler(sigma_max=20.0, rho=5.0)
    heun.set_timesteps(10)
    euler.set_timesteps(10)
    # Heun evaluates at every Euler timestep, interior ones twice; float32 defaults: this schedule is computed in
    # float64 and rounded, diffusers' in float32 (2.9e-7 relative measured)
    torch.testing.assert_close(heun.timesteps[0::2], euler.timesteps)
    torch.testing.assert_close(heun.timesteps[1::2], euler.timesteps[1:])
    x, f = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    exact = dict(atol=0, rtol=0)  # the same diffusers c-functions on the same sigma
    for k in (0, 5, 9):
        sigma = euler.sigmas[k]
        torch.testing.assert_close(heun.precondition_inputs(x, sigma), euler.precondition_inputs(x, sigma), **exact)
        torch.testing.assert_close(
            heun.precondition_outputs(x, f, sigma), euler.precondition_outputs(x, f, sigma), **exact
        )
        torch.testing.assert_close(heun.precondition_noise(sigma), euler.precondition_noise(sigma), **exact)
    fresh_euler = EDMEulerScheduler(sigma_max=20.0, rho=5.0)
    fresh_euler.set_timesteps(10)
    torch.testing.assert_close(
        heun.scale_model_input(x, heun.timesteps[0]),
        fresh_euler.scale_model_input(x, fresh_euler.timesteps[0]),
        **exact,
    )


def test_exponential_schedule_matches_diffusers_edm_euler():
    heun, euler = EDMHeunScheduler(sigma_schedule="exponential"), EDMEulerScheduler(sigma_schedule="exponential")
    heun.set_timesteps(7)
    euler.set_timesteps(7)
    torch.testing.assert_close(heun.timesteps[0::2], euler.timesteps)  # float32 defaults: float64 schedule, as above


@pytest.mark.parametrize("other_cls", [EDMEulerScheduler, EDMDPMSolverMultistepScheduler])
def test_from_config_interchangeable_with_diffusers_edm_schedulers(other_cls, tmp_path):
    other = other_cls(sigma_min=0.01, sigma_max=40.0, sigma_data=0.6, rho=6.0, prediction_type="v_prediction")
    heun = EDMHeunScheduler.from_config(other.config)
    for key in ("sigma_min", "sigma_max", "sigma_data", "rho", "prediction_type", "sigma_schedule"):
        assert heun.config[key] == other.config[key]
    back = other_cls.from_config(heun.config)
    assert back.config.sigma_max == 40.0 and back.config.sigma_data == 0.6
    heun.save_pretrained(tmp_path)
    loaded = other_cls.from_pretrained(tmp_path)
    assert loaded.config.sigma_min == 0.01 and loaded.config.prediction_type == "v_prediction"
    reloaded = EDMHeunScheduler.from_pretrained(tmp_path)
    assert {k: v for k, v in reloaded.config.items() if not k.startswith("_")} == {
        k: v for k, v in heun.config.items() if not k.startswith("_")
    }
    assert other_cls in heun.compatibles


def test_v_prediction_matches_diffusers_sign_convention():
    heun, euler = EDMHeunScheduler(prediction_type="v_prediction"), EDMEulerScheduler(prediction_type="v_prediction")
    x, f = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2)
    assert torch.equal(heun.precondition_outputs(x, f, 3.0), euler.precondition_outputs(x, f, 3.0))


def test_add_noise_uses_sigma_of_each_timestep():
    heun, euler = EDMHeunScheduler(), EDMEulerScheduler()
    heun.set_timesteps(5)
    euler.set_timesteps(5)
    x, n = torch.randn(3, 1, 2, 2), torch.randn(3, 1, 2, 2)
    t = euler.timesteps[[0, 2, 4]]
    assert torch.equal(heun.add_noise(x, n, t), euler.add_noise(x, n, t))  # the same sigmas at these timesteps


def test_step_index_restarts_on_set_timesteps_and_set_begin_index(mixture):
    scheduler, network = EDMHeunScheduler(), MixtureNetwork(mixture)
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(9)) * 80.0
    first = run_scheduler(scheduler, network, x, 5)
    second = run_scheduler(scheduler, network, x, 5)  # reuse: state must reset
    assert torch.equal(first, second)
    # image-to-image style: start at the third evaluation (an Euler step from t_1)
    scheduler.set_timesteps(5)
    assert scheduler.index_for_timestep(scheduler.timesteps[2]) == 2  # t_1 appears twice: start with the Euler step
    x_mid = torch.randn(4, 2, generator=torch.Generator().manual_seed(10)) * float(scheduler.sigmas[2])
    results = []
    for use_begin_index in (True, False):  # a loop over a slice, with and without set_begin_index
        sliced = EDMHeunScheduler()
        sliced.set_timesteps(5)
        if use_begin_index:
            sliced.set_begin_index(2)
        x = x_mid
        for t in sliced.timesteps[2:]:
            x = sliced.step(network(sliced.scale_model_input(x, t), t), t, x).prev_sample
        results.append(x)
    assert torch.equal(results[0], results[1])


def test_single_step_is_one_euler_step_to_zero(mixture):
    scheduler = EDMHeunScheduler()
    x = torch.randn(4, 2) * 80.0
    got = run_scheduler(scheduler, MixtureNetwork(mixture), x, 1)
    assert len(scheduler.timesteps) == 1
    # x + (0 - t)(x - D)/t = D in float32 cancels |x| ~ 80 (an ulp is 7.6e-6) down to |D| < 0.3: 9.3e-6 measured
    torch.testing.assert_close(got.double(), mixture.denoise(x, 80.0), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma_schedule="linear"), "sigma_schedule"),
        (dict(prediction_type="sample"), "prediction_type"),
        (dict(final_sigmas_type="sigma_min"), "final_sigmas_type"),
        (dict(sigma_min=100.0), "sigma_min"),
        (dict(S_churn=-1.0), "S_churn"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EDMHeunScheduler(**kwargs)


def test_bad_step_inputs_raise():
    scheduler = EDMHeunScheduler()
    with pytest.raises(ValueError, match="num_inference_steps"):
        scheduler.set_timesteps(0)
    scheduler.set_timesteps(4)
    x = torch.randn(1, 1, 2, 2)
    with pytest.raises(ValueError, match="integer index"):
        scheduler.step(x, 0, x)
    with pytest.raises(ValueError, match="not in this scheduler"):
        scheduler.step(x, torch.tensor(12.345), x)
