"""The key-major reconstruction pass: several targets at once, tensors split into blocks of rows, equal to the
coefficient-weighted sum of the snapshot files computed independently."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import diffusers_scalelong.ema.reconstruct as reconstruct
from diffusers_scalelong.ema import PowerFunctionEMA, plan_reconstruction, reconstruct_ema

TARGETS = [0.05, 0.06, 0.075, 0.12]


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    """A linear layer + batch norm walking randomly for 100 steps; float16 snapshots of 0.05 and 0.10 every 20."""
    folder = tmp_path_factory.mktemp("snapshots")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.BatchNorm1d(30), nn.Linear(30, 3))
    ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
    for step in range(1, 101):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=1e-2)
            model[1].running_mean.add_(1.0)
        ema.update(model, step)
        if step % 20 == 0:
            ema.save_snapshots(folder, step, is_main_process=True, dtype=torch.float16)
    return folder


@pytest.mark.parametrize("block_bytes", [reconstruct.STACK_BLOCK_BYTES, 1000])
def test_all_targets_equal_the_weighted_sum_of_the_files(snapshots, monkeypatch, block_bytes):
    """1000 bytes: the 30 x 40 weight of 10 snapshots in float64 is read in blocks of one row (10 x 40 x 8 bytes)."""
    monkeypatch.setattr(reconstruct, "STACK_BLOCK_BYTES", block_bytes)
    plan = plan_reconstruction(snapshots, TARGETS)
    files = [load_file(info.path) for info in plan.snapshots]
    states = reconstruct_ema(snapshots, TARGETS, accumulate_dtype="float64")
    for j, state in enumerate(states):
        assert list(state) == list(plan.snapshots[-1].shapes) and state.keys() == files[-1].keys()
        for key in files[-1]:
            if key in plan.snapshots[-1].copied_keys:  # buffers: the newest snapshot's
                assert torch.equal(state[key], files[-1][key]), key
                continue
            expected = sum(float(x) * f[key].double() for x, f in zip(plan.coefficients[:, j], files, strict=True))
            # float64 sums in another order (~1e-16), then rounded once to float32: at most half an ulp, 6e-8
            torch.testing.assert_close(state[key].double(), expected, rtol=6e-8, atol=1e-15)
