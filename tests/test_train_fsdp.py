"""train_unconditional.py --distributed_type fsdp: the EDM2 recipe (ScaleLong LS gates, learned uncertainty, post-hoc
EMA, gradient checkpointing) with FSDP2-sharded parameters on 2 CPU processes, against data-parallel training of the
same batches with the same random streams; exact resume from its checkpoints; refusals that name the option. Slow:
train_text_to_image.py fine-tuning a tiny Stable Diffusion UNet sharded, against data parallel."""

import json
import socket
import subprocess
import sys

import pytest
import torch
from _training_scripts import (
    ROOT,
    TRAIN_TEXT_TO_IMAGE,
    TRAIN_UNCONDITIONAL,
    load_script_module,
    run_script,
    script_env,
    tensors_equal,
    write_image_folder,
)
from safetensors import safe_open
from safetensors.torch import load_file
from test_train_text_to_image import tiny_sd  # noqa: F401  (the tiny Stable-Diffusion pipeline fixture)

from diffusers_scalelong.trainer import Checkpoint

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

STEPS = 6
MAX_GRAD_NORM = 500.0  # unclipped norms grow from ~200 to ~2000 in these 6 steps: some are clipped, some not
RUN = [
    "--model", "edm2", "--recipe", "edm2", "--lsc", "ls", "--model_channels", "16", "--channel_mult", "1", "2",
    "--layers_per_block", "1", "--attention_resolutions", "8", "--channels_per_head", "16", "--resolution", "16",
    "--max_train_samples", "64", "--train_batch_size", "4", "--report_to", "none", "--num_grid_images", "4",
    "--num_inference_steps", "4", "--checkpointing_steps", "3", "--ema_sigma_rels", "0.05", "0.10",
    "--snapshot_every", "3", "--save_images_steps", "3", "--gradient_checkpointing", "--learning_rate", "0.02",
    "--lr_warmup_steps", "0", "--max_grad_norm", str(MAX_GRAD_NORM),
]  # fmt: skip
# Files at the last step, each with its counterpart at step 3 (to measure how much training changed it).
FILES = {
    "checkpoint-6/unet/diffusion_pytorch_model.safetensors": "checkpoint-3/unet/diffusion_pytorch_model.safetensors",
    "checkpoint-6/uncertainty/diffusion_pytorch_model.safetensors": "checkpoint-3/uncertainty/"
    "diffusion_pytorch_model.safetensors",
    "checkpoint-6/posthoc_ema.safetensors": "checkpoint-3/posthoc_ema.safetensors",
    "ema_snapshots/phema-0000000006-0.050.safetensors": "ema_snapshots/phema-0000000003-0.050.safetensors",
    "ema_snapshots/phema-0000000006-0.100.safetensors": "ema_snapshots/phema-0000000003-0.100.safetensors",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(output, *extra, launcher: str = "accelerate", script=TRAIN_UNCONDITIONAL, run=RUN) -> str:
    """Train ``script`` with the options ``run`` and ``extra`` in 2 processes started by ``accelerate launch`` or
    ``torchrun``; returns their output."""
    if launcher == "accelerate":
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
        command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        command += ["--num_cpu_threads_per_process", "1", "--main_process_port", str(_free_port())]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{_free_port()}"]
    command += [str(script), "--output_dir", str(output), *map(str, run), *map(str, extra)]
    result = subprocess.run(command, capture_output=True, text=True, env=script_env(), cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


def _files(output) -> set[str]:
    return {str(p.relative_to(output)) for p in output.rglob("*") if p.is_file() and "logs" not in p.parts}


def _logged(output, tag: str) -> torch.Tensor:
    """The values TensorBoard received for ``tag``, one per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (output / "logs" / "train_unconditional").glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    scalars = accumulator.Scalars(tag)
    assert [s.step for s in scalars] == list(range(1, STEPS + 1))
    return torch.tensor([s.value for s in scalars])


def _assert_same_training(sharded, replicated, files: dict[str, str]) -> None:
    """Each file of ``files`` (final: earlier) holds the same tensors in both runs, up to float rounding."""
    for name, earlier in files.items():
        ours, theirs, before = (load_file(path) for path in (sharded / name, replicated / name, sharded / earlier))
        assert ours.keys() == theirs.keys() == before.keys(), name
        difference = sum((ours[k] - theirs[k]).square().sum() for k in theirs).sqrt()
        change = sum((theirs[k] - before[k]).square().sum() for k in theirs).sqrt()
        # Same batches, same noise, float32: the processes' gradients are summed by a reduce-scatter instead of an
        # all-reduce (another order of the same additions). Adam's g / sqrt(v) turns the last-bit differences of a
        # few near-zero gradient entries into differences up to ~1e-4, so the files are compared as a whole: the
        # difference is 1.5e-5 of what steps 4-6 changed in the EDM2 run (measured), while sharding mistakes (an
        # unprojected shard, a gradient not averaged) make it of order 1.
        assert difference < 1e-3 * change, (name, difference.item(), change.item())


# One test: its 4 launches share the runs (a fixture shared by two tests could run on both pytest workers).
def test_sharded_training_equals_data_parallel_training_and_resumes_exactly(tmp_path):
    sharded, replicated = tmp_path / "fsdp", tmp_path / "ddp"
    log = _launch(sharded, "--max_train_steps", STEPS, "--distributed_type", "fsdp", "--report_to", "tensorboard")
    _launch(replicated, "--max_train_steps", STEPS, "--report_to", "tensorboard")
    # gradient clipping: the norm over sharded and replicated gradients equals the data-parallel one, and clips
    norms = [_logged(output, "grad_norm") for output in (sharded, replicated)]
    torch.testing.assert_close(*norms, rtol=1e-5, atol=0)  # float32 sums of squares in another order: ~1e-7
    assert (norms[1] > MAX_GRAD_NORM).any() and (norms[1] < MAX_GRAD_NORM).any(), norms[1]
    assert "ScaleLong diagnostics are off with sharded parameters" in log
    assert log.count("pipeline saved to") == 1
    # the same files, written once: models, optimiser state, EMA state and snapshots in full (unsharded) form
    assert _files(sharded) == _files(replicated)
    _assert_same_training(sharded, replicated, FILES)
    final, before = (load_file(sharded / name) for name in next(iter(FILES.items())))  # the UNet at steps 6 and 3
    assert max((final[k] - before[k]).abs().max().item() for k in final) > 1e-2, "the model did not train"
    gates = [k for k in final if k.startswith("lsc.gates.")]  # ScaleLong's LS calibration, sharded with the UNet
    assert gates and all(not torch.equal(final[k], before[k]) for k in gates)
    # the snapshots name the model's own class (not FSDP's subclass) and the run's step, like the unsharded run's
    for name in list(FILES)[3:]:
        with safe_open(str(sharded / name), "pt") as ours, safe_open(str(replicated / name), "pt") as theirs:
            ours, theirs = json.loads(ours.metadata()["phema"]), json.loads(theirs.metadata()["phema"])
        assert ours["model_class"] == theirs["model_class"] == "diffusers_scalelong.models.edm2_unet.EDM2UNet2DModel"
        differing = {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}
        # two runs, last-bit different tensors (the header checksum covers both)
        assert differing == {"run_id", "content_sha256", "header_sha256"}
    assert Checkpoint(sharded / "checkpoint-6").verify()["distributed_type"] == "fsdp"

    # Interrupted after 3 steps, then resumed: the uninterrupted run's files bit for bit.
    output = tmp_path / "resumed"
    _launch(output, "--max_train_steps", 3, "--distributed_type", "fsdp", launcher="torchrun")
    # a sharded run's checkpoint keeps the optimiser state by parameter name: resuming it data parallel is refused
    result = run_script(
        TRAIN_UNCONDITIONAL,
        ["--output_dir", output, *RUN, "--max_train_steps", STEPS, "--resume_from_checkpoint", "latest"],
        check=False,
    )
    assert result.returncode == 2
    assert "was written with --distributed_type fsdp" in result.stderr
    assert "resume it with --distributed_type fsdp" in result.stderr
    log = _launch(
        output, "--max_train_steps", STEPS, "--distributed_type", "fsdp", "--resume_from_checkpoint", "latest"
    )
    assert "Resuming from" in log
    # model, optimiser (full tensors keyed by name, re-sharded on load), post-hoc EMA state, RNG streams: bit for bit
    for name in [*FILES, "unet/diffusion_pytorch_model.safetensors"]:
        tensors_equal(sharded / name, output / name, same_run=False)
    ours = torch.load(output / "checkpoint-6" / "optimizer.bin", weights_only=True)
    theirs = torch.load(sharded / "checkpoint-6" / "optimizer.bin", weights_only=True)
    assert ours["state"].keys() == theirs["state"].keys() and "unet.conv_out.weight" in ours["state"]
    for key, moments in theirs["state"].items():
        for name, tensor in moments.items():
            assert torch.equal(ours["state"][key][name], tensor), (key, name)


def test_refusals_name_the_problem(tmp_path, capsys):
    # one process has nothing to shard over
    result = run_script(
        TRAIN_UNCONDITIONAL,
        ["--output_dir", tmp_path / "single", *RUN, "--max_train_steps", 1, "--distributed_type", "fsdp"],
        check=False,
    )
    assert result.returncode == 2
    assert "--distributed_type fsdp shards the model over processes: launch 2 or more" in result.stderr
    assert not (tmp_path / "single").exists()  # refused before anything is written
    # options that need whole parameters on one process
    script = load_script_module(TRAIN_UNCONDITIONAL)
    base = ["--output_dir", str(tmp_path / "refused"), *RUN, "--distributed_type", "fsdp"]
    for extra, message in (
        (["--use_ema"], "--distributed_type fsdp does not support --use_ema"),
        (["--mixed_precision", "fp16", "--compile"], "does not support --compile, --mixed_precision fp16"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            script.main([*base, *extra])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow  # a tiny Stable Diffusion fine-tuned in 2 launches of 2 processes: about a minute
def test_text_to_image_unet_sharded_equals_data_parallel(tiny_sd, tmp_path):  # noqa: F811
    data = write_image_folder(tmp_path / "data", count=8, size=16, captions=True)
    run = ["--pretrained_model_name_or_path", tiny_sd, "--train_data_dir", data, "--resolution", 16, "--lsc", "cs"]
    run += ["--kappa", 0.5, "--train_batch_size", 2, "--learning_rate", "1e-3", "--max_train_steps", 4]
    run += ["--checkpointing_steps", 2, "--report_to", "none", "--ema_sigma_rels", 0.1, "--snapshot_every", 2]
    sharded, replicated = tmp_path / "fsdp", tmp_path / "ddp"
    _launch(sharded, "--distributed_type", "fsdp", script=TRAIN_TEXT_TO_IMAGE, run=run)
    _launch(replicated, script=TRAIN_TEXT_TO_IMAGE, run=run)
    assert _files(sharded) == _files(replicated)
    unet = "unet/diffusion_pytorch_model.safetensors"
    files = {f"checkpoint-4/{unet}": f"checkpoint-2/{unet}"}
    files["ema_snapshots/phema-0000000004-0.100.safetensors"] = "ema_snapshots/phema-0000000002-0.100.safetensors"
    _assert_same_training(sharded, replicated, files)
