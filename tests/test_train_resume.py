"""Exact resume: a run killed with SIGKILL and resumed ends identical to an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time

import pytest
from _training_scripts import ROOT, TINY_UNET, TRAIN_UNCONDITIONAL, run_script, script_env, tensors_equal

from diffusers_scalelong.ema import list_snapshots
from diffusers_scalelong.trainer import Checkpoint

STEPS = 30
RUN = [*TINY_UNET, "--max_train_steps", STEPS, "--checkpointing_steps", 10, "--seed", 3, "--random_flip"]
RUN += ["--ema_sigma_rels", "0.05", "0.10", "--snapshot_every", 5, "--use_ema", "--ema_max_decay", "0.9"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    output = tmp_path_factory.mktemp("uninterrupted")
    run_script(TRAIN_UNCONDITIONAL, ["--output_dir", output, *RUN])
    return output


def _kill_after_checkpoint(output, checkpoint: str) -> None:
    command = [sys.executable, str(TRAIN_UNCONDITIONAL), "--output_dir", str(output), *map(str, RUN)]
    process = subprocess.Popen(command, env=script_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (output / checkpoint / "training_state.json").exists():
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    assert not (output / "model_index.json").exists(), "the run finished before it was killed"


def test_sigkill_then_resume_latest_is_identical(uninterrupted, tmp_path):
    output = tmp_path / "killed"
    _kill_after_checkpoint(output, "checkpoint-10")
    result = run_script(TRAIN_UNCONDITIONAL, ["--output_dir", output, *RUN, "--resume_from_checkpoint", "latest"])
    assert "Resuming from" in result.stdout + result.stderr

    # live weights, classic EMA and post-hoc EMA state at the last step, and the saved pipeline (classic EMA weights)
    final = f"checkpoint-{STEPS}"
    for name in (
        "unet/diffusion_pytorch_model.safetensors",
        "unet_ema/diffusion_pytorch_model.safetensors",
        "posthoc_ema.safetensors",
    ):
        tensors_equal(uninterrupted / final / name, output / final / name, same_run=False)
    tensors_equal(
        uninterrupted / "unet/diffusion_pytorch_model.safetensors", output / "unet/diffusion_pytorch_model.safetensors"
    )
    snapshots = sorted(p.name for p in (uninterrupted / "ema_snapshots").iterdir())
    assert snapshots == sorted(p.name for p in (output / "ema_snapshots").iterdir())
    assert len(snapshots) == 2 * STEPS // 5
    for name in snapshots:
        tensors_equal(uninterrupted / "ema_snapshots" / name, output / "ema_snapshots" / name, same_run=False)
    # the resumed run continued the killed one: one run id in every checkpoint and snapshot it wrote
    run_ids = {info.run_id for info in list_snapshots(output / "ema_snapshots")}
    run_ids |= {checkpoint.read_state()["run_id"] for checkpoint in Checkpoint.find_all(output)}
    assert len(run_ids) == 1 and None not in run_ids, run_ids
