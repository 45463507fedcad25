"""StabilityDiagnostics: recorded quantities against direct computations on the same models."""

import math

import pytest
import torch
from diffusers import UNet2DModel

from diffusers_scalelong.diagnostics import StabilityDiagnostics
from diffusers_scalelong.models import ScaleLongUNet2DModel, UViT2DModel

UNET_CONFIG = dict(
    sample_size=8,
    in_channels=1,
    out_channels=1,
    block_out_channels=(8, 16),
    layers_per_block=1,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    norm_num_groups=4,
    attention_head_dim=4,
)


def _hook_counts(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _recorded_step(model, diagnostics, sample, timesteps, step=0):
    diagnostics.begin_step(step)
    out = model(sample, timesteps).sample
    losses = out.pow(2).flatten(1).mean(1)
    diagnostics.record_loss(losses, timesteps)
    losses.mean().backward()
    diagnostics.record_gradients()
    diagnostics.probe_robustness(sample, timesteps)
    logs = diagnostics.end_step()
    return losses.detach(), logs


def test_skip_norms_show_the_cs_coefficients_and_match_direct_norms():
    vanilla = UNet2DModel(**UNET_CONFIG)
    cs = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method="cs", lsc_kappa=0.5)
    cs.load_state_dict(vanilla.state_dict())
    sample, timesteps = torch.randn(2, 1, 8, 8), torch.tensor([10.0, 900.0])
    conv_in_out = []
    vanilla.conv_in.register_forward_hook(lambda m, a, out: conv_in_out.append(out.detach()))
    _, logs_vanilla = _recorded_step(vanilla, StabilityDiagnostics(vanilla), sample, timesteps)
    _, logs_cs = _recorded_step(cs, StabilityDiagnostics(cs), sample, timesteps)
    # 4 skips: conv_in (i = 1), down0.resnet0, down0.downsampler, down1.resnet0 (i = 4)
    assert {f"skip/{i}/scaled" for i in range(1, 5)} <= logs_cs.keys()
    assert math.isclose(
        logs_vanilla["skip/1/scaled"], conv_in_out[0].flatten(1).norm(dim=1).mean().item(), rel_tol=1e-6
    )
    for i in range(1, 5):
        ratio = logs_cs[f"skip/{i}/scaled"] / logs_vanilla[f"skip/{i}/scaled"]
        assert math.isclose(ratio, 0.5 ** (i - 1), rel_tol=1e-5)
    # the innermost skip is joined with the mid-block output, which CS does not change
    assert math.isclose(logs_cs["skip/4/decoder"], logs_vanilla["skip/4/decoder"], rel_tol=1e-6)
    assert math.isclose(logs_cs["skip/4/decoder"], logs_cs["block/mid"], rel_tol=1e-6)


def test_gradients_loss_bins_and_robustness():
    model = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method="ls")
    diagnostics = StabilityDiagnostics(model, num_train_timesteps=1000, num_noise_bins=2, probe_scale=1e-2, seed=3)
    sample, timesteps = torch.randn(3, 1, 8, 8), torch.tensor([100.0, 200.0, 800.0])
    losses, logs = _recorded_step(model, diagnostics, sample, timesteps)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert math.isclose(logs["grad/global"], torch.cat([g.flatten() for g in grads]).norm().item(), rel_tol=1e-5)
    lsc_grad = torch.cat([p.grad.flatten() for p in model.lsc.parameters()]).norm().item()
    assert math.isclose(logs["grad/lsc"], lsc_grad, rel_tol=1e-5)
    assert math.isclose(logs["loss/bin0"], losses[:2].mean().item(), rel_tol=1e-6)
    assert math.isclose(logs["loss/bin1"], losses[2].item(), rel_tol=1e-6)
    delta = torch.randn(sample.shape, generator=torch.Generator().manual_seed(3)) * 1e-2
    model.eval()
    with torch.no_grad():
        change = model(sample + delta, timesteps).sample - model(sample, timesteps).sample
    ratio = change.flatten(1).norm(dim=1) / delta.flatten(1).norm(dim=1)
    assert math.isclose(logs["robustness/bin0"], ratio[:2].mean().item(), rel_tol=1e-4)
    assert 0.2 < logs["gate/0/mean"] < 0.8 and logs["gate/1/std"] >= 0


