"""An EDM2 run's final pipeline keeps the preconditioner (uncertainty head, sigma_data) as the EDM2 converter does, and
fine-tuning from that folder continues the trained head instead of starting a fresh one."""

import torch
from _training_scripts import TRAIN_UNCONDITIONAL, run_script
from safetensors.torch import load_file

from diffusers_scalelong.edm2 import EDMPreconditioner, LearnedUncertainty

TINY_EDM2 = [
    "--model", "edm2", "--recipe", "edm2", "--model_channels", "8", "--channel_mult", "1", "2",
    "--layers_per_block", "1", "--attention_resolutions", "--channels_per_head", "8", "--resolution", "16",
    "--max_train_samples", "32", "--train_batch_size", "8", "--report_to", "none", "--diagnostics_every", "0",
]  # fmt: skip


def _uncertainty(folder):
    return load_file(folder / "uncertainty" / "diffusion_pytorch_model.safetensors")


def test_final_pipeline_keeps_the_head_and_fine_tuning_continues_it(tmp_path):
    first = tmp_path / "first"
    run_script(
        TRAIN_UNCONDITIONAL, ["--output_dir", first, *TINY_EDM2, "--max_train_steps", 3, "--checkpointing_steps", 3]
    )
    # the folder loads as the converter's layout: the pipeline's UNet and the trained head with sigma_data
    loaded = EDMPreconditioner.from_pretrained(first)
    assert loaded.sigma_data == 0.5 and isinstance(loaded.uncertainty, LearnedUncertainty)
    trained_head = _uncertainty(first / "checkpoint-3")
    saved_head = _uncertainty(first)
    assert trained_head.keys() == saved_head.keys()
    assert all((trained_head[k] == saved_head[k]).all() for k in trained_head)  # the head after the last step
    fresh = LearnedUncertainty().state_dict()
    assert any(not (fresh[k] == saved_head[k]).all() for k in fresh)  # it is not an untrained head

    # fine-tuning from the run's own output: with an lr far below float32 resolution one Adam step moves no weight,
    # so the head at the end is the one it started from as a training forward leaves it (magnitude-preserving layers
    # normalise their stored weights in place): the saved head's, not a new one's
    second = tmp_path / "second"
    run_script(
        TRAIN_UNCONDITIONAL,
        ["--output_dir", second, *TINY_EDM2, "--pretrained_model_name_or_path", first, "--max_train_steps", 1,
         "--learning_rate", "1e-30", "--lr_warmup_steps", "0"],
    )  # fmt: skip
    expected = LearnedUncertainty.from_pretrained(first / "uncertainty").train()
    expected(torch.zeros(8))  # the forward normalises the weights as the fine-tuning step did
    expected = expected.state_dict()
    continued = _uncertainty(second)
    assert all(torch.equal(continued[k], expected[k]) for k in expected)
