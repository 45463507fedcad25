"""diffusers' generic loaders find this package's classes: AutoModel through ``auto_map`` where a folder asks for it
(``write_auto_model_files``, or a folder an earlier version saved), in a fresh process that never imports the
package; folders of earlier versions load into the classes; scheduler ``compatibles`` in both directions."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from diffusers import AutoModel, EDMDPMSolverMultistepScheduler, EDMEulerScheduler
from safetensors.torch import load_file

from diffusers_scalelong.edm2 import LearnedUncertainty
from diffusers_scalelong.hub import write_auto_model_files
from diffusers_scalelong.hub.cards import INSTALL
from diffusers_scalelong.hub.shims import render_shim
from diffusers_scalelong.models import EDM2UNet2DModel, ScaleLongUNet2DModel, UViT2DModel
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._tiny_models import TINY_EDM2_UNET, TINY_UNET

MODELS = {
    "EDM2UNet2DModel": lambda: EDM2UNet2DModel(**TINY_EDM2_UNET, lsc_method="ls"),
    "ScaleLongUNet2DModel": lambda: ScaleLongUNet2DModel(**TINY_UNET, lsc_method="cs"),
    "UViT2DModel": lambda: UViT2DModel(sample_size=8, patch_size=2, in_channels=1, embed_dim=16, num_heads=2, depth=2),
    "LearnedUncertainty": lambda: LearnedUncertainty(8),
}
SHIM = "diffusers_scalelong_components"


def fresh_process(code: str, cwd) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter that has not imported diffusers_scalelong (diffusers' loaders may import it)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(cwd / "modules")})  # fmt: skip


def public(config) -> dict:
    """JSON values (tuples read back as lists), private keys left out."""
    return json.loads(json.dumps({key: value for key, value in config.items() if not key.startswith("_")}))


def save_as_earlier_versions_did(model, folder) -> None:
    """The folder an earlier version's ``save_pretrained`` wrote: ``auto_map`` and the component shim beside the
    weights (written here by hand, as those versions wrote them)."""
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModel": f"{SHIM}.{type(model).__name__}"}
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / f"{SHIM}.py").write_text(render_shim(SHIM))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_folders_of_earlier_versions_load_and_save_without_auto_map(tmp_path, name, caplog):
    model = MODELS[name]()
    save_as_earlier_versions_did(model, tmp_path / "old")
    reloaded = type(model).from_pretrained(tmp_path / "old")
    assert "auto_map" not in reloaded.config and public(reloaded.config) == public(model.config)
    assert "auto_map" not in caplog.text  # no warning about an unexpected config key
    reloaded.save_pretrained(tmp_path / "new")
    assert "auto_map" not in json.loads((tmp_path / "new" / "config.json").read_text())
    assert not (tmp_path / "new" / f"{SHIM}.py").exists()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_write_auto_model_files_names_the_class(tmp_path, name):
    model = MODELS[name]()
    model.save_pretrained(tmp_path)
    config = write_auto_model_files(tmp_path)
    assert config["auto_map"] == {"AutoModel": f"{SHIM}.{name}"}
    assert json.loads((tmp_path / "config.json").read_text()) == config
    assert f"{name} = _package.{name}" in (tmp_path / f"{SHIM}.py").read_text()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_model_loads_a_plain_folder_once_the_package_is_imported(tmp_path, name):
    """``config.json`` names only the class: diffusers' ``AutoModel`` finds it on the ``diffusers`` module."""
    model = MODELS[name]()
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(str(tmp_path))  # AutoModel takes a str path
    assert type(loaded) is type(model)
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_write_auto_model_files_refuses_other_folders(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        write_auto_model_files(tmp_path)
    from diffusers import UNet2DModel

    UNet2DModel(**TINY_UNET).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds a UNet2DModel, not a model of diffusers_scalelong"):
        write_auto_model_files(tmp_path)


def test_auto_model_loads_the_folders_without_importing_the_package(tmp_path):
    """Both kinds of folder that carry ``auto_map``: written by ``write_auto_model_files`` and by an earlier version."""
    model = MODELS["EDM2UNet2DModel"]()
    model.save_pretrained(tmp_path / "explicit")
    write_auto_model_files(tmp_path / "explicit")
    save_as_earlier_versions_did(model, tmp_path / "earlier")
    result = fresh_process(
        """
        import sys, torch
        from diffusers import AutoModel
        for name in ("explicit", "earlier"):
            try:
                AutoModel.from_pretrained(name)
            except ValueError as error:
                print("UNTRUSTED:", name, error)
            assert "diffusers_scalelong" not in sys.modules
        for name in ("explicit", "earlier"):
            model = AutoModel.from_pretrained(name, trust_remote_code=True)
            print("CLASS:", name, type(model).__module__, type(model).__name__, "auto_map" in model.config)
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{name}.pt")
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = load_file(tmp_path / "explicit" / "diffusion_pytorch_model.safetensors")
    for name in ("explicit", "earlier"):
        assert f"UNTRUSTED: {name}" in result.stdout and "trust_remote_code=True" in result.stdout
        assert f"CLASS: {name} diffusers_scalelong.models.edm2_unet EDM2UNet2DModel False" in result.stdout
        loaded = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_auto_model_without_the_package_gives_the_install_line(tmp_path):
    MODELS["LearnedUncertainty"]().save_pretrained(tmp_path / "uncertainty")
    write_auto_model_files(tmp_path / "uncertainty")
    result = fresh_process(
        f"""
        import sys
        sys.modules["diffusers_scalelong"] = None  # as if it were not installed
        from diffusers import AutoModel
        AutoModel.from_pretrained({str(tmp_path / "uncertainty")!r}, trust_remote_code=True)
        """,
        tmp_path,
    )
    assert result.returncode != 0 and f"Install it with: {INSTALL}" in result.stderr, result.stderr[-2000:]


def test_edm_heun_is_compatible_with_diffusers_edm_schedulers_both_ways():
    for theirs in (EDMEulerScheduler, EDMDPMSolverMultistepScheduler):
        assert EDMHeunScheduler in theirs().compatibles
        assert theirs in EDMHeunScheduler().compatibles
        converted = EDMHeunScheduler.from_config(theirs(sigma_data=0.7).config)
        assert converted.config.sigma_data == 0.7
        assert type(theirs.from_config(converted.config)) is theirs
