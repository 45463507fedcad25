"""Temporaries of killed runs: the next run in the folder tidies those of its own kinds whose process ended."""

import signal

import torch
from _forked import kill_at, run_forked
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

from diffusers_scalelong import atomic
from diffusers_scalelong.ema import PowerFunctionEMA, list_snapshots
from diffusers_scalelong.trainer import save_pipeline_atomic
from diffusers_scalelong.trainer.output import clean_interrupted_writes
from tests._tiny_models import TINY_UNET


def _pipeline(seed: int) -> DDPMPipeline:
    torch.manual_seed(seed)
    return DDPMPipeline(unet=UNet2DModel(**TINY_UNET), scheduler=DDPMScheduler())


def _weights(folder) -> bytes:
    return (folder / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()


def test_pipeline_save_killed_mid_swap_is_put_right_by_the_next_save(tmp_path, caplog):
    output = tmp_path / "pipeline"
    save_pipeline_atomic(_pipeline(0), output)
    old = _weights(output)

    def work() -> int:
        kill_at(("replace", 2), {"replace": (atomic.os, "replace")})  # 1: old scheduler/ aside, 2: the new one in place
        save_pipeline_atomic(_pipeline(1), output)
        return 0

    status, text = run_forked(work)
    assert status == -signal.SIGKILL, text
    assert not (output / "scheduler").exists()
    leftovers = sorted(p.name for p in output.iterdir() if p.name.startswith("."))
    assert any(name.startswith(".pipeline.") for name in leftovers) and any(".scheduler.old." in n for n in leftovers)

    save_pipeline_atomic(_pipeline(1), output)  # the next save (demo, or a training run's final save)
    assert not [p for p in output.iterdir() if p.name.startswith(".")]
    assert _weights(output) != old and DDPMPipeline.from_pretrained(output).unet.config.sample_size == 8
    said = " ".join(record.getMessage() for record in caplog.records)
    assert all(name in said for name in leftovers), said


def test_training_start_removes_a_half_written_snapshot_of_a_killed_run(tmp_path, caplog):
    snapshots = tmp_path / "run" / "ema_snapshots"
    model = torch.nn.Linear(2, 1)
    ema = PowerFunctionEMA(model, sigma_rels=(0.05,))
    ema.update(model, 1)
    ema.save_snapshots(snapshots, 1, is_main_process=True)

    def work() -> int:  # killed just before the finished temporary file is renamed into place
        kill_at(("replace", 1), {"replace": (atomic.os, "replace")})
        ema.update(model, 2)
        ema.save_snapshots(snapshots, 2, is_main_process=True)
        return 0

    status, text = run_forked(work)
    assert status == -signal.SIGKILL, text
    (leftover,) = snapshots.glob(".phema-0000000002-0.050.safetensors.*.tmp")
    live = snapshots / f".phema-0000000003-0.050.safetensors.{__import__('os').getppid()}-abcdefgh.tmp"
    live.write_bytes(b"a write in progress")
    other_kind = snapshots / ".notes.txt.1-abcdefgh.tmp"
    other_kind.write_bytes(b"not a snapshot temporary")

    assert clean_interrupted_writes(tmp_path / "run") == [leftover]
    assert live.exists() and other_kind.exists() and not leftover.exists()
    assert [info.time for info in list_snapshots(snapshots)] == [1]
    assert any(str(leftover) in record.getMessage() for record in caplog.records)