def test_only_every_nth_step_is_recorded_and_oscillation_is_summarised():
    model = UViT2DModel(sample_size=8, patch_size=2, in_channels=1, embed_dim=16, depth=4, num_heads=2)
    diagnostics = StabilityDiagnostics(model, every_n_steps=3, window=2)
    sample, timesteps = torch.randn(2, 1, 8, 8), torch.tensor([5.0, 600.0])
    logged = []
    for step in range(7):
        with torch.no_grad():
            recorded = diagnostics.begin_step(step)
            model(sample * (1 + step), timesteps)
            assert bool(diagnostics._pending) == recorded
            logged.append(diagnostics.end_step())
    assert [bool(logs) for logs in logged] == [True, False, False, True, False, False, True]
    assert [step for step, _ in diagnostics.history] == [0, 3, 6]
    steps, values = diagnostics.series("skip/1/scaled")
    std, value_range = StabilityDiagnostics.oscillation(values[-2:])
    assert logged[-1]["osc_std/skip/1/scaled"] == pytest.approx(std)
    assert value_range == pytest.approx(abs(values[2] - values[1])) and std == pytest.approx(value_range / 2**0.5)
    assert diagnostics.summary()["skip/1/scaled"]["osc_range"] == pytest.approx(
        (abs(values[1] - values[0]) + abs(values[2] - values[1])) / 2
    )


def test_gradient_checkpointing_records_the_same_values():
    model = UViT2DModel(sample_size=8, patch_size=2, in_channels=1, embed_dim=16, depth=4, num_heads=2)
    sample, timesteps = torch.randn(2, 1, 8, 8), torch.tensor([5.0, 600.0])
    plain = _recorded_step(model, StabilityDiagnostics(model), sample, timesteps)[1]
    model.zero_grad()
    model.enable_gradient_checkpointing()
    checkpointed = _recorded_step(model, StabilityDiagnostics(model), sample, timesteps)[1]
    assert plain.keys() == checkpointed.keys()
    for key, value in plain.items():
        assert checkpointed[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_detach_removes_only_its_hooks_and_plot_writes_png(tmp_path):
    model = ScaleLongUNet2DModel(**UNET_CONFIG, lsc_method="ls_nonshared")
    before = _hook_counts(model)
    diagnostics = StabilityDiagnostics(model, every_n_steps=1)
    assert _hook_counts(model) > before
    sample, timesteps = torch.randn(2, 1, 8, 8), torch.tensor([5.0, 600.0])
    for step in range(3):
        _recorded_step(model, diagnostics, sample, timesteps, step)
        model.zero_grad()
    path = diagnostics.plot(tmp_path / "curves" / "stability.png", title="tiny")
    with open(path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in (tmp_path / "curves").iterdir()] == ["stability.png"]
    diagnostics.detach()
    assert _hook_counts(model) == before  # the LSC hooks stay


def test_rejects_unsupported_models_and_options():
    with pytest.raises(ValueError, match="neither"):
        StabilityDiagnostics(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="every_n_steps"):
        StabilityDiagnostics(UNet2DModel(**UNET_CONFIG), every_n_steps=0)


def test_logs_to_an_accelerate_tracker(tmp_path):
    from accelerate import Accelerator

    model = UViT2DModel(sample_size=8, patch_size=2, in_channels=1, embed_dim=16, depth=2, num_heads=2)
    diagnostics = StabilityDiagnostics(model, every_n_steps=1)
    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("stability")
    sample, timesteps = torch.randn(2, 1, 8, 8), torch.tensor([5.0, 600.0])
    for step in range(2):
        _, logs = _recorded_step(model, diagnostics, sample, timesteps, step)
        assert logs and all(isinstance(value, float) for value in logs.values())
        accelerator.log(logs, step=step)
    accelerator.end_training()
    assert list((tmp_path / "stability").glob("events.out.tfevents.*"))
