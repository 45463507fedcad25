"""train_unconditional.py end to end: saved pipelines load in a fresh process, fine-tuning adds ScaleLong to a
vanilla UNet, bad input fails before any work and never touches earlier checkpoints, a NaN loss stops the run."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _training_scripts import (
    ROOT,
    TINY_UNET,
    TRAIN_UNCONDITIONAL,
    load_script_module,
    run_script,
    script_env,
    write_image_folder,
)
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from PIL import Image


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4 and a sample grid."""
    output = tmp_path_factory.mktemp("tiny_run")
    run_script(
        TRAIN_UNCONDITIONAL,
        [
            "--output_dir",
            output,
            *TINY_UNET,
            "--max_train_steps",
            4,
            "--checkpointing_steps",
            2,
            "--save_images_steps",
            4,
        ],
    )
    return output


@pytest.fixture(scope="module")
def vanilla_pipeline(tmp_path_factory):
    """A saved DDPMPipeline holding a plain diffusers UNet2DModel (no ScaleLong anywhere)."""
    folder = tmp_path_factory.mktemp("vanilla")
    torch.manual_seed(1)
    unet = UNet2DModel(
        sample_size=16, in_channels=1, out_channels=1, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=8,
    )  # fmt: skip
    DDPMPipeline(unet=unet, scheduler=DDPMScheduler()).save_pretrained(folder)
    return folder


def _folder_state(folder):
    """(relative path, size, mtime) of every file but the lock file (each start records itself there): proves a
    failed run left the folder untouched."""
    files = [p for p in folder.rglob("*") if p.is_file() and p.name != ".run.lock"]
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files)


