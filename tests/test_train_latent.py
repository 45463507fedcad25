"""Fine-tuning an imported EDM2 latent pipeline on VAE latents: cached moments, resume, sampling through the VAE.

The imported pipeline is converted from a fake-official latent pickle (see ``test_convert_edm2``) with a tiny
``AutoencoderKL`` (3 latent channels, 2x down-sampling), so the 16x16 latent network works on 32x32 images.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _training_scripts import TRAIN_UNCONDITIONAL, load_script_module, run_script, write_image_folder
from diffusers import AutoencoderKL
from PIL import Image
from safetensors.torch import load_file
from test_convert_edm2 import official  # noqa: F401  (fixture: fake official modules and pickle writer)

from diffusers_scalelong import EDM2Pipeline, LearnedUncertainty
from diffusers_scalelong.convert import convert_edm2_pickle

PIXELS = 32
RUN = [
    "--recipe", "edm2", "--resolution", str(PIXELS), "--center_crop", "--train_batch_size", "4",
    "--learning_rate", "1e-4", "--report_to", "none", "--num_grid_images", "2", "--num_inference_steps", "2",
    "--checkpointing_steps", "2",
]  # fmt: skip


@pytest.fixture
def imported(official, tmp_path):  # noqa: F811
    """An EDM2 latent pipeline folder converted from a fake-official pickle, and its VAE."""
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=3, block_out_channels=(8, 8), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, sample_size=PIXELS,
    )  # fmt: skip
    vae.save_pretrained(tmp_path / "vae")
    official.write(tmp_path / "net.pkl", latent=True, conditional=False)
    convert_edm2_pickle(tmp_path / "net.pkl", tmp_path / "imported", vae=tmp_path / "vae")
    return tmp_path / "imported"


def test_finetune_imported_latent_pipeline_with_cached_latents_then_resume(imported, tmp_path):
    data = write_image_folder(tmp_path / "images", count=8, size=PIXELS)
    out = tmp_path / "run"
    args = ["--output_dir", out, "--pretrained_model_name_or_path", imported, "--train_data_dir", data, *RUN]
    run_script(TRAIN_UNCONDITIONAL, [*args, "--max_train_steps", "2"])

    (cache,) = (out / "latents").glob("latents-*.safetensors")
    moments = load_file(cache)["moments"]
    assert moments.shape == (8, 6, PIXELS // 2, PIXELS // 2)
    # The moments of image 0, computed here: pixels / 255 (the imported pipeline's VAE range is [0, 1]).
    vae = EDM2Pipeline.from_pretrained(imported).vae
    pixels = torch.from_numpy(np.asarray(Image.open(data / "000.png"), dtype=np.float32) / 255).permute(2, 0, 1)
    with torch.no_grad():
        posterior = vae.encode(pixels[None]).latent_dist
    expected = torch.cat([posterior.mean, posterior.std], dim=1)[0]
    torch.testing.assert_close(moments[0], expected, atol=1e-5, rtol=1e-5)  # same float32 VAE, another batch size

    # Fine-tuning starts from the imported uncertainty head: its Fourier buffers are never trained.
    imported_head = LearnedUncertainty.from_pretrained(imported / "uncertainty")
    trained_head = LearnedUncertainty.from_pretrained(out / "checkpoint-2" / "uncertainty")
    assert torch.equal(trained_head.fourier.freqs, imported_head.fourier.freqs)
    assert not torch.equal(trained_head.linear.weight, imported_head.linear.weight)  # but it is trained

    stamp = cache.stat().st_mtime_ns
    run_script(TRAIN_UNCONDITIONAL, [*args, "--max_train_steps", "4", "--resume_from_checkpoint", "latest"])
    assert list((out / "latents").glob("latents-*")) == [cache] and cache.stat().st_mtime_ns == stamp

    pipe = EDM2Pipeline.from_pretrained(out)
    assert pipe.vae is not None and pipe.config.vae_pixel_range == "[0, 1]"
    images = pipe(batch_size=2, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np")
    assert images.images.shape == (2, PIXELS, PIXELS, 3) and (out / "checkpoint-4").is_dir()


@pytest.mark.slow
def test_latent_training_without_cache_encodes_every_batch(imported, tmp_path):
    data = write_image_folder(tmp_path / "images", count=4, size=PIXELS)
    out = tmp_path / "run"
    args = ["--output_dir", out, "--pretrained_model_name_or_path", imported, "--train_data_dir", data, *RUN]
    run_script(TRAIN_UNCONDITIONAL, [*args, "--max_train_steps", "1", "--no-cache_latents"])
    assert not (out / "latents").exists() and EDM2Pipeline.from_pretrained(out).vae is not None


def test_latent_option_errors_name_the_option(imported, tmp_path):
    data = write_image_folder(tmp_path / "images", count=4, size=PIXELS)
    base = [
        "--output_dir",
        tmp_path / "run",
        "--pretrained_model_name_or_path",
        imported,
        "--train_data_dir",
        data,
        *RUN,
    ]
    script = load_script_module(TRAIN_UNCONDITIONAL)
    failing = {
        "cache_latents encodes each image once": [*base, "--random_flip"],
        "vae .* needs recipe edm2": [
            "--output_dir", tmp_path / "x", "--train_data_dir", data, "--vae", imported / "vae", "--recipe", "ddpm",
        ],
        "vae_pixel_range needs a VAE": ["--output_dir", tmp_path / "y", "--vae_pixel_range", "[0, 1]"],
        "resolution 33 must be a multiple": [*base, "--resolution", "33", "--allow_upscaling"],
        "vae .* could not be loaded": [*base, "--vae", tmp_path / "no-such-vae"],
    }  # fmt: skip
    for message, argv in failing.items():
        with pytest.raises(ValueError, match=message):
            script.build_job(script.UnconditionalConfig.from_command_line([str(a) for a in argv]))


def test_a_run_refused_at_set_up_writes_no_latent_cache(imported, tmp_path, capsys):
    """The latent cache is filled only once the run holds its output folder: a run refused while it is set up (here
    4 images cannot fill one step of a batch of 8) leaves no folder behind, though its latents would be cached."""
    data = write_image_folder(tmp_path / "images", count=4, size=PIXELS)
    output = tmp_path / "run"
    argv = ["--output_dir", output, "--pretrained_model_name_or_path", imported, "--train_data_dir", data, *RUN]
    with pytest.raises(SystemExit) as stop:
        load_script_module(TRAIN_UNCONDITIONAL).main([str(a) for a in [*argv, "--train_batch_size", 8]])
    assert stop.value.code == 2 and "give no full optimiser step" in capsys.readouterr().err
    assert not output.exists()
