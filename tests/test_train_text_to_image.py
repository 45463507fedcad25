"""train_text_to_image.py fine-tunes a tiny, randomly initialised Stable-Diffusion-style pipeline built here."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from _training_scripts import ROOT, TRAIN_TEXT_TO_IMAGE, run_script, script_env, write_image_folder
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel


def _tiny_tokenizer(folder):
    """A CLIP BPE tokenizer over single characters (plus two merges), built from files written here."""
    from transformers import CLIPTokenizer

    symbols = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    vocab = ["<|startoftext|>", "<|endoftext|>", *symbols, *(s + "</w>" for s in symbols), "pi", "pic", "pic</w>"]
    (folder / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\np i\npi c\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=12)


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    from transformers import CLIPTextConfig, CLIPTextModel

    folder = tmp_path_factory.mktemp("tiny_sd")
    tokenizer = _tiny_tokenizer(tmp_path_factory.mktemp("vocab"))
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=12, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )
    )  # fmt: skip
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"), up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    )  # fmt: skip
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4,
    )  # fmt: skip
    pipeline = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=DDIMScheduler(),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    pipeline.save_pretrained(folder)
    return folder


def test_text_to_image_finetune_with_cs_saves_and_loads(tiny_sd, tmp_path):
    data = write_image_folder(tmp_path / "data", count=8, size=16, captions=True)
    output = tmp_path / "out"
    args = ["--pretrained_model_name_or_path", tiny_sd, "--train_data_dir", data, "--output_dir", output]
    args += [
        "--resolution",
        "16",
        "--lsc",
        "cs",
        "--kappa",
        "0.5",
        "--train_batch_size",
        "2",
        "--learning_rate",
        "1e-3",
    ]
    args += ["--max_train_steps", "4", "--checkpointing_steps", "2", "--report_to", "none", "--random_flip"]
    args += [
        "--ema_sigma_rels",
        "0.1",
        "--snapshot_every",
        "2",
        "--validation_prompt",
        "a pic",
        "--save_images_steps",
        "4",
    ]
    args += ["--num_grid_images", "2", "--num_inference_steps", "2"]
    run_script(TRAIN_TEXT_TO_IMAGE, args)
    assert (output / "samples" / "step-0000004.png").is_file()
    assert len(list((output / "ema_snapshots").iterdir())) == 2  # steps 2 and 4, one profile

    check = textwrap.dedent("""
        import sys, torch
        import diffusers_scalelong
        from diffusers import DiffusionPipeline
        pipe = DiffusionPipeline.from_pretrained(sys.argv[1])
        image = pipe("a pic", num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)).images
        assert image.shape == (1, 16, 16, 3), image.shape
        print(type(pipe).__name__, type(pipe.unet).__name__, pipe.unet.config.lsc_method, type(pipe.scheduler).__name__)
    """)
    result = subprocess.run(
        [sys.executable, "-c", check, str(output)], capture_output=True, text=True, env=script_env(), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "StableDiffusionPipeline ScaleLongUNet2DConditionModel cs DDIMScheduler"

    from safetensors.torch import load_file

    before = load_file(tiny_sd / "unet" / "diffusion_pytorch_model.safetensors")
    after = load_file(output / "unet" / "diffusion_pytorch_model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    for frozen in ("vae", "text_encoder"):  # frozen components are saved unchanged
        (name,) = [p.name for p in (tiny_sd / frozen).glob("*.safetensors")]
        old, new = load_file(tiny_sd / frozen / name), load_file(output / frozen / name)
        assert all(torch.equal(old[k], new[k]) for k in old)


def test_text_to_image_rejects_data_without_captions(tiny_sd, tmp_path):
    data = write_image_folder(tmp_path / "uncaptioned", count=2, size=16, captions=False)
    args = [
        "--pretrained_model_name_or_path",
        tiny_sd,
        "--train_data_dir",
        data,
        "--output_dir",
        tmp_path / "o",
        "--resolution",
        "16",
    ]
    result = run_script(TRAIN_TEXT_TO_IMAGE, args, check=False)
    assert result.returncode == 2
    assert "--caption_column 'text' not found" in result.stderr
    assert not (tmp_path / "o" / "logs").exists()
