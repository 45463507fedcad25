"""PowerFunctionEMA and the sigma_rel <-> gamma map, against the EDM2 equations computed independently."""

import copy
import math
import os
import socket

import numpy as np
import pytest
import torch
from diffusers.training_utils import EMAModel
from scipy import integrate
from torch import nn

from diffusers_scalelong.ema import (
    PowerFunctionEMA,
    gamma_to_sigma_rel,
    profile_inner_products,
    sigma_rel_to_gamma,
    unwrap_model,
)

# Values from the EDM2 paper (two decimals).
PAPER_GAMMAS = {
    0.010: 97.0,
    0.025: 36.99,
    0.050: 16.97,
    0.100: 6.94,
    0.130: 4.60,
    0.150: 3.56,
    0.200: 1.83,
    0.250: 0.72,
}


@pytest.mark.parametrize("sigma_rel,gamma", sorted(PAPER_GAMMAS.items()))
def test_sigma_rel_to_gamma_matches_paper(sigma_rel, gamma):
    g = sigma_rel_to_gamma(sigma_rel)
    assert g == pytest.approx(gamma, abs=0.006)  # the paper rounds to two decimals (97.0: 96.9949), at most 0.0051
    # root of the cubic g^3 + 7g^2 + (16 - s^-2) g + (12 - s^-2)
    s2 = sigma_rel**-2
    # Newton-polished float64 root: residual <= 1.3e-16 of s^-2 g measured; 1e-14 allows ~100 float64 roundings
    assert g**3 + 7 * g**2 + (16 - s2) * g + (12 - s2) == pytest.approx(0.0, abs=1e-14 * s2 * g)
    assert gamma_to_sigma_rel(g) == pytest.approx(sigma_rel, rel=1e-12)  # float64 round trip: 2e-16 measured


@pytest.mark.parametrize("sigma_rel", [0.05, 0.1, 0.25])
def test_sigma_rel_is_relative_std_of_profile(sigma_rel):
    """sigma_rel is the std of the profile p_t(tau) = (g+1) tau^g / t^(g+1) divided by t (numerical integral)."""
    g, t = sigma_rel_to_gamma(sigma_rel), 3.0

    def profile(tau):
        return (g + 1) * tau**g / t ** (g + 1)

    mass = integrate.quad(profile, 0, t)[0]
    mean = integrate.quad(lambda tau: tau * profile(tau), 0, t)[0]
    var = integrate.quad(lambda tau: (tau - mean) ** 2 * profile(tau), 0, t)[0]
    # scipy quad aims at 1.5e-8 relative and reaches 2e-16 (mass) and 4e-15 (std) here; the variance nests two
    # integrals, hence the looser bound
    assert mass == pytest.approx(1.0, rel=1e-9)
    assert math.sqrt(var) / t == pytest.approx(sigma_rel, rel=1e-7)


@pytest.mark.parametrize("bad", [0.0, -0.1, 0.2887, math.sqrt(1 / 12), 0.3, float("nan"), float("inf"), "x"])
def test_bad_sigma_rel_rejected(bad):
    with pytest.raises(ValueError, match="sigma_rel"):
        sigma_rel_to_gamma(bad)
    with pytest.raises(ValueError, match="sigma_rel"):
        PowerFunctionEMA(nn.Linear(2, 2), sigma_rels=(0.05, bad))


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan")])
def test_bad_gamma_rejected(bad):
    with pytest.raises(ValueError, match="gamma"):
        gamma_to_sigma_rel(bad)


