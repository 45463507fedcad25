"""``--compile``: the training script trains a compiled EDM2 denoiser and reports the compilation apart."""

import re

import pytest
from _training_scripts import TRAIN_UNCONDITIONAL, load_script_module, run_script

TINY_EDM2 = [
    "--model", "edm2", "--model_channels", "8", "--channel_mult", "1", "2", "--layers_per_block", "1",
    "--attention_resolutions", "8", "--channels_per_head", "8", "--recipe", "edm2",
    "--resolution", "16", "--max_train_samples", "32", "--train_batch_size", "8", "--report_to", "none",
    "--num_grid_images", "4", "--num_inference_steps", "2", "--diagnostics_every", "0", "--max_train_steps", "3",
]  # fmt: skip


@pytest.mark.slow  # dynamo traces the EDM2 loss, preconditioner and network: minutes of CPU on a busy machine
def test_compiled_training_saves_a_pipeline_and_reports_the_compile_time(tmp_path):
    result = run_script(
        TRAIN_UNCONDITIONAL,
        [*TINY_EDM2, "--output_dir", tmp_path, "--compile", "--compile_backend", "eager"],
        timeout=900,
    )
    log = result.stdout + result.stderr
    match = re.search(r"torch.compile: first step ([\d.]+) s \(includes the compilation\), then ([\d.]+) s/step", log)
    assert match, log[-3000:]
    assert float(match[1]) > float(match[2])  # tracing happens in the first step only
    assert (tmp_path / "unet" / "diffusion_pytorch_model.safetensors").is_file()


def test_bad_compile_mode_is_refused_with_the_choices(tmp_path, capsys):
    script = load_script_module(TRAIN_UNCONDITIONAL)
    with pytest.raises(SystemExit) as exit_info:
        script.main([*TINY_EDM2, "--output_dir", str(tmp_path), "--compile_mode", "fast"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--compile_mode" in error and "max-autotune" in error
