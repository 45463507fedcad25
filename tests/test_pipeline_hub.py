"""Hub-native layout: shim files, model card, push to a real local Hub and loading by repo id in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DDPMPipeline, DDPMScheduler
from huggingface_hub import hf_hub_download

from diffusers_scalelong.hub import push_pipeline_to_hub, write_hub_layout
from diffusers_scalelong.hub.shims import render_shim
from diffusers_scalelong.models import ScaleLongUNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._exact import REALIGN_SOURCE, one_thread
from tests._tiny_models import TINY_UNET

SHIMS = Path(__file__).resolve().parents[1] / "pipelines"
STEPS = 2


def scalelong_unet(num_class_embeds=None):
    torch.manual_seed(0)
    return ScaleLongUNet2DModel(
        **TINY_UNET,
        time_embedding_type="positional",
        num_class_embeds=num_class_embeds,
        lsc_method="cs",
    ).eval()


def edm2_pipe():
    return EDM2Pipeline(unet=scalelong_unet(num_class_embeds=3), scheduler=EDMHeunScheduler(S_churn=2.0))


def reference_images(pipe, path):
    with one_thread():  # as the loader subprocess runs (OMP_NUM_THREADS=1), so its images can match exactly
        _reference_images(pipe, path)


def _reference_images(pipe, path):
    if isinstance(pipe, EDM2Pipeline):
        images = pipe(
            class_labels=[0, 2], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(1), output_type="np"
        ).images
    else:
        images = pipe(
            batch_size=2, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(1), output_type="np"
        ).images
    np.save(path, images)


def run_loader(script: str, env: dict, tmp_path: Path) -> list[dict]:
    """Run loading code in a fresh interpreter (HF_ENDPOINT is read at import); each line it prints is JSON."""
    env = {
        **env,
        "OMP_NUM_THREADS": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_HUB_CACHE": str(tmp_path / "hub-cache"),
    }
    prelude = textwrap.dedent(
        """
        import json, sys, numpy as np, torch
        from diffusers import DiffusionPipeline

        def images(pipe):
            kwargs = dict(num_inference_steps=STEPS, generator=torch.Generator().manual_seed(1), output_type="np")
            if type(pipe).__name__ == "EDM2Pipeline":
                return pipe(class_labels=[0, 2], **kwargs).images
            return pipe(batch_size=2, **kwargs).images

        def report(name, fn, ref=None):
            try:
                pipe = realign(fn())  # bit-identical weights in aligned storage, see tests/_exact.py
                out = {"name": name, "pipeline": type(pipe).__name__, "unet": type(pipe.unet).__name__,
                       "scheduler": type(pipe.scheduler).__name__}
                if ref is not None:
                    out["max_diff"] = float(np.abs(images(pipe) - np.load(ref)).max())
            except Exception as error:
                out = {"name": name, "error": type(error).__name__, "message": str(error)}
            print(json.dumps(out), flush=True)
    """
    ).replace("STEPS", str(STEPS))
    result = subprocess.run(
        [sys.executable, "-c", REALIGN_SOURCE + prelude + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr[-3000:]
    return lines


def test_write_hub_layout_copies_shims_and_rewrites_index(tmp_path):
    edm2_pipe().save_pretrained(tmp_path / "edm2")
    index = write_hub_layout(tmp_path / "edm2")
    assert index["_class_name"] == ["edm2_pipeline", "EDM2Pipeline"]
    assert index["unet"] == ["diffusers_scalelong_components", "ScaleLongUNet2DModel"]
    assert index["scheduler"] == ["diffusers_scalelong_components", "EDMHeunScheduler"]
    assert index["vae"] == [None, None]
    assert json.loads((tmp_path / "edm2" / "model_index.json").read_text()) == index
    assert (tmp_path / "edm2" / "edm2_pipeline.py").read_text() == render_shim("edm2_pipeline")
    for component in ("unet", "scheduler"):
        shim = tmp_path / "edm2" / component / "diffusers_scalelong_components.py"
        assert shim.read_text() == render_shim("diffusers_scalelong_components")
    unet_config = json.loads((tmp_path / "edm2" / "unet" / "config.json").read_text())
    assert unet_config["auto_map"] == {"AutoModel": "diffusers_scalelong_components.ScaleLongUNet2DModel"}
    assert not (tmp_path / "edm2" / "vae").exists()

    DDPMPipeline(unet=scalelong_unet(), scheduler=DDPMScheduler()).save_pretrained(tmp_path / "ddpm")
    index = write_hub_layout(tmp_path / "ddpm")
    assert index["_class_name"] == "DDPMPipeline"  # a diffusers pipeline keeps its class
    assert index["scheduler"] == ["diffusers", "DDPMScheduler"]
    assert index["unet"] == ["diffusers_scalelong_components", "ScaleLongUNet2DModel"]
    assert not (tmp_path / "ddpm" / "scheduler" / "diffusers_scalelong_components.py").exists()
    assert write_hub_layout(tmp_path / "ddpm") == index  # idempotent


def test_write_hub_layout_without_model_index_raises(tmp_path):
    with pytest.raises(ValueError, match="no model_index.json"):
        write_hub_layout(tmp_path)


def test_local_layout_and_custom_pipeline_file_load_in_fresh_process(tmp_path):
    pipe = edm2_pipe()
    reference_images(pipe, tmp_path / "ref.npy")
    pipe.save_pretrained(tmp_path / "plain")
    pipe.save_pretrained(tmp_path / "layout")
    write_hub_layout(tmp_path / "layout")
    results = run_loader(
        f"""
        # no `import diffusers_scalelong`: the shim files import it themselves
        report("layout", lambda: DiffusionPipeline.from_pretrained({str(tmp_path / "layout")!r},
               trust_remote_code=True), {str(tmp_path / "ref.npy")!r})
        report("custom_pipeline", lambda: DiffusionPipeline.from_pretrained({str(tmp_path / "plain")!r},
               custom_pipeline={str(SHIMS / "edm2_pipeline.py")!r}, trust_remote_code=True),
               {str(tmp_path / "ref.npy")!r})
    """,
        dict(os.environ, HF_HUB_OFFLINE="1"),
        tmp_path,
    )
    for result in results:
        assert result.get("pipeline") == "EDM2Pipeline" and result["unet"] == "ScaleLongUNet2DModel", result
        assert result["scheduler"] == "EDMHeunScheduler" and result["max_diff"] == 0, result


def test_push_to_local_hub_and_load_by_repo_id(local_hub, tmp_path):
    pipe = edm2_pipe()
    reference_images(pipe, tmp_path / "edm2.npy")
    commit = push_pipeline_to_hub(
        pipe, "tester/edm2-pipe", endpoint=local_hub.endpoint, ema_sigma_rel=0.1,
        sampler_settings={"num_inference_steps": 32}, dataset="fashion_mnist", base_model="tester/edm2-base",
    )  # fmt: skip
    assert "tester/edm2-pipe" in commit
    ddpm = DDPMPipeline(unet=scalelong_unet(), scheduler=DDPMScheduler(num_train_timesteps=50))
    reference_images(ddpm, tmp_path / "ddpm.npy")
    push_pipeline_to_hub(ddpm, "tester/ddpm-scalelong", endpoint=local_hub.endpoint, ema=False, license="mit")

    def card(repo_id: str) -> str:
        return Path(
            hf_hub_download(repo_id, "README.md", revision="main", endpoint=local_hub.endpoint,
                            cache_dir=tmp_path / "cards")
        ).read_text()  # fmt: skip

    edm2_card, ddpm_card = card("tester/edm2-pipe"), card("tester/ddpm-scalelong")
    for text in (
        "library_name: diffusers",
        "license: apache-2.0",  # the package's, when none is given
        "datasets:\n- fashion_mnist",
        "base_model: tester/edm2-base",
        "- diffusers-scalelong",
        "- edm2",
        "- scalelong",
        "- ema",
        "pip install diffusers-scalelong",
        "trust_remote_code=True",
        "relative length sigma_rel = 0.1",
        "| num_inference_steps | 32 |",
        "| S_churn | 2.0 |",
    ):
        assert text in edm2_card, text
    assert "license: mit" in ddpm_card and "The weights are the raw training weights (no EMA)." in ddpm_card
    assert "- ema" not in ddpm_card and "datasets" not in ddpm_card and "base_model" not in ddpm_card

    results = run_loader(
        f"""
        report("trusted", lambda: DiffusionPipeline.from_pretrained("tester/edm2-pipe", revision="main",
               trust_remote_code=True), {str(tmp_path / "edm2.npy")!r})
        report("ddpm", lambda: DiffusionPipeline.from_pretrained("tester/ddpm-scalelong", revision="main",
               trust_remote_code=True), {str(tmp_path / "ddpm.npy")!r})
        report("untrusted", lambda: DiffusionPipeline.from_pretrained("tester/edm2-pipe", revision="main"))
        import diffusers_scalelong.pipelines as p
        report("edm2_untrusted", lambda: p.EDM2Pipeline.from_pretrained("tester/edm2-pipe", revision="main"))
    """,
        local_hub.env(),
        tmp_path,
    )
    by_name = {r["name"]: r for r in results}
    trusted, ddpm_loaded = by_name["trusted"], by_name["ddpm"]
    assert trusted.get("pipeline") == "EDM2Pipeline" and trusted["unet"] == "ScaleLongUNet2DModel", trusted
    assert trusted["scheduler"] == "EDMHeunScheduler" and trusted["max_diff"] == 0
    assert ddpm_loaded.get("pipeline") == "DDPMPipeline" and ddpm_loaded["unet"] == "ScaleLongUNet2DModel", ddpm_loaded
    assert ddpm_loaded["max_diff"] == 0
    for name in ("untrusted", "edm2_untrusted"):
        assert by_name[name].get("error") == "ValueError" and "trust_remote_code=True" in by_name[name]["message"]
    assert (
        "EDM2Pipeline.from_pretrained('tester/edm2-pipe', trust_remote_code=True)"
        in by_name["edm2_untrusted"]["message"]
    )