def test_profile_inner_products_match_numerical_integral():
    times, gammas = [1.0, 2.5, 4.0], [16.97, 6.94, 0.72]

    def profile(tau, t, g):
        return (g + 1) * tau**g / t ** (g + 1) if tau <= t else 0.0

    closed = profile_inner_products(times, gammas, times, gammas)
    for i, (ti, gi) in enumerate(zip(times, gammas, strict=True)):
        for j, (tj, gj) in enumerate(zip(times, gammas, strict=True)):

            def product(x, ti=ti, gi=gi, tj=tj, gj=gj):
                return profile(x, ti, gi) * profile(x, tj, gj)

            numeric = integrate.quad(product, 0, min(ti, tj), limit=200)[0]
            assert closed[i, j] == pytest.approx(numeric, rel=1e-7)  # quad (target 1.5e-8): 1.2e-11 measured


# ------------------------------------------------------------------------------------------- synthetic tracking
def _track_trajectory(theta, sigma_rels, total, every):
    """Track theta(step) for steps 1..total with an update every `every` steps; returns the averages."""
    param = nn.Parameter(torch.zeros(theta(1).shape, dtype=torch.float32))
    model = nn.ParameterDict({"w": param})
    ema = PowerFunctionEMA(model, sigma_rels=sigma_rels)
    for step in range(every, total + 1, every):
        param.data.copy_(theta(step))
        ema.update(model, step)
    return [ema.averaged_state_dict(s)["w"].double() for s in sigma_rels]


def _sampled_profile_average(theta, gamma, total, every):
    """Independent closed form: integral of p_t over the sample-and-hold trajectory (value at each update time
    held over the interval since the previous update), sum_j theta(t_j) [(t_j/t)^(g+1) - (t_{j-1}/t)^(g+1)]."""
    times = np.arange(every, total + 1, every, dtype=np.float64)
    edges = np.concatenate([[0.0], times]) / total
    weights = np.diff(edges ** (gamma + 1.0))
    values = np.stack([theta(int(t)).double().numpy() for t in times])
    return torch.from_numpy(np.tensordot(weights, values, axes=1))


def test_ramp_example_from_reference():
    """sigma_rel 0.10 EMA of the ramp theta = step, steps 1..20000: the power-function average is
    (g+1)/(g+2) * 20000 = 17762.2 (integral); tracked every 1 and every 100 steps."""
    g = sigma_rel_to_gamma(0.10)
    continuous = (g + 1) / (g + 2) * 20000

    def ramp(step):
        return torch.tensor([float(step)])

    every_1 = _track_trajectory(ramp, (0.10,), 20000, 1)[0].item()
    every_100 = _track_trajectory(ramp, (0.10,), 20000, 100)[0].item()
    # sample-and-hold of the ramp at unit steps (bias dt/2 = 0.5) plus float32 accumulation of 2e4 updates at
    # values ~2e4 (an ulp is 2e-3): 1.2 measured, rel 1e-4 is 1.8
    assert every_1 == pytest.approx(continuous, rel=1e-4)
    assert round(every_1) in (17762, 17763)
    # Every 100 steps sees the ramp only at the update times: the exact average of that sampled trajectory,
    # which is the continuous one plus the sample-and-hold bias of at most dt/2 = 50.
    # float32 tracking of 200 updates against the float64 closed form: 2.7e-7 measured
    assert every_100 == pytest.approx(_sampled_profile_average(ramp, g, 20000, 100).item(), rel=1e-6)
    assert abs(every_100 - continuous) <= 50.0
    # The mistaken rule beta = (1 - 1/(step + 1))^(g+1), applied only every 100 steps, lands near 1465.
    naive = None
    for step in range(100, 20001, 100):
        beta = (1 - 1 / (step + 1)) ** (g + 1)
        naive = float(step) if naive is None else beta * naive + (1 - beta) * step
    assert naive < 2000 < every_100


