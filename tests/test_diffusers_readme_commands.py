"""The commands of diffusers' example READMEs run with this package's scripts, through a real `accelerate launch`.

The flags and values are the READMEs' (diffusers' examples/unconditional_image_generation and
examples/text_to_image); only what cannot run here is replaced, each replacement said where it is made: the Hub
dataset by a local image folder (no network), the network by a tiny one and the step count by a few steps (CPU), the
Hub push by the local Hub server. Every flag the READMEs pass is kept and must mean what it means in diffusers'
scripts: the checks below read its effect from the files the run writes.
"""

import json
import subprocess
import sys

import pytest
from _training_scripts import ROOT, TRAIN_TEXT_TO_IMAGE, TRAIN_UNCONDITIONAL, script_env, write_image_folder
from hub_server import LOCAL_USER, TOKEN
from safetensors.torch import load_file
from test_train_text_to_image import tiny_sd  # noqa: F401  (the tiny Stable Diffusion fixture)

# Appended to the README command: a tiny network and a step limit (the README trains a 114M UNet for 100 epochs).
TINY_UNCONDITIONAL = [
    "--block_out_channels", "16", "32", "--attention_levels", "--norm_num_groups", "8", "--layers_per_block", "1",
    "--max_train_steps", "2", "--checkpointing_steps", "2", "--report_to", "none", "--diagnostics_every", "0",
]  # fmt: skip


def launch(script, args: list, env: dict | None = None, accelerate_args: tuple = ("--mixed_precision", "no")):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
    command += ["--dynamo_backend", "no", "--num_cpu_threads_per_process", "1", *accelerate_args, str(script)]
    result = subprocess.run(
        [*command, *map(str, args)], capture_output=True, text=True, env={**script_env(), **(env or {})}, cwd=ROOT,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def test_unconditional_readme_command_trains_with_ema_and_pushes(tmp_path, local_hub):
    images = write_image_folder(tmp_path / "flowers", count=32, size=64)
    output = tmp_path / "ddpm-ema-flowers-64"
    readme = [
        f"--train_data_dir={images}",  # README: --dataset_name="huggan/flowers-102-categories"
        "--resolution=64", "--center_crop", "--random_flip",
        f"--output_dir={output}",
        "--train_batch_size=16",
        "--num_epochs=100",
        "--gradient_accumulation_steps=1",
        "--use_ema",
        "--learning_rate=1e-4",
        "--lr_warmup_steps=500",
        "--mixed_precision=no",
        "--push_to_hub",
    ]  # fmt: skip
    launch(TRAIN_UNCONDITIONAL, [*readme, *TINY_UNCONDITIONAL], env=local_hub.env(tmp_path / "hub-cache"))
    unet = json.loads((output / "unet" / "config.json").read_text())
    assert unet["sample_size"] == 64 and unet["in_channels"] == 3  # --resolution, RGB flowers
    assert (output / "checkpoint-2" / "unet_ema").is_dir()  # --use_ema: the classic EMA is kept and checkpointed
    # --push_to_hub without --hub_model_id: diffusers' repo name, <user>/<output folder name>
    from huggingface_hub import HfApi, hf_hub_download

    files = HfApi(endpoint=local_hub.endpoint, token=TOKEN).list_repo_files(f"{LOCAL_USER}/ddpm-ema-flowers-64")
    assert "model_index.json" in files and "unet/diffusion_pytorch_model.safetensors" in files
    card = hf_hub_download(f"{LOCAL_USER}/ddpm-ema-flowers-64", "README.md", endpoint=local_hub.endpoint, token=TOKEN)
    assert "The weights are an exponential moving average (EMA) of the training weights." in open(card).read()
    # the pipeline holds the EMA weights (diffusers' script saves the EMA model): equal to the checkpoint's EMA copy
    ema = load_file(output / "checkpoint-2" / "unet_ema" / "diffusion_pytorch_model.safetensors")
    saved = load_file(output / "unet" / "diffusion_pytorch_model.safetensors")
    assert all((saved[key] == ema[key]).all() for key in saved)


@pytest.mark.slow  # a tiny Stable Diffusion through accelerate launch: about a minute on a busy 2-core machine
def test_text_to_image_readme_command_fine_tunes(tiny_sd, tmp_path):  # noqa: F811
    data = write_image_folder(tmp_path / "naruto", count=8, size=16, captions=True)
    output = tmp_path / "sd-naruto-model"
    readme = [
        f"--pretrained_model_name_or_path={tiny_sd}",
        f"--train_data_dir={data}",  # README: --dataset_name=$DATASET_NAME
        "--use_ema",
        "--resolution=16", "--center_crop", "--random_flip",  # README: --resolution=512 (the tiny model works at 16)
        "--train_batch_size=1",
        "--gradient_accumulation_steps=4",
        "--gradient_checkpointing",
        "--max_train_steps=2",  # README: 15000
        "--learning_rate=1e-05",
        "--max_grad_norm=1",
        "--lr_scheduler=constant", "--lr_warmup_steps=0",
        f"--output_dir={output}",
    ]  # fmt: skip
    # README: accelerate launch --mixed_precision="fp16" (a GPU's); on CPU the same launch flag with bf16
    result = launch(
        TRAIN_TEXT_TO_IMAGE, [*readme, "--report_to", "none"], accelerate_args=("--mixed_precision", "bf16")
    )
    assert json.loads((output / "model_index.json").read_text())["unet"][1] == "ScaleLongUNet2DConditionModel"
    # --gradient_accumulation_steps=4 x --train_batch_size=1: 2 optimiser steps of 4 images
    assert "2 steps of 4 images" in result.stderr
    # accelerate launch's precision reaches the run (the script's own --mixed_precision is left unset)
    assert "frozen: AutoencoderKL in torch.bfloat16" in result.stderr
