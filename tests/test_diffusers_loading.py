"""diffusers' generic loaders find this package's classes: AutoModel through ``auto_map`` (in a fresh process that
never imports the package), scheduler ``compatibles`` in both directions."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from diffusers import EDMDPMSolverMultistepScheduler, EDMEulerScheduler
from safetensors.torch import load_file

from diffusers_scalelong.edm2 import LearnedUncertainty
from diffusers_scalelong.hub.cards import INSTALL
from diffusers_scalelong.models import EDM2UNet2DModel, ScaleLongUNet2DModel, UViT2DModel
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._tiny_models import TINY_EDM2_UNET, TINY_UNET

MODELS = {
    "EDM2UNet2DModel": lambda: EDM2UNet2DModel(**TINY_EDM2_UNET, lsc_method="ls"),
    "ScaleLongUNet2DModel": lambda: ScaleLongUNet2DModel(**TINY_UNET, lsc_method="cs"),
    "UViT2DModel": lambda: UViT2DModel(sample_size=8, patch_size=2, in_channels=1, embed_dim=16, num_heads=2, depth=2),
    "LearnedUncertainty": lambda: LearnedUncertainty(8),
}


def fresh_process(code: str, cwd) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter that has not imported diffusers_scalelong (diffusers' loaders may import it)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(cwd / "modules")})  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODELS))
def test_saved_config_names_the_auto_model_class(tmp_path, name):
    model = MODELS[name]()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": f"diffusers_scalelong_components.{name}"}
    assert f"{name} = _package.{name}" in (tmp_path / "diffusers_scalelong_components.py").read_text()
    reloaded = type(model).from_pretrained(tmp_path)

    def public(config) -> dict:  # JSON values (tuples read back as lists), private keys left out
        return json.loads(json.dumps({key: value for key, value in config.items() if not key.startswith("_")}))

    assert "auto_map" not in reloaded.config and public(reloaded.config) == public(model.config)


def test_auto_model_loads_the_folder_without_importing_the_package(tmp_path):
    MODELS["EDM2UNet2DModel"]().save_pretrained(tmp_path / "unet")
    result = fresh_process(
        f"""
        import sys, torch
        from diffusers import AutoModel
        try:
            AutoModel.from_pretrained({str(tmp_path / "unet")!r})
        except ValueError as error:
            print("UNTRUSTED:", error)
        assert "diffusers_scalelong" not in sys.modules
        model = AutoModel.from_pretrained({str(tmp_path / "unet")!r}, trust_remote_code=True)
        print("CLASS:", type(model).__module__, type(model).__name__)
        torch.save({{k: v.clone() for k, v in model.state_dict().items()}}, "state.pt")
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "UNTRUSTED:" in result.stdout and "trust_remote_code=True" in result.stdout
    assert "CLASS: diffusers_scalelong.models.edm2_unet EDM2UNet2DModel" in result.stdout
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    saved = load_file(tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_auto_model_without_the_package_gives_the_install_line(tmp_path):
    MODELS["LearnedUncertainty"]().save_pretrained(tmp_path / "uncertainty")
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
