"""Official EDM2 network pickles -> EDM2Pipeline, read without running anything from the file.

The pickles are built here the way the official code writes them: a fake ``torch_utils.persistence`` module whose
decorated classes reduce to ``_reconstruct_persistent_obj(meta)`` with ``meta`` holding ``type``, ``version``,
``module_src``, ``class_name`` and ``state``; tensors in float16; a ``dnnlib.util.EasyDict`` at the top. The
embedded module source writes a marker file, so a reader that executed it would leave the marker behind.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, DiffusionPipeline
from test_edm2_convert import CLASSES, HEAD, IMG_CH, RES, official_state_dict, reference_denoiser

from diffusers_scalelong import EDM2Pipeline, EDMPreconditioner
from diffusers_scalelong.convert import UnsafePickleError, load_restricted_pickle
from diffusers_scalelong.convert.cli import edm2_main
from diffusers_scalelong.convert.edm2_official import (
    SOURCE_METADATA,
    from_edm2_pickle,
    preconditioner_from_edm2_pickle,
    read_edm2_pickle,
)
from tests._exact import one_thread, realign

# Latent statistics of a 3-channel latent space (the test network has 3 channels; EDM2's SD-VAE latents have 4).
VAE_MEAN, VAE_STD, FINAL_STD = [5.81, 3.25, 0.12], [4.17, 4.62, 3.71], 0.5


@pytest.fixture
def official(monkeypatch, tmp_path):
    """Fake ``torch_utils.persistence`` and ``dnnlib`` modules; returns a namespace that writes official pickles."""
    marker = tmp_path / "module-source-was-executed"
    persistence = types.ModuleType("torch_utils.persistence")

    def _reconstruct_persistent_obj(meta):  # the official loader would exec(meta["module_src"]) here
        exec(meta["module_src"], {})

    _reconstruct_persistent_obj.__module__ = "torch_utils.persistence"
    _reconstruct_persistent_obj.__qualname__ = "_reconstruct_persistent_obj"
    persistence._reconstruct_persistent_obj = _reconstruct_persistent_obj
    torch_utils = types.ModuleType("torch_utils")
    torch_utils.persistence = persistence
    dnnlib_util = types.ModuleType("dnnlib.util")

    class EasyDict(dict):
        pass

    EasyDict.__module__, EasyDict.__qualname__ = "dnnlib.util", "EasyDict"
    dnnlib_util.EasyDict = EasyDict
    dnnlib = types.ModuleType("dnnlib")
    dnnlib.util, dnnlib.EasyDict = dnnlib_util, EasyDict
    for name, module in [
        ("torch_utils", torch_utils),
        ("torch_utils.persistence", persistence),
        ("dnnlib", dnnlib),
        ("dnnlib.util", dnnlib_util),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    source = f"open({str(marker)!r}, 'w').write('executed')\n"

    class Persistent:
        """Reduces like an official persistent class: (reconstruct function, (meta,), None)."""

        def __reduce__(self):
            fields = list(super().__reduce__())
            meta = dict(type="class", version=6, module_src=source, class_name=type(self).__name__, state=fields[2])
            return (_reconstruct_persistent_obj, (meta,), None)

    def persistent_class(name, base):
        return type(name, (Persistent, base), {"__module__": "_imported_module_fake"})

    ns = types.SimpleNamespace(marker=marker, EasyDict=EasyDict, persistent_class=persistent_class)
    ns.module_classes = {
        n: persistent_class(n, torch.nn.Module) for n in ("Precond", "UNet", "Block", "MPConv", "MPFourier")
    }
    ns.Encoder = persistent_class("StabilityVAEEncoder", object)
    ns.Loss = persistent_class("EDM2Loss", object)
    ns.write = lambda path, **kw: write_official_pickle(ns, path, **kw)
    return ns


def build_network(ns, sd: dict[str, torch.Tensor], label_dim: int) -> torch.nn.Module:
    """A module tree with the official classes, names and recorded attributes holding ``sd`` (in float16)."""
    cls = ns.module_classes

    def module_at(root, path):
        node = root
        for part in path:
            node = node._modules[part]
        return node

    root = cls["Precond"]()
    root.__dict__.update(img_resolution=RES, img_channels=IMG_CH, label_dim=label_dim, use_fp16=True, sigma_data=0.5)
    root._init_kwargs = dict(img_resolution=RES, img_channels=IMG_CH, label_dim=label_dim, model_channels=16)
    root.add_module("unet", cls["UNet"]())
    unet = root.unet
    unet.__dict__.update(label_balance=0.5, concat_balance=0.5)
    unet._init_kwargs = dict(
        img_resolution=RES, img_channels=IMG_CH, label_dim=label_dim, model_channels=16, channel_mult=[1, 2, 3],
        num_blocks=2, attn_resolutions=[8, 4], channels_per_head=HEAD, dropout=0.0,
    )  # fmt: skip
    unet.add_module("enc", torch.nn.ModuleDict())
    unet.add_module("dec", torch.nn.ModuleDict())
    for key, value in sd.items():
        *path, leaf = key.split(".")
        for depth in range(1, len(path) + 1):
            parent, name = module_at(root, path[: depth - 1]), path[depth - 1]
            if name in parent._modules:
                continue
            in_block = parent in (unet.enc, unet.dec) and not name.endswith("_conv")
            kind = "Block" if in_block else "MPFourier" if "fourier" in name else "MPConv"
            parent.add_module(name, cls[kind]())
        module = module_at(root, path)
        tensor = value.to(torch.float16)
        if leaf in ("freqs", "phases"):
            module.register_buffer(leaf, tensor)
        else:
            module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    for container in (unet.enc, unet.dec):
        for block in container.values():
            if isinstance(block, cls["Block"]):
                out = block.conv_res1.weight.shape[0]
                block.__dict__.update(
                    out_channels=out, flavor="enc" if container is unet.enc else "dec",
                    num_heads=out // HEAD if "attn_qkv" in block._modules else 0, resample_filter=[1, 1],
                    dropout=0.0, res_balance=0.3, attn_balance=0.3, clip_act=256,
                )  # fmt: skip
    return root.eval()


def write_official_pickle(ns, path, seed=0, latent=False, conditional=True, uncertainty=True):
    sd = official_state_dict(seed)
    if not conditional:
        del sd["unet.emb_label.weight"]
    if not uncertainty:
        sd = {key: value for key, value in sd.items() if not key.startswith("logvar_")}
    data = ns.EasyDict(dataset_kwargs=ns.EasyDict(class_name="training.dataset.ImageFolderDataset", resolution=RES))
    data["loss_fn"] = ns.Loss()
    data["loss_fn"].__dict__.update(P_mean=-0.4, P_std=1.0, sigma_data=0.5)
    if latent:
        encoder = ns.Encoder()
        scale = np.float32(FINAL_STD) / np.float32(VAE_STD)
        encoder.__dict__.update(vae_name="stabilityai/sd-vae-ft-mse", scale=scale, batch_size=8, _vae=None)
        encoder.bias = np.float32(0) - np.float32(VAE_MEAN) * scale
        encoder._init_kwargs = dict(final_std=FINAL_STD)
        data["encoder"] = encoder
    data["ema"] = build_network(ns, sd, CLASSES if conditional else 0)
    with open(path, "wb") as handle:
        pickle.dump(data, handle)
    return {k: v.to(torch.float16).float() for k, v in sd.items()}


def evaluate(denoiser_fn, official_sd, labels=True):
    x = torch.randn(3, IMG_CH, RES, RES, generator=torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.05, 0.8, 12.0])
    label = torch.tensor([0, 3, 4])
    with torch.no_grad():
        expected, expected_logvar = reference_denoiser(official_sd, x, sigma, label)
        actual, logvar = denoiser_fn(x, sigma, label)
    return actual, expected, logvar, expected_logvar


# ---- the safe reader -------------------------------------------------------------------------------------------
def test_reader_turns_persistent_objects_into_data_without_running_their_source(official, tmp_path):
    path = tmp_path / "network-snapshot-0000512-0.100.pkl"
    official.write(path, latent=True)
    data = load_restricted_pickle(path)
    assert not official.marker.exists()
    assert data["ema"].class_name == "Precond" and data["ema"].version == 6 and len(data["ema"].source_sha256) == 64
    unet = data["ema"]["_modules"]["unet"]
    assert unet["_init_kwargs"]["num_blocks"] == 2 and unet["_modules"]["enc"].class_path.endswith("ModuleDict")
    weight = unet["_modules"]["out_conv"]["_parameters"]["weight"]
    assert weight.dtype == torch.float16 and weight.shape == (IMG_CH, 16, 3, 3)
    np.testing.assert_array_equal(data["encoder"]["scale"], np.float32(FINAL_STD) / np.float32(VAE_STD))
    assert data["dataset_kwargs"].resolution == RES and data["loss_fn"]["P_mean"] == -0.4
    with open(path, "rb") as handle:  # the same file through the ordinary unpickler runs the embedded source
        pickle.load(handle)
    assert official.marker.read_text() == "executed"


@pytest.mark.parametrize(
    "payload, name",
    [
        (lambda marker: (os.system, (f"touch {marker}",)), "system"),
        (lambda marker: (builtins.exec, (f"open({str(marker)!r}, 'w').close()",)), "builtins.exec"),
        (lambda marker: (builtins.eval, (f"open({str(marker)!r}, 'w')",)), "builtins.eval"),
        (lambda marker: (subprocess.run, (["touch", str(marker)],)), "subprocess.run"),
    ],
)
def test_reader_refuses_any_other_global_and_nothing_runs(tmp_path, payload, name):
    marker = tmp_path / "pwned"

    class Malicious:
        def __reduce__(self):
            return payload(marker)

    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({"ema": Malicious()}))
    with pytest.raises(UnsafePickleError, match=name):
        load_restricted_pickle(path)
    assert not marker.exists()
    pickle.loads(path.read_bytes())  # the payload is live: the ordinary unpickler runs it
    assert marker.exists()


def test_reader_refuses_object_arrays_and_persistent_ids(tmp_path):
    path = tmp_path / "objects.pkl"
    path.write_bytes(pickle.dumps({"x": np.array([{"a": 1}], dtype=object)}))
    with pytest.raises(UnsafePickleError, match="object dtype"):
        load_restricted_pickle(path)

    class WithPid(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage" if isinstance(obj, str) and obj == "s" else None

    with open(path, "wb") as handle:
        WithPid(handle).dump(["s"])
    with pytest.raises(UnsafePickleError, match="persistent id"):
        load_restricted_pickle(path)


# ---- network pickle -> models ----------------------------------------------------------------------------------
def test_preconditioner_from_pickle_reproduces_the_reference_network(official, tmp_path):
    path = tmp_path / "edm2-img16-t-0000512-0.100.pkl"
    official_sd = official.write(path)
    denoiser = preconditioner_from_edm2_pickle(path).eval()
    assert denoiser.unet.config.channels_per_head == HEAD and denoiser.unet.config.num_class_embeds == CLASSES
    actual, expected, logvar, expected_logvar = evaluate(
        lambda x, s, y: denoiser(x, s, y, return_logvar=True), official_sd
    )
    # Same float32 weights; the converted UNet uses fused SDPA and cached normalisation, the reference explicit ops.
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    # the uncertainty head has no attention: only the weight normalisation's rounding differs
    torch.testing.assert_close(logvar, expected_logvar, atol=1e-5, rtol=1e-5)
    assert not official.marker.exists()


def test_pipeline_from_pickle_with_guide_samples_like_the_official_guided_sampler(official, tmp_path):
    official_sd = official.write(tmp_path / "net.pkl", seed=0)
    guide_sd = official.write(tmp_path / "guide.pkl", seed=1)  # autoguidance: another conditional network
    pipe = from_edm2_pickle(tmp_path / "net.pkl", guide=tmp_path / "guide.pkl", guidance_scale=1.7)
    assert pipe.config.default_guidance_scale == 1.7 and pipe.guide_unet is not pipe.unet
    with pytest.raises(ValueError, match="default_guidance_scale=1.7 needs a guide_unet"):
        EDM2Pipeline(unet=pipe.unet, scheduler=pipe.scheduler, default_guidance_scale=1.7)
    with pytest.raises(ValueError, match="vae_pixel_range must be one of"):
        EDM2Pipeline(unet=pipe.unet, scheduler=pipe.scheduler, vae_pixel_range="[0, 255]")
    scheduler = pipe.scheduler.config
    assert (scheduler.sigma_min, scheduler.sigma_max, scheduler.rho, scheduler.S_churn) == (0.002, 80.0, 7.0, 0.0)

    # EDM's Heun sampler (no churn) with D = D_g + w (D - D_g), written from the equations on the reference network.
    def guided(x, sigma, labels):
        d = reference_denoiser(official_sd, x, sigma.expand(len(x)), labels)[0]
        d_g = reference_denoiser(guide_sd, x, sigma.expand(len(x)), labels)[0]
        return d_g + 1.7 * (d - d_g)

    steps, rho = 4, 7.0
    i = torch.arange(steps, dtype=torch.float64)
    t = (80 ** (1 / rho) + i / (steps - 1) * (0.002 ** (1 / rho) - 80 ** (1 / rho))) ** rho
    t = torch.cat([t, torch.zeros(1, dtype=torch.float64)]).float()
    noise = torch.randn(2, IMG_CH, RES, RES, generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([1, 4])
    with torch.no_grad():
        x = noise * t[0]
        for k in range(steps):
            d = (x - guided(x, t[k : k + 1], labels)) / t[k]
            x_next = x + (t[k + 1] - t[k]) * d
            if k < steps - 1:
                d2 = (x_next - guided(x_next, t[k + 1 : k + 2], labels)) / t[k + 1]
                x_next = x + (t[k + 1] - t[k]) * (d + d2) / 2
            x = x_next
        out = pipe(class_labels=labels, num_inference_steps=steps, latents=noise, output_type="latent").images
    # Eight network evaluations chain through the sampler; each agrees with the reference to ~1e-5 relative.
    torch.testing.assert_close(out, x, atol=2e-3, rtol=2e-3)
    assert (out - noise * 80).abs().max() > 1  # the sampler moved the sample


def test_unconditional_guide_for_classifier_free_guidance(official, tmp_path):
    official.write(tmp_path / "net.pkl")
    official.write(tmp_path / "uncond.pkl", seed=1, conditional=False)
    pipe = from_edm2_pickle(tmp_path / "net.pkl", guide=tmp_path / "uncond.pkl", guidance_scale=1.4)
    assert pipe.unet.config.num_class_embeds == CLASSES and pipe.guide_unet.config.num_class_embeds is None
    kwargs = dict(class_labels=[1, 2], num_inference_steps=2, output_type="latent")
    guided = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    plain = pipe(generator=torch.Generator().manual_seed(0), guidance_scale=1.0, **kwargs).images
    assert (guided - plain).abs().max() > 1e-2  # the default weight 1.4 is applied when the call gives none
    pipe.save_pretrained(tmp_path / "saved")
    assert EDM2Pipeline.from_pretrained(tmp_path / "saved").config.default_guidance_scale == 1.4


def test_latent_pickle_needs_the_vae_and_keeps_the_encoders_normalisation(official, tmp_path):
    path = tmp_path / "latent.pkl"
    official.write(path, latent=True)
    with pytest.raises(ValueError, match="latent model .*sd-vae-ft-mse.*--vae"):
        from_edm2_pickle(path)

    def tiny_vae(latent_channels):
        return AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8,),
            layers_per_block=1, norm_num_groups=4, sample_size=RES,
        )  # fmt: skip

    with pytest.raises(ValueError, match="latent_channels"):
        from_edm2_pickle(path, vae=tiny_vae(4))
    vae = tiny_vae(IMG_CH)
    vae.save_pretrained(tmp_path / "vae")
    pipe = from_edm2_pickle(path, vae=str(tmp_path / "vae"))
    config = pipe.vae.config
    # float32 scale/bias of the pickle turned back into mean/std: float32 rounding.
    np.testing.assert_allclose(config.latents_mean, VAE_MEAN, rtol=1e-6, atol=1e-6)
    # float32 values written to JSON and read back as float64: within float32 rounding (6e-8 relative)
    np.testing.assert_allclose(config.latents_std, VAE_STD, rtol=1e-6)
    assert config.scaling_factor == FINAL_STD and pipe.config.vae_pixel_range == "[0, 1]"

    # Decoding inverts the official encoder's x = z * scale + bias: z = (x - bias) / scale, and reads the VAE's
    # output as pixels in [0, 1] (the official encoder feeds the VAE pixels / 255).
    kwargs = dict(class_labels=[1, 2], num_inference_steps=2)
    latents = pipe(generator=torch.Generator().manual_seed(0), output_type="latent", **kwargs).images
    images = pipe(generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs).images
    scale = torch.tensor(FINAL_STD / np.float32(VAE_STD)).reshape(1, -1, 1, 1)
    bias = torch.tensor(-np.float32(VAE_MEAN) * (np.float32(FINAL_STD) / np.float32(VAE_STD))).reshape(1, -1, 1, 1)
    with torch.no_grad():
        expected = vae.decode((latents - bias) / scale).sample.clamp(0, 1)
    torch.testing.assert_close(images, expected, atol=1e-5, rtol=1e-5)  # float32 vs float64 statistics
    official.write(tmp_path / "pixel.pkl")
    with pytest.raises(ValueError, match="pixel model"):
        from_edm2_pickle(tmp_path / "pixel.pkl", vae=vae)


def test_cli_writes_a_pipeline_that_loads_with_from_pretrained_and_as_a_preconditioner(official, tmp_path):
    path = tmp_path / "edm2-img16-t-0000512-0.100.pkl"
    official_sd = official.write(path)
    out = tmp_path / "converted"
    assert edm2_main([str(path), "--output_dir", str(out)]) == 0
    assert not official.marker.exists()
    pipe = DiffusionPipeline.from_pretrained(out)
    assert isinstance(pipe, EDM2Pipeline) and pipe.config.default_guidance_scale == 1.0
    api = from_edm2_pickle(path)
    kwargs = dict(class_labels=[0, 4], num_inference_steps=3, output_type="np")
    images = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    np.testing.assert_array_equal(images, api(generator=torch.Generator().manual_seed(0), **kwargs).images)
    assert images.shape == (2, RES, RES, IMG_CH) and 0.01 < images.std()

    denoiser = EDMPreconditioner.from_pretrained(out).eval()
    actual, expected, logvar, expected_logvar = evaluate(
        lambda x, s, y: denoiser(x, s, y, return_logvar=True), official_sd
    )
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)  # as in the test above
    torch.testing.assert_close(logvar, expected_logvar, atol=1e-5, rtol=1e-5)  # as above

    metadata = json.loads((out / SOURCE_METADATA).read_text())
    assert metadata["license"] == "cc-by-nc-sa-4.0" and metadata["source_model"] == path.stem
    assert metadata["source"]["training_kimg"] == 512 and metadata["source"]["ema_sigma_rel"] == 0.1
    assert metadata["source"]["network"]["init_kwargs"]["img_resolution"] == RES
    assert metadata["loss"]["attributes"] == {"P_mean": -0.4, "P_std": 1.0, "sigma_data": 0.5}
    assert metadata["dataset_kwargs"]["resolution"] == RES
    card = (out / "README.md").read_text()
    assert "license: cc-by-nc-sa-4.0" in card and path.name in card and "CC BY-NC-SA 4.0" in card

    with pytest.raises(SystemExit, match="--overwrite"):
        edm2_main([str(path), "--output_dir", str(out)])
    with pytest.raises(SystemExit, match="--guidance 2.0 needs a guide"):
        edm2_main([str(path), "--output_dir", str(tmp_path / "x"), "--guidance", "2.0"])


def test_overwrite_replaces_the_whole_folder_and_a_failed_conversion_keeps_the_old_one(official, tmp_path, capsys):
    old, new = tmp_path / "old.pkl", tmp_path / "new.pkl"
    official.write(old, seed=0)
    new_sd = official.write(new, seed=1, uncertainty=False)
    out = tmp_path / "converted"
    assert edm2_main([str(old), "--output_dir", str(out)]) == 0
    assert (out / "uncertainty").is_dir()
    (out / "notes.txt").write_text("kept by the user")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))

    with pytest.raises(SystemExit) as refused:
        edm2_main([str(new), "--output_dir", str(out)])
    assert refused.value.code == 2 and "--overwrite" in str(refused.value)
    assert capsys.readouterr().err.count("\n") == 1  # one line on stderr
    with pytest.raises(SystemExit) as failed:  # a failing conversion with --overwrite touches nothing
        edm2_main([str(tmp_path / "missing.pkl"), "--output_dir", str(out), "--overwrite"])
    assert failed.value.code == 2 and "missing.pkl" in str(failed.value)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before

    assert edm2_main([str(new), "--output_dir", str(out), "--overwrite"]) == 0
    assert not (out / "uncertainty").exists() and not (out / "notes.txt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left beside it
    denoiser = EDMPreconditioner.from_pretrained(out)
    assert denoiser.uncertainty is None
    # the new network's weights, as stored in the pickle (float16 -> float32), bit for bit
    stored = new_sd["unet.out_conv.weight"]
    assert stored.dtype == torch.float32 and torch.equal(denoiser.unet.conv_out.weight.detach(), stored)
    assert json.loads((out / SOURCE_METADATA).read_text())["source"]["file"] == "new.pkl"


def test_read_edm2_pickle_rejects_a_pickle_without_network(tmp_path):
    path = tmp_path / "empty.pkl"
    path.write_bytes(pickle.dumps({"encoder": None}))
    with pytest.raises(ValueError, match="no 'ema' network"):
        read_edm2_pickle(path)


def test_push_to_local_hub_and_load_by_repo_id(official, local_hub, tmp_path):
    from test_pipeline_hub import run_loader

    path = tmp_path / "edm2-img16-t-0000512-0.100.pkl"
    official.write(path)
    out = tmp_path / "converted"
    edm2_main(
        [str(path), "--output_dir", str(out), "--push_to_hub", "tester/edm2-t", "--hub_endpoint", local_hub.endpoint]
    )
    with one_thread():  # the loader runs in a one-thread process with realigned weights: the result can be exact
        reference = realign(DiffusionPipeline.from_pretrained(out))(
            class_labels=[0, 2], num_inference_steps=2, generator=torch.Generator().manual_seed(1), output_type="np"
        ).images
    np.save(tmp_path / "ref.npy", reference)
    results = run_loader(
        f"""
        report("hub", lambda: DiffusionPipeline.from_pretrained("tester/edm2-t", revision="main",
               trust_remote_code=True), {str(tmp_path / "ref.npy")!r})
        from huggingface_hub import hf_hub_download
        print(json.dumps({{"card": open(hf_hub_download("tester/edm2-t", "README.md")).read()}}))
        """,
        local_hub.env(),
        tmp_path,
    )
    loaded = next(r for r in results if r.get("name") == "hub")
    assert loaded.get("pipeline") == "EDM2Pipeline" and loaded["unet"] == "EDM2UNet2DModel", loaded
    assert loaded["max_diff"] == 0, loaded
    card = next(r["card"] for r in results if "card" in r)
    assert "license: cc-by-nc-sa-4.0" in card and path.name in card and "NVIDIA" in card
