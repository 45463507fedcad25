"""``save_pretrained`` of the package's models and pipelines writes what diffusers writes for its own (no code file,
no ``auto_map``) and honours ``variant``, ``safe_serialization`` and ``max_shard_size``; variant folders load back."""

import json
import re
from pathlib import Path

import pytest
import torch
from diffusers import DDPMPipeline, DDPMScheduler, DiffusionPipeline, ModelMixin, UNet2DModel

from diffusers_scalelong.edm2 import LearnedUncertainty
from diffusers_scalelong.models import EDM2UNet2DModel, ScaleLongUNet2DModel, UViT2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._tiny_models import TINY_EDM2_UNET, TINY_UNET

MODELS = {
    "EDM2UNet2DModel": lambda: EDM2UNet2DModel(**TINY_EDM2_UNET, lsc_method="ls"),
    "ScaleLongUNet2DModel": lambda: ScaleLongUNet2DModel(**TINY_UNET, lsc_method="cs"),
    "UViT2DModel": lambda: UViT2DModel(sample_size=8, patch_size=2, in_channels=1, embed_dim=16, num_heads=2, depth=2),
    "LearnedUncertainty": lambda: LearnedUncertainty(128),
}
# Argument sets diffusers' own tests save with; 1 KB splits every model here (the smallest holds 1.5 KB).
SAVE_ARGS = {
    "default": {},
    "variant": {"variant": "fp16"},
    "sharded": {"max_shard_size": "1KB"},
    "sharded variant": {"variant": "fp16", "max_shard_size": "1KB"},
}


def files(folder: Path) -> set[str]:
    return {path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()}


def shapes(names: set[str]) -> set[str]:
    """File names with shard counts blanked (``-00001-of-00004``), so layouts of models of other sizes compare."""
    return {re.sub(r"-\d{5}-of-\d{5}", "-N-of-M", name) for name in names}


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("args", sorted(SAVE_ARGS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_save_writes_what_diffusers_writes(tmp_path, name, args):
    """Byte for byte what diffusers' ``ModelMixin.save_pretrained`` writes for the same model, file names laid out as
    for diffusers' own ``UNet2DModel``; no code file, no ``auto_map``; the folder loads back with its variant."""
    model = MODELS[name]()
    model.save_pretrained(tmp_path / "ours", **SAVE_ARGS[args])
    ModelMixin.save_pretrained(model, tmp_path / "base", **SAVE_ARGS[args])
    UNet2DModel(**TINY_UNET).save_pretrained(tmp_path / "unet2d", **SAVE_ARGS[args])
    written = files(tmp_path / "ours")
    assert written == files(tmp_path / "base") and shapes(written) == shapes(files(tmp_path / "unet2d")), written
    assert all((tmp_path / "ours" / f).read_bytes() == (tmp_path / "base" / f).read_bytes() for f in written)
    assert not any(f.endswith(".py") for f in written)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert "auto_map" not in config and config["_class_name"] == name
    if "sharded" in args:
        assert sum(".safetensors" in f and "index" not in f for f in written) > 1  # really sharded
    variant = {"variant": SAVE_ARGS[args]["variant"]} if "variant" in SAVE_ARGS[args] else {}
    assert weights_equal(type(model).from_pretrained(tmp_path / "ours", **variant), model)


def test_model_save_honours_safe_serialization_false(tmp_path):
    model = MODELS["ScaleLongUNet2DModel"]()
    model.save_pretrained(tmp_path / "ours", safe_serialization=False)
    UNet2DModel(**TINY_UNET).save_pretrained(tmp_path / "diffusers", safe_serialization=False)
    assert files(tmp_path / "ours") == files(tmp_path / "diffusers") == {"config.json", "diffusion_pytorch_model.bin"}


def edm2_pipeline() -> EDM2Pipeline:
    return EDM2Pipeline(unet=MODELS["EDM2UNet2DModel"](), scheduler=EDMHeunScheduler())


def ddpm_pipeline() -> DDPMPipeline:
    return DDPMPipeline(unet=MODELS["ScaleLongUNet2DModel"](), scheduler=DDPMScheduler(num_train_timesteps=10))


@pytest.mark.parametrize("make", [edm2_pipeline, ddpm_pipeline], ids=["EDM2Pipeline", "DDPMPipeline"])
def test_pipeline_variant_round_trip(tmp_path, make):
    pipe = make()
    pipe.save_pretrained(tmp_path, variant="fp16", max_shard_size="20KB")
    written = files(tmp_path / "unet")
    assert all(".fp16" in name for name in written if name != "config.json"), written
    assert len(written) > 3 and not any(name.endswith(".py") for name in files(tmp_path))  # shards + index + config
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["unet"] == [type(pipe.unet).__module__, type(pipe.unet).__name__]  # what diffusers records
    loaded = DiffusionPipeline.from_pretrained(tmp_path, variant="fp16")
    assert type(loaded) is type(pipe) and type(loaded.unet) is type(pipe.unet)
    assert weights_equal(loaded.unet, pipe.unet)
    with pytest.raises(OSError, match="no file named diffusion_pytorch_model"):  # no non-variant weights written
        DiffusionPipeline.from_pretrained(tmp_path)
