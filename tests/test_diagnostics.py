"""StabilityDiagnostics: recorded quantities against direct computations on the same models."""

import math

import pytest
import torch
from diffusers import UNet2DModel

from diffusers_scalelong.edm2 import EDM2Loss, EDMPreconditioner, LearnedUncertainty
from diffusers_scalelong.models import EDM2UNet2DModel, ScaleLongUNet2DModel, UViT2DModel
from diffusers_scalelong.scalelong import StabilityDiagnostics
from diffusers_scalelong.trainer.compute import make_diagnostics
from tests._tiny_models import TINY_ATTENTION_UNET

UNET_CONFIG = TINY_ATTENTION_UNET


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
    assert logged[-1]["osc_std/skip/1/scaled"] == std  # the same function on the same values
    # pytest.approx defaults (rel 1e-6): the same float64 quantities by other formulas, an ulp apart at most
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
        assert checkpointed[key] == value, key  # checkpointing recomputes the same forward: identical records


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
    with pytest.raises(ValueError, match="not a diffusers UNet"):
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


EDM2_CONFIG = dict(
    sample_size=8, in_channels=1, model_channels=8, channel_mult=(1, 2), layers_per_block=1,
    attention_resolutions=(4,), channels_per_head=8,
)  # fmt: skip


def _edm2_joins(model, sample, c_noise):
    """Replay the skip joins of ``model``'s forward from hooked block outputs: {skip number: (x, skip, kappa)}."""
    outputs, gates = {}, []
    modules = [model.conv_in, *model.encoder_blocks, *model.decoder_blocks]
    handles = [m.register_forward_hook(lambda m, a, out: outputs.__setitem__(m, out.detach())) for m in modules]
    handles += [g.register_forward_hook(lambda m, a, out: gates.append(out.detach())) for g in model.lsc.gates]
    with torch.no_grad():
        model(sample, c_noise)
    for handle in handles:
        handle.remove()
    skips = [outputs[model.conv_in], *(outputs[block] for block in model.encoder_blocks)]
    x, joins = outputs[model.encoder_blocks[-1]], {}
    for block in model.decoder_blocks:
        if block.in_channels != x.shape[1]:  # this block takes the last skip pushed, joined by mp_cat
            skip = skips.pop()
            joins[len(skips) + 1] = (x, skip, gates[len(joins)])
        x = outputs[block]
    return joins


def test_edm2_skip_norms_match_a_manual_mp_cat():
    torch.manual_seed(0)
    model = EDM2UNet2DModel(**EDM2_CONFIG, lsc_method="ls_nonshared")
    with torch.no_grad():
        model.out_gain.fill_(1.0)
        for block in [*model.encoder_blocks, *model.decoder_blocks]:
            block.emb_gain.fill_(0.5)
    model.eval()  # a training-mode forward re-projects the stored weights in place
    sample, c_noise = torch.randn(3, 1, 8, 8), torch.tensor([-1.0, 0.0, 0.5])
    reference = model(sample, c_noise).sample
    diagnostics = StabilityDiagnostics(model)
    diagnostics.begin_step(0)
    assert torch.equal(model(sample, c_noise).sample, reference)  # the hooks only read
    logs = diagnostics.end_step()
    joins = _edm2_joins(model, sample, c_noise)
    assert sorted(joins) == [1, 2, 3, 4]
    t = model.config.concat_balance
    for i, (x, skip, kappa) in joins.items():  # mp_cat's formula written out, with the LS gate kappa [B, C, 1, 1]
        na, nb = x.shape[1], skip.shape[1]
        c = ((na + nb) / ((1 - t) ** 2 + t**2 * kappa.square().mean(dim=1, keepdim=True))).sqrt()
        decoder = (c * (1 - t) / math.sqrt(na) * x).flatten(1).norm(dim=1).mean().item()
        scaled = (c * t * kappa / math.sqrt(nb) * skip).flatten(1).norm(dim=1).mean().item()
        assert math.isclose(logs[f"skip/{i}/decoder"], decoder, rel_tol=1e-5), i
        assert math.isclose(logs[f"skip/{i}/scaled"], scaled, rel_tol=1e-5), i
    assert {f"gate/{g}/mean" for g in range(4)} <= logs.keys()