def test_run_writes_checkpoints_grid_and_pipeline(tiny_run):
    assert sorted(p.name for p in tiny_run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not list(tiny_run.glob(".checkpoint-*")) and not list(tiny_run.glob(".pipeline-*")), "temporary folders left"
    grid = Image.open(tiny_run / "samples" / "step-0000004.png")
    assert grid.mode == "L" and grid.size == (2 + 2 * 18, 2 + 2 * 18)  # 4 images of 16x16 in a 2x2 grid, 2 px gaps
    index = json.loads((tiny_run / "model_index.json").read_text())
    assert index["_class_name"] == "DDPMPipeline"
    assert index["unet"] == ["diffusers_scalelong.models.scalelong_unet", "ScaleLongUNet2DModel"]


def test_finetune_vanilla_pipeline_with_cs_then_load_all_in_fresh_process(tiny_run, vanilla_pipeline, tmp_path):
    small = ["--resolution", "16", "--max_train_samples", "32", "--train_batch_size", "8", "--max_train_steps", "2"]
    small += ["--report_to", "none", "--num_inference_steps", "2", "--num_grid_images", "4"]
    finetuned = tmp_path / "finetuned"
    run_script(
        TRAIN_UNCONDITIONAL,
        [
            "--output_dir",
            finetuned,
            "--pretrained_model_name_or_path",
            vanilla_pipeline,
            "--lsc",
            "cs",
            "--kappa",
            "0.5",
            *small,
        ],
    )
    # the EDM2 recipe on a class-conditional EDM2 UNet (its grid is skipped: it would need labels) ...
    edm2 = tmp_path / "edm2"
    edm2_args = ["--model", "edm2", "--recipe", "edm2", "--lsc", "cs", "--kappa", "0.7", "--model_channels", "16"]
    edm2_args += [
        "--channel_mult",
        "1",
        "2",
        "--layers_per_block",
        "1",
        "--attention_resolutions",
        "8",
        "--channels_per_head",
        "16",
    ]
    run_script(
        TRAIN_UNCONDITIONAL,
        [
            "--output_dir",
            edm2,
            *edm2_args,
            "--class_conditional",
            "--ema_sigma_rels",
            "0.1",
            "--snapshot_every",
            "1",
            *small,
        ],
    )
    assert len(list((edm2 / "ema_snapshots").iterdir())) == 2
    # ... and the U-ViT with learnable (LS) skip gates, with a sample grid and the stability plot
    uvit = tmp_path / "uvit"
    uvit_args = [
        "--model",
        "uvit",
        "--lsc",
        "ls",
        "--uvit_embed_dim",
        "32",
        "--uvit_depth",
        "4",
        "--uvit_num_heads",
        "2",
    ]
    run_script(
        TRAIN_UNCONDITIONAL,
        ["--output_dir", uvit, *uvit_args, "--save_images_steps", "2", "--diagnostics_every", "1", *small],
    )
    assert (uvit / "samples" / "step-0000002.png").is_file() and (uvit / "stability.png").is_file()

    # a fresh interpreter: the plugin classes must be found through model_index.json after `import diffusers_scalelong`
    check = textwrap.dedent("""
        import sys, torch
        import diffusers_scalelong
        from diffusers import DiffusionPipeline, UNet2DModel
        for folder in sys.argv[1:]:
            pipe = DiffusionPipeline.from_pretrained(folder)
            labels = {"class_labels": [0, 7]} if getattr(pipe.unet.config, "num_class_embeds", None) else {}
            images = pipe(batch_size=2, num_inference_steps=3, output_type="np", generator=torch.Generator().manual_seed(0), **labels).images
            assert images.shape == (2, 16, 16, 1) and (images >= 0).all() and (images <= 1).all(), images.shape
            print(type(pipe).__name__, type(pipe.unet).__name__, pipe.unet.config.lsc_method, pipe.unet.config.lsc_kappa)
        # a CS fine-tune keeps vanilla parameter names, so it also loads back into diffusers' own class
        UNet2DModel.from_pretrained(sys.argv[2], subfolder="unet")
    """)
    folders = [str(f) for f in (tiny_run, finetuned, edm2, uvit)]
    result = subprocess.run(
        [sys.executable, "-c", check, *folders], capture_output=True, text=True, env=script_env(), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:4] == [
        "DDPMPipeline ScaleLongUNet2DModel cs 0.7",
        "DDPMPipeline ScaleLongUNet2DModel cs 0.5",
        "EDM2Pipeline EDM2UNet2DModel cs 0.7",
        "DDPMPipeline UViT2DModel ls 0.5",
    ]

    from safetensors.torch import load_file

    before = load_file(vanilla_pipeline / "unet" / "diffusion_pytorch_model.safetensors")
    after = load_file(finetuned / "unet" / "diffusion_pytorch_model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "fine-tuning did not change the weights"


@pytest.fixture(scope="module")
def script():
    return load_script_module(TRAIN_UNCONDITIONAL)


def _fails(script, capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        script.main([str(a) for a in argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_bad_input_fails_fast_and_keeps_checkpoints(script, tiny_run, tmp_path, capsys):
    before = _folder_state(tiny_run)
    base = ["--output_dir", tiny_run, *TINY_UNET, "--max_train_steps", 8, "--resume_from_checkpoint", "latest"]

    assert "argument --lsc: invalid choice: 'bogus'" in _fails(script, capsys, [*base, "--lsc", "bogus"])
    assert "argument --recipe: invalid choice" in _fails(script, capsys, [*base, "--recipe", "ddim"])
    assert "argument --kappa: must be a positive number" in _fails(script, capsys, [*base, "--kappa", "-1"])

    empty = tmp_path / "no_images"
    empty.mkdir()
    (empty / "notes.txt").write_text("no pictures here")
    assert f"--train_data_dir '{empty}'" in _fails(script, capsys, [*base, "--train_data_dir", empty])

    small = write_image_folder(tmp_path / "small", count=3, size=8)
    error = _fails(script, capsys, [*base, "--train_data_dir", small])
    assert "8 pixels on their shorter side, smaller than --resolution 16" in error

    blocked = tmp_path / "a_file"
    blocked.write_text("")
    assert f"--output_dir '{blocked / 'out'}' is not a writable folder" in _fails(
        script, capsys, [*base[2:], "--output_dir", blocked / "out"]
    )

    other_model = [*base, "--block_out_channels", "16", "16"]
    error = _fails(script, capsys, other_model)
    assert "checkpoint-4" in error and "different model" in error and "block_out_channels" in error
    other_class = [*base, "--model", "edm2", "--lsc", "none", "--model_channels", "16", "--channels_per_head", "16"]
    assert "holds a ScaleLongUNet2DModel model but this run builds a EDM2UNet2DModel" in _fails(
        script, capsys, other_class
    )

    assert _folder_state(tiny_run) == before, "a failed start changed the output folder"


def test_nan_loss_stops_with_message_and_keeps_last_checkpoint(tmp_path):
    output = tmp_path / "diverged"
    args = ["--output_dir", output, *TINY_UNET, "--max_train_steps", 20, "--checkpointing_steps", 1]
    args += ["--learning_rate", "1e30", "--lr_warmup_steps", 0, "--max_grad_norm", 0, "--lr_scheduler", "constant"]
    result = run_script(TRAIN_UNCONDITIONAL, args, check=False)
    assert result.returncode == 1, result.stderr
    checkpoints = sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert checkpoints, "no checkpoint was kept"
    assert f"The last good checkpoint is {checkpoints[-1]}" in result.stderr
    assert "the loss is nan" in result.stderr or "the loss is inf" in result.stderr
    assert not (output / "model_index.json").exists()


def test_push_to_hub_uploads_pipeline_and_snapshots(local_hub, tmp_path):
    from huggingface_hub import HfApi

    output = tmp_path / "pushed"
    args = [
        "--output_dir",
        output,
        *TINY_UNET,
        "--max_train_steps",
        2,
        "--ema_sigma_rels",
        "0.1",
        "--snapshot_every",
        1,
    ]
    args += ["--push_to_hub", "--hub_model_id", "trainer/tiny-ddpm"]
    hub_env = local_hub.env(hub_cache=tmp_path / "cache")
    run_script(
        TRAIN_UNCONDITIONAL,
        args,
        env={
            k: hub_env[k] for k in ("HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN")
        },
    )
    files = set(HfApi(endpoint=local_hub.endpoint).list_repo_files("trainer/tiny-ddpm"))
    assert {"model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors", "README.md"} <= files
    local_snapshots = {p.name for p in (output / "ema_snapshots").glob("*.safetensors")}
    assert len(local_snapshots) == 2 and all(any(f.endswith(name) for f in files) for name in local_snapshots)
    assert not any(f.startswith(("checkpoint-", "logs/", "samples/")) for f in files)
    card = HfApi(endpoint=local_hub.endpoint).hf_hub_download("trainer/tiny-ddpm", "README.md", cache_dir=tmp_path)
    assert "The weights are the raw training weights (no EMA)." in Path(card).read_text()  # no --use_ema


def test_a_network_that_does_not_fit_the_data_is_refused_before_anything_is_written(
    script, vanilla_pipeline, tmp_path, capsys
):
    """A 1-channel pretrained UNet and RGB images: one line naming both, before the output folder exists (diffusers'
    script finds out at the first forward pass, after its log folder was made)."""
    images = write_image_folder(tmp_path / "rgb", count=8, size=16)
    output = tmp_path / "never"
    error = _fails(
        script,
        capsys,
        ["--output_dir", output, "--pretrained_model_name_or_path", vanilla_pipeline, "--train_data_dir", images,
         "--resolution", "16", "--report_to", "tensorboard", "--max_train_steps", "2"],
    )  # fmt: skip
    assert "the network takes 1-channel input but the images have 3 channels" in error
    assert len([line for line in error.splitlines() if "error:" in line]) == 1 and not output.exists()