@pytest.mark.parametrize("every,total", [(1, 10_000), (100, 200_000)])
def test_synthetic_trajectory_matches_closed_form(every, total):
    """A smooth drifting, oscillating trajectory: the tracked averages equal the exact profile-weighted sum of the
    sampled trajectory (1e-5) and the power-function integral of the continuous trajectory (1e-3)."""
    sigma_rels = (0.05, 0.10)
    freqs = [0.5, 1.0, 3.0]

    def value(tau, f):
        x = tau / total
        return 2.0 + math.sin(f * x * 2 * math.pi) + x * f

    def theta(step):
        return torch.tensor([value(step, f) for f in freqs], dtype=torch.float32)

    tracked = _track_trajectory(theta, sigma_rels, total, every)
    for sigma_rel, average in zip(sigma_rels, tracked, strict=True):
        gamma = sigma_rel_to_gamma(sigma_rel)
        # float32 tracking of up to 1e4 updates against float64: rounding walks ~sqrt(1e4) 6e-8 = 6e-6; 7.6e-7 measured
        torch.testing.assert_close(average, _sampled_profile_average(theta, gamma, total, every), rtol=1e-5, atol=0)
        for i, f in enumerate(freqs):

            def weighted(tau, f=f, gamma=gamma):
                return (gamma + 1) * tau**gamma / total ** (gamma + 1) * value(tau, f)

            continuous = integrate.quad(weighted, 0, total, limit=200)[0]
            # deterministic sample-and-hold bias, largest for every=100 (dt = 5e-4 of the span): 7.1e-4 measured
            assert average[i].item() == pytest.approx(continuous, rel=1e-3)


def test_update_rejects_non_increasing_or_bad_time():
    model = nn.Linear(2, 2)
    ema = PowerFunctionEMA(model)
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="step"):
            ema.update(model, bad)
    ema.update(model, 10)
    for bad in (10, 9):
        with pytest.raises(ValueError, match="increase"):
            ema.update(model, bad)
    with pytest.raises(ValueError, match="distinct"):
        PowerFunctionEMA(model, sigma_rels=(0.1, 0.1))


def test_buffers_are_copied_and_parameters_averaged():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ema = PowerFunctionEMA(model, sigma_rels=(0.05,))
    first = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model(torch.randn(8, 3))  # updates BatchNorm running stats and num_batches_tracked
    ema.update(model, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model(torch.randn(8, 3))
    ema.update(model, 2)
    avg = ema.averaged_state_dict(0.05)
    live = model.state_dict()
    assert set(avg) == set(live)
    for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(avg[key], live[key])
    assert avg["1.num_batches_tracked"].dtype == torch.int64
    beta = (1 / 2) ** (sigma_rel_to_gamma(0.05) + 1)  # second update: dt/t = 1/2
    # float32 defaults: beta w + (1 - beta)(w + 1) against w + (1 - beta), a different rounding (6e-8 measured)
    torch.testing.assert_close(avg["0.weight"], first["0.weight"] + (1 - beta) * 1.0)


def test_fp16_model_is_averaged_in_float32():
    model = nn.Linear(4, 4).half()
    ema = PowerFunctionEMA(model, sigma_rels=(0.1,))
    ema.update(model, 1)
    assert ema.averages[0]["weight"].dtype == torch.float32
    assert ema.averaged_state_dict(0.1, dtype=torch.float16)["weight"].dtype == torch.float16


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unwraps_data_parallel_compile_and_ddp():
    base = nn.Linear(3, 2)
    assert unwrap_model(nn.DataParallel(base)) is base
    assert unwrap_model(torch.compile(base)) is base
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        ddp = nn.parallel.DistributedDataParallel(base)
        assert unwrap_model(torch.compile(ddp)) is base
        ema = PowerFunctionEMA(ddp, sigma_rels=(0.05,))
        ema.update(ddp, 1)
        assert set(ema.averaged_state_dict(0.05)) == {"weight", "bias"}  # no "module." prefix
    finally:
        torch.distributed.destroy_process_group()


def test_averaged_model_is_eval_only_copy():
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
    ema.update(model, 1)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model, 2)
    averaged = ema.averaged_model(model, 0.10)
    assert not averaged.training and not any(p.requires_grad for p in averaged.parameters())
    assert torch.equal(averaged[0].weight, ema.averages[1]["0.weight"])
    assert not torch.equal(averaged[0].weight, model[0].weight)
    averaged(torch.randn(2, 3))
    averaged.train()
    with pytest.raises(RuntimeError, match="training mode"):
        averaged(torch.randn(2, 3))
    with pytest.raises(ValueError, match="not tracked"):
        ema.copy_to(model, 0.2)