def test_edm2_cs_shrinks_the_skip_share_by_kappa_powers():
    vanilla = EDM2UNet2DModel(**EDM2_CONFIG)
    cs = EDM2UNet2DModel(**EDM2_CONFIG, lsc_method="cs", lsc_kappa=0.5)
    cs.load_state_dict(vanilla.state_dict())
    sample, c_noise = torch.randn(2, 1, 8, 8), torch.tensor([-1.0, 0.5])
    logs = []
    for model in (vanilla, cs):
        diagnostics = StabilityDiagnostics(model)
        diagnostics.begin_step(0)
        with torch.no_grad():
            model(sample, c_noise)
        logs.append(diagnostics.end_step())
    # the innermost skip (i = 4, kappa^3) joins the same x (block dec1's output) and skip in both models
    width, t = EDM2_CONFIG["model_channels"] * 2, 0.5  # x and skip both have 16 channels there
    for b_scale, model_logs in zip((1.0, 0.5**3), logs, strict=True):
        c = math.sqrt(2 * width / ((1 - t) ** 2 + t**2 * b_scale**2))
        decoder = model_logs["block/dec1"] * c * (1 - t) / math.sqrt(width)
        assert math.isclose(model_logs["skip/4/decoder"], decoder, rel_tol=1e-5)
    ratio_vanilla = logs[0]["skip/4/scaled"] / logs[0]["skip/4/decoder"]
    assert math.isclose(logs[1]["skip/4/scaled"] / logs[1]["skip/4/decoder"], ratio_vanilla * 0.5**3, rel_tol=1e-5)


def test_edm2_training_loop_logs_the_expected_keys():
    torch.manual_seed(0)
    unet = EDM2UNet2DModel(**EDM2_CONFIG, lsc_method="ls")
    denoiser = EDMPreconditioner(unet, LearnedUncertainty(16))
    diagnostics = make_diagnostics(unet, every_n_steps=2)  # what the training script builds
    assert isinstance(diagnostics, StabilityDiagnostics)
    diagnostics.noise_level_edges = torch.tensor([0.0])  # c_noise < 0: sigma < 1
    loss_fn = EDM2Loss(P_mean=-0.4, P_std=1.0)
    optimizer = torch.optim.Adam(denoiser.parameters(), lr=1e-3)
    images, generator, logged = torch.randn(4, 1, 8, 8), torch.Generator().manual_seed(1), []
    for step in range(4):
        diagnostics.begin_step(step)
        sigma = torch.tensor([0.2, 0.5, 2.0, 5.0])
        output = loss_fn(denoiser, images, sigma=sigma, generator=generator)
        diagnostics.record_loss(output.per_sample_loss, sigma.log() / 4)
        output.loss.backward()
        diagnostics.record_gradients()
        diagnostics.probe_robustness(images, sigma.log() / 4)
        optimizer.step()
        optimizer.zero_grad()
        logged.append(diagnostics.end_step())
    assert [bool(logs) for logs in logged] == [True, False, True, False]
    skips = {f"skip/{i}/{part}" for i in range(1, 5) for part in ("scaled", "decoder")}
    blocks = {f"block/enc{k}" for k in range(3)} | {f"block/dec{k}" for k in range(7)}
    gates = {f"gate/{g}/{stat}" for g in range(2) for stat in ("mean", "std")}  # widths 8 and 16 share a gate each
    grads = {"grad/global", "grad/encoder_blocks.0", "grad/decoder_blocks.6", "grad/lsc", "grad/out_gain"}
    rest = {"loss/mean", "loss/bin0", "loss/bin1", "robustness/bin0", "robustness/bin1"}
    assert skips | blocks | gates | grads | rest <= logged[2].keys()
    assert all(math.isfinite(value) for value in logged[2].values())
    assert logged[2]["osc_std/skip/1/scaled"] >= 0
