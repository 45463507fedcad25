"""--gradient_checkpointing, --allow_tf32, --logger / --report_to of the training scripts (diffusers' names)."""

import copy
import importlib.util

import pytest
import torch
from _tiny_models import TINY_ATTENTION_UNET, TINY_UNET
from _training_scripts import TINY_UNET as TINY_UNET_ARGS
from _training_scripts import TRAIN_UNCONDITIONAL, load_script_module, run_script
from diffusers import DDPMScheduler
from safetensors.torch import load_file

from diffusers_scalelong import ScaleLongUNet2DModel
from diffusers_scalelong.trainer import DDPMRecipe, TrainingConfig
from diffusers_scalelong.trainer.compute import adamw_class, apply_compute_options


def compute_args(**overrides) -> TrainingConfig:
    return TrainingConfig(output_dir="unused", report_to="none", **overrides)


def loss_and_grads(unet: torch.nn.Module, images: torch.Tensor):
    torch.manual_seed(1)
    loss = DDPMRecipe(DDPMScheduler()).loss(unet, images)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in unet.named_parameters()}


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    unet = ScaleLongUNet2DModel(**TINY_UNET, lsc_method="cs", lsc_kappa=0.5)
    checkpointed = copy.deepcopy(unet)
    apply_compute_options(compute_args(gradient_checkpointing=True), checkpointed)
    assert checkpointed.is_gradient_checkpointing and not unet.is_gradient_checkpointing
    images = torch.rand(4, 1, 8, 8) * 2 - 1
    loss, grads = loss_and_grads(unet, images)
    loss_ckpt, grads_ckpt = loss_and_grads(checkpointed, images)
    assert torch.equal(loss, loss_ckpt)  # the forward pass is the same computation
    for name, grad in grads.items():  # the backward pass recomputes the same activations: same gradients
        assert torch.equal(grad, grads_ckpt[name]), name


def test_gradient_checkpointing_refuses_a_model_without_it():
    with pytest.raises(ValueError, match="gradient_checkpointing: Linear does not support it"):
        apply_compute_options(compute_args(gradient_checkpointing=True), torch.nn.Linear(2, 2))


def test_allow_tf32_sets_torch_flags():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        apply_compute_options(compute_args(), torch.nn.Linear(2, 2))
        assert not torch.backends.cuda.matmul.allow_tf32
        apply_compute_options(compute_args(allow_tf32=True), torch.nn.Linear(2, 2))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.skipif(
    importlib.util.find_spec("xformers") is not None, reason="the message is for machines without xformers"
)
def test_xformers_flag_without_xformers_says_so_and_changes_nothing(caplog):
    unet = ScaleLongUNet2DModel(**TINY_ATTENTION_UNET)
    processors = [type(m.processor) for m in unet.modules() if hasattr(m, "processor")]
    apply_compute_options(compute_args(enable_xformers_memory_efficient_attention=True), unet)
    assert "xformers is not installed; attention keeps torch's scaled_dot_product_attention" in caplog.text
    assert processors and [type(m.processor) for m in unet.modules() if hasattr(m, "processor")] == processors


def test_8bit_adam_needs_bitsandbytes():
    assert adamw_class(compute_args()) is torch.optim.AdamW
    script = load_script_module(TRAIN_UNCONDITIONAL)
    argv = ["--output_dir", "x", "--use_8bit_adam"]
    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(ValueError, match="use_8bit_adam needs the bitsandbytes package: pip install bitsandbytes"):
            script.UnconditionalConfig.from_command_line(argv)
    else:
        import bitsandbytes

        assert adamw_class(script.UnconditionalConfig.from_command_line(argv)) is bitsandbytes.optim.AdamW8bit


def test_logger_is_report_to_and_wandb_needs_its_package():
    script = load_script_module(TRAIN_UNCONDITIONAL)
    assert script.UnconditionalConfig.from_command_line(["--output_dir", "x", "--logger", "none"]).report_to == "none"
    argv = ["--output_dir", "x", "--report_to", "wandb"]
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ValueError, match="report_to wandb needs the wandb package: pip install wandb"):
            script.UnconditionalConfig.from_command_line(argv)
    else:
        assert script.UnconditionalConfig.from_command_line(argv).report_to == "wandb"


def test_checkpointed_run_trains_the_same_weights(tmp_path):
    """Two 2-step runs that differ only by --gradient_checkpointing save identical UNets (the other new flags on)."""
    common = [*TINY_UNET_ARGS, "--max_train_steps", "2", "--checkpointing_steps", "100", "--logger", "none"]
    common += ["--allow_tf32", "--snr_gamma", "5", "--noise_offset", "0.05"]
    weights = []
    for name, extra in (("plain", []), ("checkpointed", ["--gradient_checkpointing"])):
        run_script(TRAIN_UNCONDITIONAL, ["--output_dir", tmp_path / name, *common, *extra])
        weights.append(load_file(tmp_path / name / "unet" / "diffusion_pytorch_model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    for key, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][key]), key
