"""--variant and --revision select the pretrained weights, as in diffusers' example scripts: passed to every
``from_pretrained`` of the pipeline's components (a real fp16-variant folder; a real revision on the local Hub)."""

import pytest
import torch
from _training_scripts import (
    TRAIN_TEXT_TO_IMAGE,
    TRAIN_UNCONDITIONAL,
    load_script_module,
    run_script,
    write_image_folder,
)
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file
from test_train_text_to_image import tiny_sd  # noqa: F401  (the tiny Stable-Diffusion pipeline fixture)

FAST = ["--resolution", "16", "--train_batch_size", "2", "--max_train_steps", "1", "--report_to", "none"]
FAST += ["--diagnostics_every", "0"]


@pytest.fixture(scope="module")
def fp16_variant(tiny_sd, tmp_path_factory):  # noqa: F811
    """The tiny pipeline saved in float16 as diffusers' fp16 variant (``*.fp16.safetensors`` only)."""
    folder = tmp_path_factory.mktemp("fp16_variant")
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_sd, torch_dtype=torch.float16, safety_checker=None)
    pipeline.save_pretrained(folder, variant="fp16")
    assert (folder / "unet" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    assert not (folder / "unet" / "diffusion_pytorch_model.safetensors").exists()
    return folder


def _argv(pipeline, tmp_path) -> list[str]:
    data = write_image_folder(tmp_path / "data", count=2, size=16, captions=True)
    argv = ["--pretrained_model_name_or_path", pipeline, "--train_data_dir", data, "--output_dir", tmp_path / "out"]
    return [str(a) for a in [*argv, *FAST]]


def test_variant_loads_the_fp16_files_and_trains_a_float32_unet(fp16_variant, tmp_path):
    script = load_script_module(TRAIN_TEXT_TO_IMAGE)
    assert script.main([*_argv(fp16_variant, tmp_path), "--variant", "fp16"]) == 0
    unet = load_file(tmp_path / "out" / "unet" / "diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in unet.values()} == {torch.float32}
    loaded = load_file(fp16_variant / "vae" / "diffusion_pytorch_model.fp16.safetensors")
    saved = load_file(tmp_path / "out" / "vae" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in loaded.items())  # the frozen VAE is saved as loaded


def test_without_the_variant_the_error_names_it(fp16_variant, tmp_path, capsys):
    script = load_script_module(TRAIN_TEXT_TO_IMAGE)
    with pytest.raises(SystemExit) as exit_info:
        script.main(_argv(fp16_variant, tmp_path))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"--pretrained_model_name_or_path '{fp16_variant}' (--revision None, --variant None) could not" in error


def test_unconditional_revision_and_variant_need_a_pretrained_model(tmp_path, capsys):
    script = load_script_module(TRAIN_UNCONDITIONAL)
    with pytest.raises(SystemExit):
        script.main(["--output_dir", str(tmp_path), "--revision", "main"])
    assert "--revision / --variant need --pretrained_model_name_or_path" in capsys.readouterr().err


@pytest.mark.slow  # two fresh training processes that talk to the local Hub: about a minute on a busy machine
def test_revision_selects_the_commit_on_the_hub(tiny_sd, local_hub, tmp_path):  # noqa: F811
    first = local_hub.seed_repo("tester/revision-sd", tiny_sd)
    changed = tmp_path / "changed"
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_sd, safety_checker=None)
    with torch.no_grad():
        for parameter in pipeline.text_encoder.parameters():
            parameter.add_(1.0)
    pipeline.save_pretrained(changed)
    local_hub.seed_repo("tester/revision-sd", changed)  # main moves on; the first commit keeps the old weights

    env = local_hub.env(hub_cache=tmp_path / "cache")
    argv = _argv("tester/revision-sd", tmp_path)
    run_script(TRAIN_TEXT_TO_IMAGE, [*argv, "--revision", first], env=env)
    saved = load_file(tmp_path / "out" / "text_encoder" / "model.safetensors")
    original = load_file(tiny_sd / "text_encoder" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in original.items())

    missing = run_script(TRAIN_TEXT_TO_IMAGE, [*argv, "--revision", "no-such-branch"], check=False, env=env)
    assert missing.returncode == 2 and "--revision no-such-branch" in missing.stderr
