"""Sample grids as diffusers' example scripts make them: --eval_batch_size images per sampler batch, one row per
class of a class-conditional run, one row per --validation_prompts prompt; logged to TensorBoard under diffusers'
tags (``test_samples``, ``validation``). Every grid row is checked against the saved pipeline sampled here."""

import numpy as np
import pytest
import torch
from _training_scripts import TRAIN_TEXT_TO_IMAGE, TRAIN_UNCONDITIONAL, load_script_module, write_image_folder
from diffusers import DDIMPipeline, DDIMScheduler, DDPMPipeline, StableDiffusionPipeline
from PIL import Image
from test_train_text_to_image import tiny_sd  # noqa: F401  (the tiny Stable-Diffusion pipeline fixture)

from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.trainer import images_from_numpy, make_image_grid

FAST = ["--max_train_steps", "1", "--save_images_steps", "1", "--report_to", "tensorboard", "--diagnostics_every", "0"]
UNET = ["--resolution", "8", "--max_train_samples", "16", "--train_batch_size", "8", "--num_inference_steps", "3"]
UNET += ["--block_out_channels", "8", "16", "--attention_levels", "--norm_num_groups", "4", "--layers_per_block", "1"]
EDM2 = ["--model", "edm2", "--recipe", "edm2", "--model_channels", "8", "--channel_mult", "1", "2"]
EDM2 += ["--layers_per_block", "1", "--attention_resolutions", "4", "--channels_per_head", "8"]


def _run(script_path, argv) -> None:
    assert load_script_module(script_path).main([str(a) for a in argv]) == 0


def _grid(output) -> np.ndarray:
    return np.asarray(Image.open(output / "samples" / "step-0000001.png"))


def _logged_images(output, run_name: str) -> dict[str, list[int]]:
    """TensorBoard image tags and the steps logged under each."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output / "logs" / run_name), size_guidance={"images": 0})
    events.Reload()
    return {tag: [event.step for event in events.Images(tag)] for tag in events.Tags()["images"]}


def test_eval_batch_size_is_the_unconditional_grid_sampled_as_one_batch(tmp_path):
    _run(TRAIN_UNCONDITIONAL, ["--output_dir", tmp_path, *UNET, *FAST, "--model", "unet2d", "--eval_batch_size", "3"])
    saved = DDPMPipeline.from_pretrained(tmp_path)
    sampler = DDIMPipeline(unet=saved.unet, scheduler=DDIMScheduler.from_config(saved.scheduler.config))
    images = sampler(
        batch_size=3, generator=torch.Generator().manual_seed(0), num_inference_steps=3, output_type="np"
    ).images
    expected = np.asarray(make_image_grid(images_from_numpy(images)))
    np.testing.assert_array_equal(_grid(tmp_path), expected)
    assert _logged_images(tmp_path, "train_unconditional") == {"test_samples": [1]}


def test_class_conditional_grid_has_one_row_per_class(tmp_path):
    argv = ["--output_dir", tmp_path, *UNET, *FAST, *EDM2, "--class_conditional", "--eval_batch_size", "2"]
    _run(TRAIN_UNCONDITIONAL, argv)
    saved = EDM2Pipeline.from_pretrained(tmp_path)
    rows = []
    for label in range(10):  # Fashion-MNIST's ten classes, each row from the same noise
        generator = torch.Generator().manual_seed(0)
        output = saved(class_labels=[label] * 2, generator=generator, num_inference_steps=3, output_type="np")
        rows.append(images_from_numpy(output.images))
    expected = np.asarray(make_image_grid(torch.cat(rows), nrow=2))
    np.testing.assert_array_equal(_grid(tmp_path), expected)
    assert _logged_images(tmp_path, "train_unconditional") == {"test_samples": [1]}


def test_validation_prompts_give_one_row_each(tiny_sd, tmp_path):  # noqa: F811
    data = write_image_folder(tmp_path / "data", count=4, size=16, captions=True)
    prompts = ["a pic", "a picture 7"]
    argv = ["--pretrained_model_name_or_path", tiny_sd, "--train_data_dir", data, "--output_dir", tmp_path / "out"]
    argv += ["--resolution", "16", "--train_batch_size", "2", "--num_inference_steps", "2", *FAST]
    _run(TRAIN_TEXT_TO_IMAGE, [*argv, "--eval_batch_size", "2", "--validation_prompts", *prompts])
    saved = StableDiffusionPipeline.from_pretrained(tmp_path / "out", safety_checker=None)
    rows = []
    for prompt in prompts:
        generator = torch.Generator().manual_seed(0)
        output = saved([prompt] * 2, num_inference_steps=2, generator=generator, output_type="np")
        rows.append(images_from_numpy(output.images))
    expected = np.asarray(make_image_grid(torch.cat(rows), nrow=2))
    np.testing.assert_array_equal(_grid(tmp_path / "out"), expected)
    assert _logged_images(tmp_path / "out", "train_text_to_image") == {"validation": [1]}


@pytest.mark.parametrize("flag", ["--validation_prompt", "--validation_prompts"])
def test_one_validation_prompt_keeps_working(flag):
    config_class = load_script_module(TRAIN_TEXT_TO_IMAGE).TextToImageConfig
    config = config_class.from_command_line(
        ["--pretrained_model_name_or_path", "p", "--output_dir", "o", flag, "a pic"]
    )
    assert config.validation_prompts == ("a pic",)
