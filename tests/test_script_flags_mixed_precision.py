"""Frozen VAE / text encoder in the mixed-precision dtype (diffusers' ``weight_dtype``), the trained UNet float32,
and the final pipeline holding the frozen modules exactly as loaded."""

import pytest
import torch
from _training_scripts import TRAIN_TEXT_TO_IMAGE, load_script_module, write_image_folder
from accelerate.state import AcceleratorState
from diffusers import AutoencoderKL
from safetensors.torch import load_file
from test_train_text_to_image import tiny_sd  # noqa: F401  (the tiny Stable-Diffusion pipeline fixture)

from diffusers_scalelong.trainer import FrozenModules, weight_dtype


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state; a run with another --mixed_precision needs it cleared."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_frozen_modules_are_cast_and_restored_exactly():
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=2)
    loaded = {name: tensor.clone() for name, tensor in vae.state_dict().items()}
    frozen = FrozenModules([vae], "cpu", weight_dtype("bf16"))
    assert {p.dtype for p in vae.parameters()} == {torch.bfloat16} and not vae.training
    assert not any(p.requires_grad for p in vae.parameters())
    assert frozen.describe() == "AutoencoderKL in torch.bfloat16"
    frozen.restore()
    restored = vae.state_dict()
    assert all(torch.equal(restored[k], v) and restored[k].dtype == v.dtype for k, v in loaded.items())


def test_bf16_run_computes_frozen_modules_in_bf16_and_saves_them_as_loaded(
    tiny_sd,  # noqa: F811
    tmp_path,
    capsys,
    fresh_accelerate_state,
):
    data = write_image_folder(tmp_path / "data", count=4, size=16, captions=True)
    argv = ["--pretrained_model_name_or_path", tiny_sd, "--train_data_dir", data, "--output_dir", tmp_path / "out"]
    argv += ["--resolution", "16", "--train_batch_size", "2", "--max_train_steps", "2", "--report_to", "none"]
    argv += ["--mixed_precision", "bf16", "--validation_prompts", "a pic", "--save_images_steps", "2"]
    argv += ["--eval_batch_size", "1", "--num_inference_steps", "2", "--diagnostics_every", "0"]
    assert load_script_module(TRAIN_TEXT_TO_IMAGE).main([str(a) for a in argv]) == 0
    assert "frozen: AutoencoderKL in torch.bfloat16, CLIPTextModel in torch.bfloat16" in capsys.readouterr().err
    assert (tmp_path / "out" / "samples" / "step-0000002.png").is_file()  # sampled under bf16 autocast
    for component, filename in (("vae", "diffusion_pytorch_model"), ("text_encoder", "model")):
        loaded = load_file(tiny_sd / component / f"{filename}.safetensors")
        saved = load_file(tmp_path / "out" / component / f"{filename}.safetensors")
        assert all(torch.equal(saved[k], v) and saved[k].dtype == v.dtype for k, v in loaded.items()), component
    unet = load_file(tmp_path / "out" / "unet" / "diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in unet.values()} == {torch.float32}
