"""train_unconditional.py --model_config_name_or_path: the network built from a config, as diffusers' example
(``UNet2DModel.from_config(UNet2DModel.load_config(path))``), with ScaleLong added by --lsc."""

import json

import pytest
from _tiny_models import TINY_EDM2_UNET, TINY_UNET
from _training_scripts import TRAIN_UNCONDITIONAL, load_script_module
from diffusers import UNet2DModel
from safetensors.torch import load_file

from diffusers_scalelong.models import EDM2UNet2DModel, ScaleLongUNet2DModel

FAST = ["--resolution", "8", "--max_train_samples", "16", "--train_batch_size", "8", "--report_to", "none"]
FAST += ["--max_train_steps", "1", "--diagnostics_every", "0"]


@pytest.fixture(scope="module")
def script():
    return load_script_module(TRAIN_UNCONDITIONAL)


@pytest.fixture
def unet_config(tmp_path):
    """A diffusers UNet2DModel config.json in a model folder (as ``save_config`` writes it)."""
    UNet2DModel(**TINY_UNET).save_config(tmp_path / "config_folder")
    return tmp_path / "config_folder"


def _run(script, argv) -> int:
    return script.main([str(a) for a in argv])


def _trained_unet(output):
    config = json.loads((output / "unet" / "config.json").read_text())
    return config, load_file(output / "unet" / "diffusion_pytorch_model.safetensors")


def test_a_config_folder_builds_that_unet_and_lsc_makes_it_scalelong(script, unet_config, tmp_path):
    assert _run(script, ["--output_dir", tmp_path / "plain", "--model_config_name_or_path", unet_config, *FAST]) == 0
    config, weights = _trained_unet(tmp_path / "plain")
    reference = UNet2DModel.from_config(UNet2DModel.load_config(unet_config))  # diffusers' example does this
    assert config["_class_name"] == "UNet2DModel"
    assert config["block_out_channels"] == list(TINY_UNET["block_out_channels"])
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in reference.state_dict().items()}

    config_file = unet_config / "config.json"  # a JSON file works as well as its folder
    argv = ["--output_dir", tmp_path / "cs", "--model_config_name_or_path", config_file, "--lsc", "cs", *FAST]
    assert _run(script, argv + ["--kappa", "0.6"]) == 0
    config, weights = _trained_unet(tmp_path / "cs")
    assert (config["_class_name"], config["lsc_method"], config["lsc_kappa"]) == ("ScaleLongUNet2DModel", "cs", 0.6)
    assert weights.keys() == ScaleLongUNet2DModel(**TINY_UNET, lsc_method="cs").state_dict().keys()


def test_an_edm2_config_builds_the_edm2_unet(script, tmp_path):
    EDM2UNet2DModel(**TINY_EDM2_UNET, num_class_embeds=10).save_config(tmp_path / "edm2")
    argv = ["--output_dir", tmp_path / "out", "--model_config_name_or_path", tmp_path / "edm2", "--recipe", "edm2"]
    assert _run(script, [*argv, "--class_conditional", *FAST]) == 0
    config, _ = _trained_unet(tmp_path / "out")
    assert (config["_class_name"], config["model_channels"], config["num_class_embeds"]) == ("EDM2UNet2DModel", 8, 10)


def _fails(script, capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        _run(script, argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_conflicting_or_missing_configs_fail_with_one_clear_line(script, unet_config, tmp_path, capsys):
    base = ["--output_dir", tmp_path / "out", *FAST, "--model_config_name_or_path"]
    error = _fails(script, capsys, [*base, unet_config, "--block_out_channels", "8", "16"])
    assert "--model_config_name_or_path sets the architecture; drop --block_out_channels" in error
    error = _fails(script, capsys, [*base, unet_config, "--model", "uvit", "--uvit_depth", "2"])
    assert "drop --model, --uvit_depth" in error
    error = _fails(script, capsys, [*base, unet_config, "--pretrained_model_name_or_path", unet_config])
    assert "not both" in error
    missing = tmp_path / "nowhere"
    assert f"--model_config_name_or_path '{missing}': no such config file" in _fails(script, capsys, [*base, missing])
    (tmp_path / "bad.json").write_text("{not json")
    assert "is not a JSON config file" in _fails(script, capsys, [*base, tmp_path / "bad.json"])
    error = _fails(script, capsys, [*base, unet_config, "--resolution", "16"])
    assert "sample_size is 8, the data needs 16" in error
    error = _fails(script, capsys, [*base, unet_config, "--recipe", "edm2", "--class_conditional"])
    assert "num_class_embeds is None, the data needs 10" in error
    assert not (tmp_path / "out" / "unet").exists()
