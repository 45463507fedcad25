"""The training scripts take every flag of diffusers' example scripts they stand in for, with the same meaning or a
one-line refusal naming this package's way, and their --help shows each default once."""

import re
import subprocess
import sys

import pytest
from _training_scripts import ROOT, TRAIN_TEXT_TO_IMAGE, TRAIN_UNCONDITIONAL, load_script_module, script_env

# The flags of diffusers' examples/unconditional_image_generation/train_unconditional.py and
# examples/text_to_image/train_text_to_image.py (diffusers 0.3x-0.4x), as their argparse parsers define them.
DIFFUSERS_UNCONDITIONAL = """
dataset_name dataset_config_name model_config_name_or_path train_data_dir output_dir overwrite_output_dir cache_dir
resolution center_crop random_flip train_batch_size eval_batch_size dataloader_num_workers num_epochs
save_images_epochs save_model_epochs gradient_accumulation_steps learning_rate lr_scheduler lr_warmup_steps
adam_beta1 adam_beta2 adam_weight_decay adam_epsilon use_ema ema_inv_gamma ema_power ema_max_decay push_to_hub
hub_token hub_model_id hub_private_repo logger logging_dir local_rank mixed_precision prediction_type ddpm_num_steps
ddpm_num_inference_steps ddpm_beta_schedule checkpointing_steps checkpoints_total_limit resume_from_checkpoint
enable_xformers_memory_efficient_attention
""".split()
DIFFUSERS_TEXT_TO_IMAGE = """
input_perturbation pretrained_model_name_or_path revision variant dataset_name dataset_config_name train_data_dir
image_column caption_column max_train_samples validation_prompts output_dir cache_dir seed resolution center_crop
random_flip train_batch_size num_train_epochs max_train_steps gradient_accumulation_steps gradient_checkpointing
learning_rate scale_lr lr_scheduler snr_gamma dream_training dream_detail_preservation use_8bit_adam allow_tf32
use_ema offload_ema foreach_ema non_ema_revision dataloader_num_workers adam_beta1 adam_beta2 adam_weight_decay
adam_epsilon max_grad_norm push_to_hub hub_token prediction_type hub_model_id logging_dir mixed_precision report_to
local_rank checkpointing_steps checkpoints_total_limit resume_from_checkpoint
enable_xformers_memory_efficient_attention noise_offset validation_epochs tracker_project_name
image_interpolation_mode
""".split()
REFUSED = {"dream_training": [], "dream_detail_preservation": ["1.0"], "non_ema_revision": ["main"]}


def _flags(script) -> set[str]:
    module = load_script_module(script)
    config = getattr(module, "UnconditionalConfig", None) or module.TextToImageConfig
    from diffusers_scalelong.trainer import build_parser

    return set(build_parser(config, "").__dict__["_option_string_actions"])


@pytest.mark.parametrize(
    "script,flags", [(TRAIN_UNCONDITIONAL, DIFFUSERS_UNCONDITIONAL), (TRAIN_TEXT_TO_IMAGE, DIFFUSERS_TEXT_TO_IMAGE)]
)
def test_every_diffusers_flag_is_known(script, flags):
    assert {f"--{flag}" for flag in flags} - _flags(script) == set()


@pytest.mark.parametrize("flag,values", REFUSED.items())
def test_flags_this_package_does_not_offer_are_refused_in_one_line(flag, values, capsys):
    main = load_script_module(TRAIN_TEXT_TO_IMAGE).main
    with pytest.raises(SystemExit) as stop:
        main(["--pretrained_model_name_or_path", "p", "--output_dir", "o", f"--{flag}", *values])
    assert stop.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "not offered by this script" in line and f"--{flag.split('_detail')[0]}" in line


@pytest.mark.parametrize("script", [TRAIN_UNCONDITIONAL, TRAIN_TEXT_TO_IMAGE])
def test_help_shows_each_default_once(script):
    result = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, env=script_env(), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert text.count("(default:") > 10 and not re.search(r"\(default:[^()]*\) \(default:", text)
    if script == TRAIN_TEXT_TO_IMAGE:  # the text-to-image script has no --recipe
        assert "recipe" not in text


def test_prediction_type_and_input_perturbation_reach_the_loss(tmp_path):
    """--prediction_type sample trains on x_0 (diffusers' unconditional script); --input_perturbation perturbs the
    network's input noise only: both are read back from the recipe the script builds."""
    script = load_script_module(TRAIN_UNCONDITIONAL)
    config = script.UnconditionalConfig.from_command_line(["--output_dir", "x", "--prediction_type", "sample"])
    recipe = script.build_recipe(config, script.PretrainedEDM2Parts(), None)
    assert recipe.noise_scheduler.config.prediction_type == "sample"


def test_parameter_names_become_flags_and_nothing_else_does():
    """What script_main prints for a library error: parameter names as flags (the option's own name, or the library's
    name an option declares), never inside a path, a longer name, an existing flag or an everyday word."""
    from diffusers_scalelong.trainer import flag_message

    config = load_script_module(TRAIN_UNCONDITIONAL).UnconditionalConfig
    assert flag_message("P_std must lie in (0, 6.9], got -1.0", config) == "--P_std must lie in (0, 6.9], got -1.0"
    assert flag_message("lsc_method 'cs' needs lsc_kappa > 0", config) == "--lsc 'cs' needs --kappa > 0"
    assert flag_message("sigma_rels must be distinct", config) == "--ema_sigma_rels must be distinct"
    unchanged = [
        "/runs/output_dir/model_index.json is missing",  # inside a path
        "--output_dir is not writable",  # already a flag
        "the model and its seed",  # one-word fields that are everyday words
        "max_train_steps_total is unknown",  # a longer identifier
    ]
    for message in unchanged:
        assert flag_message(message, config) == message
