"""One install line, ``pip install diffusers-scalelong``: every card and every Hub shim file gives it, the package
metadata names the project URL the cards link to, and a shim run without the package installed fails with it."""

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from diffusers import EDMEulerScheduler
from huggingface_hub import ModelCardData

from diffusers_scalelong.hub import build_card, model_card, write_hub_layout
from diffusers_scalelong.hub.cards import INSTALL, PROJECT_URL
from diffusers_scalelong.hub.shims import render_shim
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from tests._tiny_models import TINY_EDM2_UNET

ROOT = Path(__file__).resolve().parent.parent
# Run before anything else in the subprocess: an import of the package then fails as if it were not installed.
HIDE_PACKAGE = "import sys; sys.modules['diffusers_scalelong'] = None\n"


def pipeline() -> EDM2Pipeline:
    return EDM2Pipeline(unet=EDM2UNet2DModel(**TINY_EDM2_UNET), scheduler=EDMEulerScheduler())


def test_install_line_names_the_distribution_and_its_metadata_the_project_url():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert INSTALL == f"pip install {project['name']}"
    assert PROJECT_URL in project["urls"].values()


def test_cards_give_the_install_line_and_the_project_url():
    for card in (
        str(model_card(pipeline(), "user/edm2")),
        str(build_card(ModelCardData(), "title", "summary", "code")),
    ):
        assert f"```bash\n{INSTALL}\n```" in card and PROJECT_URL in card


@pytest.mark.parametrize("shim", ["edm2_pipeline", "diffusers_scalelong_components"])
def test_shim_without_the_package_fails_with_the_install_line(tmp_path, shim):
    (tmp_path / f"{shim}.py").write_text(render_shim(shim))
    result = subprocess.run(
        [sys.executable, "-c", HIDE_PACKAGE + f"import {shim}"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode != 0 and "ImportError" in result.stderr
    assert f"Install it with: {INSTALL}" in result.stderr


def test_loading_a_hub_layout_without_the_package_names_the_install_line(tmp_path):
    pipeline().save_pretrained(tmp_path / "repo")
    write_hub_layout(tmp_path / "repo")
    code = HIDE_PACKAGE + textwrap.dedent(f"""
        from diffusers import DiffusionPipeline
        DiffusionPipeline.from_pretrained({str(tmp_path / "repo")!r}, trust_remote_code=True)
    """)
    env = {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=env)  # fmt: skip
    assert result.returncode != 0 and f"Install it with: {INSTALL}" in result.stderr, result.stderr[-2000:]
