"""Checkpoint folders: discovery, completeness, step, recorded state and rotation, on real folders."""

import json

import pytest
import torch

from diffusers_scalelong.edm2 import EDMPreconditioner, LearnedUncertainty
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.trainer import Checkpoint


def _write(output_dir, step, complete=True, recorded_step=None):
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    if complete:
        state = {"global_step": step if recorded_step is None else recorded_step, "num_processes": 1}
        (folder / "training_state.json").write_text(json.dumps(state))
    return folder


def test_find_resolve_and_rotate(tmp_path):
    for step in (100, 20, 300):
        _write(tmp_path, step)
    _write(tmp_path, 400, complete=False)  # interrupted while saving: not a checkpoint yet
    (tmp_path / "checkpoint-x").mkdir()
    assert [c.step for c in Checkpoint.find_all(tmp_path)] == [20, 100, 300]
    assert Checkpoint.resolve("latest", tmp_path).step == 300
    assert Checkpoint.resolve("checkpoint-100", tmp_path).path == tmp_path / "checkpoint-100"
    assert Checkpoint.resolve(None, tmp_path) is None
    assert Checkpoint.resolve("latest", tmp_path / "empty") is None
    with pytest.raises(ValueError, match="not a complete checkpoint folder"):
        Checkpoint.resolve("checkpoint-400", tmp_path)
    assert [c.step for c in Checkpoint.rotate(tmp_path, 2)] == [20]
    assert [c.step for c in Checkpoint.find_all(tmp_path)] == [100, 300]
    with pytest.raises(ValueError, match="checkpoint-500"):
        Checkpoint(tmp_path / "step-5")


def test_recorded_state_is_cross_checked_with_the_folder_name(tmp_path):
    # a record written before run ids, file manifests and distributed_type existed
    recorded = {"global_step": 7, "num_processes": 1, "distributed_type": "ddp", "run_id": None, "files": None}
    assert Checkpoint(_write(tmp_path, 7)).read_state() == recorded
    with pytest.raises(ValueError, match="records step 8, but the folder is named for step 9"):
        Checkpoint(_write(tmp_path, 9, recorded_step=8)).read_state()


def test_preconditioner_models_use_the_preconditioner_format(tmp_path):
    unet = EDM2UNet2DModel(
        sample_size=8, in_channels=1, model_channels=8, channel_mult=(1, 2), layers_per_block=1, channels_per_head=8
    )
    saved = EDMPreconditioner(unet, LearnedUncertainty(8), sigma_data=0.6)
    with torch.no_grad():
        for parameter in saved.parameters():
            parameter.normal_()
    Checkpoint.save_models(saved, tmp_path)
    assert EDMPreconditioner.read_config(tmp_path) == {"sigma_data": 0.6, "unet_class": "EDM2UNet2DModel"}
    fresh = EDMPreconditioner(EDM2UNet2DModel(**unet.config), LearnedUncertainty(8), sigma_data=0.6)
    Checkpoint.load_models(fresh, tmp_path)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    other = EDMPreconditioner(EDM2UNet2DModel(**unet.config), LearnedUncertainty(8), sigma_data=0.5)
    with pytest.raises(ValueError, match="sigma_data=0.6"):
        Checkpoint.load_models(other, tmp_path)