def test_state_dict_round_trip_through_weights_only_load(tmp_path):
    model = nn.Linear(5, 3)
    ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
    for step in (3, 7):
        with torch.no_grad():
            model.weight.mul_(1.1)
        ema.update(model, step)
    torch.save(ema.state_dict(), tmp_path / "ema.pt")
    restored = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
    restored.load_state_dict(torch.load(tmp_path / "ema.pt", weights_only=True))
    assert restored.last_step == 7 and restored.num_updates == 2
    for s in (0.05, 0.10):
        for k, v in ema.averaged_state_dict(s).items():
            assert torch.equal(restored.averaged_state_dict(s)[k], v)
    with pytest.raises(ValueError, match="sigma_rels"):
        PowerFunctionEMA(model, sigma_rels=(0.05, 0.2)).load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match="shape"):
        PowerFunctionEMA(nn.Linear(5, 4), sigma_rels=(0.05, 0.10)).load_state_dict(ema.state_dict())


def test_composes_with_diffusers_ema_model():
    """Keeping diffusers' EMAModel and PowerFunctionEMA side by side: each gives what it would give alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 1))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    classic = EMAModel(model.parameters(), decay=0.9, use_ema_warmup=False)
    phema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
    alone = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
    expected_classic = [p.detach().clone() for p in model.parameters()]
    data = torch.randn(20, 16, 4)
    for step in range(1, 21):
        opt.zero_grad()
        model(data[step - 1]).pow(2).mean().backward()
        opt.step()
        classic.step(model.parameters())
        phema.update(model, step)
        # reference classic EMA with diffusers' documented decay: min(decay, (1 + n) / (10 + n)), n = step - 1
        n = step - 1
        decay = min(0.9, (1 + n) / (10 + n)) if n > 0 else 0.0
        for e, p in zip(expected_classic, model.parameters(), strict=True):
            e.mul_(decay).add_(p.detach(), alpha=1 - decay)
    # replay the same weights into a tracker that runs alone
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, 21):
        opt.zero_grad()
        model(data[step - 1]).pow(2).mean().backward()
        opt.step()
        alone.update(model, step)
    for s in (0.05, 0.10):
        for k, v in alone.averaged_state_dict(s).items():
            assert torch.equal(phema.averaged_state_dict(s)[k], v)
    for e, c in zip(expected_classic, classic.shadow_params, strict=True):
        # diffusers updates s -= (1 - d)(s - p), the reference s d + (1 - d) p: 20 float32 steps, 1.3e-7 relative
        # measured; atol for entries near 0, where the two forms' rounding is not relative
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


def test_refused_update_and_copy_leave_every_tensor_as_it_was():
    """Validate first, then mutate: a model whose names match but one shape differs changes nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
    ema.update(model, 1)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model, 2)
    before = copy.deepcopy(ema.state_dict())
    other = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))  # last layer: 3 outputs, not 2
    with pytest.raises(ValueError, match=r"2\.weight: \(3, 4\) != \(2, 4\)"):
        ema.update(other, 3)
    after = ema.state_dict()
    assert after["last_step"] == before["last_step"] == 2 and after["num_updates"] == before["num_updates"]
    for old, new in zip(before["averages"], after["averages"], strict=True):
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    assert all(torch.equal(before["copies"][k], v) for k, v in after["copies"].items())
    untouched = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match="other shapes"):
        ema.copy_to(other, 0.05)
    assert all(torch.equal(untouched[k], v) for k, v in other.state_dict().items())
    ema.update(model, 3)  # the tracker still works with the right model
