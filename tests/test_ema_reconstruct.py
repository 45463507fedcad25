"""Post-hoc reconstruction (EDM2 Algorithm 3) from real snapshot files, the model folders it writes, and the CLI."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _ema_utils import TinyTraining, flat
from diffusers import UNet2DModel
from safetensors.torch import load_file, save_file
from scipy import integrate
from torch import nn

from diffusers_scalelong.ema import (
    PowerFunctionEMA,
    list_snapshots,
    plan_reconstruction,
    reconstruct_ema,
    save_reconstructed_models,
    sigma_rel_to_gamma,
    solve_profile_coefficients,
)
from diffusers_scalelong.ema.cli import main as cli_main
from diffusers_scalelong.ema.plot import profile_values
from diffusers_scalelong.ema.snapshots import write_snapshot
from tests._tiny_models import TINY_UNET

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 120, 10


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """120 real training steps of a tiny UNet tracking sigma_rel 0.05, 0.10 and 0.075, snapshots every 10 steps;
    the folder `pair` holds only the 0.05 and 0.10 snapshots."""
    root = tmp_path_factory.mktemp("phema")
    run = TinyTraining((0.05, 0.10, 0.075), snapshot_dir=root / "all", snapshot_every=EVERY)
    run.run(1, STEPS)
    (root / "pair").mkdir()
    for info in list_snapshots(root / "all"):
        if info.sigma_rel != 0.075:
            shutil.copy(info.path, root / "pair" / info.path.name)
    return run, root


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its content (to prove that nothing was written)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------- coefficients
def test_coefficients_reproduce_a_stored_profile():
    g05, g10 = sigma_rel_to_gamma(0.05), sigma_rel_to_gamma(0.10)
    times = [100, 200, 300, 400] * 2
    gammas = [g05] * 4 + [g10] * 4
    x, err = solve_profile_coefficients(times, gammas, [300], [g10])
    expected = np.zeros(8)
    expected[6] = 1.0
    # float64 solve of an 8 x 8 Gram system: 1.4e-15 measured, 1e-6 leaves room for its conditioning
    np.testing.assert_allclose(x[:, 0], expected, atol=1e-6)
    assert err[0] < 1e-6  # sqrt of a float64 quadratic form that cancels to ~1e-16: at most ~1e-8 (0.0 measured)


def test_expected_profile_error_matches_numerical_integral():
    """The reported error equals ||sum_i x_i p_i - p_r|| / ||p_r|| integrated numerically."""
    g05, g10, g075 = (sigma_rel_to_gamma(s) for s in (0.05, 0.10, 0.075))
    times = [250, 500, 750, 1000] * 2
    gammas = [g05] * 4 + [g10] * 4
    x, err = solve_profile_coefficients(times, gammas, [1000, 1000], [g075, sigma_rel_to_gamma(0.2)])
    np.testing.assert_allclose(x.sum(axis=0), 1.0, rtol=1e-12)  # float64 sums of 8 coefficients: 2.2e-16 measured

    def p(tau, t, g):
        return (g + 1) * tau**g / t ** (g + 1) if tau <= t else 0.0

    for j, g_target in enumerate((g075, sigma_rel_to_gamma(0.2))):

        def residual2(tau, j=j, g_target=g_target):
            mix = sum(x[i, j] * p(tau, t, g) for i, (t, g) in enumerate(zip(times, gammas, strict=True)))
            return (mix - p(tau, 1000, g_target)) ** 2

        num = integrate.quad(residual2, 0, 1000, points=[250, 500, 750], limit=400)[0]
        den = integrate.quad(lambda tau, g=g_target: p(tau, 1000, g) ** 2, 0, 1000)[0]
        # quad's absolute target 1.5e-8 on num ~ 9e-6 allows ~1e-3 relative on sqrt(num / den); 2.2e-6 measured
        assert err[j] == pytest.approx(np.sqrt(num / den), rel=1e-3)
    assert err[0] < 0.05 < err[1]  # 0.075 lies between the stored profiles, 0.2 far outside


# ------------------------------------------------------------------------------------------- reconstruction
def test_reconstruction_matches_directly_tracked_profile(trained):
    run, root = trained
    (reconstructed,) = reconstruct_ema(root / "pair", [0.075])
    keys = run.ema.averaged_keys
    direct = flat(run.ema.averaged_state_dict(0.075), keys)
    error = flat(reconstructed, keys) - direct
    spread = flat(run.ema.averaged_state_dict(0.05), keys) - flat(run.ema.averaged_state_dict(0.10), keys)
    relative = (error.norm() / direct.norm()).item()
    relative_to_spread = (error.norm() / spread.norm()).item()
    print(
        f"reconstructed 0.075 vs tracked: relative L2 {relative:.2e}, relative to |p05 - p10| {relative_to_spread:.2e}"
    )
    # The stored profiles fit the 0.075 profile only approximately (relative profile error 6e-3), so the weights
    # differ in proportion: 1.6e-5 of the weights and 1.05e-3 of the gap between the two stored averages measured.
    assert relative < 1e-3
    assert relative_to_spread < 0.01  # far below the gap between the two stored profiles
    assert reconstructed.keys() == run.model.state_dict().keys()


def test_reconstruction_at_an_earlier_snapshot_time(trained):
    """Target time 60: snapshots after 60 are excluded; compare with the tracked 0.075 snapshot of step 60."""
    run, root = trained
    plan = plan_reconstruction(root / "pair", [0.075], target_time=60)
    assert max(info.time for info in plan.snapshots) == 60 and len(plan.snapshots) == 12
    reconstructed, in_fp64 = (
        reconstruct_ema(root / "pair", [0.075], 60, accumulate_dtype=a)[0] for a in ("float32", "float64")
    )
    tracked = load_file(root / "all" / "phema-0000000060-0.075.safetensors")
    keys = run.ema.averaged_keys
    # approximate profile fit, as above: 8.8e-5 measured
    assert ((flat(reconstructed, keys) - flat(tracked, keys)).norm() / flat(tracked, keys).norm()).item() < 1e-3
    # float32 accumulation of 12 weighted snapshots: at most ~12 x 6e-8 = 7e-7; 4.7e-8 measured
    assert ((flat(reconstructed, keys) - flat(in_fp64, keys)).norm() / flat(in_fp64, keys).norm()).item() < 1e-6


def test_written_folders_load_with_from_pretrained(trained, tmp_path):
    _, root = trained
    targets = [0.06, 0.075]
    states = reconstruct_ema(root / "pair", targets)
    folders = save_reconstructed_models(root / "pair", tmp_path / "out", targets, dtype="float16")
    assert [f.name for f in folders] == ["phema-0000000120-0.060", "phema-0000000120-0.075"]
    for folder, state, sigma_rel in zip(folders, states, targets, strict=True):
        assert load_file(folder / "diffusion_pytorch_model.safetensors")["conv_in.weight"].dtype == torch.float16
        model = UNet2DModel.from_pretrained(folder, torch_dtype=torch.float16)
        for k, v in model.state_dict().items():
            assert torch.equal(v, state[k].half()), k
        record = json.loads((folder / "phema.json").read_text())
        assert record["sigma_rel"] == sigma_rel and record["time"] == STEPS and record["dtype"] == "float16"
        assert len(record["snapshots"]) == 24
        assert sum(s["coefficient"] for s in record["snapshots"]) == pytest.approx(1.0)  # float64 solve: ~1e-15
    assert sorted(os.listdir(tmp_path / "out")) == [f.name for f in folders]  # no temporary folders left
    with pytest.raises(ValueError, match="already exist"):
        save_reconstructed_models(root / "pair", tmp_path / "out", targets)
    save_reconstructed_models(root / "pair", tmp_path / "out", targets, overwrite=True)
    assert load_file(folders[0] / "diffusion_pytorch_model.safetensors")["conv_in.weight"].dtype == torch.float32


def test_plain_module_written_as_safetensors(tmp_path):
    model = nn.Linear(3, 2)
    ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
    for step in range(1, 41):
        with torch.no_grad():
            model.weight.add_(0.01)
        ema.update(model, step)
        if step % 10 == 0:
            ema.save_snapshots(tmp_path / "snaps", step)
    (folder,) = save_reconstructed_models(tmp_path / "snaps", tmp_path / "out", [0.07])
    state = load_file(folder / "model.safetensors")
    model.load_state_dict(state)  # loads into the plain module
    # the 0.07 and 0.05 averages of a ramp (0.01 per step) lie about a step apart in mean time: 0.0100 measured;
    # 0.05 (five steps) catches a wrong target or a mixed-up snapshot
    assert state["weight"].sub(ema.averages[0]["weight"]).abs().max() < 0.05


# -------------------------------------------------------------------------------------------- bad input
def _write_linear_snapshot(folder, out_features=2, time=10, sigma_rel=0.1, **overrides):
    model = nn.Linear(2, out_features)
    ema = PowerFunctionEMA(model, sigma_rels=(sigma_rel,))
    ema.update(model, time)
    kwargs = dict(
        time=time,
        sigma_rel=sigma_rel,
        gamma=sigma_rel_to_gamma(sigma_rel),
        time_unit="steps",
        copied_keys=[],
        model_class=None,
        model_config=None,
    )
    kwargs.update(overrides)
    return write_snapshot(folder, ema.averaged_state_dict(sigma_rel), **kwargs)


def _corrupt(kind):
    """Return a function that damages a copy of the snapshot folder in the way named by `kind`."""

    def damage(folder: Path):
        first = sorted(folder.iterdir())[0]
        if kind == "truncated":
            first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
        elif kind == "corrupt":
            first.write_bytes(b"\xff" * 64 + first.read_bytes()[64:])
        elif kind == "no metadata":
            save_file({"w": torch.zeros(2)}, folder / "phema-0000000005-0.100.safetensors")
        elif kind == "mixed config":
            other = TinyTraining((0.1,))
            other.model = UNet2DModel(**dict(TINY_UNET, block_out_channels=(8, 8)))
            ema = PowerFunctionEMA(other.model, sigma_rels=(0.15,))
            ema.update(other.model, 30)
            ema.save_snapshots(folder)
        elif kind == "empty":
            for p in folder.iterdir():
                p.unlink()

    return damage


@pytest.mark.parametrize(
    "kind,targets,target_time,match",
    [
        ("none", [0.0], None, "sigma_rel"),
        ("none", [0.075, 0.2887], None, "sigma_rel"),
        ("none", [0.075], 130, "later than the newest snapshot"),
        ("none", [0.075], 65, "no snapshot at target_time=65"),
        ("truncated", [0.075], None, "truncated or corrupt"),
        ("corrupt", [0.075], None, "truncated or corrupt"),
        ("no metadata", [0.075], None, "no 'phema' metadata"),
        ("mixed config", [0.075], None, "different model configs"),
        ("empty", [0.075], None, "no snapshot files"),
    ],
)
def test_bad_input_raises_and_writes_nothing(trained, tmp_path, kind, targets, target_time, match):
    _, root = trained
    snaps = tmp_path / "snaps"
    shutil.copytree(root / "pair", snaps)
    _corrupt(kind)(snaps)
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=match):
        save_reconstructed_models(snaps, tmp_path / "out", targets, target_time)
    assert _tree(tmp_path) == before and not (tmp_path / "out").exists()


def test_mixed_shapes_and_unknown_classes_rejected(tmp_path):
    _write_linear_snapshot(tmp_path / "shapes", out_features=2, time=10)
    _write_linear_snapshot(tmp_path / "shapes", out_features=3, time=20)
    _write_linear_snapshot(tmp_path / "classes", time=10, model_class="builtins.dict", model_config={})
    _write_linear_snapshot(tmp_path / "classes", time=20, model_class="builtins.dict", model_config={})
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="different tensors/shapes"):
        save_reconstructed_models(tmp_path / "shapes", tmp_path / "out", [0.08])
    with pytest.raises(ValueError, match="not from an allowed package"):
        save_reconstructed_models(tmp_path / "classes", tmp_path / "out", [0.08])
    with pytest.raises(ValueError, match="does not exist"):
        save_reconstructed_models(tmp_path / "missing", tmp_path / "out", [0.08])
    assert _tree(tmp_path) == before


def test_plotted_profiles_match_reported_error(trained):
    """The curves in the PNG: integrating (reconstruction - target)^2 on a grid gives the reported error."""
    _, root = trained
    plan = plan_reconstruction(root / "pair", [0.075, 0.2])
    tau = np.linspace(0, plan.target_time, 200_001)
    for j, gamma in enumerate(plan.target_gammas):
        pairs = zip(plan.coefficients[:, j], plan.snapshots, strict=True)
        mix = sum(x * profile_values(tau, info.time, info.gamma) for x, info in pairs)
        target = profile_values(tau, plan.target_time, gamma)
        measured = np.sqrt(np.trapezoid((mix - target) ** 2, tau) / np.trapezoid(target**2, tau))
        # trapezoid rule on 2e5 intervals; the profiles jump to 0 at snapshot times (first-order error ~h/t = 5e-6):
        # 1.0e-5 measured
        assert measured == pytest.approx(plan.relative_errors[j], rel=1e-3)


# ---------------------------------------------------------------------------------------------------- CLI
def _cli(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "training" / "reconstruct_ema.py"), *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )


def test_cli_reconstructs_several_targets(trained, tmp_path):
    _, root = trained
    result = _cli(root / "pair", "--sigma_rel", 0.06, 0.075, "--output_dir", tmp_path / "out", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr
    assert "relative profile error" in result.stdout
    direct = reconstruct_ema(root / "pair", [0.06, 0.075], dtype=torch.bfloat16)
    for sigma_rel, state in zip((0.06, 0.075), direct, strict=True):
        model = UNet2DModel.from_pretrained(tmp_path / "out" / f"phema-0000000120-{sigma_rel:.3f}")
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_cli_dry_run_and_errors(trained, tmp_path, capsys):
    _, root = trained
    argv = [
        str(root / "pair"),
        "--sigma_rel",
        "0.075",
        "--target_step",
        "60",
        "--dry-run",
        "--output_dir",
        str(tmp_path / "o"),
    ]
    assert cli_main(argv + ["--plot", str(tmp_path / "profiles.png")]) == 0
    assert (tmp_path / "profiles.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stdout = capsys.readouterr().out
    assert "target time 60 steps, 12 snapshots" in stdout
    assert "phema-0000000060-0.100.safetensors" in stdout
    assert "phema-0000000070" not in stdout
    assert not (tmp_path / "o").exists()
    # bad input: a clear message and exit status 2, nothing written
    for args, message in [
        (["--sigma_rel", "0.3"], "sigma_rel"),
        (["--sigma_rel", "0.075", "--target_step", "500"], "later than the newest snapshot"),
        (["--sigma_rel", "0.075", "--dtype", "int8"], "dtype"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli_main([str(root / "pair"), *args, "--output_dir", str(tmp_path / "o")])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["output_dir", "plot"])
def test_cli_unwritable_output_is_a_one_line_error(trained, tmp_path, where):
    """An OSError (here: a path under a regular file) ends in one error line and status 2, no traceback.
    A --plot into a missing folder is not an error: the folder is created."""
    _, root = trained
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    outputs = {
        "output_dir": ["--output_dir", blocker / "sub"],
        "plot": ["--output_dir", tmp_path / "out", "--plot", blocker / "plot.png"],
    }[where]
    result = _cli(root / "pair", "--sigma_rel", 0.075, *outputs)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert line.startswith("scalelong-reconstruct-ema: error:")
    assert str(blocker) in line
    assert not (tmp_path / "out").exists()
